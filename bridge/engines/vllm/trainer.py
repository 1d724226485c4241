"""The trainer side: a JAX trainer updates a running vLLM engine through the ``"jreshard"`` backend (imports jax).

``VLLMWeightSync`` is ``bridge.engines.trainer.TrainerSync`` (the group, hellos, plan,
``Sender`` and reports) driving the engine through vLLM's weight-sync client: trainer
rank 0 holds the client (``bridge.engines.vllm.LLMClient`` over a ``vllm.LLM``, an
``AsyncLLM``-backed or HTTP client: any object with the four methods of vLLM's
``VLLMWeightSyncClient``), which ``ClientControl`` turns into the trainer's
``EngineControl``. Generation is paused where the client can pause
(``pause_generation``/``resume_generation``): for the whole sync, or with ``pause="commit"``
only for the workers' commit while the bytes stream in as the engine serves; the engine
reports the synced version (``client.get_weight_version()``).
"""

from __future__ import annotations

import logging
from typing import Any

from bridge.engines.trainer import SyncReport, TrainerSync
from bridge.engines.worker import GroupInfo
from bridge.recipes.recipe import Recipe

__all__ = ["ClientControl", "SyncReport", "VLLMWeightSync"]

log = logging.getLogger("bridge")

_PHASES = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


class ClientControl:
    """vLLM's four weight-sync phases as an ``EngineControl``: what ``TrainerSync`` calls on trainer rank 0.

    Raises:
      TypeError: ``client`` lacks one of the four phases.
    """

    def __init__(self, client: Any) -> None:
        missing = [m for m in _PHASES if not hasattr(client, m)]
        if missing:
            raise TypeError(f"client on trainer rank 0 must have the four weight-sync methods; "
                            f"{type(client).__name__} lacks {missing}. "
                            "Wrap a vllm.LLM in bridge.engines.vllm.LLMClient.")
        self.client = client
        self._paused = False

    def connect(self, info: GroupInfo) -> None:
        self.client.init_weight_transfer_engine({
            "master_address": info.host, "master_port": info.port, "trainer_world_size": info.trainers,
            "world_size": info.world_size, "timeout": info.timeout, "ready_timeout": info.ready_timeout,
            "group_name": info.name, "secret": info.secret.hex()})

    def pause(self) -> bool:
        if not hasattr(self.client, "pause_generation"):
            return False
        self.client.pause_generation()
        self._paused = True
        return True

    def begin_update(self) -> None:
        self.client.start_weight_update()

    def update(self, version: int) -> None:
        self.client.update_weights({"version": version})

    def end_update(self, version: int | None) -> None:
        try:
            if version is None:
                self.client.finish_weight_update()
            else:
                self.client.finish_weight_update(str(version))
        finally:
            self._resume()

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self.client.resume_generation()


class VLLMWeightSync(TrainerSync):
    """Sends a JAX trainer's weights to the workers of a vLLM engine, each rank its exact slices.

    Args:
      recipe: how the trainer's leaves become vLLM params (``Recipe.llama(config)``, ...).
      workers: the number of vLLM workers (TP x DP of the engine).
      client: the engine's weight-sync client; required on trainer rank 0, ignored elsewhere.
      rank, trainers, host, port, bucket_bytes, timeout, ready_timeout, secret, checksum, transport, pause:
        as ``TrainerSync``'s (with ``"auto"``, an engine on this host gets its bytes through shared memory;
        with ``pause="commit"`` it serves while they arrive, and a client that pauses in vLLM's ``"keep"``
        mode, ``HTTPClient(url, pause_mode="keep")``, lets requests in flight go on with the new weights).
        The secret reaches the workers in the init info of ``init_weight_transfer_engine`` (as hex):
        keep that call on a channel only the job can read (the process itself, a private network, HTTPS).

    After a failed sync, call ``sync`` again: it reconnects at once on the same port. One object
    holds an engine's workers until its ``close()``; another one (another port) is refused until then.

    Example (trainer rank 0 of one, beside a ``vllm.LLM`` built with the ``"jreshard"`` backend)::

        sync = VLLMWeightSync(Recipe.llama(config), workers=2, client=LLMClient(llm), port=29600)
        report = sync.sync(params, version=step)
    """

    def __init__(self, recipe: Recipe, *, workers: int, client: Any = None, rank: int | None = None,
                 trainers: int | None = None, host: str = "127.0.0.1", port: int, bucket_bytes: int = 16 << 20,
                 secret: bytes | str | None = None,
                 timeout: float = 60.0, ready_timeout: float = 600.0, checksum: bool = False,
                 transport: str = "auto", pause: str = "sync") -> None:
        if rank is None:
            import jax

            rank = jax.process_index()
        control = ClientControl(client) if rank == 0 else None
        super().__init__(recipe, workers=workers, control=control, rank=rank, trainers=trainers, host=host,
                         port=port, bucket_bytes=bucket_bytes, timeout=timeout, ready_timeout=ready_timeout,
                         secret=secret, checksum=checksum, transport=transport, pause=pause)
