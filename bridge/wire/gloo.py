"""The gloo transport: a sync's payload as point-to-point operations on its torch.distributed group.

With gloo the operations go straight to the process group's ``send`` / ``recv``: ``batch_isend_irecv``
posts each operation through ``isend`` / ``irecv``, whose Python checks cost more than the call
itself (a sync posts hundreds of operations per rank), and the sync's tensors and peers are
checked already. A group of another backend (NCCL) gets one ``batch_isend_irecv`` per bucket, as
before, so it still works unchanged (unframed: NCCL does not abort a process on a length).

Framing (gloo). gloo takes a message shorter than the receive posted for it, and ends the receiving
process on a longer one, so a receiver must know what comes before it posts a payload receive. Per
bucket and per peer, the sender first sends a header of ``HEADER_WORDS`` int64 on a tag of its own
(``HEADER_TAG``; the payload travels on tag 0): a magic word, the pair's sequence number (the
``k``-th bucket this transport sends to that peer), the number of operations, their total bytes,
the longest, and an xxh3-64 digest of the lengths in order, all as the transport actually posts
them. The receiver posts only the header receive at once; a helper thread per peer (in posting
order, so the payload receives of one peer keep the order of its sends, and a peer that is late
or gone holds up no other) waits for each header, checks it against the receives the plan
posted, and only then posts them. A header that differs names the
peer and both lengths: the payload is taken into a scratch buffer of the announced (bounded) size,
one message at a time, and dropped, and ``wait`` raises ``WrongLength`` once the bucket's other
handles completed (the group stays usable). A header that cannot be drained (longer than
``DRAIN_BYTES``), of another sequence number (a stale one) or without the magic word fails the
wait with ``SyncError``; no payload receive is posted for that peer, so gloo never sees it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from bridge.errors import REBUILD_GROUP, SyncError
from bridge.wire.alarm import SyncAlarm, Waiter, wait_failure, wait_once
from bridge.wire.route import Mode
from bridge.wire.transport import Kind, Op, Transport, WrongLength

__all__ = ["GlooTransport", "direct_group", "check_transport", "frame", "HEADER_TAG", "HEADER_WORDS", "DRAIN_BYTES",
           "MAGIC"]

HEADER_TAG = 1  # headers travel apart from the payload (tag 0), so the two streams keep their own order
HEADER_WORDS = 8
MAGIC = 0x4A52_4652_414D_4531  # "JRFRAME1"
DRAIN_BYTES = 1 << 26  # the longest message a receiver takes in (and drops) when its header differs


def frame(seq: int, lengths: Sequence[int]) -> torch.Tensor:
    """The header of one bucket's operations with one peer: magic, sequence, count, total, longest, digest.

      >>> from bridge.wire.gloo import frame
      >>> frame(0, [64, 8])[2:5].tolist()
      [2, 72, 64]
    """
    lens = np.asarray(lengths, dtype=np.int64)
    digest = xxhash.xxh3_64_intdigest(lens.tobytes()) & ((1 << 63) - 1)
    return torch.tensor([MAGIC, seq, len(lens), int(lens.sum()), int(lens.max(initial=0)), digest, 0, 0],
                        dtype=torch.int64)


def _describe(h: Sequence[int]) -> str:
    return f"{h[3]} bytes in {h[2]} messages (the longest {h[4]})"


class _Work(NamedTuple):
    """Posted operations with one peer: torch.distributed's works (and a header kept alive until sent)."""

    works: list[Any]
    peer: int
    head: torch.Tensor | None = None


class _Framed(NamedTuple):
    """Receives from one peer, posted once its header arrived: the helper's future of their works."""

    admitted: Future
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
    the sync's ranks (``bridge.wire.group.group_ranks``); see the module docstring. One transport
    serves one sync (its sequence numbers start at 0)."""

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._direct: dist.ProcessGroup | None = None
        self._resolved = False
        self._peer_in_group: dict[int, int] = {}
        self._seq: dict[tuple[Kind, int], int] = {}
        self._helpers: dict[int, Waiter] = {}  # per peer received from

    def _resolve(self) -> None:
        if not self._resolved:
            self._direct, self._resolved = direct_group(self.group), True

    def _peer(self, pg: dist.ProcessGroup, rank: int) -> int:
        got = self._peer_in_group.get(rank)
        if got is None:
            got = self._peer_in_group[rank] = dist.get_group_rank(pg, rank)
        return got

    def _next_seq(self, kind: Kind, peer: int) -> int:
        seq = self._seq.get((kind, peer), 0)
        self._seq[(kind, peer)] = seq + 1
        return seq

    def post(self, ops: Sequence[Op]) -> list[Any]:
        """Posts one bucket's operations (one call per bucket): per peer, the header, then the sends; the
        receives once their header arrived (see the module docstring)."""
        self._resolve()
        pg = self._direct
        if pg is None:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend if op.kind == Kind.SEND else dist.irecv, op.buf,
                                                       op.peer, self.group) for op in ops])
            return [_Work([w], op.peer) for w, op in zip(works, ops, strict=True)]
        groups: dict[tuple[Kind, int], list[Op]] = {}
        for op in ops:
            groups.setdefault((op.kind, op.peer), []).append(op)
        handles: list[Any] = []
        for (kind, peer), mine in groups.items():
            seq, gpeer = self._next_seq(kind, peer), self._peer(pg, peer)
            if kind == Kind.SEND:
                head = frame(seq, [op.nbytes for op in mine])
                works = [pg.send([head], gpeer, HEADER_TAG)] + [pg.send([op.buf], gpeer, 0) for op in mine]
                handles.append(_Work(works, peer, head))
                continue
            head = torch.empty(HEADER_WORDS, dtype=torch.int64)
            hwork = pg.recv([head], gpeer, HEADER_TAG)
            helper = self._helpers.get(peer)
            if helper is None:
                helper = self._helpers[peer] = Waiter()
            admit = functools.partial(self._admit, pg, gpeer, seq, head, hwork, mine, peer)
            handles.append(_Framed(helper.submit(admit), peer))
        return handles

    def _admit(self, pg: dist.ProcessGroup, gpeer: int, seq: int, head: torch.Tensor, hwork: Any,
               ops: list[Op], peer: int) -> tuple[list[Any], Exception | None]:
        """In the helper thread: waits for a peer's header, then posts the receives it matches (their works),
        or drains what it announces (a ``WrongLength``), or posts nothing (a ``SyncError``)."""
        hwork.wait()
        got, want = head.tolist(), frame(seq, [op.nbytes for op in ops]).tolist()
        if got[0] != MAGIC or got[1] != seq:
            return [], SyncError(f"a bucket header from rank {peer} is not the one expected (magic {got[0]:#x}, "
                                 f"sequence {got[1]}, expected {seq}): the pair is out of step; no payload was "
                                 "received from it.", advice=REBUILD_GROUP)
        if got == want:
            return [pg.recv([op.buf], gpeer, 0) for op in ops], None
        refusal = WrongLength(peer, _describe(want), _describe(got))
        if not 0 <= got[4] <= DRAIN_BYTES or got[2] < 0:
            return [], SyncError(f"{refusal}; too long to take in and drop ({DRAIN_BYTES} bytes at most), so no "
                                 "payload was received from it.", advice=REBUILD_GROUP)
        scratch = torch.empty(max(got[4], 1), dtype=torch.uint8)
        for _ in range(got[2]):  # one at a time into one buffer: every message fits it, none lands anywhere else
            pg.recv([scratch], gpeer, 0).wait()
        return [], refusal

    def wait(self, handles: Sequence[Any], *, deadline: float, alarm: SyncAlarm, what: str, rank: int) -> None:
        """Waits for every work in the alarm's helper thread (a gloo point-to-point wait that times out
        closes its pair, so it cannot be cut into slices); a refused peer's ``WrongLength`` last."""
        pending = list(handles)

        def job() -> None:
            refused: list[WrongLength] = []
            for h in pending:
                with_peer = f"{what} with peer rank {h.peer}"
                works = h.works if isinstance(h, _Work) else self._admitted(h, deadline, with_peer, rank, refused)
                for w in works:
                    wait_once(w, deadline, with_peer, rank)
            if refused:
                raise refused[0]

        if pending:
            alarm.run(job, what)

    @staticmethod
    def _admitted(h: _Framed, deadline: float, what: str, rank: int, refused: list[WrongLength]) -> list[Any]:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            works, failure = h.admitted.result(timeout=left)
        except FutureTimeout as e:
            raise wait_failure(TimeoutError("no header arrived"), deadline, left, what, rank) from e
        except Exception as e:  # gloo reports a dead peer or a closed pair as RuntimeError
            raise wait_failure(e, deadline, left, what, rank) from e
        if isinstance(failure, WrongLength):
            refused.append(failure)
        elif failure is not None:
            raise SyncError(f"rank {rank}: {what} failed: {failure}", advice=REBUILD_GROUP)
        return works

    def abort(self) -> None:
        """Nothing to cancel: gloo closes the pairs of a failed operation, and the group is rebuilt."""

    def close(self) -> None:
        self._peer_in_group.clear()
        for helper in self._helpers.values():
            helper.close()
        self._helpers.clear()


def check_transport(transport: Any) -> Transport | str:
    """``transport`` checked: a mode's name (``None``: ``"auto"``; ``bridge.wire.route``) or a ``Transport``.

      >>> from bridge.wire.gloo import check_transport
      >>> check_transport(None), check_transport("shm")
      ('auto', 'shm')
    """
    if transport is None:
        return "auto"
    if isinstance(transport, str):
        Mode.parse(transport)
        return transport
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be 'auto', 'shm', 'gloo' or implement bridge.wire.transport.Transport "
                        f"(name, post, wait, abort, close), got {type(transport).__name__}.")
    return transport
