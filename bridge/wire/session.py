"""The torch.distributed side shared by senders and receivers (imports torch, never jax).

Protocol of one sync, every rank of the group taking part:

1. Handshake: one ``all_gather`` of a small int64 header per rank (magic, role,
   status, version, whether it asks for digests, the plan's 32-byte fingerprint). A rank
   whose own checks failed sends a non-zero status; fingerprints or versions that differ
   raise ``PlanMismatchError`` on every rank before any data moves. On a fingerprint
   mismatch the ranks also exchange what their fingerprints cover (JSON text,
   ``bridge.plan.key``), so the error says what differs. When any rank asks for digests
   (``Sender(checksum=True)``), every rank sends them.
2. Votes: before the payload of a voted bucket moves, one ``all_gather`` of a fixed-length
   int64 row per rank (``bridge.wire.vote``): the rank's status (an exception while packing
   or unpacking, a message of the wrong size or length, a checksum mismatch found in an
   earlier bucket) and the byte count of every segment it is about to send, every
   ``vote_every(plan)`` buckets (``VOTE_BYTES`` per rank between votes). Every rank
   reaches the same verdict from the same table; on a failure or a byte count that
   differs from the plan every rank raises ``SyncError`` naming the rank, the bucket and
   the tensor, before any payload of the bucket is posted, and the group stays usable.
   Lengths are checked three times: each sender checks its ``pack``'s tensors against the
   plan's segments (count and bytes) before posting them and reports a mismatch as a
   failure; the vote compares every announced byte count with the plan; and the transport
   checks what arrives against the receive it was posted for (``bridge.wire.transport``: the
   gloo transport frames every bucket with its lengths and refuses a message of another
   length before any of its bytes land). A rank that failed between votes keeps sending and
   receiving staging bytes of the planned sizes, so its peers' operations match, unpacks
   nothing and announces the failure (naming its bucket) in the next vote.
3. Buckets: per bucket every rank posts its operations at once through the sync's transport
   (``bridge.wire.transport``; by default ``bridge.wire.gloo.GlooTransport``: with gloo straight to
   the process group's ``send`` / ``recv``, else one ``batch_isend_irecv``):
   per peer, one operation per segment of the message (``BridgePlan.segments``). Each piece starts
   at a 64-byte-aligned offset of the message and is laid out C-contiguous in the
   param's dim order (the sender casts and transposes, the receiver only copies
   blocks). A piece contiguous in the sender's cast/transposed shard is sent from
   there; a piece contiguous in the receiver's param is received straight into
   it; the other pieces travel packed, runs of them as one operation. Bucket buffers
   come from two arenas per side, so the sender packs bucket b+1 while bucket b is on
   the wire and the receiver checks and unpacks bucket b while bucket b+1 arrives. With
   digests, each message is followed by one more operation to its receiver: the xxh3-64 digest
   of each of its pieces (computed in a thread while the bucket before is on the wire). A rank
   that only receives, into memory of its own (the default atomic ``Receiver``, which holds
   every message until the final ack), posts the receives of every bucket up to the next vote
   at once, so the senders never wait for it between buckets. The vote
   on bucket b+1 travels while bucket b is on the wire, and is counted once bucket b
   arrived. Receivers check every piece's digest before unpacking it and report a
   mismatch in the next vote (or the final ack).
4. Final ack: the vote after the last bucket; receivers commit only when every rank
   reported success.

The handshake waits up to ``ready_timeout`` for every rank to join (a trainer may
still be computing its step); gloo also bounds it by the process group's timeout.
After it, one deadline (``timeout`` seconds) bounds the whole sync: every bucket and
the final ack. A peer that dies while others wait breaks its connections, which fails
the wait at once on every survivor that has an operation pending with it; a rank that
gives up so raises the sync's alarm (``bridge.wire.alarm``, passed to the transport's waits),
which every other rank checks while it waits for a bucket.

After a ``SyncError`` raised by a vote (a rank's exception, corrupt or wrong-size data, a
message of the wrong length that the transport refused)
nothing is in flight and the group can run the next sync. After a timeout or a dead
peer the group is unusable (gloo closes the pairs of a failed operation):
``rebuild_group`` destroys it and creates a new one.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from bridge.errors import REBUILD_GROUP, PlanMismatchError, SyncError
from bridge.plan.bridge_plan import WIRE_DTYPES, BridgePlan
from bridge.wire import vote as _vote
from bridge.wire.alarm import SyncAlarm
from bridge.wire.bucket import Arena, Bucket, Side, WrongCount, check_sizes, digest_ops
from bridge.wire.gloo import GlooTransport, check_transport
from bridge.wire.group import check_plan_and_rank, group_ranks
from bridge.wire.handshake import HandshakeStatus, Role, handshake, header
from bridge.wire.route import Mode, Place, here, routes
from bridge.wire.shm import ShmTransport
from bridge.wire.tally import Tally
from bridge.wire.transport import Kind, Op, Transport, WrongLength
from bridge.wire.vote import Code, Status, vote_every
from jreshard.core.args import check_int, check_seconds
from jreshard.core.progress import progress_bar

__all__ = ["SyncError", "PlanMismatchError", "SyncSession", "reject_sync", "torch_dtype", "TORCH_DTYPES"]

log = logging.getLogger("bridge")

TORCH_DTYPES = {name: getattr(torch, name) for name in WIRE_DTYPES}

def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} has no torch equivalent here; use one of {sorted(TORCH_DTYPES)}.") from None


class _Ballot(NamedTuple):
    """A vote posted and not yet waited for: the ``all_gather``'s work and the table it fills."""

    work: Any
    table: list[torch.Tensor]


class _InFlight(NamedTuple):
    """A bucket and the transport's handles of its operations (``None``: not posted yet)."""

    bucket: Bucket | None
    handles: list | None


class SyncSession:
    """One sync of one rank: ``run()`` it once; ``stats`` then says what it did (also after a failure).

    Args:
      plan, rank, group: the sync plan (the same on every rank), this rank, the sync's process group
        (default: the default group; it must hold exactly the plan's ranks).
      side: what this rank sends and receives (``bridge.wire.bucket.Side``).
      version: the trainers' version (receivers pass -1: the handshake tells them).
      timeout: seconds the sync may take after the handshake (one deadline: every bucket, the final ack).
      ready_timeout: seconds the handshake waits for every rank.
      status: ``HandshakeStatus.REJECTED`` joins only to fail every rank at once (``reject_sync``).
      checksum: this rank asks for digests; when any rank asks, every rank sends an xxh3-64 digest of
        every piece it sends, after the bucket's payload, and receivers check them before unpacking.
      progress: a progress bar (``jreshard.core.progress``).
      arena: staging buffers to reuse across syncs (default: new ones).
      transport: moves the payload: a mode (``"auto"``, the default, ``"shm"``, ``"gloo"``: the
        transport is built after the handshake from every pair's route, ``bridge.wire.route``, and
        closed at the end) or a ``Transport`` object (every rank passes one).

    In a two-stage plan inference ranks also send (stage 2, inside their domain), in buckets shared
    with stage 1: a stage-2 message of bucket ``b`` forwards only what stage-1 buckets up to
    ``b - 2`` delivered (``bridge.plan.bridge_plan.STAGE2_LAG``), which the loop has unpacked when it
    packs bucket ``b``.
    """

    def __init__(self, plan: BridgePlan, rank: int, group: Any, side: Side, *, version: int, timeout: float,
                 ready_timeout: float, status: HandshakeStatus = HandshakeStatus.OK, checksum: bool = False,
                 progress: bool | None = None, arena: Arena | None = None,
                 transport: Transport | str | None = None) -> None:
        version = check_int("version", version, minimum=-1)
        timeout, ready_timeout = check_seconds("timeout", timeout), check_seconds("ready_timeout", ready_timeout)
        self.ranks = group_ranks(group)
        if rank not in self.ranks:
            raise SyncError(f"rank {rank} is not in the process group (ranks {self.ranks}).")
        needed = set(plan.source.ranks) | set(plan.param_map.ranks)
        if set(self.ranks) != needed:
            raise ValueError(
                f"the process group has ranks {self.ranks} but the plan involves ranks {sorted(needed)}; pass a "
                "group of exactly the trainer and inference ranks (torch.distributed.new_group)."
            )
        self.plan, self.rank, self.group, self.side = plan, rank, group, side
        self.version, self.status, self.checksum, self.progress = version, status, checksum, progress
        self.timeout, self.ready_timeout = timeout, ready_timeout
        self.arena = arena if arena is not None else Arena()
        given = check_transport(transport)
        self.mode = Mode.CUSTOM if not isinstance(given, str) else Mode.parse(given)
        # A mode's transport is built once the handshake told every rank's place (``_open_transport``).
        self.transport: Transport | None = given if not isinstance(given, str) else None
        self.place: Place = here(torch.device(side.device).type)
        self.routes: dict[int, str] = {}
        home = plan.domain_of(rank)
        self._away = {r: plan.domain_of(r) != home for r in self.ranks}  # peers in another domain
        label = self.transport.name if self.transport is not None else self.mode.label
        self.tally = Tally(rank, label, "hierarchical" if plan.two_stage else "direct")
        self.stats = self.tally.stats(0.0)
        self.alarm = SyncAlarm(None, rank)
        self.deadline = 0.0
        self.every = vote_every(plan)
        # A rank that only receives, into memory of its own, posts receives ahead (``_post_ahead``).
        self._posts_ahead = not side.stage_recvs and all(m.src != rank for m in plan.messages)
        # The state of the bucket loop.
        self._mine = Status()  # this rank's status, announced in the next vote
        self._cur = _InFlight(None, [])  # the bucket on the wire
        self._ahead: dict[int, _InFlight] = {}  # buckets posted ahead, with their handles
        self._reach = 0  # the first bucket not posted ahead
        self._hasher: ThreadPoolExecutor | None = None
        self._bar: Any = None

    @property
    def nbytes(self) -> int:
        """Payload bytes this rank sends and receives in the sync."""
        return sum(m.nbytes for m in self.plan.messages if self.rank in (m.src, m.dst))

    def run(self) -> int:
        """Runs the protocol; returns the agreed version. Raises SyncError (or PlanMismatchError) on any failure."""
        start = time.perf_counter()
        self.alarm = SyncAlarm.open(self.group, self.rank, len(self.ranks))
        self.alarm.on_give_up(self._abort)
        own = self.transport is None
        try:
            with self.alarm:
                with self.tally.timing("handshake"):
                    self.handshake()
                self.deadline = time.monotonic() + self.timeout
                self._buckets()
        finally:
            moved = getattr(self.transport, "moved", None)  # bytes per route, where a transport routes ops apart
            self.stats = self.tally.stats(time.perf_counter() - start, dict(moved) if moved else None)
            if own and self.transport is not None:
                self.transport.close()
        s = self.stats
        log.info("rank %d synced version %d: %s bytes in %d buckets, %.3f s (%.2f GB/s, pid %d)", self.rank,
                 self.version, f"{self.nbytes:,}", self.plan.num_buckets, s.seconds,
                 self.nbytes / max(s.seconds, 1e-9) / 1e9, os.getpid())
        return self.version

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def handshake(self) -> None:
        """Agrees on the version, on digests and on the transport with every rank (``bridge.wire.handshake``),
        then builds the transport of a mode from every pair's route."""
        mine = header(self.side.role, self.status, self.version, self.checksum, self.plan.fingerprint, self.mode,
                      self.place)
        agreed = handshake(self.plan, self.rank, self.ranks, self.group, self.alarm, mine,
                           time.monotonic() + self.ready_timeout)
        self.version, self.checksum = agreed.version, agreed.digests
        pairs = {(m.src, m.dst) for m in self.plan.messages}
        self.routes = routes(agreed.modes, agreed.places, pairs=pairs, rank=self.rank)
        if self.transport is None:
            self.transport = self._open_transport(agreed.places)

    def _open_transport(self, places: dict[int, Place]) -> Transport:
        """The transport of this rank's pairs: shared memory with the peers routed ``"shm"``, gloo with the rest."""
        if "shm" not in self.routes.values():
            return GlooTransport(self.group)
        return ShmTransport(self.group, self.routes, {r: p.pid for r, p in places.items()})

    def _buckets(self) -> None:
        """Every bucket, then the final ack (``_step``); nothing of the sync outlives it."""
        self._bar = progress_bar(self.progress, self.nbytes, f"bridge sync rank {self.rank}")
        # The digests of what this rank sends in a bucket are computed in a thread (xxhash releases the
        # GIL) while it waits for the previous bucket; the vote carries them.
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="bridge-digests") if self.checksum else None
        try:
            for b in range(self.plan.num_buckets + 1):
                self._step(b)
        finally:
            # No handles of this sync outlive it (they would keep a failed group's connections open).
            self._ahead.clear()
            self._cur = _InFlight(None, [])
            if self._hasher is not None:
                self._hasher.shutdown(wait=True, cancel_futures=True)
            if self._bar is not None:
                self._bar.close()

    def _step(self, b: int) -> None:
        """Bucket ``b`` (``num_buckets``: the final ack) in its turn.

        Bucket b is packed while bucket b-1 is on the wire, and bucket b-1 is checked and unpacked
        while bucket b is; a failure there is announced in the vote after. Each bucket's payload is
        posted only after every rank voted for it. So bucket b is packed once buckets up to b-2 are
        unpacked: what a stage-2 message of bucket b forwards arrived in stage-1 buckets up to b-2
        (``bridge.plan.bridge_plan.STAGE2_LAG``), and nothing waits for stage 1 to finish.
        """
        nb, voting = self.plan.num_buckets, self._votes_at(b)
        nxt = self._next(b, voting)
        sums = self._digest(nxt.bucket)
        # The vote on bucket b travels while bucket b-1 is on the wire. Not the final ack, which announces
        # the check and unpacking of the last bucket.
        early = self.cast(b, nxt.bucket) if voting and b < nb else None
        self.wait(b)
        if b == nb:  # the last bucket is checked and unpacked before the final ack, which announces a failure
            self.finish(b - 1)
        if voting:
            self.count(b, early if early is not None else self.cast(b, nxt.bucket))
        if nxt.handles is None:
            self._seal(b, nxt.bucket, sums)
        handles = nxt.handles if nxt.handles is not None else self.post(nxt.bucket, b)
        self._reach = max(self._reach, b + 1)
        if nxt.bucket is not None:
            self._post_ahead()
        if b < nb:
            self.finish(b - 1)
        self._cur = _InFlight(nxt.bucket, handles)

    def _votes_at(self, b: int) -> bool:
        return b == self.plan.num_buckets or (b > 0 and b % self.every == 0)

    def _next(self, b: int, voting: bool) -> _InFlight:
        """Bucket ``b``: posted ahead already, packed now, or (after a failure, with no vote to announce it
        before its payload) scratch bytes of the planned sizes; ``None`` past the last or after a failure."""
        if b in self._ahead:
            return self._ahead.pop(b)
        bucket = None
        if b < self.plan.num_buckets and self._mine.code == Code.OK:
            try:
                bucket = self.prepare(b)
            except WrongCount as e:  # announced in the next vote as a wrong-size message
                self._mine = e.status
            except Exception as e:  # announced in the next vote
                self._mine = self._failed(b, e)
        if b < self.plan.num_buckets and bucket is None and not voting:
            bucket = self.scratch(b)
        return _InFlight(bucket, None)

    def _digest(self, bucket: Bucket | None) -> Future | None:
        """Starts the digests of what this rank sends in ``bucket`` (in a thread: xxhash releases the GIL)."""
        if self._hasher is None or bucket is None or not bucket.sdigests:
            return None
        return self._hasher.submit(_vote.send_digests, self.plan, bucket.sends)

    def _seal(self, b: int, bucket: Bucket | None, sums: Future | None) -> None:
        """Writes the digests of what this rank sends in bucket ``b`` into the tensors they are sent from."""
        if bucket is None or sums is None:
            return
        with self.tally.timing("check"):
            try:
                got = sums.result()
            except Exception as e:  # sent as "not computed"; announced in the next vote
                self._mine = self._failed(b, e)
                return
            for t, d in zip(bucket.sdigests, got, strict=True):
                t.copy_(torch.tensor(d, dtype=torch.int64))

    def prepare(self, b: int) -> Bucket:
        """Packs bucket ``b``'s messages and sets its receives up (timed as ``pack``)."""
        plan, side = self.plan, self.side
        with self.tally.timing("pack"):
            sends, recvs = plan.sends(self.rank, b), plan.recvs(self.rank, b)
            ops: list[Op] = []
            packed = []
            for m, buf in zip(sends, self.arena.slices(Kind.SEND, b, sends, side.device), strict=True):
                xs = side.pack(m, buf)
                check_sizes(plan, m, xs)
                packed.append((m, xs))
                ops += [Op(Kind.SEND, m.dst, x) for x in xs]
            rbufs = (self.arena.slices(Kind.RECV, b, recvs, side.device) if side.stage_recvs
                     else [torch.empty(0, dtype=torch.uint8, device=side.device)] * len(recvs))
            rtensors = []
            for m, buf in zip(recvs, rbufs, strict=True):
                xs = side.recv(m, buf)
                rtensors.append(xs)
                ops += [Op(Kind.RECV, m.src, x) for x in xs]
            sops, sdigests = digest_ops(Kind.SEND, sends, side.device) if self.checksum else ([], [])
            rops, rdigests = digest_ops(Kind.RECV, recvs, side.device) if self.checksum else ([], [])
            return Bucket(ops + sops + rops, recvs, rbufs, packed, rtensors, sdigests, rdigests)

    def scratch(self, b: int) -> Bucket:
        """Bucket ``b`` of a rank that failed earlier: staging bytes of the planned sizes are sent and
        received (its peers post the same operations, and a wrong-size message never reaches the
        transport); nothing is unpacked."""
        ops: list[Op] = []
        sends, recvs = self.plan.sends(self.rank, b), self.plan.recvs(self.rank, b)
        for kind, msgs in ((Kind.SEND, sends), (Kind.RECV, recvs)):
            for m, buf in zip(msgs, self.arena.slices(kind, b, msgs, self.side.device), strict=True):
                peer = m.dst if kind == Kind.SEND else m.src
                ops += [Op(kind, peer, buf[s.start:s.stop]) for s in self.plan.segments(m)]
        if self.checksum:  # digests of 0: "not computed", never checked
            for kind, msgs in ((Kind.SEND, sends), (Kind.RECV, recvs)):
                ops += digest_ops(kind, msgs, self.side.device)[0]
        return Bucket(ops, [], [], [], [])

    def post(self, bucket: Bucket | None, b: int) -> list:
        """Posts bucket ``b``'s operations through the transport; returns their handles."""
        if bucket is None or not bucket.ops:
            return []
        transport = self.transport
        assert transport is not None  # the handshake built it
        with self.tally.timing("post"):
            for op in bucket.ops:
                self.tally.count(op, away=self._away[op.peer], via=transport.name)
            try:
                return transport.post(bucket.ops)
            except SyncError as e:
                raise self.alarm.give_up(e) from e
            except RuntimeError as e:  # gloo fails at once when a peer's connection is already closed
                raise self.alarm.give_up(SyncError(
                    f"rank {self.rank}: posting bucket {b + 1}/{self.plan.num_buckets} failed: {e}")) from e

    def _post_ahead(self) -> None:
        """A rank that only receives, into memory of its own (``stage_recvs=False``: nothing is reused or
        unpacked between buckets), posts the receives of every bucket up to the next vote at once, so
        senders never wait for it between buckets (a vote still comes before the payloads it covers)."""
        nb = self.plan.num_buckets
        while self._posts_ahead and self._mine.code == Code.OK and self._reach < nb and not self._votes_at(self._reach):
            try:
                bucket = self.prepare(self._reach)
            except Exception:  # noqa: BLE001 (prepared again in its own turn, which reports it)
                break
            self._ahead[self._reach] = _InFlight(bucket, self.post(bucket, self._reach))
            self._reach += 1

    def wait(self, b: int) -> None:
        """Waits for the bucket on the wire (bucket ``b - 1``) under the sync's deadline and alarm. A message
        the transport refused for its length fails this rank (announced in the next vote), not the group."""
        handles = self._cur.handles or []
        if handles:
            assert self.transport is not None
            with self.tally.timing("wait"):
                try:
                    self.transport.wait(handles, deadline=self.deadline, alarm=self.alarm,
                                        what=f"bucket {b}/{self.plan.num_buckets}", rank=self.rank)
                except WrongLength as e:
                    if self._mine.code == Code.OK:
                        self._mine = self._refused(b - 1, e)

    def _refused(self, b: int, e: WrongLength) -> Status:
        log.error("rank %d refused a message of bucket %d: %s", self.rank, b + 1, e)
        first = next((m.pieces[0][0] for m in self.plan.recvs(self.rank, b) if m.src == e.peer and m.pieces), -1)
        return Status(Code.LENGTH, b, e.peer, first, str(e))

    def cast(self, b: int, bucket: Bucket | None) -> _Ballot:
        """Posts this rank's row of the vote on bucket ``b`` (``num_buckets``: the final ack)."""
        with self.tally.timing("vote"):
            length = _vote.row_length(self.plan, b, self.ranks)
            row = _vote.make_row(self.plan, length, self._mine, bucket.sends if bucket is not None else [],
                                 self.checksum)
            table = [torch.empty_like(row) for _ in self.ranks]
            return _Ballot(dist.all_gather(table, row, group=self.group, async_op=True), table)

    def count(self, b: int, ballot: _Ballot) -> None:
        """Waits for the vote on bucket ``b``; raises the verdict's SyncError."""
        nb = self.plan.num_buckets
        with self.tally.timing("vote"):
            what = f"the vote on bucket {b + 1}/{nb}" if b < nb else "the final ack"
            self.alarm.wait_for(ballot.work, self.deadline, what)
            if b == nb and time.monotonic() > self.deadline - min(0.5, 0.05 * self.timeout):
                # The others give up at the deadline: committing now could leave receivers on different versions.
                raise self.alarm.give_up(SyncError(
                    f"rank {self.rank}: the final ack completed at the sync's deadline, when other ranks may "
                    "already have given up; nothing was committed.", advice=REBUILD_GROUP))
            failure = _vote.verdict(self.plan, b, self.ranks, ballot.table)
            if failure is not None:
                raise SyncError(_vote.describe(self.plan, self.rank, failure))

    def finish(self, b: int) -> None:
        """Checks the digests of bucket ``b`` (on the wire until now, arrived), then unpacks it."""
        bucket = self._cur.bucket
        if bucket is None or self._mine.code != Code.OK:
            return
        if bucket.rdigests:
            with self.tally.timing("check"):
                expected = _vote.announced(bucket.recvs, bucket.rdigests)
                self._mine = _vote.check_received(self.plan, bucket.recvs, bucket.rtensors, b, expected)
        if self._mine.code != Code.OK:
            return
        with self.tally.timing("unpack"):
            try:
                for m, buf in zip(bucket.recvs, bucket.rbufs, strict=True):
                    self.side.unpack(m, buf)
            except Exception as e:  # announced in the next vote
                self._mine = self._failed(b, e)
                return
            if self._bar is not None:
                self._bar.update(sum(op.nbytes for op in bucket.ops))

    def _failed(self, b: int, e: Exception) -> Status:
        log.exception("rank %d failed in bucket %d", self.rank, b + 1)
        return Status(Code.ERROR, b, -1, -1, f"{type(e).__name__}: {e}")


def reject_sync(plan: BridgePlan, *, rank: int | None = None, group: dist.ProcessGroup | None = None,
                ready_timeout: float = 600.0) -> None:
    """Joins one sync as a rank that cannot take part, so that every other rank fails at once.

    Call it where a rank's own set-up failed (for example ``Receiver`` refused its
    parameters): the handshake tells every rank, which raise ``SyncError`` ("ranks [r]
    rejected the sync") instead of waiting ``ready_timeout`` for this rank. Nothing is
    sent or received; returns once the handshake is done (or failed).
    """
    rank = check_plan_and_rank(plan, rank)
    ready_timeout = check_seconds("ready_timeout", ready_timeout)
    role = Role.SENDER if rank in plan.source.ranks else Role.RECEIVER
    try:
        SyncSession(plan, rank, group, Side(role), version=0 if role == Role.SENDER else -1, timeout=ready_timeout,
                    ready_timeout=ready_timeout, status=HandshakeStatus.REJECTED).run()
    except SyncError as e:
        log.info("rank %d rejected a sync: %s", rank, e)

