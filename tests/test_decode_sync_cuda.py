"""On CUDA a decode window is enqueued without a host synchronisation (DESIGN invariant 3).

Runs where CUDA exists (the GPU machine); the CPU suite checks the host-read count of the same
expert path in tests/test_gather_decode.py.
"""

from __future__ import annotations

import pytest
import torch

from strata_core.engine import Engine
from strata_core.testing.sync import no_host_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.usefixtures("float_cpu_kernels")  # CUDA's float products against the CPU's: the CPU kernels' float bodies
@pytest.mark.parametrize("slots", [0, 7, 24])
def test_decode_window_makes_no_host_sync_and_matches_the_cpu(tiny_model_factory, slots):
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    ids = list(range(5, 60))
    want = Engine.load(path, devices=["cpu"], max_context=128).generate(ids, max_tokens=12, temperature=0)
    engine = Engine.load(path, devices=["cuda:0"], max_context=128, dtype="float32", arena="pinned",
                         expert_cache=slots, cuda_graphs=False)  # eager windows (graphs: test_cuda_graphs.py)
    session = engine.new_session()
    token = int(engine.prefill(session, ids).argmax())
    out = [token]
    for _ in range(11):
        with no_host_sync():
            row = engine.decode_window([(session, token)])
        token = int(row[0].argmax())
        out.append(token)
    assert engine.tokenizer.decode(out) == want
