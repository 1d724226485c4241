"""How a ``Receiver`` lands a sync and commits it: one strategy object per receiver, chosen once.

=================  =====================================================  ==========================
strategy           where buckets land                                     commit (after the final ack)
=================  =====================================================  ==========================
``HeldCommit``     memory held until the final ack, each message at its   unpack every held message
                   own offset (no receive buffer; receives posted ahead)  into the params
``ShadowCommit``   a shadow copy of the params, unpacked as buckets       copy the shadow into the
                   arrive (a stage-2 forwarder reads what it forwards     params
                   from it)
``SwapCommit``     a shadow copy, as ``ShadowCommit``                     swap storage: the params'
                                                                          objects take the shadow's
``InPlaceCommit``  the params themselves (``atomic=False``)               nothing
=================  =====================================================  ==========================

A strategy's ``begin(device, alloc)`` gives the sync its ``Side`` (``alloc``: where host memory it
lands in comes from, ``bridge.wire.shm.staging`` for shared memory, or ``None``) (``bridge.wire.session``), ``commit()``
runs after the final ack, ``release()`` frees what it holds between syncs. Every strategy reads
and writes the receiver's own ``params`` dict, so ``Receiver.rebind`` reaches it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from bridge.plan.bridge_plan import BridgePlan, Message
from bridge.wire.bucket import Alloc, Side
from bridge.wire.handshake import Role
from bridge.wire.session import torch_dtype
from jreshard.core.schedule import aligned

__all__ = ["CommitStrategy", "HeldCommit", "ShadowCommit", "SwapCommit", "InPlaceCommit", "Wiring", "Unpack"]

Boxes = dict[str, list[tuple[tuple[int, ...], tuple[slice, ...]]]]


class Unpack(NamedTuple):
    """Copy buffer bytes ``[offset, offset + nbytes)``, as ``shape`` of ``dtype``, into ``param.view(view)[box]``."""

    param: str
    box: tuple[slice, ...]
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    view: tuple[int, ...]

    def block(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The piece's block of ``params``."""
        return params[self.param].view(self.view)[self.box]

    def bytes_of(self, buf: torch.Tensor, base: int = 0) -> torch.Tensor:
        """The piece in ``buf`` (its message starting at ``base``), as a block of its dtype."""
        at = base + self.offset
        return buf[at:at + self.nbytes].view(self.dtype).view(self.shape)


class _Recv(NamedTuple):
    """One receive of a message: straight into a piece's block (``direct``), or into buffer bytes ``[start, stop)``."""

    direct: Unpack | None
    start: int
    stop: int


class _Steps(NamedTuple):
    """How this rank receives one message: one receive per segment, then the unpacking copies."""

    recvs: list[_Recv]
    unpacks: list[Unpack]


class _Forward(NamedTuple):
    """One send of a stage-2 message: a piece's block as it is (``direct``), or the ``pieces`` (unpacking
    copies run backwards) packed into buffer bytes ``[start, stop)``."""

    start: int
    stop: int
    direct: Unpack | None
    pieces: list[Unpack]


class _Held(NamedTuple):
    """Where one message lands in the held bytes: bytes ``[base, base + nbytes)``, its segments' ``(start,
    stop)`` within them, and every piece's copy into the params."""

    base: int
    nbytes: int
    segments: list[tuple[int, int]]
    unpacks: list[Unpack]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class Wiring:
    """Per message of one rank, the receives, unpacking copies and stage-2 forwards the plan gives it."""

    def __init__(self, plan: BridgePlan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self.steps: dict[tuple[int, int], _Steps] = {}
        self.forwards: dict[tuple[int, int], list[_Forward]] = {}
        for m in plan.messages:
            if m.dst == rank:
                self.steps[(m.bucket, m.src)] = self._steps(m)
            if m.src == rank:
                self.forwards[(m.bucket, m.dst)] = [
                    _Forward(seg.start, seg.stop, pieces[0] if seg.src_direct else None, pieces)
                    for seg, members in zip(plan.segments(m), plan.segment_pieces(m), strict=True)
                    for pieces in [[self.piece(i, off) for i, off in members]]]

    def piece(self, i: int, off: int) -> Unpack:
        """Plan move ``i`` at byte ``off`` of its message, as a block of this rank's copy of its param."""
        t = self.plan.moves[i]
        box = self.plan.param_box(t, self.rank)  # pieces travel in torch dim order
        dtype = torch_dtype(self.plan.param(t.param, self.rank).dtype)
        return Unpack(t.param, box, off, t.nbytes, tuple(s.stop - s.start for s in box), dtype,
                      self.plan.view_of(t, self.rank))

    def _steps(self, m: Message) -> _Steps:
        unpacks = [self.piece(i, off) for i, off in m.pieces]
        recvs, direct = [], set()
        for seg in self.plan.segments(m):
            if seg.dst_direct and seg.piece is not None:  # straight into the param: no unpacking
                direct.add(seg.piece)
                recvs.append(_Recv(unpacks[seg.piece], 0, 0))
            else:
                recvs.append(_Recv(None, seg.start, seg.stop))
        return _Steps(recvs, [u for k, u in enumerate(unpacks) if k not in direct])

    def held(self) -> dict[tuple[int, int], _Held]:
        """Per message to this rank: where it lands in held bytes (each at an aligned base), and its copies."""
        out, base = {}, 0
        for m in self.plan.messages:
            if m.dst == self.rank:
                out[(m.bucket, m.src)] = _Held(base, m.nbytes, [(g.start, g.stop) for g in self.plan.segments(m)],
                                               [self.piece(i, off) for i, off in m.pieces])
                base += aligned(m.nbytes)
        return out


class CommitStrategy(Protocol):
    """Where a receiver's sync lands and how it commits (see the module docstring)."""

    def begin(self, device: torch.device, alloc: Alloc | None = None) -> Side: ...

    def commit(self) -> None: ...

    def release(self) -> None: ...


class InPlaceCommit:
    """Receives into the params as buckets arrive; nothing to commit (``atomic=False``)."""

    def __init__(self, wiring: Wiring, params: dict[str, torch.Tensor]) -> None:
        self.wiring, self.params = wiring, params
        self._into: dict[str, torch.Tensor] = params

    def staging(self) -> dict[str, torch.Tensor]:
        """Where this sync writes."""
        return self.params

    def begin(self, device: torch.device, alloc: Alloc | None = None) -> Side:
        self._into = self.staging()
        # Looked up on the instance, so a test can wrap one step (an unpacking failure).
        return Side(Role.RECEIVER, self.forward, self.recv, self.unpack, device)

    def forward(self, m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
        """The tensors of this rank's stage-2 message ``m``, one per segment (packed into ``buf``)."""
        out = []
        for f in self.wiring.forwards[(m.bucket, m.dst)]:
            if f.direct is not None:  # one contiguous block of this rank's copy: sent as it is
                out.append(_as_bytes(f.direct.block(self._into)))
                continue
            for u in f.pieces:
                u.bytes_of(buf).copy_(u.block(self._into))
            out.append(buf[f.start:f.stop])
        return out

    def recv(self, m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
        # ``view``, never ``reshape``: a receive must land in the param itself, not in a copy of it.
        return [buf[r.start:r.stop] if r.direct is None else r.direct.block(self._into).view(-1).view(torch.uint8)
                for r in self.wiring.steps[(m.bucket, m.src)].recvs]

    def unpack(self, m: Message, buf: torch.Tensor) -> None:
        for u in self.wiring.steps[(m.bucket, m.src)].unpacks:
            u.block(self._into).copy_(u.bytes_of(buf))

    def commit(self) -> None:
        """Nothing: the sync wrote the params."""

    def release(self) -> None:
        """Nothing held."""


class ShadowCommit(InPlaceCommit):
    """Receives into a shadow copy of the params (kept for the next sync), copied into them after the final ack."""

    def __init__(self, wiring: Wiring, params: dict[str, torch.Tensor], uncovered: Boxes) -> None:
        super().__init__(wiring, params)
        self.uncovered = uncovered  # parts no region writes (padded rows): taken from the params each sync
        self.shadow: dict[str, torch.Tensor] | None = None

    def staging(self) -> dict[str, torch.Tensor]:
        if self.shadow is None:
            self.shadow = {k: torch.empty_like(v) for k, v in self.params.items()}
        for name, boxes in self.uncovered.items():
            for view, box in boxes:
                self.shadow[name].view(view)[box].copy_(self.params[name].view(view)[box])
        return self.shadow

    def commit(self) -> None:
        for name, dst in self.params.items():
            dst.copy_(self._into[name])

    def release(self) -> None:
        self.shadow = None


class SwapCommit(ShadowCommit):
    """Receives into a shadow copy; commits with no copy: the params' tensor, Parameter and DTensor objects
    (``owners``) take the shadow's storage, and the old storage becomes the next shadow."""

    def __init__(self, wiring: Wiring, params: dict[str, torch.Tensor], uncovered: Boxes,
                 owners: dict[str, torch.Tensor]) -> None:
        super().__init__(wiring, params, uncovered)
        self.owners = owners

    def commit(self) -> None:
        shadow = self._into
        for name, dst in list(self.params.items()):
            self.owners[name].data = shadow[name]
            self.params[name], shadow[name] = shadow[name], dst


class HeldCommit:
    """Receives every message into memory held until the final ack (each byte lands once, where it stays),
    then unpacks them into the params: they keep their storage, so views and pointers an engine
    captured (CUDA graphs) stay valid."""

    def __init__(self, wiring: Wiring, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.held = wiring.held()
        self.hold: torch.Tensor | None = None
        self._alloc: Alloc | None = None  # what made ``hold``

    def begin(self, device: torch.device, alloc: Alloc | None = None) -> Side:
        last = max(self.held.values(), key=lambda h: h.base, default=None)
        total = max(last.base + last.nbytes if last is not None else 0, 1)
        alloc = alloc if device.type == "cpu" else None
        if self.hold is None or self.hold.numel() < total or self.hold.device != device or self._alloc is not alloc:
            self.hold = None  # freed before the new one is allocated
            self.hold = alloc(total) if alloc is not None else torch.empty(total, dtype=torch.uint8, device=device)
            self._alloc = alloc
        return Side(Role.RECEIVER, recv=self.recv, device=device, stage_recvs=False)

    def recv(self, m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
        assert self.hold is not None  # begin() ran
        h = self.held[(m.bucket, m.src)]
        return [self.hold[h.base + start:h.base + stop] for start, stop in h.segments]

    def commit(self) -> None:
        assert self.hold is not None
        for h in self.held.values():
            for u in h.unpacks:
                u.block(self.params).copy_(u.bytes_of(self.hold, h.base))

    def release(self) -> None:
        self.hold = None
