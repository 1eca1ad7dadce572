"""The CPU's joined layer ops in the forward (``MoEModel.cpu_layer``, ``qkv_write``, the routed experts in one call)
against the ops they join: one session's decode rows and a prompt give the same bits, and the cache the same rows,
either way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata_core.engine import Engine
from strata_core.experts.device_rows import CachedExpertRows
from strata_core.model.rope import RopeScaling
from strata_core.ops.cpu_kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels(), reason="the CPU kernels did not build (see the warning)")

PROMPT = list(range(5, 30))


def _unjoined(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``engine``'s forward take the separate ops: the add, the norm, the q/k norm and RoPE, ``kv.write``,
    the router, the routing, the expert rows and their combination."""
    monkeypatch.setattr(engine.model, "takes_cpu_layer", lambda *args: False)
    monkeypatch.setattr(engine.model, "_cpu_kv", lambda *args: False)
    monkeypatch.setattr(engine.model, "_cpu_routed", lambda *args: None)


def _count_routed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers whose routed experts took one call (``CachedExpertRows.routed_cpu``), as they run."""
    layers: list[int] = []
    routed_cpu = CachedExpertRows.routed_cpu

    def counted(self, layer, *args):
        out = routed_cpu(self, layer, *args)
        if out is not None:
            layers.append(layer)
        return out

    monkeypatch.setattr(CachedExpertRows, "routed_cpu", counted)
    return layers


def _engine(tiny_model_factory, architecture: str, scaling: RopeScaling | None) -> Engine:
    path = tiny_model_factory(architecture=architecture, expert_type="Q4_0", n_layers=3)
    engine = Engine.load(path, devices=["cpu"], max_context=64, dtype="float32")
    engine.model.spec = dataclasses.replace(engine.model.spec, rope_scale=scaling)
    return engine


def _decode(engine: Engine, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """The prompt's logits and those of a decode window per token, the cache's rows after, the layers the
    observers saw."""
    session = engine.new_session()
    logits = [engine.prefill(session, PROMPT, all_logits=True)]
    seen: list[int] = []
    with engine.runner.observe_layers(lambda layer, h: seen.append(layer)):
        logits += [engine.decode_window([(session, token)]) for token in tokens]
    kv = session.kv
    rows = [t for layer in range(engine.model.spec.n_layers) for t in kv.read(layer, kv.n_tokens)]
    engine.release_session(session)
    return torch.cat(logits), rows, seen


@pytest.mark.parametrize("architecture", ["qwen3moe", "qwen2moe"])  # qwen2moe: q/k/v biases, a shared expert
@pytest.mark.parametrize("scaling", [None, RopeScaling("yarn", 4.0, 16, 1.1)], ids=["rope", "yarn"])
def test_joined_layer_ops_give_the_bits_of_the_separate_ones(tiny_model_factory, monkeypatch, architecture, scaling):
    engine = _engine(tiny_model_factory, architecture, scaling)
    (segment,) = engine.runner.segments("decode")
    session = engine.new_session()
    assert engine.model.takes_cpu_layer(segment.layers[0], torch.zeros(1, engine.model.spec.hidden_size), session.kv)
    engine.release_session(session)
    routed = _count_routed(monkeypatch)
    joined, joined_kv, joined_seen = _decode(engine, [3, 9, 4])
    assert routed == list(segment.layers) * 4  # the prompt, then each decode row
    _unjoined(engine, monkeypatch)
    separate, separate_kv, separate_seen = _decode(engine, [3, 9, 4])
    assert torch.equal(joined, separate)
    assert all(torch.equal(a, b) for a, b in zip(joined_kv, separate_kv))
    assert joined_seen == separate_seen == list(segment.layers) * 3


def test_a_quantized_cache_takes_the_separate_ops(tiny_model_factory):
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    engine = Engine.load(path, devices=["cpu"], max_context=64, dtype="float32", kv_type="int8")
    session = engine.new_session()
    assert not engine.model.takes_cpu_layer(0, torch.zeros(1, engine.model.spec.hidden_size), session.kv)
    engine.release_session(session)
