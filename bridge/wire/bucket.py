"""A sync's buckets as one rank handles them: what the rank brings to a sync (``Side``: how it packs,
receives and unpacks messages), staging buffers (``Arena``), the operations of a bucket ready to post
(``Bucket``), and the check that a packed message matches the plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from bridge.errors import SyncError
from bridge.plan.bridge_plan import BridgePlan, Message
from bridge.wire.handshake import Role
from bridge.wire.transport import Kind, Op
from bridge.wire.vote import Code, Status

__all__ = ["Alloc", "Side", "Arena", "Bucket", "WrongCount", "check_sizes", "digest_ops"]

PackFn = Callable[[Message, torch.Tensor], list[torch.Tensor]]
Alloc = Callable[[int], torch.Tensor]  # ``nbytes`` of uint8 host memory
UnpackFn = Callable[[Message, torch.Tensor], None]


def _nothing(m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
    raise SyncError(f"this rank was asked to send or receive message {m}, which its side of the sync does not "
                    "handle; the plan is inconsistent.")


def _no_unpack(m: Message, buf: torch.Tensor) -> None:
    """Nothing to unpack as the message arrives (a sender; a receiver that commits after the final ack)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Side:
    """What one rank brings to a sync.

    Per message, ``pack(m, buf)`` returns the tensors to send, one per segment of
    ``plan.segments(m)`` (packing the others into ``buf``, a slice of the send arena),
    ``recv(m, buf)`` the tensors to receive into, one per segment, and ``unpack(m, buf)`` runs
    once they arrived. Staging buffers live on ``device`` (the parameters' device: CUDA with
    NCCL, CPU with gloo). ``stage_recvs=False``: ``recv`` gives memory of its own for every
    segment, so no receive buffer is set aside (``recv`` and ``unpack`` are given an empty one).
    """

    role: Role
    pack: PackFn = _nothing
    recv: PackFn = _nothing
    unpack: UnpackFn = _no_unpack
    device: torch.device | str = "cpu"
    stage_recvs: bool = True


class Arena:
    """Staging buffers of a rank's buckets: per side (send, receive), two parities, so bucket ``b + 1``
    is packed (or arrives) while bucket ``b`` is on the wire (or is unpacked). Reused across syncs:
    a buffer grows to the largest bucket it served.

      >>> import torch
      >>> from bridge.wire.bucket import Arena
      >>> from bridge.wire.transport import Kind
      >>> a = Arena()
      >>> a.buffer(Kind.SEND, 3, 100, "cpu").numel(), a.buffer(Kind.SEND, 5, 10, "cpu").numel()  # same parity
      (100, 100)
    """

    __slots__ = ("_bufs", "recv_alloc")

    def __init__(self) -> None:
        self._bufs: dict[tuple[Kind, int], tuple[torch.Tensor, Alloc | None]] = {}
        # Host memory for the receive buffers (``bridge.wire.shm.staging``: senders of this host write
        # into it); ``None``: ``torch.empty``.
        self.recv_alloc: Alloc | None = None

    def buffer(self, kind: Kind, bucket: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """The uint8 buffer of ``kind`` for ``bucket``'s parity, at least ``nbytes`` long, on ``device``."""
        key = (kind, bucket % 2)
        alloc = self.recv_alloc if kind == Kind.RECV and torch.device(device).type == "cpu" else None
        buf, made_by = self._bufs.get(key, (None, None))
        if buf is None or buf.numel() < nbytes or buf.device != torch.device(device) or made_by is not alloc:
            self._bufs.pop(key, None)  # freed before the new one is allocated
            buf = (alloc(max(nbytes, 1)) if alloc is not None
                   else torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device))
            self._bufs[key] = (buf, alloc)
        return buf

    def slices(self, kind: Kind, bucket: int, msgs: list[Message], device: torch.device | str) -> list[torch.Tensor]:
        """One slice of the buffer per message of ``msgs``, back to back."""
        buf = self.buffer(kind, bucket, sum(m.nbytes for m in msgs), device)
        out, off = [], 0
        for m in msgs:
            out.append(buf[off:off + m.nbytes])
            off += m.nbytes
        return out

    def clear(self) -> None:
        self._bufs.clear()


class Bucket(NamedTuple):
    """A bucket ready to post: its operations, the messages it sends (with the tensors of each) and
    those it receives (with their staging buffers and the tensors each segment lands in); with
    checksums, per message sent the int64 tensor its digests are sent from (filled before posting),
    per message received the one they arrive in."""

    ops: list[Op]
    recvs: list[Message]
    rbufs: list[torch.Tensor]
    sends: list[tuple[Message, list[torch.Tensor]]]
    rtensors: list[list[torch.Tensor]]
    sdigests: Sequence[torch.Tensor] = ()
    rdigests: Sequence[torch.Tensor] = ()


def digest_ops(kind: Kind, msgs: list[Message], device: torch.device | str) -> tuple[list[Op], list[torch.Tensor]]:
    """The operations that carry the digests of ``msgs`` (one int64 per piece, one operation per message,
    after the bucket's payload), and their tensors."""
    bufs = [torch.zeros(len(m.pieces), dtype=torch.int64, device=device) for m in msgs]
    return [Op(kind, m.dst if kind == Kind.SEND else m.src, t) for m, t in zip(msgs, bufs, strict=True)], bufs


class WrongCount(Exception):
    """``pack`` gave tensors other than the plan's segments of a message (count or bytes); ``status`` says where."""

    def __init__(self, status: Status) -> None:
        super().__init__(status.text)
        self.status = status


def check_sizes(plan: BridgePlan, m: Message, xs: list[torch.Tensor]) -> None:
    """Refuses a message whose tensors are not one per planned segment of its planned byte count: a
    surplus one would be posted with no receive to match it (every rank would then wait for the
    deadline), a missing one never sent, one of another size would abort gloo."""
    members = plan.segment_pieces(m)
    if len(xs) != len(members):
        # The piece named: that of the first segment left out, or of the last one planned for a surplus.
        move = members[min(len(xs), len(members) - 1)][0].move if members else -1
        raise WrongCount(Status(Code.SIZE, m.bucket, m.dst, move,
                                f"{len(xs)} tensors given for the {len(members)} segments of the plan"))
    for x, seg, pieces in zip(xs, plan.segments(m), members, strict=True):
        n = x.numel() * x.element_size()
        if n != seg.stop - seg.start:
            raise WrongCount(Status(Code.SIZE, m.bucket, m.dst, pieces[0].move,
                                    f"{n} bytes given for a segment of {seg.stop - seg.start}"))
