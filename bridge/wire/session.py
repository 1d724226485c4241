"""The torch.distributed side shared by senders and receivers (imports torch, never jax).

Protocol of one sync, every rank of the group taking part:

1. Handshake: one ``all_gather`` of a small int64 header per rank (magic, role,
   status, version, whether it asks for digests, the plan's 32-byte fingerprint). A rank
   whose own checks failed sends a non-zero status; fingerprints or versions that differ
   raise ``PlanMismatchError`` on every rank before any data moves. On a fingerprint
   mismatch the ranks also exchange what their fingerprints cover (JSON text,
   ``bridge.plan.key``), so the error says what differs. When any rank asks for digests
   (``Sender(checksum=True)``), every rank announces them and votes on every bucket.
2. Votes: before the payload of a voted bucket moves, one ``all_gather`` of a fixed-length
   int64 row per rank (``bridge.wire.vote``): the rank's status (an exception while packing
   or unpacking, a message of the wrong size, a checksum mismatch found in an earlier
   bucket), the byte count of every segment it is about to send and, with digests, an
   xxh3-64 digest of every piece. Every bucket is voted with digests; without, every
   ``vote_every(plan)`` buckets (``VOTE_BYTES`` per rank between votes). Every rank
   reaches the same verdict from the same table; on a failure or a byte count that
   differs from the plan every rank raises ``SyncError`` naming the rank, the bucket and
   the tensor, before any payload of the bucket is posted, and the group stays usable.
   A wrong-size message never reaches gloo: each sender checks its ``pack``'s tensors
   against the plan's segments (count and bytes) before posting them and reports a
   mismatch as a failure. A rank that failed between votes keeps sending and receiving
   staging bytes of the planned sizes, so its peers' operations match, unpacks nothing
   and announces the failure (naming its bucket) in the next vote.
3. Buckets: per bucket every rank posts its operations at once (``_post``: with gloo
   straight to the process group's ``send`` / ``recv``, else one ``batch_isend_irecv``):
   per peer, one operation per segment of the message (``BridgePlan.segments``). Each piece starts
   at a 64-byte-aligned offset of the message and is laid out C-contiguous in the
   param's dim order (the sender casts and transposes, the receiver only copies
   blocks). A piece contiguous in the sender's cast/transposed shard is sent from
   there; a piece contiguous in the receiver's param is received straight into
   it; the other pieces travel packed, runs of them as one operation. Bucket buffers
   come from two arenas per side, so the sender packs bucket b+1 while bucket b is on
   the wire and the receiver checks and unpacks bucket b while bucket b+1 arrives. A rank
   that only receives, into memory of its own (the default atomic ``Receiver``, which holds
   every message until the final ack), posts the receives of every bucket up to the next vote
   at once, so the senders never wait for it between buckets. The vote
   on bucket b+1 travels while bucket b is on the wire (except a vote that carries digests,
   cast once they are computed), and is counted once bucket b arrived. Receivers
   check every piece's digest before unpacking it and report a mismatch in the next vote
   (that of bucket b+2, or the final ack).
4. Final ack: the vote after the last bucket; receivers commit only when every rank
   reported success.

The handshake waits up to ``ready_timeout`` for every rank to join (a trainer may
still be computing its step); gloo also bounds it by the process group's timeout.
After it, one deadline (``timeout`` seconds) bounds the whole sync: every bucket and
the final ack. A peer that dies while others wait breaks its connections, which fails
the wait at once on every survivor that has an operation pending with it; a rank that
gives up so raises the sync's alarm (``bridge.wire.alarm``), which every other rank checks
while it waits for a bucket.

After a ``SyncError`` raised by a vote (a rank's exception, corrupt or wrong-size data)
nothing is in flight and the group can run the next sync. After a timeout or a dead
peer the group is unusable (gloo closes the pairs of a failed operation):
``rebuild_group`` destroys it and creates a new one.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from bridge.errors import PlanMismatchError, SyncError
from bridge.plan.bridge_plan import WIRE_DTYPES, BridgePlan, Message
from bridge.plan.key import decode, describe_difference, encode, plan_key
from bridge.wire import vote as _vote
from bridge.wire.alarm import alarm_for, await_job, give_up, wait_for, wait_once
from bridge.wire.vote import Code, Status
from jreshard.core.args import check_int, check_seconds

__all__ = ["SyncError", "PlanMismatchError", "init_group", "rebuild_group", "run_sync", "reject_sync",
           "check_plan_and_rank", "new_arena", "torch_dtype", "TORCH_DTYPES"]

log = logging.getLogger("bridge")

MAGIC = 0x6A72_6573  # "jres"
VOTE_BYTES = 1 << 30  # without digests, a vote before at most this many bytes of buckets per rank
SENDER, RECEIVER = 1, 2

TORCH_DTYPES = {name: getattr(torch, name) for name in WIRE_DTYPES}


class _Op(NamedTuple):
    """One point-to-point operation of a bucket: ``fn`` (isend or irecv) of ``buf`` with ``peer``."""

    fn: Callable[..., Any]
    peer: int
    buf: torch.Tensor


class _Bucket(NamedTuple):
    """A bucket ready to post: its operations, the messages it sends (with the tensors of each) and
    those it receives (with their staging buffers and the tensors each segment lands in)."""

    ops: list[_Op]
    recvs: list[Message]
    rbufs: list[torch.Tensor]
    sends: list[tuple[Message, list[torch.Tensor]]]
    rtensors: list[list[torch.Tensor]]


class _Ballot(NamedTuple):
    """A vote posted and not yet waited for: the ``all_gather``'s work and the table it fills."""

    work: Any
    table: list[torch.Tensor]


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} has no torch equivalent here; use one of {sorted(TORCH_DTYPES)}.") from None


def init_group(rank: int, world_size: int, *, port: int, host: str = "127.0.0.1", backend: str = "gloo",
               timeout: float = 60.0) -> dist.ProcessGroup:
    """Creates the default process group of trainer and inference processes (TCP rendezvous).

    Rank 0 hosts the rendezvous store. ``timeout`` (seconds) bounds every collective.
    Returns ``torch.distributed.group.WORLD``.
    """
    rank = check_int("rank", rank)
    world_size = check_int("world_size", world_size, minimum=1)
    port = check_int("port", port, minimum=1, maximum=65535)
    timeout = check_seconds("timeout", timeout)
    if not isinstance(host, str) or not host:
        raise TypeError(f"host must be a non-empty str (a host name or address), got {host!r}.")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")
    if not rank < world_size:
        raise ValueError(f"rank {rank} must be below world_size {world_size}.")
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    world = dist.group.WORLD
    if world is None:
        raise SyncError("torch.distributed.init_process_group returned without a default group.")
    return world


def rebuild_group(rank: int, world_size: int, *, port: int, host: str = "127.0.0.1", backend: str = "gloo",
                  timeout: float = 60.0) -> dist.ProcessGroup:
    """Destroys the default process group (if any) and creates a new one: what a sync needs after a timeout
    or a dead peer. Every rank calls it with a fresh ``port`` (a replacement process for a dead one too)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    return init_group(rank, world_size, port=port, host=host, backend=backend, timeout=timeout)


def new_arena() -> list:
    """Empty staging slots: two parities (double buffering) for sending and for receiving."""
    return [[None, None], [None, None]]


def check_plan_and_rank(plan: BridgePlan, rank: int | None) -> int:
    """Validates a Sender's or Receiver's plan; returns ``rank`` (default: this process's global rank)."""
    if not isinstance(plan, BridgePlan):
        raise TypeError(f"plan must be a bridge.BridgePlan, got {type(plan).__name__}.")
    if rank is None:
        if not dist.is_initialized():
            raise ValueError("rank is None and torch.distributed is not initialised; pass rank=.")
        return dist.get_rank()
    return check_int("rank", rank)


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The ranks of ``group`` in its own order, as the plan names them.

    A group given explicitly needs no default group: a process may hold only the sync's
    own group (a JAX trainer), or a default group of its own that the sync must not use
    (a vLLM worker). Its ranks are those torch.distributed registered for it: global ranks
    for a group from ``new_group``, ``0 .. size-1`` for one registered with an identity map
    (``bridge.engines.group.open_group``). Point-to-point calls translate peers through the
    same registry, so an unregistered group is refused here, before any rank waits.
    """
    if group is not None and group is not dist.group.WORLD:
        try:
            return dist.get_process_group_ranks(group)
        except KeyError:
            raise ValueError(
                f"group {group!r} is not registered with torch.distributed, so its peers cannot be named; "
                "create it with torch.distributed.new_group(...) or bridge.engines.group.open_group(...)."
            ) from None
    if not dist.is_initialized():
        raise SyncError("torch.distributed is not initialised and no group was given; pass group= "
                        "or call bridge.init_group(...) or torch.distributed.init_process_group(...) first.")
    return dist.get_process_group_ranks(dist.group.WORLD)


def _header(role: int, status: int, version: int, digests: bool, fingerprint: bytes) -> torch.Tensor:
    fp = np.frombuffer(fingerprint, dtype=np.int64)
    return torch.tensor([MAGIC, role, status, version, int(digests), *fp.tolist()], dtype=torch.int64)


def _handshake(plan: BridgePlan, rank: int, ranks: list[int], group, role: int, status: int, version: int,
               digests: bool, deadline: float) -> tuple[int, bool]:
    """Returns the agreed version and whether any rank asked for digests (then every rank announces them)."""
    mine = _header(role, status, version, digests, plan.fingerprint)
    out = [torch.empty_like(mine) for _ in ranks]
    wait_for(dist.all_gather(out, mine, group=group, async_op=True), deadline, "the handshake", rank)
    rows = {r: t.tolist() for r, t in zip(ranks, out, strict=True)}
    bad = [r for r, h in rows.items() if h[0] != MAGIC]
    if bad:
        raise PlanMismatchError(f"rank {rank}: ranks {bad} do not speak the bridge protocol (wrong header).")
    failed = [r for r, h in rows.items() if h[2] != 0]
    if failed:
        raise SyncError(f"rank {rank}: ranks {failed} rejected the sync before any data moved; see their errors.")
    prints: dict[bytes, list[int]] = {}
    for r, h in rows.items():
        prints.setdefault(np.array(h[5:], dtype=np.int64).tobytes(), []).append(r)
    if len(prints) > 1:
        groups = "; ".join(f"ranks {rs}: {fp.hex()[:16]}" for fp, rs in prints.items())
        keys = _exchange_keys(plan, rank, ranks, group, deadline)
        firsts = [rs[0] for rs in prints.values()]
        differences = "; ".join(
            f"ranks {_ranks_like(prints, r)} against ranks {_ranks_like(prints, firsts[0])}: "
            f"{describe_difference(keys[r], keys[firsts[0]])}" for r in firsts[1:])
        raise PlanMismatchError(
            f"rank {rank}: the ranks computed different sync plans ({groups}); nothing was sent. {differences}. "
            "Build the Source, ParamMap and bucket_bytes from the same model config, mesh and ranks on every process."
        )
    versions = {h[3] for h in rows.values() if h[1] == SENDER}
    if len(versions) != 1:
        raise PlanMismatchError(f"rank {rank}: the trainer ranks sent different versions {sorted(versions)}.")
    roles = {r: h[1] for r, h in rows.items()}
    for r in plan.source.ranks:
        if roles.get(r) != SENDER:
            raise PlanMismatchError(f"rank {rank}: rank {r} holds trainer shards but did not join as a sender.")
    for r in plan.param_map.ranks:
        if roles.get(r) != RECEIVER:
            raise PlanMismatchError(f"rank {rank}: rank {r} has params but did not join as a receiver.")
    return versions.pop(), any(h[4] for h in rows.values())


def _ranks_like(prints: dict[bytes, list[int]], r: int) -> list[int]:
    """The ranks whose fingerprint equals rank ``r``'s."""
    return next(rs for rs in prints.values() if r in rs)


def _exchange_keys(plan: BridgePlan, rank: int, ranks: list[int], group, deadline: float) -> dict[int, dict]:
    """Every rank's ``plan_key``; every rank calls it, since all see the same mismatch in the handshake."""
    mine = torch.frombuffer(bytearray(encode(plan_key(plan))), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
    wait_for(dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64), group=group, async_op=True),
             deadline, "the plan comparison", rank)
    longest = max(int(n.item()) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:mine.numel()] = mine
    out = [torch.empty(longest, dtype=torch.uint8) for _ in ranks]
    wait_for(dist.all_gather(out, padded, group=group, async_op=True), deadline, "the plan comparison", rank)
    return {r: decode(t[:int(n.item())].numpy().tobytes()) for r, t, n in zip(ranks, out, sizes, strict=True)}


def _progress(enabled: bool | None, total: int, rank: int):
    if enabled is None:
        enabled = total > (1 << 30) and sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"bridge sync rank {rank}", leave=False)


def run_sync(plan: BridgePlan, rank: int, group, *, role: int, version: int, status: int, timeout: float,
             ready_timeout: float, pack: Callable[[Message, torch.Tensor], list[torch.Tensor]],
             recv: Callable[[Message, torch.Tensor], list[torch.Tensor]],
             unpack: Callable[[Message, torch.Tensor], None], progress: bool | None = None,
             device: torch.device | str = "cpu", arena: list | None = None, checksum: bool = False,
             stats: dict[str, float] | None = None, stage_recvs: bool = True) -> int:
    """Runs the protocol for one rank; returns the agreed version. Raises SyncError on any failure.

    Per message, ``pack(m, buf)`` returns the tensors to send, one per segment of
    ``plan.segments(m)`` (packing the others into ``buf``), ``recv(m, buf)`` the tensors
    to receive into, one per segment, and ``unpack(m, buf)`` runs once they arrived.
    Staging buffers live on ``device`` (the parameters' device: CUDA with NCCL, CPU with gloo);
    pass the same ``arena`` (``[[None, None], [None, None]]``) to every sync to reuse them.
    ``stage_recvs=False``: ``recv`` gives memory of its own for every segment, so no receive
    buffer is set aside (``recv`` and ``unpack`` are then given an empty one).
    ``timeout`` bounds everything after the handshake (every bucket and the final ack) as one
    deadline. ``checksum``: this rank asks for digests; when any rank asks (the handshake tells),
    every rank announces a digest of every piece it sends and votes on every bucket, otherwise
    the ranks vote every ``vote_every(plan)`` buckets and in the final ack.

    In a two-stage plan inference ranks also send (stage 2, inside their domain), in buckets shared
    with stage 1: a stage-2 message of bucket ``b`` forwards only what stage-1 buckets up to
    ``b - 2`` delivered (``bridge.plan.bridge_plan.STAGE2_LAG``), which this loop has unpacked when it packs
    bucket ``b``. ``stats`` (cleared, then filled) receives this
    rank's bytes sent and received, those across a domain boundary (``plan.domain_of``), counted
    from the operations posted, and the seconds spent in each step: ``pack`` (including
    ``recv``), ``vote``, ``post``, ``wait``, ``check`` (digests of received pieces), ``unpack``.
    """
    ranks = _group_ranks(group)
    if rank not in ranks:
        raise SyncError(f"rank {rank} is not in the process group (ranks {ranks}).")
    needed = set(plan.source.ranks) | set(plan.param_map.ranks)
    if set(ranks) != needed:
        raise ValueError(
            f"the process group has ranks {ranks} but the plan involves ranks {sorted(needed)}; pass a "
            "group of exactly the trainer and inference ranks (torch.distributed.new_group)."
        )
    with alarm_for(group, rank, ranks):
        return _run(plan, rank, group, ranks, role=role, version=version, status=status, timeout=timeout,
                    ready_timeout=ready_timeout, pack=pack, recv=recv, unpack=unpack, progress=progress,
                    device=device, arena=arena, checksum=checksum, stats=stats, stage_recvs=stage_recvs)


def _run(plan: BridgePlan, rank: int, group, ranks: list[int], *, role: int, version: int, status: int,
         timeout: float, ready_timeout: float, pack: Callable[[Message, torch.Tensor], list[torch.Tensor]],
         recv: Callable[[Message, torch.Tensor], list[torch.Tensor]],
         unpack: Callable[[Message, torch.Tensor], None], progress: bool | None, device: torch.device | str,
         arena: list | None, checksum: bool, stats: dict[str, float] | None, stage_recvs: bool) -> int:
    """``run_sync`` for a checked group of ``ranks``, inside the sync's alarm."""
    start = time.perf_counter()
    tally: dict[str, float] = dict.fromkeys(
        ("sent", "received", "cross_domain_sent", "cross_domain_received", "pack", "vote", "post", "wait", "check",
         "unpack", "handshake", "seconds"), 0.0)
    if stats is not None:
        stats.clear()
        stats.update(tally)
        tally = stats
    version, checksum = _handshake(plan, rank, ranks, group, role, status, version, checksum,
                                   time.monotonic() + ready_timeout)
    every = 1 if checksum else vote_every(plan)
    deadline = time.monotonic() + timeout
    tally["handshake"] = time.perf_counter() - start
    home = plan.domain_of(rank)
    away = {r: plan.domain_of(r) != home for r in ranks}  # peers in another domain
    direct, peer_in_group = _direct_p2p(group, ranks)
    if arena is None:
        arena = new_arena()  # [send|recv][parity] uint8 buffers of up to bucket_bytes

    def buffers(kind: int, b: int, msgs: list[Message]) -> list[torch.Tensor]:
        total = sum(m.nbytes for m in msgs)
        buf = arena[kind][b % 2]
        if buf is None or buf.numel() < total or buf.device != torch.device(device):
            buf = arena[kind][b % 2] = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        out, off = [], 0
        for m in msgs:
            out.append(buf[off:off + m.nbytes])
            off += m.nbytes
        return out

    def prepare(b: int) -> _Bucket:
        sends, recvs = plan.sends(rank, b), plan.recvs(rank, b)
        ops: list[_Op] = []
        packed = []
        for m, buf in zip(sends, buffers(0, b, sends), strict=True):
            xs = pack(m, buf)
            _check_sizes(plan, m, xs)
            packed.append((m, xs))
            ops += [_Op(dist.isend, m.dst, x) for x in xs]
        rbufs = buffers(1, b, recvs) if stage_recvs else [torch.empty(0, dtype=torch.uint8, device=device)] * len(recvs)
        rtensors = []
        for m, buf in zip(recvs, rbufs, strict=True):
            xs = recv(m, buf)
            rtensors.append(xs)
            ops += [_Op(dist.irecv, m.src, x) for x in xs]
        return _Bucket(ops, recvs, rbufs, packed, rtensors)

    def scratch(b: int) -> _Bucket:
        """Bucket ``b`` of a rank that failed earlier, with no vote to announce it before the payload:
        staging bytes of the planned sizes are sent and received (its peers post the same operations
        for the bucket, and a wrong-size message never reaches gloo); nothing is unpacked."""
        ops: list[_Op] = []
        for kind, fn, msgs in ((0, dist.isend, plan.sends(rank, b)), (1, dist.irecv, plan.recvs(rank, b))):
            for m, buf in zip(msgs, buffers(kind, b, msgs), strict=True):
                ops += [_Op(fn, m.dst if kind == 0 else m.src, buf[s.start:s.stop]) for s in plan.segments(m)]
        return _Bucket(ops, [], [], [], [])

    def post(state: _Bucket, b: int) -> list:
        for op in state.ops:
            n = op.buf.numel() * op.buf.element_size()
            way = "sent" if op.fn is dist.isend else "received"
            tally[way] += n
            if away[op.peer]:
                tally["cross_domain_" + way] += n
        try:
            return _post(state.ops, group, direct, peer_in_group) if state.ops else []
        except RuntimeError as e:  # gloo fails at once when a peer's connection is already closed
            raise give_up(SyncError(f"rank {rank}: posting bucket {b + 1}/{plan.num_buckets} failed: {e}")) from e

    def cast(b: int, state: _Bucket | None, mine: Status, sums: Future | None) -> _Ballot:
        """Posts this rank's row of the vote on bucket ``b`` (``nb``: the final ack); ``count`` waits for it."""
        length = _vote.row_length(plan, b, ranks)
        row = _vote.make_row(plan, b, length, mine, state.sends if state is not None else [], checksum,
                             sums.result() if sums is not None else None)
        table = [torch.empty_like(row) for _ in ranks]
        return _Ballot(dist.all_gather(table, row, group=group, async_op=True), table)

    def count(b: int, ballot: _Ballot) -> dict[tuple[int, int], int]:
        """Waits for the vote on bucket ``b``; raises the verdict's SyncError, else returns the digests
        announced."""
        table = ballot.table
        what = f"the vote on bucket {b + 1}/{nb}" if b < nb else "the final ack"
        wait_for(ballot.work, deadline, what, rank)
        if b == nb and time.monotonic() > deadline - min(0.5, 0.05 * timeout):
            # The others give up at the deadline: committing now could leave receivers on different versions.
            raise give_up(SyncError(
                f"rank {rank}: the final ack completed at the sync's deadline, when other ranks may already "
                "have given up; nothing was committed. The process group is no longer usable: call "
                "bridge.rebuild_group(...) on every rank, then retry."))
        failure = _vote.verdict(plan, b, ranks, table)
        if failure is not None:
            raise SyncError(_vote.describe(plan, rank, failure))
        return _vote.expected_digests(plan, b, rank, ranks, table) if b < nb else {}

    def check(state: _Bucket, b: int, expected: dict[tuple[int, int], int]) -> Status:
        for m, xs in zip(state.recvs, state.rtensors, strict=True):
            like = {i: expected.get((m.src, i), _vote.UNCHECKED) for i, _ in m.pieces}
            got = _vote.digests(plan, m, xs, like) if any(like.values()) else []
            for (i, _), d in zip(m.pieces, got, strict=False):
                want = expected.get((m.src, i), _vote.UNCHECKED)
                if want != _vote.UNCHECKED and d != _vote.UNCHECKED and d != want:
                    return Status(Code.CHECKSUM, b, m.src, i, "checksum mismatch")
        return Status()

    def failed(b: int, e: Exception) -> Status:
        log.exception("rank %d failed in bucket %d", rank, b + 1)
        return Status(Code.ERROR, b, -1, -1, f"{type(e).__name__}: {e}")

    def unpack_all(state: _Bucket | None, b: int, mine: Status) -> Status:
        if state is None or mine.code != Code.OK:
            return mine
        try:
            for m, buf in zip(state.recvs, state.rbufs, strict=True):
                unpack(m, buf)
        except Exception as e:  # announced in the next vote
            return failed(b, e)
        if bar is not None:
            bar.update(sum(op.buf.numel() * op.buf.element_size() for op in state.ops))
        return mine

    nb = plan.num_buckets

    def votes_at(c: int) -> bool:
        return c == nb or every == 1 or (c > 0 and c % every == 0)

    # A rank that only receives, into memory of its own (``stage_recvs=False``: nothing is reused or
    # unpacked between buckets), posts the receives of every bucket up to the next vote at once, so
    # senders never wait for it between buckets (a vote still comes before the payloads it covers).
    ahead = not stage_recvs and all(m.src != rank for m in plan.messages)
    posted: dict[int, tuple[_Bucket, list]] = {}  # buckets posted ahead, with their works
    reach = 0  # the first bucket not posted ahead
    bar = _progress(progress, sum(m.nbytes for m in plan.messages if rank in (m.src, m.dst)), rank)
    mine: Status = Status()
    cur: _Bucket | None = None
    works: list = []
    expected: dict[tuple[int, int], int] = {}
    clock = time.perf_counter

    def timed(step: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args)
        finally:
            tally[step] += clock() - t0

    def wait_all(works: list, state: _Bucket | None, b: int) -> None:
        pairs = list(zip(works, state.ops if state is not None else list[_Op](), strict=True))

        def job() -> None:
            for w, op in pairs:
                wait_once(w, deadline, f"bucket {b}/{nb} with peer rank {op.peer}", rank)

        if pairs:
            await_job(job, f"bucket {b}/{nb}", rank)

    def finish(state: _Bucket | None, b: int, mine: Status, expected: dict) -> Status:
        """Checks the digests of bucket ``b`` (``state``, arrived), then unpacks it."""
        if state is not None and mine.code == Code.OK:
            mine = timed("check", check, state, b, expected)
        return timed("unpack", unpack_all, state, b, mine)

    # The digests of what this rank sends in a bucket are computed in a thread (xxhash releases the
    # GIL) while it waits for the previous bucket; the vote carries them.
    hasher = ThreadPoolExecutor(1, thread_name_prefix="bridge-digests") if checksum else None
    try:
        # Bucket b+1 is packed while bucket b is on the wire, and bucket b is checked and unpacked
        # while bucket b+1 is; a failure there is announced in the vote after. Each bucket's payload
        # is posted only after every rank voted for it. So bucket b is packed once buckets up to b-2
        # are unpacked: what a stage-2 message of bucket b forwards arrived in stage-1 buckets up to
        # b-2 (``bridge.plan.bridge_plan.STAGE2_LAG``), and nothing waits for stage 1 to finish.
        for b in range(nb + 1):
            nxt, sums, nxt_works = None, None, None
            voting = votes_at(b)
            if b in posted:
                nxt, nxt_works = posted.pop(b)
            elif b < nb and mine.code == Code.OK:
                try:
                    nxt = timed("pack", prepare, b)
                except _WrongCount as e:  # announced in the next vote as a wrong-size message
                    mine = e.status
                except Exception as e:  # announced in the next vote
                    mine = failed(b, e)
            if b < nb and nxt is None and not voting:  # a failure, announced in the next vote
                nxt = scratch(b)
            if nxt is not None and hasher is not None and nxt.sends:
                sums = hasher.submit(_vote.send_digests, plan, nxt.sends, True)
            # The vote on bucket b travels while bucket b-1 is on the wire. Not the final ack, which
            # announces the check and unpacking of the last bucket, nor a vote that carries digests
            # (computed in the hasher thread meanwhile).
            early = timed("vote", cast, b, nxt, mine, sums) if voting and b < nb and sums is None else None
            timed("wait", wait_all, works, cur, b)
            if b == nb:  # the last bucket is checked and unpacked before the final ack, which announces a failure
                mine = finish(cur, b - 1, mine, expected)
            new_expected = {}
            if voting:
                ballot = early if early is not None else timed("vote", cast, b, nxt, mine, sums)
                new_expected = timed("vote", count, b, ballot)
            if nxt_works is None:
                nxt_works = timed("post", post, nxt, b) if nxt is not None else []
            works = nxt_works
            reach = max(reach, b + 1)
            while ahead and nxt is not None and mine.code == Code.OK and reach < nb and not votes_at(reach):
                try:
                    state = timed("pack", prepare, reach)
                except Exception:  # noqa: BLE001 (prepared again in its own turn, which reports it)
                    break
                posted[reach] = (state, timed("post", post, state, reach))
                reach += 1
            if b < nb:
                mine = finish(cur, b - 1, mine, expected)
            cur, expected = nxt, new_expected
    finally:
        posted.clear()  # no works of this sync outlive it (they would keep a failed group's connections open)
        if hasher is not None:
            hasher.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
    elapsed = tally["seconds"] = time.perf_counter() - start
    nbytes = sum(m.nbytes for m in plan.messages if rank in (m.src, m.dst))
    log.info("rank %d synced version %d: %s bytes in %d buckets, %.3f s (%.2f GB/s, pid %d)",
             rank, version, f"{nbytes:,}", plan.num_buckets, elapsed, nbytes / max(elapsed, 1e-9) / 1e9,
             os.getpid())
    return version


def _direct_p2p(group, ranks: list[int]) -> tuple[Any, dict[int, int]]:
    """The process group to post point-to-point operations to one by one, and each peer's rank in it.

    With gloo, ``batch_isend_irecv`` posts each operation through ``isend`` / ``irecv``, whose
    Python checks cost more than the call itself (a sync posts hundreds of operations per rank);
    the sync's tensors and peers are checked already, so ``_post`` calls the group's ``send`` /
    ``recv`` as they do. A backend that batches (NCCL) keeps ``batch_isend_irecv``: returns
    ``(None, {})`` then.
    """
    pg = group if group is not None else dist.group.WORLD
    # ``name()``: the group's default backend. ``dist.get_backend`` would refuse a group built outside
    # torch.distributed's registry (``bridge.engines.group.open_group``).
    if pg is None or pg.name() != "gloo":
        return None, {}
    return pg, {r: dist.get_group_rank(pg, r) for r in ranks}


def _post(ops: list[_Op], group, direct, peer_in_group: dict[int, int]) -> list:
    """Posts one bucket's operations (one call per bucket: tests inject faults here); returns their works."""
    if direct is not None:
        return [(direct.send if op.fn is dist.isend else direct.recv)([op.buf], peer_in_group[op.peer], 0)
                for op in ops]
    return dist.batch_isend_irecv([dist.P2POp(op.fn, op.buf, op.peer, group) for op in ops])


class _WrongCount(Exception):
    """``pack`` gave tensors other than the plan's segments of a message (count or bytes); ``status`` says where."""

    def __init__(self, status: Status) -> None:
        super().__init__(status.text)
        self.status = status


def _check_sizes(plan: BridgePlan, m: Message, xs: list[torch.Tensor]) -> None:
    """Refuses a message whose tensors are not one per planned segment of its planned byte count: a
    surplus one would be posted with no receive to match it (every rank would then wait for the
    deadline), a missing one never sent, one of another size would abort gloo."""
    members = plan.segment_pieces(m)
    if len(xs) != len(members):
        # The piece named: that of the first segment left out, or of the last one planned for a surplus.
        move = members[min(len(xs), len(members) - 1)][0].move if members else -1
        raise _WrongCount(Status(Code.SIZE, m.bucket, m.dst, move,
                                 f"{len(xs)} tensors given for the {len(members)} segments of the plan"))
    for x, seg, pieces in zip(xs, plan.segments(m), members, strict=True):
        n = x.numel() * x.element_size()
        if n != seg.stop - seg.start:
            raise _WrongCount(Status(Code.SIZE, m.bucket, m.dst, pieces[0].move,
                                     f"{n} bytes given for a segment of {seg.stop - seg.start}"))


def vote_every(plan: BridgePlan) -> int:
    """Without digests, the ranks vote before every this many buckets' payload (and in the final ack).

    A failure between votes is announced in the next one: until then the failed rank sends and
    receives staging bytes of the planned sizes, and nothing is committed.

    Example:
      >>> from bridge.wire.session import VOTE_BYTES
      >>> VOTE_BYTES >> 20  # MiB per rank between votes at most
      1024
    """
    return max(1, VOTE_BYTES // plan.bucket_bytes)


def _nothing(m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
    return []


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
    role = SENDER if rank in plan.source.ranks else RECEIVER
    try:
        run_sync(plan, rank, group, role=role, version=0 if role == SENDER else -1, status=1, timeout=ready_timeout,
                 ready_timeout=ready_timeout, pack=_nothing, recv=_nothing, unpack=lambda m, b: None)
    except SyncError as e:
        log.info("rank %d rejected a sync: %s", rank, e)
