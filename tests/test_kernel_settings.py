"""The kernel choices are settings (a flag, a ``STRATA_*`` variable, an ``Engine.load`` keyword) that reach
the forward (``ForwardKernels``) and the expert rows at load, or arguments of the op that uses them."""

from __future__ import annotations

import pytest
import torch

from strata_core.config import DEMO_MODEL, StrataSettings
from strata_core.engine import Engine
from strata_core.model.kernels import ForwardKernels
from strata_core.model.qwen3next.deltanet import delta_rule
from strata_core.ops import moe


def test_defaults_are_the_kernels_and_the_environment_reaches_them(monkeypatch):
    assert ForwardKernels.from_settings(StrataSettings()) == ForwardKernels()
    monkeypatch.setenv("STRATA_MLA_KERNEL", "0")
    monkeypatch.setenv("STRATA_DELTANET_CHUNKED", "recurrent")
    settings = StrataSettings()
    assert not settings.mla_kernel and settings.deltanet_chunked == "recurrent"
    with pytest.raises(ValueError, match="miss_read"):
        StrataSettings(miss_read="zero-copy")


def test_engine_load_passes_the_choices_to_the_model_and_the_expert_rows():
    engine = Engine.load(DEMO_MODEL, max_context=64, fused_norms=False, device_sdpa=False, mla_kernel=False,
                         deltanet_chunked="torch", fused_expert_ffn=False, miss_read="direct")
    try:
        assert engine.model.kernels == ForwardKernels(fused_norms=False, device_sdpa=False, mla_kernel=False,
                                                      deltanet_chunked="torch")
        rows = engine.experts.rows_for(engine.placement.main)
        assert not rows.fused_expert_ffn and rows.direct_misses
    finally:
        engine.close()


def test_delta_rule_names_an_unknown_form():
    t = torch.zeros(2, 1, 4)
    with pytest.raises(ValueError, match="chunked"):
        delta_rule(t, t, t, torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(1, 4, 4), 1, "flash")


def test_launched_with_is_scoped():
    other = moe.LaunchConfig(design="loop")
    assert moe.launch_config() is moe.DEFAULT_LAUNCH
    with moe.launched_with(other):
        assert moe.launch_config() is other
    assert moe.launch_config() is moe.DEFAULT_LAUNCH
