"""Votes: what every rank announces before a bucket's payload moves (torch, never jax).

Before the payload of a voted bucket ``b`` is posted (every bucket when digests are on,
else every ``vote_every(plan)`` buckets, then the final ack), every rank
contributes one fixed-length int64 row to an ``all_gather`` (the vote): its status (ok,
or what failed on it and where, in this bucket or since the last vote), and, for every
segment it sends in ``b``, the byte count it is about to send, then an xxh3-64 digest of
every piece. Every rank then reaches the same verdict from the same table:

* a rank reported a failure (an exception while packing or unpacking, a message of the
  wrong size found by its sender, corrupt data in an earlier bucket): every rank raises
  ``SyncError`` naming it, the bucket and, for a size or checksum failure, the tensor;
* a sender's byte count differs from the plan's: every rank raises ``SyncError``
  naming the sender, the bucket and the tensor, and no payload of the bucket is
  posted, so a wrong-size message never reaches gloo (which would abort the process);
* otherwise every rank posts the bucket; receivers check each piece's digest once it
  arrived and report a mismatch in the next vote (the last vote is the final ack).

Row lengths come from the plan, which the handshake proved identical on every rank.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from bridge.plan.bridge_plan import BridgePlan, Message
from bridge.wire.digest import digest

__all__ = ["Code", "Status", "Failure", "row_length", "make_row", "send_digests", "verdict", "digests",
           "expected_digests", "check_received", "describe", "vote_every", "UNCHECKED", "VOTE_BYTES"]

TEXT_WORDS = 24  # 192 bytes of an error message travel with a failure status
HEAD = 6 + TEXT_WORDS  # code, bucket, peer, move, checksummed, text length, text
UNCHECKED = 0  # a digest of 0 means "not computed" (checksums off)
VOTE_BYTES = 1 << 30  # without digests, a vote before at most this many bytes of buckets per rank


class Code(enum.IntEnum):
    """What a rank reports in a vote."""

    OK = 0
    ERROR = 2  # an exception on this rank (packing, unpacking, staging)
    CHECKSUM = 3  # a received piece differs from what its sender announced
    SIZE = 4  # a sender's byte count differs from the plan (found by every rank from the table)


class Status(NamedTuple):
    """A rank's state as it votes: ``code`` at ``bucket`` with ``peer`` on the piece of plan move ``move``."""

    code: Code = Code.OK
    bucket: int = -1
    peer: int = -1
    move: int = -1
    text: str = ""


class Failure(NamedTuple):
    """The verdict of a vote when it is not ok: which rank reported (or caused) what."""

    rank: int
    status: Status


@functools.lru_cache(maxsize=64)
def _layout(plan: BridgePlan, bucket: int, rank: int) -> tuple[int, int]:
    """(segments, pieces) that ``rank`` sends in ``bucket``."""
    msgs = plan.sends(rank, bucket)
    return sum(len(plan.segments(m)) for m in msgs), sum(len(m.pieces) for m in msgs)


def row_length(plan: BridgePlan, bucket: int, ranks: Sequence[int]) -> int:
    """The vote's row length for ``bucket``: the head plus the longest sender's counts and digests."""
    return HEAD + max((sum(_layout(plan, bucket, r)) for r in ranks), default=0)


def digests(plan: BridgePlan, m: Message, tensors: Sequence[torch.Tensor],
            like: dict[int, int] | None = None) -> list[int]:
    """The digest of every piece of ``m`` in ``tensors``, one tensor per segment (bytes ``[start, stop)``);
    ``like``: ``{move: digest announced}``, so each piece is digested the way its sender did it."""
    out = []
    for seg, t, members in zip(plan.segments(m), tensors, plan.segment_pieces(m), strict=True):
        flat = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)
        for i, off in members:
            n = plan.moves[i].nbytes
            out.append(digest(flat[off - seg.start:off - seg.start + n], (like or {}).get(i)))
    return out


def send_digests(plan: BridgePlan, sends: Sequence[tuple[Message, Sequence[torch.Tensor]]],
                 checksum: bool) -> list[int]:
    """The digest of every piece in ``sends``; ``UNCHECKED`` for a message whose segments are not as planned."""
    sums: list[int] = []
    for m, tensors in sends:
        segs = plan.segments(m)
        if checksum and len(tensors) == len(segs) and all(
                t.numel() * t.element_size() == s.stop - s.start for t, s in zip(tensors, segs, strict=True)):
            sums += digests(plan, m, tensors)
        else:
            sums += [UNCHECKED] * len(m.pieces)
    return sums


def make_row(plan: BridgePlan, bucket: int, length: int, status: Status,
             sends: Sequence[tuple[Message, Sequence[torch.Tensor]]], checksum: bool,
             sums: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's row: status, then per segment sent the byte count, then per piece the digest.

    ``sums``: ``send_digests(plan, sends, checksum)`` if already computed (in another thread).
    """
    row = np.zeros(length, dtype=np.int64)
    text = status.text.encode()[:TEXT_WORDS * 8]
    row[:6] = (int(status.code), status.bucket, status.peer, status.move, int(checksum), len(text))
    row[6:HEAD].view(np.uint8)[:len(text)] = np.frombuffer(text, dtype=np.uint8)
    counts: list[int] = []
    if status.code == Code.OK:
        for m, tensors in sends:
            segs = plan.segments(m)
            counts += [t.numel() * t.element_size() for t in tensors[:len(segs)]]
            counts += [-1] * (len(segs) - len(tensors))  # a segment not sent at all
        sums = send_digests(plan, sends, checksum) if sums is None else sums
    else:
        sums = []
    row[HEAD:HEAD + len(counts)] = counts
    row[HEAD + len(counts):HEAD + len(counts) + len(sums)] = sums
    return torch.from_numpy(row)


def _status(row: np.ndarray) -> Status:
    n = int(row[5])
    text = row[6:HEAD].view(np.uint8)[:n].tobytes().decode(errors="replace")
    return Status(Code(int(row[0])), int(row[1]), int(row[2]), int(row[3]), text)


def verdict(plan: BridgePlan, bucket: int, ranks: Sequence[int], table: Sequence[torch.Tensor]) -> Failure | None:
    """The same answer on every rank: the first reported failure, else the first size mismatch, else ``None``."""
    rows = {r: t.numpy() for r, t in zip(ranks, table, strict=True)}
    for r, row in rows.items():
        if row[0] != Code.OK:
            return Failure(r, _status(row))
    if bucket >= plan.num_buckets:
        return None
    for r, row in rows.items():
        k = HEAD
        for m in plan.sends(r, bucket):
            for seg, members in zip(plan.segments(m), plan.segment_pieces(m), strict=True):
                if row[k] != seg.stop - seg.start:
                    text = f"{int(row[k])} bytes announced for a segment of {seg.stop - seg.start}"
                    return Failure(r, Status(Code.SIZE, bucket, m.dst, members[0].move, text))
                k += 1
    return None


def expected_digests(plan: BridgePlan, bucket: int, rank: int, ranks: Sequence[int],
                     table: Sequence[torch.Tensor]) -> dict[tuple[int, int], int]:
    """``{(sender rank, move): digest}`` of every piece ``rank`` receives in ``bucket``, as announced."""
    rows = dict(zip(ranks, table, strict=True))
    out = {}
    for src in {m.src for m in plan.recvs(rank, bucket)}:
        row = rows[src].numpy()
        nseg, _ = _layout(plan, bucket, src)
        k = HEAD + nseg
        for m in plan.sends(src, bucket):
            for i, _ in m.pieces:
                if m.dst == rank and row[4]:
                    out[(src, i)] = int(row[k])
                k += 1
    return out


def check_received(plan: BridgePlan, recvs: Sequence[Message], tensors: Sequence[Sequence[torch.Tensor]], bucket: int,
                   expected: dict[tuple[int, int], int]) -> Status:
    """This rank's status once ``recvs`` (received into ``tensors``, one list per message) arrived: a
    checksum failure naming the first piece whose digest differs from the one announced, else ok."""
    for m, xs in zip(recvs, tensors, strict=True):
        like = {i: expected.get((m.src, i), UNCHECKED) for i, _ in m.pieces}
        got = digests(plan, m, xs, like) if any(like.values()) else []
        for (i, _), d in zip(m.pieces, got, strict=False):
            want = expected.get((m.src, i), UNCHECKED)
            if want != UNCHECKED and d != UNCHECKED and d != want:
                return Status(Code.CHECKSUM, bucket, m.src, i, "checksum mismatch")
    return Status()


def describe(plan: BridgePlan, rank: int, failure: Failure) -> str:
    """The error every rank raises for ``failure`` (``rank`` is the rank raising it)."""
    who, s = failure.rank, failure.status
    where = f"bucket {s.bucket + 1}/{plan.num_buckets}" if 0 <= s.bucket < plan.num_buckets else "the final ack"
    piece = ""
    if 0 <= s.move < len(plan.moves):
        t = plan.moves[s.move]
        piece = f" (the piece of leaf {t.leaf!r} {t.box} for param {t.param!r} on rank {t.dst})"
    if s.code == Code.CHECKSUM:
        return (f"rank {rank}: rank {who} received corrupt data from sender rank {s.peer} in {where}{piece}: its "
                "checksum differs from the one the sender announced; nothing was committed. The group is still "
                "usable: retry the sync.")
    if s.code == Code.SIZE:
        return (f"rank {rank}: sender rank {who} would send a message of the wrong size to rank {s.peer} in "
                f"{where}{piece}: {s.text}; that message was not sent and nothing was committed. Run one bridge "
                "version and one plan on every rank.")
    return f"rank {rank}: rank {who} failed in {where}: {s.text}; nothing was committed."


def vote_every(plan: BridgePlan) -> int:
    """Without digests, the ranks vote before every this many buckets' payload (and in the final ack).

    A failure between votes is announced in the next one: until then the failed rank sends and
    receives staging bytes of the planned sizes, and nothing is committed.

    Example:
      >>> from bridge.wire.vote import VOTE_BYTES
      >>> VOTE_BYTES >> 20  # MiB per rank between votes at most
      1024
    """
    return max(1, VOTE_BYTES // plan.bucket_bytes)
