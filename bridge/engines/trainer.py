"""The trainer side of a sync with any engine: open the group, hello, agree, send, read the report (imports jax).

Every trainer process (one per JAX process) makes one ``TrainerSync`` (in practice an
engine's subclass, ``bridge.engines.vllm.VLLMWeightSync``) and calls ``sync(params,
version)`` after each training step. Trainer rank 0 also drives the engine's workers
through its ``EngineControl``, the one seam an engine implements on this side: while a
control call blocks on the data plane (the workers joining, receiving), rank 0 makes it
from a helper thread and joins or sends at the same time. The first sync (and the first
after a failed one) opens a new gloo group with the workers (``bridge.engines.group``)
and exchanges hellos (``bridge.engines.hello``); later ones only send. Trainer rank 0 hosts
one store on ``host:port`` until ``close()`` and opens every group on it under a name of its
own, so a retry after a failure never waits for the port; while it is open, the engine's
workers refuse another ``TrainerSync`` (``bridge.engines.worker.WorkerSync.join``). When the engine
serves a block-FP8 model the hellos agree on an FP8 sync, and every ``sync`` quantizes
``params`` where their shards are (``bridge.trainer.fp8.quantize_params``) before sending
FP8 weights and their scales.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from typing import Any, Protocol

from bridge.engines.agree import agree
from bridge.engines.group import CLOSED_KEY, all_gather_json, close_group, host_store, open_group, wire_seconds
from bridge.engines.hello import trainer_hello
from bridge.engines.membership import SECRET_ENV, check_secret, env_secret, new_secret
from bridge.engines.worker import GroupInfo
from bridge.errors import PlanMismatchError, SyncError
from bridge.plan.bridge_plan import BridgePlan
from bridge.plan.fp8 import Fp8ParamMap
from bridge.recipes.recipe import Recipe
from bridge.trainer.sender import Sender, describe
from bridge.wire.route import Mode
from jreshard.core.args import check_flag, check_int, check_name, check_seconds

__all__ = ["PAUSES", "EngineControl", "SyncReport", "TrainerSync"]

log = logging.getLogger("bridge")

PAUSES = ("sync", "commit")  # TrainerSync's pause: what the engine's generation pauses for

# What a trainer does after a failed sync: the wire's own advice (rebuild the default group on every
# rank) does not fit here, where the workers cannot be reached and ``sync`` opens a new group itself.
_RETRY_ADVICE = ("The sync group is closed and the engine keeps serving its previous weights: call sync(params, "
                "version) again on every trainer rank; it reconnects on the same port.")


class EngineControl(Protocol):
    """How trainer rank 0 drives an engine's workers: the engine-specific seam of ``TrainerSync``.

    Each call returns once every worker has returned from it; a worker's failure there is
    raised (the workers' own side of a sync never raises: its failures come through the group).
    """

    def connect(self, info: GroupInfo) -> None:
        """Tells every worker to join the group ``info`` names (``bridge.engines.worker.WorkerSync.join``)."""

    def pause(self) -> bool:
        """Pauses the engine's generation until ``end_update``; False where this engine cannot pause."""

    def begin_update(self) -> None:
        """Has every worker start receiving the next sync (``WorkerSync.start``); returns at once."""

    def update(self, version: int) -> None:
        """Has every worker wait for ``version``'s bytes and commit them (``WorkerSync.receive``)."""

    def end_update(self, version: int | None) -> None:
        """Ends an update begun by ``begin_update``: ``version`` is now served, or ``None`` when it failed;
        generation resumes if ``pause`` paused it."""


@dataclasses.dataclass(frozen=True, slots=True)
class SyncReport:
    """One sync as the ranks counted it.

    Attributes:
      version: the version the workers received.
      bytes_received: per worker rank, the bytes it received.
      seconds: per rank of the sync group, where its time went: a trainer's ``send`` (its
        ``Sender.sync``, wire handshake included); a worker's ``receive`` (its ``Receiver.sync``),
        of which ``unpack`` (copies from bucket buffers into staging), and ``commit`` (the
        staging tensors entering the model), of which ``process`` (the engine's post-load processing).
        Every rank also reports the wire's steps (``handshake``, ``pack``, ``vote``, ``post``,
        ``wait``; see ``bridge.wire.session.SyncSession``): a trainer's ``pack`` includes XLA's casts and
        transposes, a worker's ``vote`` and ``wait`` its time waiting for the trainers.
      transport_bytes: per worker rank, the bytes it received per route (``"shm"``: written into its
        staging by trainers on its host; ``"gloo"``: over sockets; ``bridge.wire.route``).
      sync_seconds: this rank's whole ``sync`` call (the group's set-up included on a first sync).
      pause_seconds: on trainer rank 0, the seconds the engine's generation was paused (from the
        pause to the resume: the whole sync with ``pause="sync"``, the commit with ``"commit"``);
        ``None`` on the other ranks and where the engine cannot pause.
    """

    version: int
    bytes_received: dict[int, int]
    seconds: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    transport_bytes: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    sync_seconds: float = 0.0
    pause_seconds: float | None = None


class TrainerSync:
    """Sends a JAX trainer's weights to an engine's workers, each rank its exact slices.

    Args:
      recipe: how the trainer's leaves become the engine's params (``Recipe.llama(config)``, ...).
      workers: the number of the engine's workers (TP x DP).
      control: the engine's ``EngineControl``; required on trainer rank 0, ignored elsewhere.
      rank: this trainer's rank (default ``jax.process_index()``); rank 0 hosts the group.
      trainers: the number of trainer processes (default ``jax.process_count()``).
      host, port: where trainer rank 0 hosts the group's store (reachable by every worker).
      bucket_bytes: the most bytes one rank sends or receives per bucket.
      timeout: seconds any single wait for data may take.
      ready_timeout: seconds to wait for every rank to join the group or a sync.
      secret: the job's secret (bytes, or a str taken as UTF-8; at least 16 bytes), the same on every
        trainer rank: every member of a sync group proves it when it joins, and the engine's workers get
        it from trainer rank 0's control call (``EngineControl.connect``). Default: the environment
        variable ``JRESHARD_SYNC_SECRET``; without it, one trainer makes a new one, and several trainers
        under ``jax.distributed`` get rank 0's new one through jax's key-value store (the trainers'
        coordination service). Never shown in a ``repr`` or an error.
      checksum: the ``Sender`` sends a digest of every piece, which the workers check before anything
        is committed (off by default, see ``Sender``; lengths are always checked, a flipped byte only
        with digests).
      transport: ``"auto"`` (shared memory with workers on this host, gloo with the others), ``"shm"``
        or ``"gloo"`` (``bridge.wire.route``; the workers ask for ``"auto"``, and a pair takes shared
        memory only where both sides allow it).
      pause: when the engine stops generating: ``"sync"`` (the default) for the whole sync, so that
        every request the engine takes meanwhile waits for the new weights; ``"commit"`` only while
        the workers commit: the bytes stream into their staging tensors while the engine goes on
        generating with the previous weights (refit while serving).
    """

    def __init__(self, recipe: Recipe, *, workers: int, control: EngineControl | None = None,
                 rank: int | None = None, trainers: int | None = None, host: str = "127.0.0.1", port: int,
                 bucket_bytes: int = 16 << 20, timeout: float = 60.0, ready_timeout: float = 600.0,
                 secret: bytes | str | None = None,
                 checksum: bool = False, transport: str = "auto", pause: str = "sync") -> None:
        import jax

        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a bridge.recipes.Recipe, got {type(recipe).__name__}.")
        self.rank = check_int("rank", jax.process_index() if rank is None else rank)
        self.trainers = check_int("trainers", jax.process_count() if trainers is None else trainers, minimum=1)
        if self.rank >= self.trainers:
            raise ValueError(f"rank {self.rank} must be below trainers {self.trainers}.")
        self.workers = check_int("workers", workers, minimum=1)
        if self.rank == 0 and control is None:
            raise TypeError("trainer rank 0 drives the engine: give control (the engine's EngineControl).")
        self.recipe, self.control = recipe, control if self.rank == 0 else None
        args = (check_name("host", host, "the trainer's address"), check_int("port", port), self.trainers,
                self.trainers + self.workers, check_seconds("timeout", timeout),
                check_seconds("ready_timeout", ready_timeout))
        self.bucket_bytes = check_int("bucket_bytes", bucket_bytes, minimum=1)
        secret = None if secret is None else check_secret("secret", secret)
        self.checksum = check_flag("checksum", checksum)
        if not isinstance(transport, str):
            raise TypeError(f"transport must be 'auto', 'shm' or 'gloo', got {type(transport).__name__}.")
        Mode.parse(transport)
        self.transport = transport
        if pause not in PAUSES:
            raise ValueError(f"pause must be one of {PAUSES}: 'sync' pauses generation for the whole sync, 'commit' "
                             f"only while the workers commit; got {pause!r}.")
        self.pause = pause
        self.info = GroupInfo(*args, secret=_job_secret(secret, self.rank, self.trainers, port, ready_timeout))
        self.group: Any = None
        self.plan: BridgePlan | None = None
        self.fp8: Fp8ParamMap | None = None  # the agreed FP8 sync when the engine is FP8
        self.sender: Sender | None = None
        self._store: Any = None  # rank 0's store server, kept across groups (bridge.engines.group.host_store)
        self._groups = 0  # groups opened so far: each has a name of its own on the store
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jreshard-control")

    @property
    def world_size(self) -> int:
        return self.info.world_size

    def connect(self, params: Any) -> BridgePlan:
        """Opens the group with the workers and agrees on the plan (the first ``sync`` does this).

        Raises:
          PlanMismatchError: the leaves and recipe do not match the engine (every rank refuses).
          SyncError: a worker failed to join or to set up; see the engine's log.
        """
        source = describe(params, list(range(self.trainers)))
        # Every trainer rank opens as many groups as the others (each learns every failure), so the
        # names agree; the workers learn theirs from rank 0's control call.
        self._groups += 1
        info = dataclasses.replace(self.info, name=f"{self.info.name}/{self._groups}")
        if self.rank == 0 and self._store is None:
            self._store = host_store(info.host, info.port, info.world_size, timeout=info.ready_timeout)
        joined = None if self.control is None else self._pool.submit(self.control.connect, info)
        hello = trainer_hello(self.rank, source=source, recipe=self.recipe, bucket_bytes=self.bucket_bytes)
        try:
            self.group = open_group(info.host, info.port, self.rank, info.world_size, secret=info.secret,
                                    timeout=info.ready_timeout, name=info.name, store=self._store)
            hellos = all_gather_json(hello, self.group, timeout=info.ready_timeout, what="the hello")
            mismatch = None
            try:
                agreed = agree(hellos)
                self.plan, self.fp8 = agreed.plan, agreed.fp8
            except PlanMismatchError as e:  # every rank finds it; the workers still wait for the outcome
                mismatch = e
            rows = all_gather_json({"rank": self.rank, "error": None if mismatch is None else str(mismatch)},
                                   self.group, timeout=info.timeout, what="the hello")
            if mismatch is not None:
                raise mismatch
            _raise_worker_errors(rows, "setting up")
            assert self.plan is not None
            self.sender = Sender(self.plan, rank=self.rank, timeout=info.timeout, ready_timeout=info.ready_timeout,
                                 checksum=self.checksum)
        except BaseException:
            self._drop_group()
            if joined is not None:
                _settle(joined)
            raise
        if joined is not None:
            joined.result()
        return self.plan

    def sync(self, params: Any, version: int) -> SyncReport:
        """Sends ``params`` as ``version`` (the training step) to every worker; returns the workers' report.

        Raises:
          PlanMismatchError: the trainer's leaves and recipe do not match the engine (nothing moved).
          SyncError: a peer died, stalled or failed; the engine keeps serving its previous weights.
            The group is closed; the next ``sync`` (on every trainer rank) opens a new one on the
            same store and port, at once.
          ValueError, TypeError: ``params`` lack a leaf or hold one of another shape (every rank
            learns it and refuses the sync; the next ``sync`` reconnects).
        """
        check_int("version", version)
        t_sync = time.perf_counter()
        if self.group is None:
            self.connect(params)
        assert self.sender is not None
        if self.fp8 is not None:  # before any engine call: a failure here leaves the engine as it was
            from bridge.trainer.fp8 import quantize_params

            params = quantize_params(params, self.fp8)
        control, begun, update, paused = self.control, False, None, None
        try:
            if control is not None:
                if self.pause == "sync":
                    paused = self._pause(control)
                control.begin_update()
                begun = True
                if self.pause == "sync":  # the workers commit as soon as they have the bytes
                    update = self._pool.submit(control.update, version)
            t0 = time.perf_counter()
            self.sender.sync(params, version, group=self.group, transport=self.transport)
            seconds = {"send": time.perf_counter() - t0, **wire_seconds(self.sender.last_stats)}
            if control is not None and update is None:  # pause="commit": the bytes are in the workers' staging
                paused = self._pause(control)
                update = self._pool.submit(control.update, version)
            rows = all_gather_json({"rank": self.rank, "error": None, "seconds": seconds}, self.group,
                                   timeout=self.info.timeout, what="the commit report")
            _raise_worker_errors(rows, f"committing version {version}")
            if update is not None:
                update.result()
                begun = False
                control.end_update(version)  # type: ignore[union-attr]
        except BaseException as e:
            self._drop_group()
            if update is not None:
                _settle(update)
            if begun or paused is not None:  # ends the engine's update (it committed nothing) and resumes
                control.end_update(None)  # type: ignore[union-attr]
            if isinstance(e, SyncError) and not isinstance(e, PlanMismatchError):
                raise e.with_advice(_RETRY_ADVICE) from None
            raise
        done = time.perf_counter()
        workers = [r for r in rows if r["rank"] >= self.trainers]
        return SyncReport(version, {r["rank"]: int(r["bytes_received"]) for r in workers},
                          {r["rank"]: r.get("seconds", {}) for r in rows},
                          {r["rank"]: {k: int(v) for k, v in r.get("transport_bytes", {}).items()} for r in workers},
                          sync_seconds=done - t_sync, pause_seconds=None if paused is None else done - paused)

    @staticmethod
    def _pause(control: EngineControl) -> float | None:
        """Pauses the engine; when it paused (``time.perf_counter()``), or None where it cannot pause."""
        t = time.perf_counter()
        return t if control.pause() else None

    def close(self) -> None:
        """Closes the group and releases the port; the engine's workers then take a new ``TrainerSync``'s group.

        The workers close their side when a sync fails or on shutdown; until this is called, they
        refuse another ``TrainerSync`` (another address) that tries to take them over.
        """
        self._drop_group()
        store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(RuntimeError):  # tells the workers this trainer let them go
                store.set(CLOSED_KEY, "1")

    def _drop_group(self) -> None:
        """Closes this sync's group (after a failure); the store and its port stay for the next one."""
        group, self.group, self.sender = self.group, None, None
        close_group(group)


def _job_secret(secret: bytes | None, rank: int, trainers: int, port: int, timeout: float) -> bytes:
    """The secret every member of this job's sync groups proves (see ``TrainerSync``'s ``secret``)."""
    if secret is not None:
        return secret
    from_env = env_secret()
    if from_env is not None:
        return from_env
    if trainers == 1:
        return new_secret()
    import jax
    from jax._src import distributed  # the coordination service's client: no public API exposes it

    client = distributed.global_state.client
    if client is None or jax.process_count() != trainers:
        raise ValueError(f"trainers={trainers} need one secret between them: pass secret= (the same bytes on every "
                         f"trainer rank) or set {SECRET_ENV} on every trainer rank, or run the trainers under "
                         "jax.distributed.initialize(...) (trainer rank 0 then shares a new one).")
    _SHARED[port] = n = _SHARED.get(port, 0) + 1  # every rank makes its syncs in the same order
    key = f"jreshard/sync_secret/{port}/{n}"
    if rank == 0:
        made = new_secret()
        client.key_value_set_bytes(key, made)
        return made
    try:
        return bytes(client.blocking_key_value_get_bytes(key, int(timeout * 1000)))
    except Exception as e:  # jax's deadline or a lost coordinator
        raise SyncError(f"trainer rank {rank} did not get trainer rank 0's secret from jax.distributed's key-value "
                        f"store within {timeout:g} s ({type(e).__name__}): make the sync on every trainer rank, "
                        f"or pass secret= (or set {SECRET_ENV}) on every rank.") from None


_SHARED: dict[int, int] = {}  # per port, the secrets shared so far through jax's key-value store


def _raise_worker_errors(rows: list[dict[str, Any]], what: str) -> None:
    failed = [(r["rank"], r["error"]) for r in rows if r.get("error")]
    if failed:
        rank, error = failed[0]
        raise SyncError(f"{what}: sync rank {rank} failed: {error}")


def _settle(future: concurrent.futures.Future) -> None:
    """Waits for a control-plane call made before a failure; its own error is only logged."""
    try:
        future.result()
    except Exception as e:  # the workers' side of the same failure
        log.info("trainer: the engine's call failed too: %s: %s", type(e).__name__, e)
