"""One engine over several processes (ranks), possibly on several hosts, joined by torch.distributed:
gloo for control, heartbeat and every hidden state with a host end, NCCL between two ranks' GPUs.

A ``--devices`` entry may name another rank's device (``rank1:cuda:0``, ``rank1:cpu``); a placement
puts layer ranges there like on any device slot. Rank 0 loads the tokenizer and runs the server and
the scheduler; every rank memory-maps the GGUF itself and loads only the layers its slots compute
(dense weights, expert caches, KV). Rank 0 sends work, not weights: per prompt chunk and per decode
window, each run of consecutive segments on other ranks is a chain of hops (sessions, positions,
the hidden state to the first rank, each rank's output straight to the next, the last one's back to
rank 0), never one per layer.

- ``launch.py``: who this process is (torchrun's environment, or ``--nnodes --node-rank
  --dist-init-addr``) and the checks of ``--devices`` against the ranks.
- ``group.py``: :class:`Cluster`, the joined process group: the refusal of a rank started with
  another model file or settings, the one channel rank 0 talks to each rank through, a heartbeat
  while idle, and the failure (:class:`RankFailedError`) of a rank that dies or stops answering.
- ``stages.py``: rank 0's :class:`RemoteStages` (segments on other ranks, sent) and the other
  ranks' :func:`serve_stages` (load, then run the segments sent, each session mirrored by id).

Words: a *rank* is one process of the engine; a *hop* is one rank's part of a chain (its consecutive
segments), a hidden state in and one out.
"""

from strata_core.remote.group import Cluster, RankFailedError
from strata_core.remote.launch import Launch, launch_of
from strata_core.remote.stages import RemoteStages, serve_stages

__all__ = ["Cluster", "Launch", "RankFailedError", "RemoteStages", "launch_of", "serve_stages"]
