"""How a sync's payload moves between ranks: the ``Transport`` protocol and the operations it carries.

A sync (``bridge.wire.session.SyncSession``) hands its transport one bucket at a time: every
point-to-point operation of the bucket (``Op``: send or receive one segment's bytes with one
peer), posted at once, then waited for under the sync's one deadline. Control traffic (the
handshake, the votes, the final ack) never goes through a transport: it stays ``all_gather``
on the sync's process group, so every transport sees the same protocol.

Rules a transport keeps (the protocol relies on them):

* per (sender, receiver) pair, the ``k``-th send matches the ``k``-th receive, in posting order;
  both sides post the same segments in the same order (``BridgePlan.segments``), so sizes match;
* lengths: a receive completes only with a message of exactly its length. A transport never
  lets a message of another length (shorter, longer, or one more or fewer message in a bucket)
  land in a receive's ``buf``, and never lets one end a process (gloo aborts the receiving
  process on a message longer than the buffer posted for it, so ``GlooTransport`` sends each
  bucket's lengths per peer ahead of the payload and posts no payload receive for a peer whose
  lengths differ). Where the transport could take the wrong message in and drop it (so the
  pair stays usable), ``wait`` completes every other handle, then raises ``WrongLength``
  naming the peer and both lengths: the session fails only this rank's part of the sync, which
  the next vote tells every rank, and the group stays usable. Where it could not, ``wait``
  raises ``SyncError`` like any transport failure;
* ``post`` returns at once (handles, opaque to the session); the bytes of a receive are defined only
  once ``wait`` returned for it, and a send's buffer may be reused only then;
* ``wait`` blocks until every handle completed or the deadline passed, and runs its blocking part
  through ``alarm.run`` so that a rank hears another rank's alarm; every failure is a
  ``SyncError`` naming this rank, what it waited for and why (``bridge.wire.alarm.wait_failure``
  words it as the gloo transport does);
* ``abort`` is called when this rank gives up on a sync (a transport failure rang the alarm):
  cancel what is pending where the transport can, so that peers fail at once; ``close`` ends the
  transport's life (the session closes only the transports it created).

A transport may write straight into a receiver's staging: a receive ``Op``'s ``buf`` is the
final destination of those bytes (a slice of the receiver's bucket buffer, of the memory held
until the final ack, or of a param itself, chosen by the receiver's commit strategy), never a
temporary. A shared-memory or CUDA IPC transport can thus copy (or let the sender's process
copy, through a handle exchanged out of band when the transport is built) from the send ``Op``'s
buffer into the receive ``Op``'s buffer, and complete the receive's handle once the copy is
done; an NCCL transport posts ``buf`` to ``ncclRecv`` as it is. Nothing but a new class is
needed: the session only calls ``post``, ``wait``, ``abort``, ``close`` and reads ``name``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from bridge.wire.alarm import SyncAlarm

__all__ = ["Kind", "Op", "Transport", "WrongLength"]


class Kind(enum.IntEnum):
    """Which way an operation moves bytes, as this rank sees it."""

    SEND = 0
    RECV = 1


class Op(NamedTuple):
    """One point-to-point operation of a bucket: send ``buf`` to, or receive it from, rank ``peer``.

    ``buf`` is a contiguous tensor whose bytes are the segment (any dtype; its byte count is what
    moves), and for a receive where they land for good.
    """

    kind: Kind
    peer: int
    buf: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


class WrongLength(Exception):
    """What arrived from ``peer`` in a bucket differs in length from the receives posted for it: ``expected``
    and ``announced`` describe both (bytes in operations); none of the bytes that arrived were kept, and
    the transport can serve the rest of the sync (raised by ``Transport.wait`` once every handle completed).
    """

    def __init__(self, peer: int, expected: str, announced: str) -> None:
        super().__init__(f"{announced} arrived from rank {peer} where the plan has {expected}")
        self.peer, self.expected, self.announced = peer, expected, announced


@runtime_checkable
class Transport(Protocol):
    """Moves a sync's payload: the operations of one bucket at a time (see the module docstring).

    ``name`` labels the bytes it moved in the sync's statistics
    (``ExecutionStats.transport_bytes``), e.g. ``"gloo"``.
    """

    @property
    def name(self) -> str: ...

    def post(self, ops: Sequence[Op]) -> list[Any]:
        """Posts every operation of a bucket at once; returns the handles to pass to ``wait``."""
        ...

    def wait(self, handles: Sequence[Any], *, deadline: float, alarm: SyncAlarm, what: str, rank: int) -> None:
        """Waits for ``handles`` until ``deadline`` (``time.monotonic()`` seconds), hearing ``alarm``;
        raises ``WrongLength`` where a message of another length arrived and was dropped (the rest
        completed), ``SyncError`` ("rank {rank}: {what} ...") on any other failure."""
        ...

    def abort(self) -> None:
        """This rank gave up on the sync: cancel what is pending, where possible."""
        ...

    def close(self) -> None:
        """Releases what the transport holds; it serves no further sync."""
        ...
