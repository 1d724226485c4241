"""Votes: what every rank announces before a bucket's payload moves (torch, never jax).

Before the payload of a voted bucket ``b`` is posted (every ``vote_every(plan)`` buckets, then
the final ack), every rank contributes one fixed-length int64 row to an ``all_gather`` (the
vote): its status (ok, or what failed on it and where, in this bucket or since the last vote),
and, for every segment it sends in ``b``, the byte count it is about to send. Every rank then
reaches the same verdict from the same table:

* a rank reported a failure (an exception while packing or unpacking, a message of the
  wrong size found by its sender, a message of the wrong length refused by its receiver's
  transport, corrupt data found by a receiver's digests): every rank raises ``SyncError``
  naming it, the bucket and, for a size, length or checksum failure, the tensor;
* a sender's byte count differs from the plan's: every rank raises ``SyncError``
  naming the sender, the bucket and the tensor, and no payload of the bucket is
  posted, so a wrong-size message never reaches the transport;
* otherwise every rank posts the bucket.

Digests (checksums on) do not travel in votes: each message's sender sends the digests of its
pieces right after the bucket's messages to that receiver, as one more operation per message, and
the receiver checks them once the message arrived (``check_received``), reporting a mismatch in
the next vote (the last vote is the final ack). So checksums change neither the votes nor
their schedule.

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
           "announced", "check_received", "describe", "vote_every", "UNCHECKED", "VOTE_BYTES"]

TEXT_WORDS = 24  # 192 bytes of an error message travel with a failure status
HEAD = 6 + TEXT_WORDS  # code, bucket, peer, move, checksummed, text length, text
UNCHECKED = 0  # a digest of 0 means "not computed" (checksums off)
VOTE_BYTES = 1 << 30  # a vote before at most this many bytes of buckets per rank


class Code(enum.IntEnum):
    """What a rank reports in a vote."""

    OK = 0
    ERROR = 2  # an exception on this rank (packing, unpacking, staging)
    CHECKSUM = 3  # a received piece differs from what its sender announced
    SIZE = 4  # a sender's byte count differs from the plan (found by every rank from the table)
    LENGTH = 5  # a receiver's transport refused a message whose length differs from the plan


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
def _segments(plan: BridgePlan, bucket: int, rank: int) -> int:
    """How many segments ``rank`` sends in ``bucket``."""
    return sum(len(plan.segments(m)) for m in plan.sends(rank, bucket))


def row_length(plan: BridgePlan, bucket: int, ranks: Sequence[int]) -> int:
    """The vote's row length for ``bucket``: the head plus the longest sender's byte counts."""
    return HEAD + max((_segments(plan, bucket, r) for r in ranks), default=0)


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


def send_digests(plan: BridgePlan, sends: Sequence[tuple[Message, Sequence[torch.Tensor]]]) -> list[list[int]]:
    """Per message of ``sends``, the digest of every piece; ``UNCHECKED`` for a message whose segments are
    not as planned (its sender reports that in the vote)."""
    sums: list[list[int]] = []
    for m, tensors in sends:
        segs = plan.segments(m)
        if len(tensors) == len(segs) and all(
                t.numel() * t.element_size() == s.stop - s.start for t, s in zip(tensors, segs, strict=True)):
            sums.append(digests(plan, m, tensors))
        else:
            sums.append([UNCHECKED] * len(m.pieces))
    return sums


def make_row(plan: BridgePlan, length: int, status: Status, sends: Sequence[tuple[Message, Sequence[torch.Tensor]]],
             checksum: bool) -> torch.Tensor:
    """This rank's row: status (and whether it sends digests), then per segment sent the byte count."""
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
    row[HEAD:HEAD + len(counts)] = counts
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


def announced(recvs: Sequence[Message], sums: Sequence[torch.Tensor]) -> dict[tuple[int, int], int]:
    """``{(sender rank, move): digest}`` of every piece of ``recvs``, from the digests that arrived after
    each message (``sums``, one int64 tensor per message, a digest per piece in the message's order)."""
    out = {}
    for m, got in zip(recvs, sums, strict=True):
        for (i, _), d in zip(m.pieces, got.tolist(), strict=True):
            out[(m.src, i)] = int(d)
    return out


def check_received(plan: BridgePlan, recvs: Sequence[Message], tensors: Sequence[Sequence[torch.Tensor]], bucket: int,
                   expected: dict[tuple[int, int], int]) -> Status:
    """This rank's status once ``recvs`` (received into ``tensors``, one list per message) arrived: a
    checksum failure naming the first piece whose digest differs from the one announced, else ok."""
    for m, xs in zip(recvs, tensors, strict=True):
        like = {i: expected.get((m.src, i), UNCHECKED) for i, _ in m.pieces}
        got = digests(plan, m, xs, like) if any(like.values()) else []
        for (i, _), d in zip(m.pieces, got, strict=False):
            want = like[i]
            if want != UNCHECKED and d != want:
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
    if s.code == Code.LENGTH:
        return (f"rank {rank}: rank {who} refused a message of the wrong length from sender rank {s.peer} in "
                f"{where}{piece}: {s.text}; none of its bytes were kept and nothing was committed. The group is "
                "still usable: retry the sync.")
    if s.code == Code.SIZE:
        return (f"rank {rank}: sender rank {who} would send a message of the wrong size to rank {s.peer} in "
                f"{where}{piece}: {s.text}; that message was not sent and nothing was committed. Run one bridge "
                "version and one plan on every rank.")
    return f"rank {rank}: rank {who} failed in {where}: {s.text}; nothing was committed."


def vote_every(plan: BridgePlan) -> int:
    """The ranks vote before every this many buckets' payload (and in the final ack), checksums on or off.

    A failure between votes is announced in the next one: until then the failed rank sends and
    receives staging bytes of the planned sizes, and nothing is committed.

    Example:
      >>> from bridge.wire.vote import VOTE_BYTES
      >>> VOTE_BYTES >> 20  # MiB per rank between votes at most
      1024
    """
    return max(1, VOTE_BYTES // plan.bucket_bytes)
