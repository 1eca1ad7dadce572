"""Stand-in sessions (runtime/stand_ins.py): the unfused layers' graphs serve any sessions. On the CPU the
replay path runs with a graph that runs its captured body again at each replay: the same windows, the
same logits as eager, and no capture after the buckets whoever joins or leaves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata_core.engine import Engine
from strata_core.runtime.graphs import DecodeGraphs, _Graph
from strata_core.runtime.session import DecodeBatch
from strata_core.runtime.stand_ins import StandIns

DATA = Path(__file__).parent / "data"
MODELS = {"gpt-oss": DATA / "gpt-oss_llamacpp" / "model-mxfp4.gguf",
          "qwen3next": DATA / "qwen3next_llamacpp" / "model-q8_0.gguf",
          "deepseek2": DATA / "deepseek3_llamacpp" / "model-q8_0.gguf"}


class _BodyGraph:
    """A captured window that runs its body again at each replay (what a CUDA graph's replay computes)."""

    def __init__(self, body, static: dict[str, torch.Tensor]) -> None:
        self.body, self.static, self.out = body, static, torch.empty(0)

    def replay(self) -> None:
        result = self.body(self.static)
        self.out.resize_(result.shape).copy_(result)


class _BodyGraphs(DecodeGraphs):
    def _capture(self, segment, batch, inputs, body, step):
        graph = _BodyGraph(body, {name: value.clone() for name, value in inputs.items()})
        return _Graph(graph=graph, inputs=graph.static, out=graph.out)


def _replaying(engine: Engine, monkeypatch) -> _BodyGraphs:
    """Make ``engine``'s CPU decode windows take the graph replay path, with body-running graphs."""
    runner = engine.runner
    runner._graphs = graphs = _BodyGraphs(runner.experts, max_graphs=16)
    monkeypatch.setattr(runner, "why_not_graphed", lambda segment: None)
    return graphs


def _windows(engine: Engine, n: int) -> list[torch.Tensor]:
    """Each window's logits of greedy windows of sessions joining and leaving: three sessions start, a
    fourth joins at window 2, the second leaves at window 3, a fifth joins at window 4."""
    prompts = [list(range(5, 30)), list(range(40, 52)), list(range(3, 11)), list(range(60, 79)), list(range(9, 20))]
    joins = {0: prompts[:3], 2: prompts[3:4], 4: prompts[4:]}
    live, out = [], []
    for step in range(n):
        for prompt in joins.get(step, ()):
            session = engine.new_session()
            live.append([session, int(engine.prefill(session, prompt).argmax())])
        if step == 3:
            engine.release_session(live.pop(1)[0])
        logits = engine.decode_window([(s, t) for s, t in live])
        out.append(logits)
        for pair, row in zip(live, logits):
            pair[1] = int(row.argmax())
    return out


@pytest.mark.parametrize("kv_type", ["auto", "int8"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_windows_on_stand_ins_equal_eager_windows_and_capture_only_the_buckets(arch, kv_type, monkeypatch):
    """Also with a quantized KV (codes and scales read through the stand-ins' row ids)."""
    want = _windows(Engine.load(MODELS[arch], max_context=64, kv_type=kv_type, cuda_graphs=False), 6)
    engine = Engine.load(MODELS[arch], max_context=64, kv_type=kv_type)
    graphs = _replaying(engine, monkeypatch)
    engine.capture_decode_graphs(5)
    assert graphs.captures == 4  # buckets 1, 2, 4, 8
    got = _windows(engine, 6)
    assert graphs.captures == 4 and graphs.failed is None
    for a, b in zip(got, want):
        assert torch.equal(a, b), float((a - b).abs().max())  # the CPU attends over whole key blocks either way


def test_stand_ins_follow_the_rows_blocks_and_carry_the_recurrent_state():
    engine = Engine.load(MODELS["qwen3next"], max_context=64)
    (segment,) = engine.runner.segments("decode")
    a, b = engine.new_session(), engine.new_session()
    engine.prefill(a, list(range(5, 30)))
    engine.prefill(b, list(range(40, 52)))
    stand_ins = StandIns(segment)
    batch = DecodeBatch((a, b), torch.tensor([3, 4]))
    window = stand_ins.window(batch)
    assert window.sessions[0] is not a and len(window) == 2 and stand_ins.window(batch).sessions == window.sessions
    stand_ins.follow(window, stand_ins.tables(batch))
    layer = next(i for i in segment.layers if not engine.spec.recurrent[i])
    for real, stand_in in zip(batch.sessions, window.sessions):  # the same rows, read through the stand-in
        assert all(torch.equal(x, y) for x, y in zip(stand_in.kv.read(layer, real.n_tokens),
                                                     real.kv.read(layer, real.n_tokens)))
    recurrent = next(i for i in segment.layers if engine.spec.recurrent[i])
    stand_ins.load(batch, window, live=1)  # the first row only: the padding rows keep theirs
    assert torch.equal(window.sessions[0].kv.state(recurrent, "ssm"), a.kv.state(recurrent, "ssm"))
    assert not torch.equal(window.sessions[1].kv.state(recurrent, "ssm"), b.kv.state(recurrent, "ssm"))
    window.sessions[0].kv.state(recurrent, "ssm").add_(1)
    stand_ins.store(batch, window, live=1)
    assert torch.equal(a.kv.state(recurrent, "ssm"), window.sessions[0].kv.state(recurrent, "ssm"))


def test_a_recurrent_session_with_several_rows_has_no_stand_ins():
    engine = Engine.load(MODELS["qwen3next"], max_context=64)
    (segment,) = engine.runner.segments("decode")
    session = engine.new_session()
    engine.prefill(session, list(range(5, 30)))
    stand_ins = StandIns(segment)
    assert stand_ins.why_not(DecodeBatch((session,), torch.tensor([3]))) is None
    reason = stand_ins.why_not(DecodeBatch((session, session), torch.tensor([3, 4]), offsets=(0, 1)))
    assert reason is not None and "recurrent state" in reason
    other = Engine.load(MODELS["qwen3next"], max_context=32).new_session()
    assert "context lengths" in stand_ins.why_not(DecodeBatch((session, other), torch.tensor([3, 4])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_cuda_graphs_on_stand_ins_serve_sessions_joining_and_leaving(arch):
    """The buckets captured at start serve every later window, whoever joins or leaves, with eager's logits."""
    options = dict(devices=["cuda:0"], max_context=128, dtype="float32", arena="pinned")
    want = _windows(Engine.load(MODELS[arch], cuda_graphs=False, **options), 6)
    engine = Engine.load(MODELS[arch], cuda_graphs=True, **options)
    engine.capture_decode_graphs(5)
    graphs = engine.runner.graphs
    assert graphs.failed is None and graphs.captures == 4
    got = _windows(engine, 6)
    assert graphs.captures == 4 and graphs.failed is None
    for a, b in zip(got, want):
        assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())


def test_the_memory_plan_counts_the_recurrent_state_of_the_slots_the_padding_and_the_stand_ins():
    from strata_core.plugin.placement import DeviceSlot, LayerPlacement, Placement
    from strata_core.runtime.memory_plan import kv_bytes_per_device, state_copies

    spec = Engine.load(MODELS["qwen3next"], max_context=64).spec
    one = tuple(LayerPlacement.local(0) for _ in range(spec.n_layers))
    cpu = torch.device("cpu")
    plan = [kv_bytes_per_device(spec, Placement(one, one), {0: DeviceSlot(0, cpu)}, torch.float32, 64,
                                sessions=n)[cpu] for n in (1, 2)]
    state = sum(t.nbytes(0, torch.float32) for i in range(spec.n_layers) for t in spec.layer_state(i).values()
                if not t.per_token)
    assert state > 0 and plan[1] - plan[0] == state
    assert state_copies(5, cuda_graphs=True) == 5 + 1 + 8 and state_copies(5, cuda_graphs=False) == 6
