"""The trainer side: a JAX trainer updates a running vLLM engine through the ``"jreshard"`` backend.

Every trainer process (one per JAX process) makes a ``VLLMWeightSync`` and calls
``sync(params, version)`` after each training step. Trainer rank 0 holds the client
(``bridge.engines.vllm.LLMClient`` over a ``vllm.LLM``, an ``AsyncLLM``-backed or HTTP client:
any object with the four methods of vLLM's ``VLLMWeightSyncClient``) and drives the
phases; while a worker-side phase blocks on the data plane, rank 0 calls it from a
helper thread and sends at the same time. The first sync (and the first after a failed
one) opens a new gloo group with the workers and runs the handshake; later ones only
send. Generation is paused during an update where the client can pause
(``pause_generation``/``resume_generation``); the engine reports the synced version
(``client.get_weight_version()``). When the engine serves a block-FP8 model the handshake
agrees on an FP8 sync, and every ``sync`` quantizes ``params`` where their shards are
(``bridge.trainer.fp8.quantize_params``) before sending FP8 weights and their scales.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import Any

from bridge.engines.agree import agree
from bridge.engines.group import all_gather_json, close_group, open_group, wire_seconds
from bridge.engines.hello import PROTOCOL, Recipe, source_to_data
from bridge.plan.bridge_plan import BridgePlan
from bridge.plan.fp8 import Fp8ParamMap
from bridge.trainer.sender import Sender, describe
from bridge.wire.session import PlanMismatchError, SyncError

__all__ = ["VLLMWeightSync", "SyncReport"]

log = logging.getLogger("bridge")


@dataclasses.dataclass(frozen=True, slots=True)
class SyncReport:
    """One sync as the ranks counted it.

    Attributes:
      version: the version the workers received.
      bytes_received: per worker rank, the bytes it received.
      seconds: per rank of the sync group, where its time went: a trainer's ``send`` (its
        ``Sender.sync``, wire handshake included); a worker's ``receive`` (its ``Receiver.sync``),
        of which ``unpack`` (copies from bucket buffers into staging), and ``commit`` (the
        staging tensors entering the model), of which ``process`` (vLLM's post-load processing).
        Every rank also reports the wire's steps (``handshake``, ``pack``, ``vote``, ``post``,
        ``wait``; see ``bridge.wire.session.run_sync``): a trainer's ``pack`` includes XLA's casts and
        transposes, a worker's ``vote`` and ``wait`` its time waiting for the trainers.
    """

    version: int
    bytes_received: dict[int, int]
    seconds: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)


class VLLMWeightSync:
    """Sends a JAX trainer's weights to the workers of a vLLM engine, each rank its exact slices.

    Args:
      recipe: how the trainer's leaves become vLLM params (``Recipe.llama(config)``, ...).
      workers: the number of vLLM workers (TP x DP of the engine).
      client: the engine's weight-sync client; required on trainer rank 0, ignored elsewhere.
      rank: this trainer's rank (default ``jax.process_index()``); rank 0 hosts the group.
      trainers: the number of trainer processes (default ``jax.process_count()``).
      host, port: where trainer rank 0 hosts the group's store (reachable by every worker).
      bucket_bytes: the most bytes one rank sends or receives per bucket.
      timeout: seconds any single wait for data may take.
      ready_timeout: seconds to wait for every rank to join the group or a sync.
      checksum: the ``Sender`` checksums every bucket (off by default; byte and segment
        counts are always checked).
    """

    def __init__(self, recipe: Recipe, *, workers: int, client: Any = None, rank: int | None = None,
                 trainers: int | None = None, host: str = "127.0.0.1", port: int, bucket_bytes: int = 16 << 20,
                 timeout: float = 60.0, ready_timeout: float = 600.0, checksum: bool = False) -> None:
        import jax

        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a bridge.engines.vllm.Recipe, got {type(recipe).__name__}.")
        self.rank = jax.process_index() if rank is None else rank
        self.trainers = jax.process_count() if trainers is None else trainers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int (the engine's TP x DP), got {workers!r}.")
        if self.rank == 0:
            missing = [m for m in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                                   "finish_weight_update") if not hasattr(client, m)]
            if missing:
                raise TypeError(f"client on trainer rank 0 must have the four weight-sync methods; "
                                f"{type(client).__name__} lacks {missing}. "
                                "Wrap a vllm.LLM in bridge.engines.vllm.LLMClient.")
        self.recipe, self.workers, self.client = recipe, workers, client
        self.host, self.port, self.bucket_bytes = host, port, bucket_bytes
        self.timeout, self.ready_timeout, self.checksum = timeout, ready_timeout, checksum
        self.group: Any = None
        self.plan: BridgePlan | None = None
        self.fp8: Fp8ParamMap | None = None  # the agreed FP8 sync when the engine is FP8
        self.sender: Sender | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jreshard-client")

    @property
    def world_size(self) -> int:
        return self.trainers + self.workers

    def _call(self, method: str, *args: Any) -> concurrent.futures.Future:
        return self._pool.submit(getattr(self.client, method), *args)

    def connect(self, params: Any) -> BridgePlan:
        """Opens the group with the workers and agrees on the plan (the first ``sync`` does this).

        Raises:
          PlanMismatchError: the leaves and recipe do not match the engine (every rank refuses).
          SyncError: a worker failed to join or to set up; see the engine's log.
        """
        source = describe(params, list(range(self.trainers)))
        info = {"master_address": self.host, "master_port": self.port, "trainer_world_size": self.trainers,
                "world_size": self.world_size, "timeout": self.timeout, "ready_timeout": self.ready_timeout}
        init = self._call("init_weight_transfer_engine", info) if self.rank == 0 else None
        hello: dict[str, Any] = {"role": "trainer", "protocol": PROTOCOL, "rank": self.rank}
        if self.rank == 0:
            hello.update(leaves=source_to_data(source), recipe=self.recipe.to_data(), bucket_bytes=self.bucket_bytes)
        try:
            self.group = open_group(self.host, self.port, self.rank, self.world_size, timeout=self.ready_timeout)
            hellos = all_gather_json(hello, self.group, timeout=self.ready_timeout, what="the handshake")
            mismatch = None
            try:
                agreed = agree(hellos)
                self.plan, self.fp8 = agreed.plan, agreed.fp8
            except PlanMismatchError as e:  # every rank finds it; the workers still wait for the outcome
                mismatch = e
            rows = all_gather_json({"rank": self.rank, "error": None if mismatch is None else str(mismatch)},
                                   self.group, timeout=self.timeout, what="the handshake")
            if mismatch is not None:
                raise mismatch
            _raise_worker_errors(rows, "setting up")
            assert self.plan is not None
            self.sender = Sender(self.plan, rank=self.rank, timeout=self.timeout, ready_timeout=self.ready_timeout,
                                 checksum=self.checksum)
        except BaseException:
            self.close()
            if init is not None:
                _settle(init)
            raise
        if init is not None:
            init.result()
        return self.plan

    def sync(self, params: Any, version: int) -> SyncReport:
        """Sends ``params`` as ``version`` (the training step) to every worker; returns the workers' report.

        Raises:
          PlanMismatchError: the trainer's leaves and recipe do not match the engine (nothing moved).
          SyncError: a peer died, stalled or failed; the engine keeps serving its previous weights.
            The group is closed; the next ``sync`` opens a new one (give a new ``port`` if the old
            one may still be bound).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int (the training step), got {version!r}.")
        if self.group is None:
            self.connect(params)
        assert self.sender is not None
        if self.fp8 is not None:  # before any engine call: a failure here leaves the engine as it was
            from bridge.trainer.fp8 import quantize_params

            params = quantize_params(params, self.fp8)
        paused = started = False
        update = None
        try:
            if self.rank == 0:
                if hasattr(self.client, "pause_generation"):
                    self.client.pause_generation()
                    paused = True
                self.client.start_weight_update()
                started = True
                update = self._call("update_weights", {"version": version})
            t0 = time.perf_counter()
            self.sender.sync(params, version, group=self.group)
            seconds = {"send": time.perf_counter() - t0, **wire_seconds(self.sender.stats)}
            rows = all_gather_json({"rank": self.rank, "error": None, "seconds": seconds}, self.group,
                                   timeout=self.timeout, what="the commit report")
            _raise_worker_errors(rows, f"committing version {version}")
            if update is not None:
                update.result()
                self.client.finish_weight_update(str(version))
                started = False
        except BaseException:
            self.close()
            if update is not None:
                _settle(update)
            if started:  # ends the engine's update (it committed nothing)
                self.client.finish_weight_update()
            raise
        finally:
            if paused:
                self.client.resume_generation()
        workers = [r for r in rows if r["rank"] >= self.trainers]
        return SyncReport(version, {r["rank"]: int(r["bytes_received"]) for r in workers},
                          {r["rank"]: r.get("seconds", {}) for r in rows})

    def close(self) -> None:
        """Closes the group (the workers close theirs when a sync fails or on shutdown)."""
        close_group(self.group)
        self.group, self.sender = None, None


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
