"""The worker side of a sync with any engine: join, hello, agree, stage, commit, report (torch, no engine, no jax).

An engine's folder (``bridge.engines.vllm``) makes one ``WorkerSync`` per worker and
gives it what only the engine knows: the worker's hello (``bridge.engines.hello.worker_hello``
with its place in the engine and its engine params) and a commit function that puts
received tensors into the live model. Everything else is here:

1. ``join``: open the sync's own group with the trainers (``bridge.engines.group``),
   exchange hellos, agree on the plan (``bridge.engines.agree``), make the staging
   tensors (this rank's params in its logical layout, never a full tensor) and a
   ``StagingReceiver`` over them. Every rank learns every rank's outcome, so a mismatch
   is refused on every rank before any byte moves.
2. ``start``: the receiver begins filling the staging tensors in a thread of its own, so
   the engine may go on serving while the bytes arrive (the model is not touched).
3. ``receive(version, commit)``: waits for the bytes (or receives them now, without a
   ``start``); once every rank got everything, ``commit`` puts them into the model; every
   rank learns each worker's outcome, byte counter and seconds (the trainers' ``SyncReport``).
   ``settle`` ends a started receive that no ``receive`` committed (the trainers failed).
4. ``close``: forget the group; the trainers open a new one after a failure.

No method raises: an engine's control plane may not survive a worker that raises while
its peers return (vLLM's multiprocess executor then reads stale replies), and the
trainers learn every failure through the group anyway (they fail the same collective, or
read this worker's error in the next report). Failures are logged and close the group;
the methods return whether they succeeded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from bridge.engines.agree import agree
from bridge.engines.group import all_gather_json, close_group, open_group, owner_open, wire_seconds
from bridge.engines.membership import check_secret
from bridge.errors import SyncError
from bridge.plan.bridge_plan import BridgePlan
from bridge.wire import shm
from bridge.wire.receiver import Receiver
from bridge.wire.session import torch_dtype
from jreshard.core.args import check_int, check_name, check_seconds

__all__ = ["Commit", "GroupInfo", "StagingReceiver", "WorkerSync"]

log = logging.getLogger("bridge")


@dataclasses.dataclass(frozen=True, slots=True)
class Commit:
    """What an engine's commit function did with one sync's tensors.

    Attributes:
      layers: the number of layers (modules) written.
      process_seconds: the seconds the engine's own post-load processing took.
      adopted: the names of the staging tensors the model now holds instead of a copy (the
        worker gives them new storage, or reuses them when nothing else holds them).
    """

    layers: int
    process_seconds: float
    adopted: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True, slots=True)
class GroupInfo:
    """Where the trainers' sync group is and how long its waits may take (plain data, any control plane carries it).

    Args:
      host, port: where trainer rank 0 hosts the group's store.
      trainers: the number of trainer ranks (the workers' ranks follow theirs).
      world_size: trainers plus every worker of every replica.
      timeout: seconds any single wait for data may take.
      ready_timeout: seconds to wait for every rank to join the group or a sync.
      name: the group's name in the store.
      secret: the job's secret (bytes, or a str taken as UTF-8; at least 16 bytes): every rank proves
        it when it joins (``bridge.engines.membership``). Keyword only; never shown in ``repr``.
        A control plane carries it as hex (``secret.hex()``).
    """

    host: str
    port: int
    trainers: int
    world_size: int
    timeout: float = 60.0
    ready_timeout: float = 600.0
    name: str = "jreshard"
    secret: bytes = dataclasses.field(kw_only=True, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "secret", check_secret("secret", self.secret))
        check_name("host", self.host, "the trainer's address")
        check_int("port", self.port, maximum=65535)
        check_int("trainers", self.trainers, minimum=1)
        check_int("world_size", self.world_size, minimum=self.trainers + 1)
        check_seconds("timeout", self.timeout)
        check_seconds("ready_timeout", self.ready_timeout)
        check_name("name", self.name, "the group's name")


class StagingReceiver(Receiver):
    """A ``Receiver`` into a worker's staging tensors that counts, per sync, the bytes it receives and the
    seconds it unpacks, and gives adopted tensors new storage (``renew``)."""

    @property
    def bytes_received(self) -> int:
        """Bytes the last sync posted receives for."""
        return self.last_stats.received_bytes

    @property
    def unpack_seconds(self) -> float:
        """Seconds the last sync spent unpacking."""
        return float(self.last_stats.step_seconds.get("unpack", 0.0))

    def renew(self, names: Iterable[str]) -> list[str]:
        """New tensors for those of ``names`` whose storage the model still holds; returns their names.

        A param the model adopted (``Commit.adopted``) is written whole by every sync. When the
        engine's processing kept it (a GPU weight, an embedding), the next sync needs new
        storage; when processing only read it (vLLM's CPU backend packs linear weights into
        oneDNN's own memory and empties the parameter), nothing else holds it, and reusing it
        spares the next sync fresh pages (their first touch costs more than the copy itself).
        """
        renewed = []
        for name in names:
            # The Receiver keeps the tensor it was given beside its data (for swapping commits, which
            # this receiver does not make): only its data here (a tensor without a view's base), so
            # that only others count.
            self.rebind(name, self.params[name])
            if _shared(self.params[name]):
                old = self.params[name]
                self.rebind(name, _staging({name: (tuple(old.shape), old.dtype)}, old.device)[name].data)
                renewed.append(name)
        return renewed


def _staging(specs: dict[str, tuple[Any, torch.dtype]], device: Any) -> dict[str, torch.Tensor]:
    """Zeroed staging tensors; in host memory, in one shared-memory segment that same-host trainers write
    into (``bridge.wire.shm``, a segment per tensor), so a sync's bytes reach them without a socket."""
    if torch.device(device).type == "cpu":
        return shm.tensors(specs)
    return {n: torch.zeros(shape, dtype=dtype, device=device) for n, (shape, dtype) in specs.items()}


def _use_count(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _shared(t: torch.Tensor) -> bool:
    """Whether a tensor other than ``t`` (a view, a Parameter, a kernel's saved tensor) holds its storage."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return True  # cannot tell: assume the model holds it
    return _use_count(t) > (_shm_refs() if shm.find(t) is not None else
                            _use_count(torch.empty(1, dtype=t.dtype, device=t.device)))


@functools.cache
def _shm_refs() -> int:
    """What holds the storage of the data of a shared-memory staging tensor that nothing else holds (its
    mapping does too), measured once."""
    return _use_count(shm.tensors({"probe": ((1,), torch.uint8)})["probe"].data)


CommitFn = Callable[[Mapping[str, torch.Tensor], frozenset[str]], Commit]
"""An engine's commit: ``commit(tensors, adoptable)`` puts this rank's received tensors (by param name)
into the live model, may let the model hold those named in ``adoptable`` instead of copying them,
and says what it did; it raises to refuse (the sync then fails on every rank)."""


class WorkerSync:
    """One worker's side of the syncs with a group of trainers (see the module docstring).

    Args:
      device: where the staging tensors live (the engine's device).

    Attributes:
      plan: the agreed plan (``None`` before ``join`` and after a failure).
      rank: this worker's rank in the sync group.
      version: the version the model holds since the last commit (``None`` before one).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.group: Any = None
        self.receiver: StagingReceiver | None = None
        self.plan: BridgePlan | None = None
        self.rank: int | None = None
        self.version: int | None = None
        self._info: GroupInfo | None = None
        self._adoptable: frozenset[str] = frozenset()
        self._tied: dict[str, str] = {}  # engine params committed from another param's staging tensor
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jreshard-receive")
        self._pending: concurrent.futures.Future | None = None  # a started receive (``start``)

    def join(self, info: GroupInfo, hello: Mapping[str, Any]) -> bool:
        """Joins the trainers' group, exchanges hellos and makes the staging tensors; True when every rank agreed.

        ``hello`` is this worker's ``bridge.engines.hello.worker_hello`` (its ``rank`` is its rank in the group).
        A worker synced by trainers elsewhere (another ``host:port``) that have not closed refuses, so that
        those trainers' next sync still finds it; once they closed (``TrainerSync.close``) or exited, it
        joins the new ones.
        """
        old = self._info
        if old is not None and (old.host, old.port) != (info.host, info.port) and owner_open(self.group):
            return self._refuse(info, hello, f"this engine's workers are synced by the trainers at {old.host}:"
                                             f"{old.port}, which have not closed; call close() on that "
                                             "VLLMWeightSync (TrainerSync) first, or use it")
        self.close()
        self._info, self.rank = info, int(hello["rank"])
        try:
            self.group = open_group(info.host, info.port, self.rank, info.world_size, secret=info.secret,
                                    timeout=info.ready_timeout, name=info.name)
            hellos = all_gather_json(dict(hello), self.group, timeout=info.ready_timeout, what="the hello")
        except Exception as e:  # the trainers time out waiting for this worker, or failed themselves
            self.fail("joining the sync group", e)
            return False
        error = None
        try:
            agreed = agree(hellos)
            self.plan = agreed.plan
            mine = self.plan.param_map.for_rank(self.rank)
            staging = _staging({p.name: (p.shape, torch_dtype(p.dtype)) for p in mine}, self.device)
            live = {n for n, _, _ in hello["params"]}
            self._tied = {name: src for name, src in agreed.tied.items() if name in live and src in staging}
            self.receiver = StagingReceiver(self.plan, staging, rank=self.rank, atomic=False, timeout=info.timeout,
                                            ready_timeout=info.ready_timeout)
            # Params that every sync writes whole may be adopted by the model instead of copied; the
            # others (padding rows of the vocabulary are never sent) keep their staging tensors.
            # A tied param's source is committed twice (itself, then the tied param): the model copies it.
            self._adoptable = frozenset(p.name for p in mine if p.name not in self._tied.values()
                                        and sum(math.prod(r.shape) for r in p.regions) == math.prod(p.shape))
        except Exception as e:  # a plan mismatch: every rank found the same one
            error = f"{type(e).__name__}: {e}"
        if not self._report(error, "the hello"):
            return False
        log.info("jreshard: rank %d joined the sync group: %r", self.rank, self.plan)
        return True

    def _refuse(self, info: GroupInfo, hello: Mapping[str, Any], error: str) -> bool:
        """Joins ``info``'s group only to tell its ranks ``error``; keeps the group this worker has."""
        rank = int(hello["rank"])
        log.error("jreshard: rank %d refuses the trainers at %s:%d: %s", rank, info.host, info.port, error)
        group = None
        try:
            group = open_group(info.host, info.port, rank, info.world_size, secret=info.secret,
                               timeout=info.ready_timeout, name=info.name)
            all_gather_json(dict(hello), group, timeout=info.ready_timeout, what="the hello")
            all_gather_json({"rank": rank, "error": error}, group, timeout=info.timeout, what="the hello")
        except Exception as e:  # the new trainers time out, or gave up first
            log.error("jreshard: rank %d: refusing the trainers at %s:%d failed: %s", rank, info.host, info.port, e)
        finally:
            close_group(group)
        return False

    def start(self) -> None:
        """Begins receiving the next sync into the staging tensors in a thread of its own; returns at once.

        The engine may go on generating meanwhile: nothing here touches the model. ``receive``
        then waits for the bytes and commits them.
        """
        self.settle()
        if self.receiver is not None and self.group is not None:
            self._pending = self._pool.submit(self._receive_bytes, self.receiver, self.group)

    @staticmethod
    def _receive_bytes(receiver: StagingReceiver, group: Any) -> tuple[int, float]:
        t0 = time.perf_counter()
        got = receiver.sync(group)
        return got, time.perf_counter() - t0

    def settle(self) -> None:
        """Ends a started receive that no ``receive`` committed (the trainers failed after ``start``).

        Its bytes are dropped and the group closed (the trainers closed theirs): a receive still
        waiting for data then fails at once, in its own thread. Returns without waiting for it.
        """
        if self._pending is not None:
            log.info("jreshard: rank %s drops a sync that no update committed", self.rank)
            self.close()

    def receive(self, version: int, commit: CommitFn) -> bool:
        """Receives ``version`` into the staging tensors (or waits for ``start``'s receive), commits it,
        reports; True when every rank committed.

        ``version`` is the one the engine's control plane announced; the trainers' must equal it.
        """
        pending, self._pending = self._pending, None
        if self.receiver is None or self.group is None:
            log.error("jreshard: rank %s: an update without a sync group; the trainers join again after a "
                      "failure.", self.rank)
            return False
        try:
            got, received = pending.result() if pending is not None else self._receive_bytes(self.receiver,
                                                                                               self.group)
        except SyncError as e:  # every rank of the group fails this sync; the model is untouched
            self.fail(f"receiving version {version}", e)
            return False
        seconds = {"receive": received, "unpack": self.receiver.unpack_seconds,
                   **wire_seconds(self.receiver.last_stats)}
        error = None
        if got != version:
            error = f"the trainers sent version {got}, but the update announced {version}"
        else:
            try:
                t0 = time.perf_counter()
                tensors = {**self.receiver.params, **{n: self.receiver.params[s] for n, s in self._tied.items()}}
                done = commit(tensors, self._adoptable)
                renewed = self.receiver.renew(done.adopted)
                seconds.update(commit=time.perf_counter() - t0, process=done.process_seconds)
                log.debug("jreshard: rank %d: the model adopted %d tensors and kept %d of them", self.rank,
                          len(done.adopted), len(renewed))
            except Exception as e:
                error = f"committing version {got} failed: {type(e).__name__}: {e}"
        if not self._report(error, "the commit report", version=got, bytes_received=self.receiver.bytes_received,
                            transport_bytes=dict(self.receiver.last_stats.transport_bytes), seconds=seconds):
            return False
        self.version = got
        return True

    def _report(self, error: str | None, what: str, **report: Any) -> bool:
        """Tells every rank this worker's outcome (and ``report``); True when nobody failed."""
        assert self.group is not None and self._info is not None
        try:
            rows = all_gather_json({"rank": self.rank, "error": error, **report}, self.group,
                                   timeout=self._info.timeout, what=what)
        except SyncError as e:
            self.fail(what, e)
            return False
        errors = [r["error"] for r in rows if r.get("error")]
        if errors:
            self.fail(what, errors[0])
            return False
        return True

    def fail(self, what: str, error: Any) -> None:
        """Logs a failure of this worker's side and closes the group (the trainers learn it through the group)."""
        log.error("jreshard: rank %s: %s failed: %s", self.rank, what, error)
        self.close()

    def close(self) -> None:
        """Forgets the group, the plan and the staging tensors (the model keeps its weights)."""
        close_group(self.group)
        self.group, self.receiver, self.plan, self._pending = None, None, None, None
