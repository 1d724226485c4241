"""The gloo transport: a sync's payload as point-to-point operations on its torch.distributed group.

With gloo the operations go straight to the process group's ``send`` / ``recv``: ``batch_isend_irecv``
posts each operation through ``isend`` / ``irecv``, whose Python checks cost more than the call
itself (a sync posts hundreds of operations per rank), and the sync's tensors and peers are
checked already. A group of another backend (NCCL) gets one ``batch_isend_irecv`` per bucket, as
before, so it still works unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch.distributed as dist

from bridge.wire.alarm import SyncAlarm, wait_once
from bridge.wire.transport import Kind, Op, Transport

__all__ = ["GlooTransport", "direct_group", "check_transport"]


class _Work(NamedTuple):
    """A posted operation: torch.distributed's work and the peer it is with (named in errors)."""

    work: Any
    peer: int


def direct_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The process group to post operations to one by one (a gloo group), else ``None`` (batch them).

    Example (no group: nothing to post to directly):
      >>> import torch.distributed as dist
      >>> from bridge.wire.gloo import direct_group
      >>> dist.is_initialized() or direct_group(None) is None
      True
    """
    pg = group if group is not None else dist.group.WORLD
    # ``name()``: the group's default backend. ``dist.get_backend`` would refuse a group built outside
    # torch.distributed's registry (``bridge.engines.group.open_group``).
    if pg is None or pg.name() != "gloo":
        return None
    return pg


class GlooTransport:
    """The payload of a sync on ``group`` (default: the default group), peers named by their rank in
    the sync's ranks (``bridge.wire.group.group_ranks``); see the module docstring."""

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._direct: dist.ProcessGroup | None = None
        self._resolved = False
        self._peer_in_group: dict[int, int] = {}

    def _resolve(self) -> None:
        if not self._resolved:
            self._direct, self._resolved = direct_group(self.group), True

    def _peer(self, pg: dist.ProcessGroup, rank: int) -> int:
        got = self._peer_in_group.get(rank)
        if got is None:
            got = self._peer_in_group[rank] = dist.get_group_rank(pg, rank)
        return got

    def post(self, ops: Sequence[Op]) -> list[_Work]:
        """Posts one bucket's operations (one call per bucket); returns their works."""
        self._resolve()
        pg = self._direct
        if pg is not None:
            return [_Work((pg.send if op.kind == Kind.SEND else pg.recv)([op.buf], self._peer(pg, op.peer), 0), op.peer)
                    for op in ops]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if op.kind == Kind.SEND else dist.irecv, op.buf,
                                                   op.peer, self.group) for op in ops])
        return [_Work(w, op.peer) for w, op in zip(works, ops, strict=True)]

    def wait(self, handles: Sequence[_Work], *, deadline: float, alarm: SyncAlarm, what: str, rank: int) -> None:
        """Waits for every work in the alarm's helper thread (a gloo point-to-point wait that times out
        closes its pair, so it cannot be cut into slices)."""
        pending = list(handles)

        def job() -> None:
            for w in pending:
                wait_once(w.work, deadline, f"{what} with peer rank {w.peer}", rank)

        if pending:
            alarm.run(job, what)

    def abort(self) -> None:
        """Nothing to cancel: gloo closes the pairs of a failed operation, and the group is rebuilt."""

    def close(self) -> None:
        self._peer_in_group.clear()


def check_transport(transport: Any, group: Any) -> Transport:
    """``transport`` (default: a ``GlooTransport`` on ``group``), checked to be a ``Transport``."""
    if transport is None:
        return GlooTransport(group)
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must implement bridge.wire.transport.Transport (name, post, wait, abort, "
                        f"close), got {type(transport).__name__}.")
    return transport
