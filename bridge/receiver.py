"""The inference side: receive this rank's slices straight into torch parameters (torch only).

Example (every inference process; the trainers run ``bridge.sender.Sender``):

    group = bridge.init_group(rank, world_size, port=port)
    source = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    plan = bridge.BridgePlan(source, bridge.llama_mapping(cfg, source, tp_ranks=[2, 3], fused=True))
    receiver = bridge.Receiver(plan, local_params, rank=rank)
    version = receiver.sync()            # blocks until every bucket arrived, then commits
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping as MappingABC
from typing import Any

import torch
import torch.distributed as dist

from bridge._mapping import Mapping, dtensor_targets
from bridge._plan import BridgePlan, Message
from bridge._source import Source
from bridge._wire import RECEIVER, SyncError, check_plan_and_rank, new_arena, run_sync, torch_dtype

__all__ = ["Receiver", "dtensor_mapping"]

log = logging.getLogger("bridge")


def _owner(t: Any) -> torch.Tensor:
    """The tensor object whose storage holds the weights: a DTensor's local shard, else the tensor itself."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        t = t._local_tensor  # to_local() may return a new autograd view; write the storage itself
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, Parameter or DTensor, got {type(t).__name__}.")
    return t


def _local(t: Any) -> torch.Tensor:
    """The tensor to write: a DTensor's local shard, a Parameter's data, or the tensor itself."""
    return _owner(t).data


def dtensor_mapping(source: Source, params: MappingABC[str, tuple[Any, str, Any]]) -> Mapping:
    """Targets for DTensor parameters: ``{name: (dtensor, leaf path, transpose)}``.

    Each DTensor's ``device_mesh`` and ``placements`` give every rank's shard (torch
    chunk rules), so this rank can plan the whole sync. Trainer processes, which hold
    no DTensors, build the same mapping with ``bridge.dtensor_targets``.
    """
    out = Mapping(())
    for name, (dt, leaf, transpose) in params.items():
        if not hasattr(dt, "device_mesh"):
            raise TypeError(f"params[{name!r}] must hold a DTensor first, got {type(dt).__name__}.")
        dtype = str(dt.dtype).removeprefix("torch.")
        out = out + dtensor_targets(name, source, leaf, dt.device_mesh.mesh, dt.placements,
                                    transpose=transpose, dtype=dtype)
    return out


class Receiver:
    """Receives syncs into this rank's torch parameters.

    Args:
      plan: the sync plan (the same on every rank).
      params: this rank's parameters by torch name (tensors, Parameters or DTensors); every
        target of this rank must be present with its local shape and dtype.
      rank: this process's global torch rank (default: ``torch.distributed.get_rank()``).
      atomic: receive into a shadow copy of the targets and commit only when every rank got
        everything; ``False`` writes in place as buckets arrive (no extra memory, but a failed
        sync leaves a mix of old and new weights and ``consistent`` becomes False until the
        next successful sync).
      swap: how an atomic sync commits. ``False``: the shadow is copied into the parameters,
        which keep their storage, so views and pointers an engine captured (CUDA graphs) stay
        valid. ``True``: no copy; the same tensor, Parameter and DTensor objects are given the
        shadow's storage and the old storage becomes the next shadow, so views taken before
        the sync (``to_local()`` results, slices, captured pointers) keep the old weights.
      timeout: seconds any single wait for data may take before the sync fails.
      ready_timeout: seconds to wait for every rank to join a sync (the handshake; also bounded
        by the process group's timeout).
      progress: show a tqdm bar (``None``: for syncs over 1 GiB on a terminal).

    Attributes:
      version: the training step of the weights now in ``params`` (``None`` before the first sync).
    """

    def __init__(self, plan: BridgePlan, params: MappingABC[str, Any], *, rank: int | None = None,
                 atomic: bool = True, swap: bool = False, timeout: float = 60.0, ready_timeout: float = 600.0,
                 progress: bool | None = None) -> None:
        rank = check_plan_and_rank(plan, rank)
        targets = plan.mapping.for_rank(rank)
        if not targets:
            raise ValueError(f"rank {rank} has no targets in the plan (its ranks are {plan.mapping.ranks}).")
        tensors, owners = {}, {}
        for t in targets:
            if t.name not in params:
                raise ValueError(
                    f"params lacks {t.name!r}, which the mapping assigns to rank {rank}; pass every "
                    f"parameter of this rank (it expects {len(targets)}, e.g. {[x.name for x in targets[:3]]})."
                )
            local = _local(params[t.name])
            want = torch_dtype(t.dtype)
            if tuple(local.shape) != t.shape or local.dtype != want:
                raise ValueError(
                    f"params[{t.name!r}] on rank {rank} is {tuple(local.shape)} {local.dtype}, but the mapping "
                    f"expects its local shard {t.shape} {want}; build the mapping with this rank's TP degree, "
                    "padding and dtype."
                )
            if not local.is_contiguous():
                raise ValueError(f"params[{t.name!r}] must be contiguous.")
            tensors[t.name] = local
            owners[t.name] = _owner(params[t.name])
        self.plan, self.rank, self.atomic, self.progress = plan, rank, atomic, progress
        self.timeout, self.ready_timeout = timeout, ready_timeout
        self.params = tensors
        self._owners = owners
        self.swap = swap
        self.version: int | None = None
        self.consistent = True
        self._shadow: dict[str, torch.Tensor] | None = None
        self._arena = new_arena()
        # Parts of targets that no region writes (padded rows): the shadow takes them from the
        # parameters before each sync.
        self._uncovered = {t.name: boxes for t in targets if (boxes := _uncovered(t))}
        self._plan_for = self._compile()

    def _compile(self) -> dict[tuple[int, int], tuple[list[tuple], list[tuple]]]:
        """Per message: (one receive per segment, the pieces to unpack from the bucket buffer)."""
        out: dict[tuple[int, int], tuple[list[tuple], list[tuple]]] = {}
        for m in self.plan.messages:
            if m.dst != self.rank:
                continue
            steps = []
            for i, off in m.items:
                t = self.plan.transfers[i]
                box, _ = self.plan.dst_region(t)  # pieces arrive in torch dim order
                dtype = torch_dtype(self.plan.target(t.target, t.dst).dtype)
                steps.append((t.target, box, off, t.nbytes, tuple(s.stop - s.start for s in box), dtype))
            recvs, unpacks, direct = [], [], set()
            for start, stop, k, _, dst_direct in self.plan.segments(m):
                if dst_direct:  # straight into the target: no unpacking
                    direct.add(k)
                    recvs.append((steps[k][0], steps[k][1], 0, 0))
                else:
                    recvs.append((None, None, start, stop))
            unpacks = [s for k, s in enumerate(steps) if k not in direct]
            out[(m.bucket, m.src)] = (recvs, unpacks)
        return out

    def _recv(self, into: dict[str, torch.Tensor], m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[start:stop] if name is None else into[name][box].view(-1).view(torch.uint8)
                for name, box, start, stop in self._plan_for[(m.bucket, m.src)][0]]

    def _unpack(self, into: dict[str, torch.Tensor], m: Message, buf: torch.Tensor) -> None:
        for name, box, off, n, shape, dtype in self._plan_for[(m.bucket, m.src)][1]:
            into[name][box].copy_(buf[off:off + n].view(dtype).view(shape))

    def sync(self, group: dist.ProcessGroup | None = None) -> int:
        """Receives one sync; returns its version (the trainers' step).

        Raises:
          PlanMismatchError: the ranks' plans differ (nothing moved, weights unchanged).
          SyncError: a peer died, stalled past ``timeout`` or failed; with ``atomic=True``
            the weights and ``version`` are unchanged. Recreate the process group, then retry.
        """
        if self.atomic:
            if self._shadow is None:
                self._shadow = {k: torch.empty_like(v) for k, v in self.params.items()}
            for name, boxes in self._uncovered.items():
                for box in boxes:
                    self._shadow[name][box].copy_(self.params[name][box])
            into = self._shadow
        else:
            into = self.params
            self.consistent = False
        version = run_sync(self.plan, self.rank, group, role=RECEIVER, version=-1, status=0, timeout=self.timeout,
                           ready_timeout=self.ready_timeout, pack=_no_pack,
                           recv=lambda m, buf: self._recv(into, m, buf),
                           unpack=lambda m, buf: self._unpack(into, m, buf), progress=self.progress,
                           device=next(iter(self.params.values())).device, arena=self._arena)
        if self.atomic:
            with torch.no_grad():
                for name, dst in list(self.params.items()):
                    if self.swap:
                        # The same tensor objects now hold the staging storage; the old storage
                        # becomes the next sync's staging (no copy).
                        self._owners[name].data = self._shadow[name]
                        self.params[name], self._shadow[name] = self._shadow[name], dst
                    else:
                        dst.copy_(self._shadow[name])
        self.consistent = True
        self.version = version
        return version

    def release_staging(self) -> None:
        """Frees the shadow copy and the bucket buffers (rebuilt on the next sync)."""
        self._shadow = None
        self._arena = new_arena()


def _uncovered(target) -> list[tuple[slice, ...]]:
    """The boxes of ``target`` that none of its regions covers: cells of the grid cut by the regions."""
    cuts = [sorted({0, n, *(r.offset[d] for r in target.regions), *(r.offset[d] + r.shape[d] for r in target.regions)})
            for d, n in enumerate(target.shape)]
    out = []
    for cell in itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts]):
        if not any(all(o <= lo and hi <= o + n for (lo, hi), o, n in zip(cell, r.offset, r.shape, strict=True))
                   for r in target.regions):
            out.append(tuple(slice(lo, hi) for lo, hi in cell))
    return out


def _no_pack(m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
    raise SyncError(f"a receiver was asked to send (message {m}); the plan is inconsistent.")
