"""The inference side: receive this rank's slices straight into torch parameters (torch only).

Example (every inference process; the trainers run ``bridge.trainer.sender.Sender``):

    group = bridge.init_group(rank, world_size, port=port)
    source = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    plan = bridge.BridgePlan(source, bridge.llama_param_map(cfg, source, tp_ranks=[2, 3], fused=True))
    receiver = bridge.Receiver(plan, local_params, rank=rank)
    version = receiver.sync()            # blocks until every bucket arrived, then commits
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Mapping
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from bridge.plan.bridge_plan import BridgePlan, Message, _aligned
from bridge.plan.dtensor import dtensor_params
from bridge.plan.param_map import Param, ParamMap
from bridge.plan.source import Source
from bridge.wire.session import RECEIVER, check_plan_and_rank, new_arena, reject_sync, run_sync, torch_dtype
from jreshard.core.args import check_flag, check_seconds

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



class _Recv(NamedTuple):
    """One receive of a message: straight into ``param.view(view)[box]``, or into buffer bytes ``[start, stop)``."""

    param: str | None
    box: tuple[slice, ...] | None
    start: int
    stop: int
    view: tuple[int, ...] = ()


class _Unpack(NamedTuple):
    """Copy buffer bytes ``[offset, offset + nbytes)``, as ``shape`` of ``dtype``, into ``param.view(view)[box]``."""

    param: str
    box: tuple[slice, ...]
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    view: tuple[int, ...]


class _Steps(NamedTuple):
    """How this rank receives one message: one receive per segment, then the unpacking copies."""

    recvs: list[_Recv]
    unpacks: list[_Unpack]


class _Forward(NamedTuple):
    """One send of a stage-2 message: ``param.view(view)[box]`` as it is (``direct``), or the
    ``pieces`` (unpacking copies run backwards) packed into buffer bytes ``[start, stop)``."""

    start: int
    stop: int
    direct: _Unpack | None
    pieces: list[_Unpack]


class _Held(NamedTuple):
    """Where one message lands in the held bytes of a sync committed by unpacking: bytes ``[base, base +
    nbytes)``, its segments' ``(start, stop)`` within them, and every piece's copy into the params."""

    base: int
    nbytes: int
    segments: list[tuple[int, int]]
    unpacks: list[_Unpack]


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
      stats: of the last sync (also a failed one): bytes sent and received, those across a
        domain boundary, and seconds per step (see ``bridge.wire.session.run_sync``).
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
        self._shadow: dict[str, torch.Tensor] | None = None
        self._hold: torch.Tensor | None = None
        self._arena = new_arena()
        # Parts of params that no region writes (padded rows): the shadow takes them from the
        # parameters before each sync.
        self._uncovered = {p.name: boxes for p in mine if (boxes := _uncovered(p))}
        self._steps = self._compile()
        self._forwards = self._compile_forwards()
        # Committed by unpacking the held bytes: atomic, no swap, nothing forwarded from a copy of the params.
        self._held = self._compile_held() if atomic and not swap and not self._forwards else None
        self.stats: dict[str, float] = {}

    def _compile(self) -> dict[tuple[int, int], _Steps]:
        """Per (bucket, sender rank): the receives and unpacking copies of its message."""
        out: dict[tuple[int, int], _Steps] = {}
        for m in self.plan.messages:
            if m.dst != self.rank:
                continue
            unpacks = [self._piece(i, off, self.rank) for i, off in m.pieces]
            recvs, direct = [], set()
            for seg in self.plan.segments(m):
                if seg.dst_direct and seg.piece is not None:  # straight into the param: no unpacking
                    direct.add(seg.piece)
                    u = unpacks[seg.piece]
                    recvs.append(_Recv(u.param, u.box, 0, 0, u.view))
                else:
                    recvs.append(_Recv(None, None, seg.start, seg.stop))
            out[(m.bucket, m.src)] = _Steps(recvs, [u for k, u in enumerate(unpacks) if k not in direct])
        return out

    def _piece(self, i: int, off: int, rank: int) -> _Unpack:
        """Plan move ``i`` at byte ``off`` of its message, as a block of ``rank``'s copy of its param."""
        t = self.plan.moves[i]
        box = self.plan.param_box(t, rank)  # pieces travel in torch dim order
        dtype = torch_dtype(self.plan.param(t.param, rank).dtype)
        return _Unpack(t.param, box, off, t.nbytes, tuple(s.stop - s.start for s in box), dtype,
                       self.plan.view_of(t, rank))

    def _compile_held(self) -> dict[tuple[int, int], _Held]:
        """Per (bucket, sender rank): where its message lands in the held bytes, and its copies into the params."""
        out, base = {}, 0
        for m in self.plan.messages:
            if m.dst != self.rank:
                continue
            out[(m.bucket, m.src)] = _Held(base, m.nbytes, [(g.start, g.stop) for g in self.plan.segments(m)],
                                           [self._piece(i, off, self.rank) for i, off in m.pieces])
            base += _aligned(m.nbytes)
        return out

    def _compile_forwards(self) -> dict[tuple[int, int], list[_Forward]]:
        """Per (bucket, receiving rank): the sends of this rank's stage-2 message, one per segment."""
        out: dict[tuple[int, int], list[_Forward]] = {}
        for m in self.plan.messages:
            if m.src != self.rank:
                continue
            sends = []
            for seg, members in zip(self.plan.segments(m), self.plan.segment_pieces(m), strict=True):
                pieces = [self._piece(i, off, self.rank) for i, off in members]
                sends.append(_Forward(seg.start, seg.stop, pieces[0] if seg.src_direct else None, pieces))
            out[(m.bucket, m.dst)] = sends
        return out

    def _forward(self, into: dict[str, torch.Tensor], m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for f in self._forwards[(m.bucket, m.dst)]:
            if f.direct is not None:  # one contiguous block of this rank's copy: sent as it is
                out.append(into[f.direct.param].view(f.direct.view)[f.direct.box].reshape(-1).view(torch.uint8))
                continue
            for u in f.pieces:
                buf[u.offset:u.offset + u.nbytes].view(u.dtype).view(u.shape).copy_(into[u.param].view(u.view)[u.box])
            out.append(buf[f.start:f.stop])
        return out

    def _recv(self, into: dict[str, torch.Tensor], m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[r.start:r.stop] if r.param is None else into[r.param].view(r.view)[r.box].view(-1).view(torch.uint8)
                for r in self._steps[(m.bucket, m.src)].recvs]

    def _unpack(self, into: dict[str, torch.Tensor], m: Message, buf: torch.Tensor) -> None:
        for u in self._steps[(m.bucket, m.src)].unpacks:
            into[u.param].view(u.view)[u.box].copy_(buf[u.offset:u.offset + u.nbytes].view(u.dtype).view(u.shape))

    @staticmethod
    def _recv_held(held: dict[tuple[int, int], _Held], hold: torch.Tensor, m: Message,
                   buf: torch.Tensor) -> list[torch.Tensor]:
        h = held[(m.bucket, m.src)]
        return [hold[h.base + start:h.base + stop] for start, stop in h.segments]

    def _commit_held(self, held: dict[tuple[int, int], _Held], hold: torch.Tensor) -> None:
        """Unpacks every held message into the params (after the final ack)."""
        for h in held.values():
            for u in h.unpacks:
                at = h.base + u.offset
                self.params[u.param].view(u.view)[u.box].copy_(hold[at:at + u.nbytes].view(u.dtype).view(u.shape))

    def _held_bytes(self, held: dict[tuple[int, int], _Held], device: torch.device) -> torch.Tensor:
        """The memory a sync committed by unpacking lands in: every message to this rank, each at its base."""
        last = max(held.values(), key=lambda h: h.base, default=None)
        total = max(last.base + last.nbytes if last is not None else 0, 1)
        if self._hold is None or self._hold.numel() < total or self._hold.device != device:
            self._hold = None
            self._hold = torch.empty(total, dtype=torch.uint8, device=device)
        return self._hold

    def _staging(self) -> dict[str, torch.Tensor]:
        """Where this sync writes: the shadow (atomic; uncovered parts taken from the params) or the params."""
        if not self.atomic:
            return self.params
        if self._shadow is None:
            self._shadow = {k: torch.empty_like(v) for k, v in self.params.items()}
        for name, boxes in self._uncovered.items():
            for view, box in boxes:
                self._shadow[name].view(view)[box].copy_(self.params[name].view(view)[box])
        return self._shadow

    def sync(self, group: dist.ProcessGroup | None = None) -> int:
        """Receives one sync; returns its version (the trainers' step).

        Raises:
          PlanMismatchError: the ranks' plans differ (nothing moved, weights unchanged).
          SyncError: a peer died, stalled past ``timeout`` or failed; with ``atomic=True``
            the weights and ``version`` are unchanged. Recreate the process group, then retry.
        """
        held, device = self._held, next(iter(self.params.values())).device
        try:
            if held is not None:  # received into the held bytes, unpacked into the params after the final ack
                hold = self._held_bytes(held, device)
                pack, recv, unpack = _nothing_to_forward, partial(self._recv_held, held, hold), _nothing_to_unpack
                commit = partial(self._commit_held, held, hold)
            else:
                into = self._staging()
                pack, recv = partial(self._forward, into), partial(self._recv, into)
                unpack, commit = partial(self._unpack, into), partial(self._commit_shadow, into)
        except Exception:  # e.g. out of memory for the shadow: every other rank learns at once
            reject_sync(self.plan, rank=self.rank, group=group, ready_timeout=self.ready_timeout)
            raise
        if not self.atomic:
            self.consistent = False
        version = run_sync(self.plan, self.rank, group, role=RECEIVER, version=-1, status=0, timeout=self.timeout,
                           ready_timeout=self.ready_timeout, pack=pack, recv=recv, unpack=unpack,
                           progress=self.progress, device=device, arena=self._arena, stats=self.stats,
                           stage_recvs=held is None)
        start = time.perf_counter()
        with torch.no_grad():
            commit()
        self.stats["commit"] = time.perf_counter() - start
        self.consistent = True
        self.version = version
        return version

    def _commit_shadow(self, shadow: dict[str, torch.Tensor]) -> None:
        """Commits a sync received into ``shadow`` (nothing to do when it was the params themselves)."""
        if not self.atomic:
            return
        for name, dst in list(self.params.items()):
            if self.swap:
                # The same tensor objects now hold the staging storage; the old storage
                # becomes the next sync's staging (no copy).
                self._owners[name].data = shadow[name]
                self.params[name], shadow[name] = shadow[name], dst
            else:
                dst.copy_(shadow[name])

    def release_staging(self) -> None:
        """Frees the memory an atomic sync lands in (the held bytes or the shadow copy) and the bucket
        buffers (rebuilt on the next sync)."""
        self._shadow = None
        self._hold = None
        self._arena = new_arena()


def _nothing_to_forward(m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
    raise RuntimeError(f"rank {m.src} was asked to forward message {m}, but its plan gave it nothing to forward.")


def _nothing_to_unpack(m: Message, buf: torch.Tensor) -> None:
    """A held message is unpacked after the final ack, not as it arrives."""


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

