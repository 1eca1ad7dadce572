"""The joined ranks: refusal at join, rank 0's one channel to each rank, heartbeat, failure.

Every exchange is rank 0's, under one lock (a step and the heartbeat never interleave): a
*request* (a message and its answer, e.g. a session's KV rows handed off) or a *chain* of hops,
each a rank's header (a small dict: what to run, the rank its hidden state comes from and the one
its output goes to), the hidden state sent to the first, passed from rank to rank, and the last
one's output back to rank 0, then each rank's status (None, or the error its step raised).

A rank that dies closes its connection (seen at once); one that stops answering is seen when
``--dist-timeout`` runs out. Either way the cluster is failed for good: every later exchange raises
the same :class:`RankFailedError`, which names the rank. While the engine is idle rank 0 pings each
rank every quarter of the timeout, so a rank that died is seen then too, and the other ranks see
rank 0 gone when its pings stop. Joining and loading have their own, longer bound
(:data:`LOAD_TIMEOUT_S`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from strata_core.config import StrataSettings
from strata_core.errors import ConfigError, StrataError
from strata_core.experts.sizing import available_bytes
from strata_core.remote.launch import Launch
from strata_core.runtime.devices import resolve_devices, split_rank

__all__ = ["Cluster", "RankFailedError", "chain_links", "link_backend"]

log = logging.getLogger(__name__)

#: settings every rank must share (the file itself is compared by size and leading bytes)
SHARED = ("strategy", "strategy_options", "devices", "dtype", "max_context", "kv_block", "kv_pool_tokens", "kv_type",
          "prefill_chunk", "parallel", "batch_invariant", "dense_q8", "expert_profile")
_HASHED_BYTES = 1 << 20
#: how much later than the first another rank may join, and load its layers (the step timeout,
#: ``--dist-timeout``, bounds everything after)
LOAD_TIMEOUT_S = 3600.0
#: gloo for the control messages, the heartbeat and every hidden state with a host end: its errors and
#: timeouts are exceptions this process survives (the 503 naming the rank), and it crosses any network
BACKEND = "gloo"
#: a hidden state from one rank's GPU to another's goes over NCCL (no host copy on either side), with
#: blocking waits so that a rank that stops answering raises after the step timeout instead of hanging
GPU_BACKEND = "nccl"


def link_backend(src: torch.device, dst: torch.device) -> str:
    """The backend of one link of a chain, a hidden state from ``src`` (a device of one rank) to ``dst``
    (another rank's): NCCL where both ends are CUDA devices, gloo where either is the host."""
    return GPU_BACKEND if src.type == dst.type == "cuda" else BACKEND


def chain_links(hops: list[tuple[torch.device, torch.device]], home: torch.device) -> list[str]:
    """The backends of a chain's links: from ``home`` (rank 0's device) into the first hop, from each
    hop's output device (``hops``: ``(input device, output device)`` per hop) into the next, and from
    the last back to ``home``."""
    outs = [home, *(out for _, out in hops)]
    ins = [*(inp for inp, _ in hops), home]
    return [link_backend(a, b) for a, b in zip(outs, ins)]


def _gpu_ranks(devices: list[str]) -> set[int]:
    return {rank for rank, name in map(split_rank, devices) if torch.device(name).type == "cuda"}


class RankFailedError(StrataError):
    """A rank of the engine died or stopped answering; the engine cannot go on (restart every rank)."""


def identity(settings: StrataSettings) -> dict[str, Any]:
    """What must be equal on every rank: the model file (name, size, a hash of its first MiB) and
    the :data:`SHARED` settings."""
    path = settings.model
    with open(path, "rb") as file:
        head = hashlib.sha256(file.read(_HASHED_BYTES)).hexdigest()[:16]
    out: dict[str, Any] = {"model file": f"{path.name} ({path.stat().st_size} bytes, sha256 of its first MiB {head})"}
    out.update({name: getattr(settings, name) for name in SHARED})
    out["expert_profile"] = None if settings.expert_profile is None else str(settings.expert_profile)
    return out


class Cluster:
    """This process's place among the joined ranks (:meth:`join`), and rank 0's channel to the others."""

    def __init__(self, launch: Launch, timeout: float, memory: dict[tuple[int, str], int],
                 steps: dist.ProcessGroup, gpus: dist.ProcessGroup | None = None) -> None:
        self.rank = launch.rank
        self.world = launch.world
        self.timeout = timeout
        #: free bytes each rank reported at join, by (rank, device name of --devices)
        self.memory = memory
        #: set once a rank failed: every later exchange raises it
        self.failure: RankFailedError | None = None
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._names: dict[int, str] = {}
        self._steps = steps  # the group of the steps and pings: its timeout is the step timeout
        self._gpus = gpus  # NCCL, for the links between two ranks' GPUs (None where fewer than two ranks have one)

    # --- joining ---------------------------------------------------------------------------------

    @classmethod
    def join(cls, settings: StrataSettings, launch: Launch, store: dist.Store | None = None) -> Cluster:
        """Join the ranks of ``launch`` (waiting up to :data:`LOAD_TIMEOUT_S` for them) and compare each
        rank's model file and settings with rank 0's: ConfigError on every rank, naming the rank and
        the difference, when one differs. ``store``: where the ranks meet (None: a TCP store at the
        launch's address), for a process that joins the ranks again after leaving them (the gate)."""
        log.info("rank %d of %d: joining at %s", launch.rank, launch.world, launch.address)
        meet: dict[str, Any] = {"init_method": f"tcp://{launch.address}"} if store is None else {"store": store}
        try:
            dist.init_process_group(BACKEND, rank=launch.rank, world_size=launch.world,
                                    timeout=timedelta(seconds=max(settings.dist_timeout, LOAD_TIMEOUT_S)), **meet)
        except (RuntimeError, ValueError) as error:
            raise ConfigError(f"rank {launch.rank}: could not join the other ranks at {launch.address}: "
                              f"{error}") from None
        mine = [name for owner, name in map(split_rank, settings.devices) if owner == launch.rank]
        report = {"identity": identity(settings),
                  "memory": {name: available_bytes(device) for name, device in zip(mine, resolve_devices(mine))}}
        reports: list[Any] = [None] * launch.world
        dist.all_gather_object(reports, report)
        problem = _difference(reports)
        if problem is not None:
            dist.destroy_process_group()
            raise ConfigError(problem)
        memory = {(rank, name): n for rank, r in enumerate(reports) for name, n in r["memory"].items()}
        step_timeout = timedelta(seconds=settings.dist_timeout)
        steps = dist.new_group(backend=BACKEND, timeout=step_timeout)
        gpus = None
        if len(_gpu_ranks(settings.devices)) > 1:  # every rank decides alike: new_group is collective
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
            gpus = dist.new_group(backend=GPU_BACKEND, timeout=step_timeout)
        return cls(launch, settings.dist_timeout, memory, steps, gpus)

    def name(self, rank: int, what: str) -> None:
        """Call ``rank`` ``what`` in failure messages (its devices and layers)."""
        self._names[rank] = what

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop (unless the cluster failed) and leave the group."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self.rank == 0 and self.failure is None:
            for rank in range(1, self.world):
                try:
                    with self._channel() as peer:
                        peer.rank = rank
                        dist.send_object_list([{"op": "stop"}], dst=rank, group=self._steps)
                except RankFailedError:
                    pass
        dist.destroy_process_group()

    # --- rank 0's side ---------------------------------------------------------------------------

    @contextmanager
    def _channel(self, block: bool = True) -> Iterator[_Peer | None]:
        """Hold the channel (yields None where ``block`` is off and it is taken); a transport error
        inside fails the cluster, naming the rank the yielded peer names then."""
        if self.failure is not None:
            raise self.failure
        if not self._lock.acquire(blocking=block):
            yield None
            return
        peer = _Peer()
        try:
            yield peer
        except (RuntimeError, dist.DistBackendError) as error:
            if self.failure is None:
                rank = peer.rank
                what = self._names.get(rank, f"rank {rank}")
                self.failure = RankFailedError(f"rank {rank} ({what}) died or stopped answering: {_first_line(error)}; "
                                               "restart every rank")
                log.error("%s", self.failure)
            raise self.failure from None
        finally:
            self._last = time.monotonic()
            self._lock.release()

    def exchange(self, hops: list[tuple[int, dict[str, Any]]], hidden: torch.Tensor,
                 links: list[str] | None = None) -> torch.Tensor:
        """Run a chain: ``hops`` are ``(rank, header)`` in order (consecutive ranks differ), ``hidden``
        goes to the first, each rank's output to the next, the last one's back here: a tensor of
        ``hidden``'s shape and dtype on the wire's device. ``links``: each link's backend
        (:func:`chain_links`; None: gloo throughout). A step that failed on a rank re-raises its
        error here (the ranks go on); a rank that fails raises RankFailedError."""
        ranks = [rank for rank, _ in hops]
        links = links or [BACKEND] * (len(hops) + 1)
        wire = self._wire(hidden, links[0])
        out = torch.empty(wire.shape, dtype=wire.dtype, device=hidden.device if links[-1] == GPU_BACKEND else "cpu")
        statuses: list[Any] = []
        with self._channel() as peer:
            for i, (rank, header) in enumerate(hops):
                peer.rank = rank
                route = {"src": ranks[i - 1] if i else 0, "dst": ranks[i + 1] if i + 1 < len(ranks) else 0,
                         "via_in": links[i], "via_out": links[i + 1]}
                dist.send_object_list([header | route], dst=rank, group=self._steps)
            peer.rank = ranks[0]
            dist.send(wire, dst=ranks[0], group=self._group(links[0]))
            peer.rank = ranks[-1]
            dist.recv(out, src=ranks[-1], group=self._group(links[-1]))
            for rank in ranks:
                peer.rank = rank
                status: list[Any] = [None]
                dist.recv_object_list(status, src=rank, group=self._steps)
                statuses.append(status[0])
        for error in statuses:  # raised outside the channel: the ranks themselves are fine
            if error is not None:
                raise error
        return out

    def request(self, rank: int, message: dict[str, Any]) -> Any:
        """Ask ``rank`` something that carries no hidden state (``message``, given to the ``answer`` it
        serves with): its answer, a picklable object. The error its answer raised is re-raised here
        (the rank goes on); a rank that fails raises RankFailedError."""
        reply: list[Any] = [None]
        with self._channel() as peer:
            peer.rank = rank
            dist.send_object_list([{"op": "request", "message": message}], dst=rank, group=self._steps)
            dist.recv_object_list(reply, src=rank, group=self._steps)
        error, value = reply[0]
        if error is not None:
            raise error
        return value

    def wait_ready(self) -> None:
        """Rank 0, loaded: wait (up to :data:`LOAD_TIMEOUT_S`) for every rank to say it has loaded (the
        first load error is raised here), let them all start serving together, start the heartbeat."""
        for rank in range(1, self.world):
            with self._channel() as peer:
                peer.rank = rank
                status: list[Any] = [None]
                dist.recv_object_list(status, src=rank)
            if status[0] is not None:
                raise status[0]
        try:
            dist.barrier()
        except RuntimeError as error:
            raise RankFailedError(f"a rank died while the ranks started: {_first_line(error)}") from None
        self._heartbeat = threading.Thread(target=self._beat, name="strata-rank-heartbeat", daemon=True)
        self._heartbeat.start()

    @staticmethod
    def _wire(hidden: torch.Tensor, backend: str) -> torch.Tensor:
        """``hidden`` where ``backend`` sends from: the GPU for NCCL, host memory for gloo."""
        return hidden.detach().contiguous() if backend == GPU_BACKEND else hidden.detach().to("cpu").contiguous()

    def _group(self, backend: str) -> dist.ProcessGroup:
        """The process group of a link's ``backend``."""
        if backend != GPU_BACKEND:
            return self._steps
        if self._gpus is None:
            raise StrataError("a link between two ranks' GPUs, but no NCCL group was made (the ranks' --devices "
                              "name fewer than two with a CUDA device)")
        return self._gpus

    def _beat(self) -> None:
        interval = self.timeout / 4
        while not self._stop.wait(min(interval, 1.0)):
            if time.monotonic() - self._last < interval:
                continue
            for rank in range(1, self.world):
                try:
                    with self._channel(block=False) as peer:
                        if peer is not None:
                            peer.rank = rank
                            dist.send_object_list([{"op": "ping"}], dst=rank, group=self._steps)
                            pong: list[Any] = [None]
                            dist.recv_object_list(pong, src=rank, group=self._steps)
                except RankFailedError:
                    return

    # --- the other ranks' side -------------------------------------------------------------------

    def ready(self, error: BaseException | None) -> None:
        """Another rank: tell rank 0 this rank has loaded (or why it could not); loaded, wait for every
        rank to be (the step timeout then starts counting)."""
        dist.send_object_list([_portable(error, self.rank)], dst=0)
        if error is None:
            dist.barrier()

    def serve(self, step: Callable[[dict[str, Any], torch.Tensor], torch.Tensor], device: torch.device,
              answer: Callable[[dict[str, Any]], Any] | None = None) -> None:
        """Another rank: answer rank 0's pings, run each hop it sends (``step(header, hidden on
        device)``, the hidden state from the header's ``src``, the output to its ``dst``, then the
        status to rank 0; a failed step passes zeros on) and answer its requests (``answer(message)``,
        :meth:`request`) until it says stop; RankFailedError when a rank it waits on is gone or silent
        past the timeout."""
        while True:
            try:
                received: list[Any] = [None]
                dist.recv_object_list(received, src=0, group=self._steps)
                header = received[0]
                if header["op"] == "stop":
                    return
                if header["op"] == "ping":
                    dist.send_object_list([None], dst=0, group=self._steps)
                    continue
                if header["op"] == "request":
                    dist.send_object_list([self._answer(answer, header["message"])], dst=0, group=self._steps)
                    continue
                via_in, via_out = header["via_in"], header["via_out"]
                wire = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]),
                                   device=device if via_in == GPU_BACKEND else "cpu")
                dist.recv(wire, src=header["src"], group=self._group(via_in))
                error = None
                try:
                    out = self._wire(step(header, wire.to(device)), via_out)
                except Exception as exc:  # noqa: BLE001 - a failed step fails its requests on rank 0, not this rank
                    log.exception("rank %d: a step failed", self.rank)
                    error = _portable(exc, self.rank)
                    out = torch.zeros(wire.shape, dtype=wire.dtype, device=device if via_out == GPU_BACKEND else "cpu")
                dist.send(out, dst=header["dst"], group=self._group(via_out))
                dist.send_object_list([error], dst=0, group=self._steps)
            except (RuntimeError, dist.DistBackendError) as error:
                raise RankFailedError(f"rank {self.rank}: a rank it waits on died or stopped answering: "
                                      f"{_first_line(error)}") from None


    def _answer(self, answer: Callable[[dict[str, Any]], Any] | None, message: dict[str, Any]
                ) -> tuple[BaseException | None, Any]:
        """``(error, value)`` of ``answer(message)``: what :meth:`request` receives."""
        try:
            if answer is None:
                raise StrataError(f"rank {self.rank} answers no requests")
            return None, answer(message)
        except Exception as exc:  # noqa: BLE001 - a failed request fails on rank 0, not this rank
            log.exception("rank %d: a request failed", self.rank)
            return _portable(exc, self.rank), None


class _Peer:
    """The rank the channel talks to now (named when the transport fails)."""

    rank = 0


def _difference(reports: list[dict[str, Any]]) -> str | None:
    """The first way a rank's identity differs from rank 0's, as a message, or None."""
    ours = reports[0]["identity"]
    for rank, report in enumerate(reports[1:], start=1):
        for key, value in report["identity"].items():
            if value != ours.get(key):
                flag = key if key == "model file" else "--" + key.replace("_", "-")
                return (f"rank {rank} was started with {flag} {value!r}, rank 0 with {ours.get(key)!r}: every rank "
                        "must run the same model file and settings")
    return None


def _portable(error: BaseException | None, rank: int) -> BaseException | None:
    """``error`` as it can travel to rank 0: itself where it pickles back whole, else a RuntimeError
    with its text."""
    if error is None:
        return None
    try:
        if isinstance(error, StrataError) and type(pickle.loads(pickle.dumps(error))) is type(error):
            return error
    except Exception:  # noqa: BLE001 - an exception that does not round-trip travels as its text
        pass
    return RuntimeError(f"rank {rank}: {type(error).__name__}: {error}")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
