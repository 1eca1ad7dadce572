"""The time of a speculative decode window: SESSIONS sessions of a 295-token prompt, each window ROWS rows a session
(its token and ROWS - 1 drafts), then each cut back to 2 kept rows, as a verification keeping one draft does;
the median over WINDOWS windows.

    python tools/spec_window_cost.py MODEL.gguf [SESSIONS] [ROWS] [WINDOWS] [--devices cpu]

For a model with recurrent state (qwen3next) it times the rows' recurrent layers keeping their states.
"""

import sys
import time

from strata_core.engine import Engine

args = [a for a in sys.argv[1:] if not a.startswith("--")]
device = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "cpu"
args = [a for a in args if a != device]
path, sessions, rows, windows = args[0], *(int(a) for a in (args[1:] + ["4", "3", "20"][len(args) - 1:]))
engine = Engine.load(path, devices=[device], max_context=2048)
held = [engine.new_session() for _ in range(sessions)]
for i, session in enumerate(held):
    engine.prefill(session, list(range(5 + i, 300 + i)))
times = []
for _ in range(windows):
    start = time.perf_counter()
    engine.decode_window([(session, 7 + r) for session in held for r in range(rows)])
    times.append(time.perf_counter() - start)
    for session in held:
        session.truncate(session.n_tokens - rows + 2)
print(f"{sessions} session(s) x {rows} rows: median {1e3 * sorted(times)[len(times) // 2]:.1f} ms a window")
