"""A rank of an engine over several processes on loopback, for tests/test_remote.py.

``python tests/remote_ranks.py MODEL PORT RANK RANKS [--strategy S] [--main-device D] [--stop PID]``:
``layer_split`` with ``RANKS`` 2 has layers 0..1 on rank 0 and 2..3 on rank 1; with 3, one layer on
rank 0, one on each of rank 1's two device slots, one on rank 2 (a chain rank 0 -> 1 -> 2 -> 0).
``prefill_main`` (2 ranks) runs every prompt on rank 0 and decodes layers 2..3 on rank 1, the KV
handed off between them. Rank 0 computes on ``--main-device`` (the others on the CPU). The other
ranks serve their stages until rank 0 says stop; rank 0 checks the engine across ranks against a
reference in this process (``single`` on the CPU, where logits are bit-identical whatever the
placement; on CUDA the same placement on this process's devices), then, with ``--stop``, stops that
rank (SIGSTOP: it no longer answers) and times the error of the next prompt, and prints one JSON line
of findings. A ``STRATA_*`` variable (``STRATA_KV_BLOCK``) changes a setting of one rank: the join
refuses it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.errors import ConfigError
from strata_core.remote import RankFailedError, launch_of, serve_stages
from strata_core.runtime.devices import split_rank

PROMPT = list(range(5, 41))
PROMPTS = [PROMPT[:9], PROMPT[3:20], PROMPT[10:14]]
TIMEOUT_S = 3  # --dist-timeout: a rank that stops answering is failed after it


def windows(engine: Engine, n: int) -> list[torch.Tensor]:
    """Logits of ``n`` decode windows of three sessions (micro-batched across the stages)."""
    sessions = [engine.new_session() for _ in PROMPTS]
    tokens = [int(engine.prefill(s, p).argmax()) for s, p in zip(sessions, PROMPTS)]
    out = []
    for _ in range(n):
        logits = engine.decode_window(list(zip(sessions, tokens)))
        tokens = [int(row.argmax()) for row in logits]
        out.append(logits)
    for session in sessions:
        engine.release_session(session)
    return out


def turns(engine: Engine) -> list[torch.Tensor]:
    """Logits of a conversation: a prompt, two windows, a second prompt on the same session (its KV
    comes back from the decode stages), two windows."""
    session = engine.new_session()
    out = []
    for prompt in (PROMPT[:9], PROMPT[9:20]):
        out.append(engine.prefill(session, prompt))
        for _ in range(2):
            out.append(engine.decode_window([(session, int(out[-1].reshape(-1).argmax()))]))
    engine.release_session(session)
    return out


def loaded(engine: Engine, layer: int, device: str) -> bool:
    """Whether this process holds ``layer``'s dense weights on ``device``."""
    try:
        return bool(engine.model.weights.at(layer, device))
    except ConfigError:
        return False


def _settings(args: argparse.Namespace) -> StrataSettings:
    if args.ranks == 2:
        devices, options = [args.main_device, "rank1:cpu"], {"split": "2"}
    else:
        devices, options = [args.main_device, "rank1:cpu", "rank1:cpu", "rank2:cpu"], {"split": "1,2,3"}
    return StrataSettings(model=args.model, strategy=args.strategy, devices=devices, max_context=128, expert_cache=3,
                          strategy_options=options, prefill_chunk=16, nnodes=args.ranks, node_rank=args.rank,
                          dist_init_addr=f"127.0.0.1:{args.port}", dist_timeout=TIMEOUT_S, dtype="float32")


def reference(settings: StrataSettings) -> Engine:
    """``single`` on the CPU; on CUDA the same placement in this process (each rank's device here)."""
    if settings.devices[0] == "cpu":
        return Engine.load(settings.model, max_context=128, expert_cache=3)
    here = settings.model_copy(update={"devices": [split_rank(name)[1] for name in settings.devices], "nnodes": 1,
                                       "node_rank": 0, "dist_init_addr": None})
    return Engine.from_settings(here)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("port")
    parser.add_argument("rank", type=int)
    parser.add_argument("ranks", type=int)
    parser.add_argument("--strategy", default="layer_split")
    parser.add_argument("--main-device", default="cpu")
    parser.add_argument("--stop", type=int, help="the pid of a rank to stop answering, after the checks")
    args = parser.parse_args()
    settings = _settings(args)
    if args.rank:
        serve_stages(settings, launch_of(settings))
        return
    engine = Engine.from_settings(settings)
    want = reference(settings)
    found = {
        "logits": torch.equal(engine.logits(PROMPT), want.logits(PROMPT)),
        "greedy": engine.generate(PROMPT, max_tokens=6, temperature=0) == want.generate(PROMPT, max_tokens=6,
                                                                                        temperature=0),
        "windows": all(torch.equal(a, b) for a, b in zip(windows(engine, 3), windows(want, 3))),
        "turns": all(torch.equal(a, b) for a, b in zip(turns(engine), turns(want))),
        "layers_here": [layer for layer in range(4) if loaded(engine, layer, args.main_device)],
    }
    if args.stop is not None:
        os.kill(args.stop, signal.SIGSTOP)
        start = time.monotonic()
        try:
            engine.logits(PROMPT)
            found["error"] = None
        except RankFailedError as error:
            found["error"] = str(error)
        found["seconds"] = time.monotonic() - start
        found["health"] = str(engine.broken)
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
