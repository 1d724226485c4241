"""The inference side: receive this rank's slices straight into torch parameters (torch only).

Example (every inference process; the trainers run ``bridge.trainer.sender.Sender``):

    group = bridge.init_group(rank, world_size, port=port)
    source = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    plan = bridge.BridgePlan(source, bridge.llama_param_map(cfg, source, tp_ranks=[2, 3], fused=True))
    receiver = bridge.Receiver(plan, local_params, rank=rank)
    version = receiver.sync()            # blocks until every bucket arrived, then commits
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bridge.plan.bridge_plan import BridgePlan
from bridge.plan.dtensor import dtensor_params
from bridge.plan.param_map import Param, ParamMap
from bridge.plan.source import Source
from bridge.wire import shm
from bridge.wire.bucket import Arena
from bridge.wire.commit import CommitStrategy, HeldCommit, InPlaceCommit, ShadowCommit, SwapCommit, Wiring
from bridge.wire.gloo import check_transport
from bridge.wire.group import check_plan_and_rank
from bridge.wire.session import SyncSession, reject_sync, torch_dtype
from bridge.wire.transport import Transport
from jreshard.core.args import check_flag, check_seconds
from jreshard.core.execution import ExecutionStats

__all__ = ["Receiver", "dtensor_param_map"]

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


def _checked_local(name: str, value: Any) -> torch.Tensor:
    """``_local(value)``, with an error naming ``params[name]`` when it is not a tensor."""
    try:
        return _local(value)
    except TypeError as e:
        raise TypeError(f"params[{name!r}]: {e}") from None


def _check_placement(tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuses params on the meta device, on several devices, or overlapping in storage (tied ones pass)."""
    devices: dict[torch.device, str] = {}
    spans = []
    for name, t in tensors.items():
        if t.device.type == "meta":
            raise ValueError(f"params[{name!r}] is on the meta device (no storage to receive into); "
                             "materialise the model first (module.to_empty(device=...)).")
        devices.setdefault(t.device, name)
        start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        spans.append((t.device, start, start + t.numel() * t.element_size(), name))
    if len(devices) > 1:
        (d1, n1), (d2, n2) = list(devices.items())[:2]
        raise ValueError(f"params are on several devices: params[{n1!r}] on {d1}, params[{n2!r}] on {d2}; "
                         "move every param of this rank to one device.")
    # Tied params (one tensor under two names, e.g. embed_tokens and lm_head) receive the same data:
    # only a partial overlap is refused.
    spans = sorted(set(spans), key=lambda s: (str(s[0]), s[1], s[2]))
    for (d1, s1, end, n1), (d2, start, e2, n2) in zip(spans, spans[1:], strict=False):
        if d1 == d2 and start < end and (s1, end) != (start, e2):
            raise ValueError(f"params[{n1!r}] and params[{n2!r}] share storage; a sync would write both "
                             "into the same memory. Pass tensors that own separate storage (clone one).")


def dtensor_param_map(source: Source, params: Mapping[str, tuple[Any, str, Any]]) -> ParamMap:
    """The param map of DTensor parameters: ``{name: (dtensor, leaf path, transpose)}``.

    Each DTensor's ``device_mesh`` and ``placements`` give every rank's shard (torch
    chunk rules), so this rank can plan the whole sync. Trainer processes, which hold
    no DTensors, build the same param map with ``bridge.dtensor_params``.
    """
    out = ParamMap(())
    for name, (dt, leaf, transpose) in params.items():
        if not hasattr(dt, "device_mesh"):
            raise TypeError(f"params[{name!r}] must hold a DTensor first, got {type(dt).__name__}.")
        dtype = str(dt.dtype).removeprefix("torch.")
        out = out + dtensor_params(name, source, leaf, dt.device_mesh.mesh, dt.placements,
                                   transpose=transpose, dtype=dtype)
    return out




class Receiver:
    """Receives syncs into this rank's torch parameters.

    Args:
      plan: the sync plan (the same on every rank).
      params: this rank's parameters by name (tensors, Parameters or DTensors); every
        param of this rank in the plan must be present with its local shape and dtype.
      rank: this process's global torch rank (default: ``torch.distributed.get_rank()``).
      atomic: write the params only when every rank got everything (the final ack); until then
        the sync lands in memory of about the params' size, kept for the next sync
        (``release_staging`` frees it). ``False`` writes in place as buckets arrive (no extra
        memory, but a failed sync leaves a mix of old, new and, after a peer's failure between
        votes, meaningless weights, and ``consistent`` becomes False until the next successful sync).
      swap: how an atomic sync commits. ``False``: the received bytes are held as they arrived
        and unpacked into the parameters after the final ack, each byte copied once; the
        parameters keep their storage, so views and pointers an engine captured (CUDA graphs)
        stay valid. (A rank that forwards in stage 2 of a two-stage plan reads what it forwards
        from a shadow copy of the params instead, which it copies into them after the final
        ack.) ``True``: the sync unpacks into a shadow copy of the params as buckets arrive,
        and commits with no copy: the same tensor, Parameter and DTensor objects are given the
        shadow's storage and the old storage becomes the next shadow, so views taken before
        the sync (``to_local()`` results, slices, captured pointers) keep the old weights.
      timeout: seconds a sync may take once every rank joined (one deadline for every bucket
        and the final ack).
      ready_timeout: seconds to wait for every rank to join a sync (the handshake; also bounded
        by the process group's timeout).
      progress: show a tqdm bar (``None``: for syncs over 1 GiB on a terminal).

    In a two-stage plan (``BridgePlan(..., hierarchical=...)``) this rank also forwards, in
    stage 2, the slices it received in stage 1 to the ranks of its domain that need them, from
    its shadow copy (or the params when ``atomic=False``), in buckets that stage 1 shares, at
    least two buckets after those slices arrived (``bridge.plan.bridge_plan.STAGE2_LAG``); nothing is
    committed before the final ack, so a failure in stage 2 leaves every receiver's weights
    unchanged.

    Attributes:
      version: the training step of the weights now in ``params`` (``None`` before the first sync).
      strategy: how this receiver lands and commits a sync (``bridge.wire.commit``), chosen from
        ``atomic`` and ``swap`` once.
      last_stats: the ``jreshard.core.execution.ExecutionStats`` of the last sync (also a failed
        one): bytes sent and received, those across a domain boundary, per transport and per
        link, and seconds per step (``handshake``, ``pack``, ``vote``, ``post``, ``wait``,
        ``check``, ``unpack``, then ``commit``).
    """

    def __init__(self, plan: BridgePlan, params: Mapping[str, Any], *, rank: int | None = None,
                 atomic: bool = True, swap: bool = False, timeout: float = 60.0, ready_timeout: float = 600.0,
                 progress: bool | None = None) -> None:
        rank = check_plan_and_rank(plan, rank)
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a mapping of param name to tensor, got {type(params).__name__}.")
        atomic, swap = check_flag("atomic", atomic), check_flag("swap", swap)
        progress = check_flag("progress", progress, none=True)
        timeout, ready_timeout = check_seconds("timeout", timeout), check_seconds("ready_timeout", ready_timeout)
        mine = plan.param_map.for_rank(rank)
        if not mine:
            raise ValueError(f"rank {rank} has no params in the plan (its ranks are {plan.param_map.ranks}).")
        tensors, owners = {}, {}
        for p in mine:
            if p.name not in params:
                raise ValueError(
                    f"params lacks {p.name!r}, which the param map assigns to rank {rank}; pass every "
                    f"param of this rank (it expects {len(mine)}, e.g. {[x.name for x in mine[:3]]})."
                )
            local = _checked_local(p.name, params[p.name])
            want = torch_dtype(p.dtype)
            if tuple(local.shape) != p.shape or local.dtype != want:
                raise ValueError(
                    f"params[{p.name!r}] on rank {rank} is {tuple(local.shape)} {local.dtype}, but the param map "
                    f"expects its local shard {p.shape} {want}; build the param map with this rank's TP degree, "
                    "padding and dtype."
                )
            if not local.is_contiguous():
                raise ValueError(f"params[{p.name!r}] must be contiguous.")
            tensors[p.name] = local
            owners[p.name] = _owner(params[p.name])
        _check_placement(tensors)
        self.plan, self.rank, self.atomic, self.progress = plan, rank, atomic, progress
        self.timeout, self.ready_timeout = timeout, ready_timeout
        self.params = tensors
        self._owners = owners
        self.swap = swap
        self.version: int | None = None
        self.consistent = True
        self._arena = Arena()
        self.strategy = self._strategy(mine)
        self.last_stats = ExecutionStats()

    def _strategy(self, mine: Sequence[Param]) -> CommitStrategy:
        """The commit strategy that ``atomic`` and ``swap`` ask for (``bridge.wire.commit``)."""
        wiring = Wiring(self.plan, self.rank)
        if not self.atomic:
            return InPlaceCommit(wiring, self.params)
        # Parts of params that no region writes (padded rows): a shadow takes them from the params.
        uncovered = {p.name: boxes for p in mine if (boxes := _uncovered(p))}
        if self.swap:
            return SwapCommit(wiring, self.params, uncovered, self._owners)
        if wiring.forwards:  # a stage-2 forwarder reads what it forwards from a shadow copy
            return ShadowCommit(wiring, self.params, uncovered)
        return HeldCommit(wiring, self.params)

    def sync(self, group: dist.ProcessGroup | None = None, *, transport: Transport | str = "auto") -> int:
        """Receives one sync; returns its version (the trainers' step).

        ``transport`` moves the payload: ``"auto"`` (shared memory with trainers on this host, gloo with
        the others), ``"shm"``, ``"gloo"`` (``bridge.wire.route``), or a ``Transport`` object; every rank
        passes the same. With ``"auto"`` or ``"shm"`` and params in host memory, the memory a sync lands
        in (held bytes, bucket buffers) is shared memory that same-host trainers write into
        (``bridge.wire.shm``).

        Raises:
          PlanMismatchError: the ranks' plans differ (nothing moved, weights unchanged).
          SyncError: a peer died, stalled past ``timeout`` or failed; with ``atomic=True``
            the weights and ``version`` are unchanged. Recreate the process group, then retry.
        """
        transport = check_transport(transport)
        device = next(iter(self.params.values())).device
        shared = transport in ("auto", "shm") and device.type == "cpu"
        self._arena.recv_alloc = shm.staging if shared else None
        try:
            side = self.strategy.begin(device, self._arena.recv_alloc)
        except Exception:  # e.g. out of memory for the shadow: every other rank learns at once
            reject_sync(self.plan, rank=self.rank, group=group, ready_timeout=self.ready_timeout)
            raise
        if not self.atomic:
            self.consistent = False
        session = SyncSession(self.plan, self.rank, group, side, version=-1, timeout=self.timeout,
                              ready_timeout=self.ready_timeout, progress=self.progress, arena=self._arena,
                              transport=transport)
        try:
            version = session.run()
        finally:
            self.last_stats = session.stats
        start = time.perf_counter()
        with torch.no_grad():
            self.strategy.commit()
        stats = self.last_stats
        self.last_stats = dataclasses.replace(
            stats, step_seconds={**stats.step_seconds, "commit": time.perf_counter() - start})
        self.consistent = True
        self.version = version
        return version

    def rebind(self, name: str, tensor: torch.Tensor) -> None:
        """Makes the next syncs write param ``name`` into ``tensor`` instead of the tensor given before.

        ``tensor`` must be a contiguous ``torch.Tensor`` of the param's local shape, dtype and device;
        the receiver then holds that one object for ``name`` (for an engine that hands the received
        storage to its model and gives the receiver fresh storage, or its own back).
        """
        if name not in self.params:
            raise ValueError(f"name {name!r} is not a param of rank {self.rank}; its params are "
                             f"{sorted(self.params)[:3]}...")
        if not isinstance(tensor, torch.Tensor) or hasattr(tensor, "placements"):
            raise TypeError(f"tensor must be a plain torch.Tensor, got {type(tensor).__name__}.")
        old = self.params[name]
        if (tensor.shape, tensor.dtype, tensor.device) != (old.shape, old.dtype, old.device) or \
                not tensor.is_contiguous():
            raise ValueError(f"tensor for {name!r} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}; "
                             f"pass a contiguous {tuple(old.shape)} {old.dtype} tensor on {old.device}.")
        self.params[name] = self._owners[name] = tensor

    def release_staging(self) -> None:
        """Frees the memory an atomic sync lands in (the held bytes or the shadow copy) and the bucket
        buffers (rebuilt on the next sync)."""
        self.strategy.release()
        self._arena.clear()


def _uncovered(param: Param) -> list[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """The boxes of ``param`` that none of its regions covers, each with the view it is given in.

    When every region sees the param through one view: the cells of the grid cut by the
    regions. Otherwise (parts of a fused param through different views) the runs of
    uncovered elements of the flat param.
    """
    views = {r.view_shape(param.shape) for r in param.regions} or {param.shape}
    if len(views) > 1:
        covered = np.zeros(math.prod(param.shape), dtype=bool)
        for r in param.regions:
            covered.reshape(r.view_shape(param.shape))[tuple(
                slice(o, o + n) for o, n in zip(r.offset, r.shape, strict=True))] = True
        edges = np.flatnonzero(np.diff(np.concatenate([[1], covered.view(np.int8), [1]])))
        return [((covered.size,), (slice(int(a), int(b)),)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    (view,) = views
    cuts = [sorted({0, n, *(r.offset[d] for r in param.regions), *(r.offset[d] + r.shape[d] for r in param.regions)})
            for d, n in enumerate(view)]
    out = []
    for cell in itertools.product(*[list(zip(c[:-1], c[1:], strict=True)) for c in cuts]):
        if not any(all(o <= lo and hi <= o + n for (lo, hi), o, n in zip(cell, r.offset, r.shape, strict=True))
                   for r in param.regions):
            out.append((view, tuple(slice(lo, hi) for lo, hi in cell)))
    return out

