"""A rank of a two-process layer_split engine on loopback, for tests/test_remote.py.

``python tests/remote_ranks.py MODEL PORT RANK RANKS [PEER_PID]``: with ``RANKS`` 2, layers 0..1 on
rank 0 and 2..3 on rank 1; with 3, one layer on rank 0, one on each of rank 1's two device slots, one
on rank 2 (a chain rank 0 -> 1 -> 2 -> 0). The other ranks serve their stages until rank 0 says
stop; rank 0 checks the engine across ranks against ``single`` in this process, then stops the last
rank (SIGSTOP to ``PEER_PID``: it no longer answers) and times the error of the next prompt, and
prints one JSON line of findings. A
``STRATA_*`` variable (``STRATA_KV_BLOCK``) changes a setting of one rank: the join refuses it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.errors import ConfigError
from strata_core.remote import RankFailedError, launch_of, serve_stages

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


def loaded(engine: Engine, layer: int) -> bool:
    """Whether this process holds ``layer``'s dense weights."""
    try:
        return bool(engine.model.weights.at(layer, "cpu"))
    except ConfigError:
        return False


def main() -> None:
    model, port, rank, ranks = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    devices, split = ((["cpu", "rank1:cpu"], "2") if ranks == 2
                      else (["cpu", "rank1:cpu", "rank1:cpu", "rank2:cpu"], "1,2,3"))
    settings = StrataSettings(model=model, strategy="layer_split", devices=devices, max_context=128,
                              expert_cache=3, strategy_options={"split": split}, prefill_chunk=16, nnodes=ranks,
                              node_rank=rank, dist_init_addr=f"127.0.0.1:{port}", dist_timeout=TIMEOUT_S)
    if rank:
        serve_stages(settings, launch_of(settings))
        return
    engine = Engine.from_settings(settings)
    single = Engine.load(model, max_context=128, expert_cache=3)
    found = {
        "logits": torch.equal(engine.logits(PROMPT), single.logits(PROMPT)),
        "greedy": engine.generate(PROMPT, max_tokens=6, temperature=0) == single.generate(PROMPT, max_tokens=6,
                                                                                          temperature=0),
        "windows": all(torch.equal(a, b) for a, b in zip(windows(engine, 3), windows(single, 3))),
        "layers_here": [layer for layer in range(4) if loaded(engine, layer)],
    }
    os.kill(int(sys.argv[5]), signal.SIGSTOP)
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
