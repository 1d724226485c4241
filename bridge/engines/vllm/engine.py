"""The worker side: ``"jreshard"``, a vLLM weight-transfer engine (torch and vLLM, never jax).

vLLM creates one engine per worker when the model is loaded and
``LLM(..., weight_transfer_config=WeightTransferConfig(backend="jreshard"))`` names it
(``bridge.engines.vllm.plugin`` registers it through the ``vllm.general_plugins`` entry point).
The engine-generic work (the group, the hellos, the agreed plan, the staging ``Receiver``,
the reports) is ``bridge.engines.worker.WorkerSync``'s; this module adds what only vLLM
knows: the worker's place and engine params (``vllm_hello``), how new weights enter the
live model (``bridge.engines.vllm.model.write_layers``) and vLLM's four phases:

1. ``init_weight_transfer_engine``: join a new gloo group with the trainer ranks (a
   ``TCPStore`` on the trainer's address; never vLLM's own group), proving the job's secret
   that the init info carries (``bridge.engines.membership``), exchange hellos (the
   trainer's leaves and recipe; this worker's TP rank, replica and engine params from the
   live model, and its FP8 block format when the model is block-FP8), and agree on the plan.
   A mismatch is refused on every rank before any byte moves.
2. ``start_weight_update``: begin receiving this rank's slices into the staging tensors in a
   thread of the worker's own, and return: the engine goes on generating while they arrive
   unless the trainer paused it.
3. ``update_weights({"version": v})``: wait for the slices, then, once every rank got
   everything, commit them layer by layer with vLLM's post-load processing; every rank
   learns each worker's outcome. A failed transfer leaves the model untouched; the group is
   then closed and the trainer initialises again.
4. ``finish_weight_update``: ends the update (the engine's version is set by the client); a
   receive that no update committed (the trainers failed) is dropped.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from bridge.engines.fp8 import fp8_hello
from bridge.engines.hello import EngineParam, worker_hello, worker_rank
from bridge.engines.vllm.model import live_params, torch_dtype_name, write_layers
from bridge.engines.worker import Commit, GroupInfo, WorkerSync

__all__ = ["JReshardInitInfo", "JReshardUpdateInfo", "JReshardEngine", "vllm_hello"]

log = logging.getLogger("bridge")


@dataclasses.dataclass
class JReshardInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is and how many ranks it has (``bridge.engines.worker.GroupInfo`` in vLLM's form).

    ``secret`` is the job's secret as hex (``GroupInfo.secret.hex()``, what ``VLLMWeightSync`` sends); it
    is never shown in a ``repr``.
    """

    master_address: str
    master_port: int
    trainer_world_size: int
    world_size: int
    timeout: float = 60.0
    ready_timeout: float = 600.0
    group_name: str = "jreshard"
    secret: str = dataclasses.field(default="", repr=False)

    def group_info(self) -> GroupInfo:
        """The ``GroupInfo`` these fields name.

        Raises:
          ValueError: ``secret`` is not hex, or is missing (a trainer older than this worker).
        """
        try:
            secret = bytes.fromhex(self.secret)
        except (TypeError, ValueError):
            raise ValueError("init_info's secret must be the job's secret as hex, as VLLMWeightSync sends it; got "
                             f"a {type(self.secret).__name__} that is not hex (its value is not shown).") from None
        return GroupInfo(self.master_address, self.master_port, self.trainer_world_size, self.world_size,
                         self.timeout, self.ready_timeout, self.group_name, secret=secret)


@dataclasses.dataclass
class JReshardUpdateInfo(WeightTransferUpdateInfo):
    """The version (training step) the trainers send."""

    version: int


class JReshardEngine(WeightTransferEngine[JReshardInitInfo, JReshardUpdateInfo]):
    """Receives syncs from a JAX trainer into this worker's model, exact per-rank slices only.

    vLLM's phases never raise (see ``bridge.engines.worker``): a failure is logged, closes the
    group, and reaches the trainers through it.
    """

    init_info_cls = JReshardInitInfo
    update_info_cls = JReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.sync = WorkerSync(device)
        self._received: int | None = None  # the version the current update committed

    # ------------------------------------------------------------ phase 1
    def init_transfer_engine(self, init_info: JReshardInitInfo) -> None:
        self._received = None
        try:
            info = init_info.group_info()
            hello = vllm_hello(self.vllm_config, info.trainers, live_params(self.model),
                               torch_dtype_name(self.model_config.dtype))
        except Exception as e:  # the trainers time out waiting for this worker
            self.sync.fail("describing this worker", e)
            return
        self.sync.join(info, hello)

    # ------------------------------------------------------------ phases 2-4
    def start_weight_update(self) -> None:
        self._received = None
        self.sync.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize(), which a CPU worker must not rely on.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: JReshardUpdateInfo) -> None:
        if self.sync.receive(update_info.version, self._commit):
            self._received = update_info.version

    def _commit(self, tensors: Mapping[str, torch.Tensor], adoptable: frozenset[str]) -> Commit:
        return write_layers(self.model, tensors, adopt=adoptable)

    def finish_weight_update(self) -> None:
        self.sync.settle()
        if self._received is not None:
            log.info("jreshard: rank %d serves version %d", self.sync.rank, self._received)
        self._received = None

    def shutdown(self) -> None:
        self.sync.close()


def vllm_hello(vllm_config: Any, trainers: int, params: list[EngineParam], dtype: str) -> dict[str, Any]:
    """This worker's hello (``bridge.engines.hello.worker_hello``) from vLLM's parallel state and model config."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1 or get_pp_group().world_size != 1:
        raise ValueError(f"the jreshard backend supports pipeline_parallel_size=1, got "
                         f"{par.pipeline_parallel_size}; use tensor and data parallelism.")
    tp, tp_rank = par.tensor_parallel_size, get_tensor_model_parallel_rank()
    replica = getattr(par, "data_parallel_index", par.data_parallel_rank)
    return worker_hello(rank=worker_rank(trainers, replica, tp_rank, tp), replica=replica, tp_rank=tp_rank, tp=tp,
                        replicas=par.data_parallel_size, expert_parallel=bool(par.enable_expert_parallel),
                        dtype=dtype, params=params,
                        extra=fp8_hello(quant_config(vllm_config.model_config)))  # nothing unless FP8


def quant_config(model_config: Any) -> Any:
    """The checkpoint's ``quantization_config`` as vLLM read it (``None`` for an unquantized model)."""
    arch = getattr(model_config, "model_arch_config", None)
    if arch is not None:
        return getattr(arch, "quantization_config", None)
    return getattr(model_config.hf_config, "quantization_config", None)
