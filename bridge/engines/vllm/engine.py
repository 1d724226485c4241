"""The worker side: ``"jreshard"``, a vLLM weight-transfer engine (torch and vLLM, never jax).

vLLM creates one engine per worker when the model is loaded and
``LLM(..., weight_transfer_config=WeightTransferConfig(backend="jreshard"))`` names it
(``bridge.engines.vllm.plugin`` registers it through the ``vllm.general_plugins`` entry point).
The trainer drives four phases on every worker:

1. ``init_weight_transfer_engine``: join a new gloo group with the trainer ranks (a
   ``TCPStore`` on the trainer's address; never vLLM's own group), exchange plain-data
   descriptions (the trainer's leaves and recipe; this worker's TP rank, replica and
   targets from the live model, and its FP8 block format when the model is block-FP8),
   build the ``ParamMap`` (FP8 weights and ``weight_scale_inv`` scales for an FP8 model,
   ``bridge.engines.agree``) and ``BridgePlan`` and check every worker's targets. A
   mismatch is refused on every rank before any byte moves.
2. ``start_weight_update``: nothing to prepare (the staging tensors persist).
3. ``update_weights({"version": v})``: the bridge's ``Receiver`` receives this rank's
   slices into staging tensors (this rank's logical layout, never a full tensor). Once
   every rank got everything, the staging tensors enter the model layer by layer with
   vLLM's post-load processing (``bridge.engines.vllm.model``), and every rank learns each
   worker's outcome and byte counter. A failed transfer leaves the model untouched; the
   group is then closed and the trainer initialises again.
4. ``finish_weight_update``: ends the update (the engine's version is set by the client).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from bridge.engines.agree import plan_from_hellos
from bridge.engines.fp8 import fp8_hello
from bridge.engines.group import all_gather_json, close_group, open_group, wire_seconds
from bridge.engines.hello import PROTOCOL, Target
from bridge.engines.vllm.model import live_targets, torch_dtype_name, write_layers
from bridge.plan.bridge_plan import BridgePlan
from bridge.wire.receiver import Receiver
from bridge.wire.session import SyncError, torch_dtype

__all__ = ["JReshardInitInfo", "JReshardUpdateInfo", "JReshardEngine", "CountingReceiver", "worker_hello"]

log = logging.getLogger("bridge")


@dataclasses.dataclass
class JReshardInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is and how many ranks it has (plain data, any control plane carries it)."""

    master_address: str
    master_port: int
    trainer_world_size: int
    world_size: int
    timeout: float = 60.0
    ready_timeout: float = 600.0
    group_name: str = "jreshard"


@dataclasses.dataclass
class JReshardUpdateInfo(WeightTransferUpdateInfo):
    """The version (training step) the trainers send."""

    version: int


class CountingReceiver(Receiver):
    """A ``Receiver`` that counts, per sync, the bytes it posts receives for and the seconds it unpacks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bytes_received = 0
        self.unpack_seconds = 0.0

    def _recv(self, into: dict[str, torch.Tensor], m: Any, buf: torch.Tensor) -> list[torch.Tensor]:
        out = super()._recv(into, m, buf)
        self.bytes_received += sum(t.numel() * t.element_size() for t in out)
        return out

    def _unpack(self, into: dict[str, torch.Tensor], m: Any, buf: torch.Tensor) -> None:
        t0 = time.perf_counter()
        super()._unpack(into, m, buf)
        self.unpack_seconds += time.perf_counter() - t0

    def sync(self, group: Any = None) -> int:
        self.bytes_received, self.unpack_seconds = 0, 0.0
        return super().sync(group)

    def renew(self, names: Iterable[str]) -> list[str]:
        """New tensors for those of ``names`` whose storage the model still holds; returns their names.

        A param the model adopted (``write_layers``) is written whole by every sync. When the
        layer's processing kept it (a GPU weight, an embedding), the next sync needs new
        storage; when processing only read it (vLLM's CPU backend packs linear weights into
        oneDNN's own memory and empties the parameter), nothing else holds it, and reusing it
        spares the next sync fresh pages (their first touch costs more than the copy itself).
        """
        renewed = []
        for name in names:
            # The Receiver keeps the tensor it was given beside its data (for swapping commits, which
            # this receiver does not make): one tensor per storage here, so that only others count.
            self._owners[name] = self.params[name]
            if _shared(self.params[name]):
                self.params[name] = self._owners[name] = torch.empty_like(self.params[name])
                renewed.append(name)
        return renewed


def _use_count(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _shared(t: torch.Tensor) -> bool:
    """Whether a tensor other than ``t`` (a view, a Parameter, a kernel's saved tensor) holds its storage."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return True  # cannot tell: assume the model holds it
    return _use_count(t) > _use_count(torch.empty(1, dtype=t.dtype, device=t.device))


class JReshardEngine(WeightTransferEngine[JReshardInitInfo, JReshardUpdateInfo]):
    """Receives syncs from a JAX trainer into this worker's model, exact per-rank slices only."""

    init_info_cls = JReshardInitInfo
    update_info_cls = JReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.receiver: CountingReceiver | None = None
        self.plan: BridgePlan | None = None
        self.rank: int | None = None
        self.version: int | None = None  # the version now in the model
        self._received: int | None = None  # the version the current update committed
        self._info: JReshardInitInfo | None = None
        self._adoptable: frozenset[str] = frozenset()

    # ------------------------------------------------------------ phase 1
    def init_transfer_engine(self, init_info: JReshardInitInfo) -> None:
        self._close()
        self._info = init_info
        try:
            hello, self.rank = worker_hello(self.vllm_config, init_info.trainer_world_size,
                                            live_targets(self.model), torch_dtype_name(self.model_config.dtype))
            self.group = open_group(init_info.master_address, init_info.master_port, self.rank,
                                    init_info.world_size, timeout=init_info.ready_timeout, name=init_info.group_name)
            hellos = all_gather_json(hello, self.group, timeout=init_info.ready_timeout, what="the handshake")
        except Exception as e:  # the trainers time out waiting for this worker, or failed themselves
            self._fail("joining the sync group", e)
            return
        error = None
        try:
            self.plan = plan_from_hellos(hellos)
            staging = {p.name: torch.zeros(p.shape, dtype=torch_dtype(p.dtype), device=self.device)
                       for p in self.plan.param_map.for_rank(self.rank)}
            self.receiver = CountingReceiver(self.plan, staging, rank=self.rank, atomic=False,
                                             timeout=init_info.timeout, ready_timeout=init_info.ready_timeout)
            # Params that every sync writes whole may be adopted by the model instead of copied; the
            # others (padding rows of the vocabulary are never sent) keep their staging tensors.
            self._adoptable = frozenset(p.name for p in self.plan.param_map.for_rank(self.rank)
                                        if sum(math.prod(r.shape) for r in p.regions) == math.prod(p.shape))
        except Exception as e:  # a plan mismatch: every rank found the same one
            error = f"{type(e).__name__}: {e}"
        if not self._agree(error, "the handshake"):
            return
        log.info("jreshard: rank %d joined the sync group: %r", self.rank, self.plan)

    # ------------------------------------------------------------ phases 2-4
    def start_weight_update(self) -> None:
        self._received = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize(), which a CPU worker must not rely on.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: JReshardUpdateInfo) -> None:
        if self.receiver is None or self.group is None:
            log.error("jreshard: rank %s: update_weights without a sync group; the trainer initialises again "
                      "after a failure.", self.rank)
            return
        t0 = time.perf_counter()
        try:
            version = self.receiver.sync(self.group)
        except SyncError as e:  # every rank of the group fails this sync; the model is untouched
            self._fail(f"receiving version {update_info.version}", e)
            return
        seconds = {"receive": time.perf_counter() - t0, "unpack": self.receiver.unpack_seconds,
                   **wire_seconds(self.receiver.stats)}
        error = None
        if version != update_info.version:
            error = f"the trainers sent version {version}, but update_weights announced {update_info.version}"
        else:
            try:
                t0 = time.perf_counter()
                commit = write_layers(self.model, self.receiver.params, adopt=self._adoptable)
                renewed = self.receiver.renew(commit.adopted)
                seconds.update(commit=time.perf_counter() - t0, process=commit.process_seconds)
                log.debug("jreshard: rank %d: the model adopted %d tensors and kept %d of them", self.rank,
                          len(commit.adopted), len(renewed))
            except Exception as e:
                error = f"committing version {version} failed: {type(e).__name__}: {e}"
        if self._agree(error, "the commit report", version=version, bytes_received=self.receiver.bytes_received,
                       seconds=seconds):
            self.version = self._received = version

    def finish_weight_update(self) -> None:
        if self._received is not None:
            log.info("jreshard: rank %d serves version %d", self.rank, self._received)
        self._received = None

    def shutdown(self) -> None:
        self._close()

    # ------------------------------------------------------------ failures
    # A worker method that raises leaves vLLM 0.32's multiprocess executor with unread replies from
    # the other workers, which later calls would read. So the phases never raise: every failure is
    # one the trainers learn through the sync group (they fail the same collective, or read this
    # worker's error in the next all_gather), and the worker logs it and closes the group.
    def _agree(self, error: str | None, what: str, **report: Any) -> bool:
        """Tells every rank this worker's outcome; True when nobody failed."""
        assert self.group is not None and self._info is not None
        try:
            rows = all_gather_json({"rank": self.rank, "error": error, **report}, self.group,
                                   timeout=self._info.timeout, what=what)
        except SyncError as e:
            self._fail(what, e)
            return False
        errors = [r["error"] for r in rows if r.get("error")]
        if errors:
            self._fail(what, errors[0])
            return False
        return True

    def _fail(self, what: str, error: Any) -> None:
        log.error("jreshard: rank %s: %s failed: %s", self.rank, what, error)
        self._close()

    def _close(self) -> None:
        close_group(self.group)
        self.group, self.receiver, self.plan, self._received = None, None, None, None


def worker_hello(vllm_config: Any, trainers: int, targets: list[Target], dtype: str) -> tuple[dict[str, Any], int]:
    """This worker's handshake description and its rank in the sync group (trainers first)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1 or get_pp_group().world_size != 1:
        raise ValueError(f"the jreshard backend supports pipeline_parallel_size=1, got "
                         f"{par.pipeline_parallel_size}; use tensor and data parallelism.")
    tp, tp_rank = par.tensor_parallel_size, get_tensor_model_parallel_rank()
    replica = getattr(par, "data_parallel_index", par.data_parallel_rank)
    rank = trainers + replica * tp + tp_rank
    hello = {"role": "worker", "protocol": PROTOCOL, "rank": rank, "replica": replica, "tp_rank": tp_rank, "tp": tp,
             "replicas": par.data_parallel_size, "expert_parallel": bool(par.enable_expert_parallel),
             "dtype": dtype, "targets": [[t.name, list(t.shape), t.dtype] for t in targets]}
    hello.update(fp8_hello(quant_config(vllm_config.model_config)))  # nothing unless the model is FP8
    return hello, rank


def quant_config(model_config: Any) -> Any:
    """The checkpoint's ``quantization_config`` as vLLM read it (``None`` for an unquantized model)."""
    arch = getattr(model_config, "model_arch_config", None)
    if arch is not None:
        return getattr(arch, "quantization_config", None)
    return getattr(model_config.hf_config, "quantization_config", None)
