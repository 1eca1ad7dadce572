"""tools/prompt_host_time.py on the demo model on ``cpu,cpu`` (peer_tier): it times the prompts and
reports each timed function per MoE layer (the expert path's rows once a layer)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from strata_core.config import StrataSettings

TOOL = Path(__file__).parents[1] / "tools" / "prompt_host_time.py"


def test_times_each_layer_s_expert_path():
    result = subprocess.run([sys.executable, str(TOOL), str(StrataSettings().model), "--devices", "cpu,cpu",
                             "--strategy", "peer_tier", "--strategy-options", '{"peer_slots": 8}',
                             "--expert-cache", "8", "--prompt", "24", "--repeats", "2"],
                            capture_output=True, text=True, timeout=300, check=True)
    head, *rows = result.stdout.strip().splitlines()
    assert re.fullmatch(r'peer_tier \{"peer_slots": 8\}: \[\d+, \d+\] tok/s, [\d.]+ ms a layer', head)
    timed = {line.split()[0]: float(line.split()[-4]) for line in rows}  # name -> calls a layer
    assert timed["rows"] == 1.0 and timed["holders"] >= 1.0
