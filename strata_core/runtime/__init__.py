"""The runtime: how a loaded model's phases run under a placement.

- ``runner.py``: :class:`~strata_core.runtime.runner.Runner`, one per engine: the embedding and head
  on the main device, each phase's segments, the one prompt layer loop and the one decode layer loop
  (eager, or captured and replayed); it is the ``PhaseContext`` the phase hooks receive.
- ``graph_replays.py``: the runner's CUDA-graph half: where decode windows and prompt passes replay
  graphs (the reasons they do not, said once), and their capture at a server's start.
- ``graphs.py``: the CUDA-graph capture cache; it captures a body the runner hands it.
- ``phase_state.py``: around a phase, residency entries masked in place and restored, and the
  hand-off of per-layer state between device slots.
- ``session.py``: a session (one sequence's KV and tokens) and a decode batch of sessions.
- ``devices.py``: ``--devices`` parsed and checked; device scopes and copies.
- ``memory_plan.py``: the dense bytes each device will hold, known before anything loads.
- ``heap.py``: the garbage collector told to skip what a loaded engine keeps alive.

Words: a *segment* is a maximal run of consecutive layers on one device slot in one phase; a
*window* is one decode step of every session of a batch; a *chunk* is a slice of a prompt run as one
batch.
"""
