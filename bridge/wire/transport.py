"""How a sync's payload moves between ranks: the ``Transport`` protocol and the operations it carries.

A sync (``bridge.wire.session.SyncSession``) hands its transport one bucket at a time: every
point-to-point operation of the bucket (``Op``: send or receive one segment's bytes with one
peer), posted at once, then waited for under the sync's one deadline. Control traffic (the
handshake, the votes, the final ack) never goes through a transport: it stays ``all_gather``
on the sync's process group, so every transport sees the same protocol.

Rules a transport keeps (the protocol relies on them):

* per (sender, receiver) pair, the ``k``-th send matches the ``k``-th receive, in posting order;
  both sides post the same segments in the same order (``BridgePlan.segments``), so sizes match;
* ``post`` returns at once (one handle per operation); the bytes of a receive are defined only
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

__all__ = ["Kind", "Op", "Transport"]


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


@runtime_checkable
class Transport(Protocol):
    """Moves a sync's payload: the operations of one bucket at a time (see the module docstring).

    ``name`` labels the bytes it moved in the sync's statistics
    (``ExecutionStats.transport_bytes``), e.g. ``"gloo"``.
    """

    @property
    def name(self) -> str: ...

    def post(self, ops: Sequence[Op]) -> list[Any]:
        """Posts every operation of a bucket at once; returns one handle per operation, in order."""
        ...

    def wait(self, handles: Sequence[Any], *, deadline: float, alarm: SyncAlarm, what: str, rank: int) -> None:
        """Waits for ``handles`` until ``deadline`` (``time.monotonic()`` seconds), hearing ``alarm``;
        raises ``SyncError`` ("rank {rank}: {what} ...") on any failure."""
        ...

    def abort(self) -> None:
        """This rank gave up on the sync: cancel what is pending, where possible."""
        ...

    def close(self) -> None:
        """Releases what the transport holds; it serves no further sync."""
        ...
