"""even_split gives single's logits bit for bit, on logical devices."""

import pytest
import torch

from strata_core.engine import Engine
from strata_core.plugin import ConfigError


@pytest.fixture
def model_path(tiny_model_factory):
    return tiny_model_factory(n_layers=3)


def test_placement_gives_each_device_slot_a_stage(model_path, logical_devices):
    engine = Engine.load(model_path, strategy="even_split", devices=logical_devices)
    segments = engine.runner.segments("decode")
    assert [s.device for s in segments] == list(range(len(logical_devices)))
    assert [layer for s in segments for layer in s.layers] == list(range(engine.spec.n_layers))
    assert len(engine.experts.caches) == len(logical_devices)  # one cache per logical device


def test_logits_and_greedy_output_equal_single(model_path, logical_devices):
    ids = list(range(5, 40))
    single = Engine.load(model_path, strategy="single", devices=logical_devices[:1])
    split = Engine.load(model_path, strategy="even_split", devices=logical_devices)
    assert torch.equal(single.logits(ids), split.logits(ids))
    assert single.generate(ids, max_tokens=8, temperature=0) == split.generate(ids, max_tokens=8, temperature=0)


def test_too_many_stages_is_a_clear_error(model_path):
    with pytest.raises(ConfigError, match="even_split: 3 stages"):
        Engine.load(model_path, strategy="even_split", devices=["cpu", "cpu"],
                    strategy_options={"stages": 3})
