"""The fused decode layers (strata_core/model/fused_decode.py) against the eager loop.

On the CPU the fused ops run their references, so this checks the restructured layer (residual adds
in the norms, one QKV product, the address tables) in CI; on CUDA the same comparison runs the
Triton kernels (the engine takes the fused path there by itself).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata_core.engine import Engine
from strata_core.model.fused_decode import why_not_fused
from strata_core.model.rope import RopeScaling
from strata_core.runtime.session import DecodeBatch

devices = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


def _sessions(engine: Engine, prompts: list[list[int]]):
    sessions = [engine.new_session() for _ in prompts]
    for session, prompt in zip(sessions, prompts):
        engine.prefill(session, prompt)
    return sessions


def test_why_not_fused(tiny_model_factory):
    engine = Engine.load(tiny_model_factory(expert_type="Q4_0"), devices=["cpu"], max_context=64)
    assert "not a CUDA device" in why_not_fused(engine.model, torch.device("cpu"))
    shared = Engine.load(tiny_model_factory(architecture="qwen2moe", expert_type="Q4_0"), devices=["cpu"],
                         max_context=64)
    assert "shared expert" in why_not_fused(shared.model, torch.device("cuda", 0))


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("scaling", [None, RopeScaling("yarn", 4.0, 16, 1.1)], ids=["rope", "yarn"])
def test_fused_layers_match_the_eager_layers(tiny_model_factory, device, scaling):
    """Also for a model whose GGUF asks for a scaled RoPE (YaRN): the fused layers rotate by its table."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    engine = Engine.load(path, devices=[device], max_context=64, dtype="float32")
    engine.model.spec = dataclasses.replace(engine.model.spec, rope_scale=scaling)
    prompts = [list(range(5, 30)), list(range(40, 52))]
    eager_sessions, fused_sessions = _sessions(engine, prompts), _sessions(engine, prompts)
    tokens = torch.tensor([3, 9])
    (segment,) = engine.runner.segments("decode")
    hidden = engine.runner.embed(tokens, torch.device(device))
    eager = engine.runner.decode_layers(segment, hidden, DecodeBatch(tuple(eager_sessions), tokens), fused=False)
    seen = []
    with engine.runner.observe_layers(lambda layer, h: seen.append(layer)):
        fused = engine.runner.decode_layers(segment, hidden, DecodeBatch(tuple(fused_sessions), tokens), fused=True)
    assert seen == list(segment.layers)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(eager_sessions, fused_sessions):
        for layer in segment.layers:
            for x, y in zip(a.kv.read(layer, a.n_tokens + 1), b.kv.read(layer, b.n_tokens + 1)):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_kv_tables_follow_a_moved_cache():
    """The address tables the fused kernels read are each layer's K and V pool and each cache's block
    table, also after a hand-off puts some layers in another slot's pool (the tables are built once per
    version of a cache)."""
    from strata_core.model.fused_decode import kv_tables
    from strata_core.model import kvtransfer
    from strata_core.model.kvcache import KVCache
    from strata_core.model.spec import StateTensor
    from strata_core.runtime.session import Session

    row = StateTensor((1, 4))
    sessions = [Session(kv=KVCache(range(3), 8, {i: {"k": row, "v": row} for i in range(3)})) for _ in range(2)]

    def want(layers):
        return [[[s.kv.pool_rows(i)["k"].data_ptr(), s.kv.pool_rows(i)["v"].data_ptr(), s.kv.block_table(i).data_ptr()]
                 for s in sessions] for i in layers]

    assert kv_tables(sessions, range(3)).tolist() == want(range(3))
    assert kv_tables(sessions, range(1, 3)).tolist() == want(range(1, 3))
    kvtransfer.move(sessions[1].kv, range(1, 3), 1, "cpu")  # another pool and block table for layers 1 and 2
    assert kv_tables(sessions, range(3)).tolist() == want(range(3))
    assert kv_tables(sessions, range(1, 3)).tolist() == want(range(1, 3)) != kv_tables(sessions[:1] * 2, range(1, 3)).tolist()
