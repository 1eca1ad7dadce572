"""``strata bench`` on the CPU with a tiny synthetic model: figures, telemetry beside them, JSON."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata_core.tools.bench import format_table, parse_lengths, run_bench
from strata_core.errors import ConfigError
from strata_core.tools.synthetic import write_synthetic


def test_parse_lengths():
    assert parse_lengths("512, 8k,32K") == [512, 8192, 32768]
    with pytest.raises(ConfigError, match="bad length"):
        parse_lengths("8q")


def test_bench_runs_on_cpu(tmp_path):
    from strata_core.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = tmp_path / "tiny.gguf"
        write_synthetic(path, "tiny", expert_type=Q.Q8_0, progress=False, n_layers=1)
        engine = Engine.load(path, expert_cache=4, max_context=64)
        try:
            with pytest.raises(ConfigError, match="needs 100 tokens"):
                run_bench(engine, [100], [], repeats=1, steps=1)
            results = run_bench(engine, [16, 32], [8], repeats=2, steps=4)
        finally:
            engine.close()
    finally:
        torch.set_num_threads(threads)
    assert [(r.kind, r.length) for r in results] == [("prefill", 16), ("prefill", 32), ("decode", 8)]
    for r in results:
        assert r.tok_s > 0 and len(r.runs) == 2 and 0 <= r.hit_rate < 1  # 4 of 16 experts resident
        assert r.bytes_streamed > 0
        assert 0 < r.expert_gbps < r.kernel_gbps  # the routed experts' bytes over the run, and over their compute
    decode = results[-1]  # one token a window: top-4 experts of 16, each read once a token
    per_token = engine.experts.arena.slot_bytes * engine.spec.n_experts_used * len(engine.spec.moe_layers)
    assert decode.expert_gbps == pytest.approx(per_token * decode.tok_s / 1e9)
    assert "| prefill | 16 |" in format_table(results, {"expert_cache": 4})


def test_decode_bench_runs_every_session_in_each_window(tmp_path, monkeypatch):
    from strata_core.engine import Engine

    path = tmp_path / "tiny.gguf"
    write_synthetic(path, "tiny", expert_type=Q.Q8_0, progress=False, n_layers=1)
    engine = Engine.load(path, expert_cache=4, max_context=64)
    widths = []
    real = engine.decode_window
    monkeypatch.setattr(engine, "decode_window", lambda steps, *fed: widths.append(len(steps)) or real(steps, *fed))
    one, three = run_bench(engine, [], [8], repeats=1, steps=3, sessions=(1, 3))
    assert widths[-6:] == [1, 1, 1, 3, 3, 3] and (one.sessions, three.sessions) == (1, 3) and three.tok_s > 0
    engine.close()


def test_the_warm_up_runs_windows_fed_known_tokens_and_their_argmax(tmp_path, monkeypatch):
    from strata_core.engine import Engine
    from strata_core.tools.bench import warm_up

    path = tmp_path / "tiny.gguf"
    write_synthetic(path, "tiny", expert_type=Q.Q8_0, progress=False, n_layers=1)
    engine = Engine.load(path, expert_cache=4, max_context=64)
    fed = []  # per window: whether its tokens came as a device tensor (the argmax of the window before)
    real = engine.decode_window
    monkeypatch.setattr(engine, "decode_window", lambda steps, tokens=None: fed.append(tokens is not None)
                        or real(steps, tokens))
    warm_up(engine, prompt=16)
    assert fed == [False, False, False, True, True]  # the sampled windows' first token is known, then argmaxes
    assert not any(engine.kv_pools.pools[0].refs)  # the throw-away session released
    engine.close()


def test_lengths_beyond_the_context_are_skipped_or_clamped():
    from strata_core.cli.bench import fitting_lengths

    assert fitting_lengths([512, 8192], [256, 4096], 32, 1024) == ([512], [256])
    assert fitting_lengths([8192, 32768], [1024, 32768], 32, 1024) == ([1024], [992])  # none fit: the longest
    assert fitting_lengths([], [2048], 32, 1024) == ([], [992])


def test_sampled_decode_feeds_each_window_the_previous_argmax(tmp_path, monkeypatch):
    from strata_core.engine import Engine

    path = tmp_path / "tiny.gguf"
    write_synthetic(path, "tiny", expert_type=Q.Q8_0, progress=False, n_layers=1)
    engine = Engine.load(path, expert_cache=4, max_context=64)
    windows = []  # (tokens fed, argmax of the logits) per window
    real = engine.decode_window

    def record(steps, fed=None):
        logits = real(steps, fed)
        windows.append(([token for _, token in steps] if fed is None else fed.tolist(), logits.argmax(-1).tolist()))
        return logits

    monkeypatch.setattr(engine, "decode_window", record)
    known, sampled = run_bench(engine, [], [8], repeats=1, steps=4, sessions=(2,), sampled=True)
    engine.close()
    assert (known.kind, sampled.kind) == ("decode", "decode-sampled") and sampled.sessions == 2
    fed = windows[-4:]  # the sampled figure's windows
    assert all(fed[i + 1][0] == fed[i][1] for i in range(3))  # fed on the device, settled in the sessions after
    assert any(window[0] != previous[1] for previous, window in zip(windows[-8:-5], windows[-7:-4]))  # known: not
