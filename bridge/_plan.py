"""The sync plan: mapping regions reduced to Layout pairs, planned by jreshard, bucketed.

Every region group (one region index of one torch parameter across the ranks
that hold it) becomes a destination Layout over torch ranks in the leaf's own
coordinates: a regular Layout when the ranks' boxes are a JAX-style split of
the whole leaf (plain tensor parallelism), otherwise one Layout pair per cell
of the grid cut by the source shards and the destination boxes (padded
vocabularies, sub-boxes). ``jreshard.plan_layouts`` plans all of them at once,
so replicated trainer shards are balanced across the whole model. Nothing here
touches torch or jax: both sides build the same ``BridgePlan`` and compare its
``fingerprint``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping as MappingABC
from typing import Any

import numpy as np

from jreshard import Layout, Mesh, plan_layouts

from bridge._mapping import Bounds, Mapping, Target
from bridge._source import Source, split_source_id

__all__ = ["Transfer", "Message", "BridgePlan", "FORMAT_VERSION", "ALIGN"]

FORMAT_VERSION = 2
ALIGN = 64  # bytes; every piece in a message starts aligned, so any dtype view is valid


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """Send ``leaf[box]`` from trainer device ``src`` (a source id) to region ``region`` of ``target`` on ``dst``."""

    src: int
    dst: int
    source: str
    box: Bounds
    target: str
    region: int
    nbytes: int

    @property
    def src_rank(self) -> int:
        return split_source_id(self.src)[0]


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """One contiguous buffer from rank ``src`` to rank ``dst`` in ``bucket``: (transfer index, byte offset) items."""

    bucket: int
    src: int
    dst: int
    nbytes: int
    items: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Job:
    name: str
    source: str
    origin: tuple[int, ...]
    regions: dict  # dst rank -> (target name, region index)
    src: Layout
    dst: Layout


def _regular_dst(shape: tuple[int, ...], entries: list[tuple[int, Bounds]], dtype: str) -> Layout | None:
    """A Layout whose shards are exactly ``entries`` (rank, box), if the boxes are a JAX-style split."""
    index = []
    for d, n in enumerate(shape):
        iv = sorted({b[d] for _, b in entries})
        c = -(-n // len(iv))
        if iv != [(min(i * c, n), min((i + 1) * c, n)) for i in range(len(iv))]:
            return None
        index.append({v: i for i, v in enumerate(iv)})
    cells: dict[tuple, list[int]] = defaultdict(list)
    for rank, b in entries:
        cells[tuple(index[d][b[d]] for d in range(len(shape)))].append(rank)
    ks = [len(ix) for ix in index]
    reps = {len(v) for v in cells.values()}
    if len(cells) != math.prod(ks) or len(reps) != 1:
        return None
    devices = np.zeros(ks + [reps.pop()], dtype=np.int64)
    for cell, ranks in cells.items():
        devices[cell] = sorted(ranks)
    axes = tuple(f"d{d}" for d in range(len(shape))) + ("replica",)
    spec = tuple(f"d{d}" if ks[d] > 1 else None for d in range(len(shape)))
    return Layout(shape, Mesh(devices, axes), spec, dtype)


def _cells(src: Layout, entries: list[tuple[int, Bounds]]) -> Iterator[tuple[Bounds, list[int]]]:
    """The grid cells cut by source shards and destination boxes, with the ranks that want each."""
    cuts = []
    for d in range(src.rank):
        lo = min(b[d][0] for _, b in entries)
        hi = max(b[d][1] for _, b in entries)
        pts = {lo, hi}
        for box in src.shards().values():
            pts.update(x for x in (box[d].start, box[d].stop) if lo < x < hi)
        for _, b in entries:
            pts.update(b[d])
        pts_s = sorted(pts)
        cuts.append(list(zip(pts_s[:-1], pts_s[1:], strict=True)) or [(lo, hi)])
    for cell in itertools.product(*cuts):
        if any(a >= b for a, b in cell) and src.rank:
            continue
        want = [r for r, b in entries if all(bl <= a and c <= bh for (a, c), (bl, bh) in zip(cell, b, strict=True))]
        if want:
            yield tuple(cell), want


def _split_box(box: Bounds, itemsize: int, cap: int) -> Iterator[Bounds]:
    """Cuts ``box`` into pieces of at most ``cap`` bytes (a single element may exceed it)."""
    vol = math.prod(hi - lo for lo, hi in box)
    if vol * itemsize <= cap:
        yield box
        return
    for d, (lo, hi) in enumerate(box):
        if hi - lo > 1:
            step = max(1, cap // (vol // (hi - lo) * itemsize))
            for a in range(lo, hi, step):
                yield from _split_box(box[:d] + ((a, min(a + step, hi)),) + box[d + 1:], itemsize, cap)
            return
    yield box


class BridgePlan:
    """Who sends which box to whom, in which bucket and at which byte offset.

    Args:
      source: the trainer leaves and their Layouts over source ids.
      mapping: every torch rank's targets.
      bucket_bytes: the most bytes one rank sends, or receives, per bucket (its staging memory).
      balance: balance replicated trainer shards across senders (see ``jreshard.plan``).

    Example:
      >>> from bridge import Source, Rule, tp_mapping, trainer_mesh
      >>> from jreshard import Layout
      >>> src = Source({"w": Layout((4, 6), trainer_mesh((2,), "fsdp", [0], 2), ("fsdp",), "float32")})
      >>> m = tp_mapping(src, [Rule("w", "linear.weight", transpose=True, shard=0)], tp_ranks=[1, 2])
      >>> p = BridgePlan(src, m)
      >>> [(t.src, t.dst, t.box) for t in p.transfers]  # doctest: +NORMALIZE_WHITESPACE
      [(1000000, 1, ((0, 2), (0, 3))), (1000001, 1, ((2, 4), (0, 3))),
       (1000000, 2, ((0, 2), (3, 6))), (1000001, 2, ((2, 4), (3, 6)))]
      >>> p.network_bytes, p.num_buckets, len(p.fingerprint)
      (96, 1, 32)
    """

    def __init__(self, source: Source, mapping: Mapping, *, bucket_bytes: int = 16 << 20, balance: bool = True) -> None:
        if not isinstance(source, Source):
            raise TypeError(f"source must be a bridge.Source, got {type(source).__name__}.")
        if not isinstance(mapping, Mapping):
            raise TypeError(f"mapping must be a bridge.Mapping, got {type(mapping).__name__}.")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be an int >= {ALIGN}, got {bucket_bytes!r}.")
        mapping.check(source)
        clash = set(mapping.ranks) & set(source.ranks)
        if clash:
            raise ValueError(
                f"ranks {sorted(clash)} are both trainer and inference ranks; a process either sends "
                "(JAX trainer) or receives (torch inference)."
            )
        self.source, self.mapping, self.bucket_bytes, self.balance = source, mapping, bucket_bytes, balance
        self._targets = {(t.name, t.rank): t for t in mapping.targets}
        self.jobs = self._jobs()
        self.plan = plan_layouts([(j.name, j.src, j.dst) for j in self.jobs], balance=balance)
        self.transfers = self._transfers()
        self.messages, self.num_buckets = self._bucket()
        self._segments: dict[Message, tuple] = {}
        self.fingerprint = self._fingerprint()
        self._index: tuple[dict, dict] = (defaultdict(list), defaultdict(list))
        for m in self.messages:
            self._index[0][(m.src, m.bucket)].append(m)
            self._index[1][(m.dst, m.bucket)].append(m)
        self._index = (dict(self._index[0]), dict(self._index[1]))

    # ---------------------------------------------------------------- reduction
    def _jobs(self) -> list[_Job]:
        groups: dict[tuple, list[tuple[int, Any]]] = defaultdict(list)
        for t in self.mapping.targets:
            for k, r in enumerate(t.regions):
                groups[(t.name, k, r.source, r.transpose, t.dtype)].append((t.rank, r))
        jobs = []
        for j, ((name, k, path, _, dtype), regs) in enumerate(groups.items()):
            src = self.source.layout(path)
            entries = [(rank, r.box) for rank, r in regs]
            where = {rank: (name, k) for rank, _ in regs}
            label = f"{j}:{name}#{k}"
            dst = _regular_dst(src.shape, entries, dtype)
            if dst is not None:
                jobs.append(_Job(label, path, (0,) * src.rank, where, src, dst))
                continue
            for cell, want in _cells(src, entries):
                shape = tuple(b - a for a, b in cell)
                sl = tuple(slice(a, b) for a, b in cell)
                cs = Layout(shape, Mesh(list(src.holders(sl)), "r"), (), src.dtype)
                cd = Layout(shape, Mesh(sorted(want), "r"), (), dtype)
                lo = tuple(a for a, _ in cell)
                jobs.append(_Job(f"{label}@{list(lo)}", path, lo, {r: where[r] for r in want}, cs, cd))
        return jobs

    def _transfers(self) -> tuple[Transfer, ...]:
        out = []
        for job in self.jobs:
            tp = self.plan[job.name]
            origin = np.array(job.origin, dtype=np.int64)
            for s, d, lo, hi in zip(tp.move_src, tp.move_dst, tp.move_lo, tp.move_hi, strict=True):
                name, k = job.regions[int(d)]
                box = tuple((int(a), int(b)) for a, b in zip(lo + origin, hi + origin, strict=True))
                for piece in _split_box(box, tp.itemsize, self.bucket_bytes):
                    n = math.prod(b - a for a, b in piece) * tp.itemsize
                    if n:
                        out.append(Transfer(int(s), int(d), job.source, piece, name, k, n))
        return tuple(out)

    def _bucket(self) -> tuple[tuple[Message, ...], int]:
        bucket, send, recv = 0, defaultdict(int), defaultdict(int)
        items: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for i, t in enumerate(self.transfers):
            s, d = t.src_rank, t.dst
            if (send[s] + t.nbytes > self.bucket_bytes or recv[d] + t.nbytes > self.bucket_bytes) and (send or recv):
                bucket, send, recv = bucket + 1, defaultdict(int), defaultdict(int)
            send[s] += _aligned(t.nbytes)
            recv[d] += _aligned(t.nbytes)
            items[(bucket, s, d)].append(i)
        messages = []
        for (b, s, d), idx in sorted(items.items()):
            off, pieces = 0, []
            for i in idx:
                pieces.append((i, off))
                off += _aligned(self.transfers[i].nbytes)
            messages.append(Message(b, s, d, off, tuple(pieces)))
        return tuple(messages), (bucket + 1 if self.transfers else 0)

    def _fingerprint(self) -> bytes:
        body = repr((FORMAT_VERSION, self.source.key(), self.mapping.key(), self.bucket_bytes, self.balance,
                     tuple(dataclasses.astuple(t) for t in self.transfers)))
        return hashlib.sha256(body.encode()).digest()

    # ---------------------------------------------------------------- queries
    def target(self, name: str, rank: int) -> Target:
        return self._targets[(name, rank)]

    def sends(self, rank: int, bucket: int) -> list[Message]:
        """The messages ``rank`` sends in ``bucket``, in plan order."""
        return self._index[0].get((rank, bucket), [])

    def recvs(self, rank: int, bucket: int) -> list[Message]:
        """The messages ``rank`` receives in ``bucket``, in plan order."""
        return self._index[1].get((rank, bucket), [])

    def segments(self, m: Message) -> tuple[tuple[int, int, int, bool, bool], ...]:
        """How message ``m`` travels: one point-to-point operation per segment, in order.

        Each segment is ``(start, stop, item, src_direct, dst_direct)``: bytes ``[start, stop)``
        of the message buffer. A piece that is contiguous in the sender's (cast, transposed)
        shard (``src_direct``) or in the receiver's target (``dst_direct``) is a segment of its
        own (``item`` is its index in ``m.items``) and skips the packing on that side; the
        other pieces are packed together, runs of them forming one segment (``item == -1``).
        Both sides derive the same segments from the plan.
        """
        hit = self._segments.get(m)
        if hit is not None:
            return hit
        out: list[tuple[int, int, int, bool, bool]] = []
        run: list[int] | None = None
        for k, (i, off) in enumerate(m.items):
            t = self.transfers[i]
            box, perm = self.dst_region(t)
            region = self.src_region(t)
            shard = self.source.layout(t.source).shard_box(t.src)
            src_direct = _contiguous([region[p] for p in perm], [shard[p].stop - shard[p].start for p in perm])
            dst_direct = _contiguous(box, self.target(t.target, t.dst).shape)
            if src_direct or dst_direct:
                run = None
                out.append((off, off + t.nbytes, k, src_direct, dst_direct))
            elif run is not None:
                run[1] = off + t.nbytes
            else:
                run = [off, off + t.nbytes, -1, False, False]
                out.append(run)  # type: ignore[arg-type]
        hit = self._segments[m] = tuple(tuple(x) for x in out)  # type: ignore[misc]
        return hit

    def src_region(self, t: Transfer) -> tuple[slice, ...]:
        """The transfer's box in the coordinates of its source device's shard."""
        shard = self.source.layout(t.source).shard_box(t.src)
        return tuple(slice(a - s.start, b - s.start) for (a, b), s in zip(t.box, shard, strict=True))

    def dst_region(self, t: Transfer) -> tuple[tuple[slice, ...], tuple[int, ...]]:
        """(the box in the target's local tensor, the permutation leaf dims -> torch dims)."""
        region = self.target(t.target, t.dst).regions[t.region]
        perm = region.transpose
        box = tuple(slice(o + t.box[p][0] - region.box[p][0], o + t.box[p][1] - region.box[p][0])
                    for o, p in zip(region.offset, perm, strict=True))
        return box, perm

    @property
    def network_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def rank_bytes(self) -> dict[str, dict[int, int]]:
        """Bytes each torch rank sends and receives."""
        send, recv = defaultdict(int), defaultdict(int)
        for t in self.transfers:
            send[t.src_rank] += t.nbytes
            recv[t.dst] += t.nbytes
        return {"send": dict(send), "recv": dict(recv)}

    def reference(self, arrays: MappingABC[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
        """The NumPy oracle: every rank's targets filled from global leaf arrays (zeros elsewhere)."""
        from jreshard.core.reference import _np_dtype

        out: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
        for t in self.mapping.targets:
            out[t.rank][t.name] = np.zeros(t.shape, dtype=_np_dtype(t.dtype))
        for t in self.transfers:
            box, perm = self.dst_region(t)
            piece = np.asarray(arrays[t.source])[tuple(slice(a, b) for a, b in t.box)]
            dst = out[t.dst][t.target]
            dst[box] = piece.transpose(perm).astype(dst.dtype)
        return dict(out)

    def __repr__(self) -> str:
        return (f"BridgePlan({len(self.source)} leaves -> {len(self.mapping)} targets, {len(self.transfers)} "
                f"transfers, {self.network_bytes:,} B in {self.num_buckets} buckets, "
                f"fingerprint {self.fingerprint.hex()[:12]})")


def _contiguous(box: Any, shape: Any) -> bool:
    """Whether ``box`` (slices) is one contiguous block of a C-contiguous array of ``shape``."""
    ext = [sl.stop - sl.start for sl in box]
    i = 0
    while i < len(ext) - 1 and ext[i] == 1:
        i += 1
    return all(ext[j] == shape[j] for j in range(i + 1, len(ext)))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN

