"""The pure reshard planner: which box moves from which device to which device.

Planning runs in three steps:

1. *Pieces* (cached per shape and pair of grids, independent of device ids): cut
   every destination shard by the source shards it overlaps. Each piece knows the
   destination mesh position it feeds and the source shard that holds it.
2. *Candidates* (vectorised over all tensors that share the same pieces): map mesh
   positions to device ids. A piece whose destination already holds its source
   shard is a local copy; a piece whose source shard has one holder is fixed; the
   rest may come from any replica.
3. *Balancing* (over the whole pytree at once): give every remaining piece a
   sender so that the largest number of bytes any device sends is small, splitting
   a piece across replicas where that lowers the maximum.

Network bytes equal the lower bound by construction: a destination receives each
element it lacks exactly once and never receives what it already holds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import OrderedDict
from typing import Any, Iterator

import numpy as np

from jreshard.core.layout import Box, Layout, _grid, _Grid, itemsize_of
from jreshard.core.tree import _sorted_keys, describe, flatten, path_str

__all__ = ["Move", "TensorPlan", "Plan", "PlanStats", "plan", "plan_layouts", "PlanError", "clear_cache", "check_tensor_plan"]


class PlanError(ValueError):
    """A plan does not satisfy its invariants (raised by ``check``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """Copy ``box`` (global coordinates) from device ``src`` to device ``dst``."""

    src: int
    dst: int
    box: Box

    @property
    def is_local(self) -> bool:
        return self.src == self.dst

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.box)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __hash__(self) -> int:
        return hash((self.src, self.dst, tuple((s.start, s.stop) for s in self.box)))

    def __repr__(self) -> str:
        box = "[" + ", ".join(f"{s.start}:{s.stop}" for s in self.box) + "]"
        return f"Move({self.src} -> {self.dst}, {box})"


# --------------------------------------------------------------------------- pieces


@dataclasses.dataclass(frozen=True, slots=True)
class _Pieces:
    dst_pos: np.ndarray  # [M] destination mesh position
    src_shard: np.ndarray  # [M] flat source shard id
    lo: np.ndarray  # [M, rank]
    hi: np.ndarray  # [M, rank]
    vol: np.ndarray  # [M] elements


def _dim_overlaps(n: int, cs: int, ct: int) -> tuple[np.ndarray, ...]:
    """Segments of [0, n) cut by both chunkings: (dst chunk, src chunk, lo, hi)."""
    if n == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e, e
    bp = np.unique(np.concatenate([np.arange(0, n, cs), np.arange(0, n, ct), [n]]).astype(np.int64))
    lo, hi = bp[:-1], bp[1:]
    return lo // ct, lo // cs, lo, hi


@functools.lru_cache(maxsize=4096)
def _pieces(shape: tuple[int, ...], src_key: tuple, dst_key: tuple) -> _Pieces:
    src: _Grid = _grid(shape, *src_key)
    dst: _Grid = _grid(shape, *dst_key)
    rank = len(shape)
    per_dim = [_dim_overlaps(n, cs, ct) for n, cs, ct in zip(shape, src.chunk, dst.chunk, strict=True)]
    counts = tuple(len(p[0]) for p in per_dim)
    total = math.prod(counts)
    idx = np.indices(counts, dtype=np.int64).reshape(rank, total)
    j = np.stack([per_dim[d][0][idx[d]] for d in range(rank)]) if rank else np.zeros((0, total), np.int64)
    i = np.stack([per_dim[d][1][idx[d]] for d in range(rank)]) if rank else np.zeros((0, total), np.int64)
    lo = np.stack([per_dim[d][2][idx[d]] for d in range(rank)], axis=1) if rank else np.zeros((total, 0), np.int64)
    hi = np.stack([per_dim[d][3][idx[d]] for d in range(rank)], axis=1) if rank else np.zeros((total, 0), np.int64)
    j_flat = np.ravel_multi_index(j, dst.parts) if rank else np.zeros(total, np.int64)
    i_flat = np.ravel_multi_index(i, src.parts) if rank else np.zeros(total, np.int64)
    order = np.argsort(j_flat, kind="stable")
    j_flat, i_flat, lo, hi = j_flat[order], i_flat[order], lo[order], hi[order]
    n_dst_shards = math.prod(dst.parts)
    per_shard = np.bincount(j_flat, minlength=n_dst_shards)
    first = np.concatenate([[0], np.cumsum(per_shard)[:-1]])
    # Every destination position receives the pieces of its shard.
    want = per_shard[dst.shard_flat]
    dst_pos = np.repeat(np.arange(len(dst.shard_flat), dtype=np.int64), want)
    offsets = np.arange(int(want.sum()), dtype=np.int64) - np.repeat(np.cumsum(want) - want, want)
    rows = np.repeat(first[dst.shard_flat], want) + offsets
    out = _Pieces(
        dst_pos=dst_pos,
        src_shard=np.asarray(i_flat, dtype=np.int64)[rows],
        lo=lo[rows],
        hi=hi[rows],
        vol=np.prod(hi[rows] - lo[rows], axis=1, dtype=np.int64) if rank else np.ones(len(rows), np.int64),
    )
    for a in (out.dst_pos, out.src_shard, out.lo, out.hi, out.vol):
        a.setflags(write=False)
    return out


def _grid_key(layout: Layout) -> tuple:
    return (layout.mesh.shape, layout.mesh.axis_names, layout.spec)


# --------------------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStats:
    """Traffic of a plan. Bytes are elements when the layouts carry no dtype.

    ``lower_bound_bytes`` is, per destination device, what its destination shards
    hold that its source shards do not; ``naive_bytes`` is what gather-then-
    broadcast moves (every destination device receives each full tensor it holds a
    non-empty piece of). ``mean_send_bytes`` averages over devices that send.
    ``messages`` counts distinct (sender, receiver) pairs, ``moves`` network boxes.
    """

    network_bytes: int
    local_bytes: int
    lower_bound_bytes: int
    naive_bytes: int
    moves: int
    local_moves: int
    messages: int
    max_send_bytes: int
    mean_send_bytes: float
    max_recv_bytes: int
    mean_recv_bytes: float
    send_bytes: dict[int, int]
    recv_bytes: dict[int, int]
    unit: str = "bytes"

    @property
    def send_imbalance(self) -> float:
        """Largest sender load over the mean sender load (1.0 is perfect)."""
        return self.max_send_bytes / self.mean_send_bytes if self.mean_send_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["send_imbalance"] = self.send_imbalance
        return d

    def __str__(self) -> str:
        u = self.unit
        lines = [
            f"network {_fmt(self.network_bytes, u)} (lower bound {_fmt(self.lower_bound_bytes, u)}), "
            f"local {_fmt(self.local_bytes, u)}, gather-then-broadcast {_fmt(self.naive_bytes, u)}",
            f"{self.moves} network moves in {self.messages} sender->receiver pairs, {self.local_moves} local copies",
            f"per sender: max {_fmt(self.max_send_bytes, u)}, mean {_fmt(self.mean_send_bytes, u)} "
            f"(imbalance {self.send_imbalance:.3f}); per receiver: max {_fmt(self.max_recv_bytes, u)}, "
            f"mean {_fmt(self.mean_recv_bytes, u)}",
        ]
        return "\n".join(lines)


def _fmt(n: float, unit: str) -> str:
    if unit != "bytes":
        return f"{int(n):,} elements"
    for scale, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {name}"
    return f"{int(n)} B"


def _stats(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, lower: int, naive: int, unit: str,
           count: np.ndarray | None = None) -> PlanStats:
    """Statistics of move rows; ``count`` says how many moves a row stands for (default 1)."""
    net = src != dst
    ns, nd, nb = src[net], dst[net], nbytes[net]
    n_net = int(net.sum()) if count is None else int(count[net].sum())
    n_local = int((~net).sum()) if count is None else int(count[~net].sum())
    if len(ns):
        top = int(max(ns.max(), nd.max())) + 1
        # Device ids are ranks: dense tables (bincount) beat sorting millions of moves.
        if top * top <= 1 << 26:
            pairs = int(np.count_nonzero(np.bincount(ns * top + nd, minlength=top * top)))
        else:
            pairs = len(np.unique(ns * top + nd))
        sids, sent = _sum_ints(ns, nb, top)
        rids, recv = _sum_ints(nd, nb, top)
    else:
        pairs, sids, sent, rids, recv = 0, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return PlanStats(
        network_bytes=int(nb.sum()),
        local_bytes=int(nbytes[~net].sum()),
        lower_bound_bytes=int(lower),
        naive_bytes=int(naive),
        moves=n_net,
        local_moves=n_local,
        messages=int(pairs),
        max_send_bytes=int(sent.max()) if len(sent) else 0,
        mean_send_bytes=float(sent.mean()) if len(sent) else 0.0,
        max_recv_bytes=int(recv.max()) if len(recv) else 0,
        mean_recv_bytes=float(recv.mean()) if len(recv) else 0.0,
        send_bytes={int(d): int(b) for d, b in zip(sids, sent, strict=True)},
        recv_bytes={int(d): int(b) for d, b in zip(rids, recv, strict=True)},
        unit=unit,
    )


def _sum_ints(ids: np.ndarray, weights: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids, exact int64 sum of weights per id), ids sorted."""
    # float64 sums are exact below 2**53 bytes per device.
    if top <= 1 << 24:
        count = np.bincount(ids, minlength=top)
        uniq = np.nonzero(count)[0]
        return uniq, np.bincount(ids, weights=weights, minlength=top)[uniq].astype(np.int64)
    uniq, inv = np.unique(ids, return_inverse=True)
    return uniq, np.bincount(inv.ravel(), weights=weights, minlength=len(uniq)).astype(np.int64)


class TensorPlan:
    """The moves that reshard one tensor from ``src`` to ``dst``.

    ``moves`` is a tuple of ``Move``; the same data is available as arrays
    (``move_src``, ``move_dst``, ``move_lo``, ``move_hi``), which executors use.
    """

    __slots__ = ("src", "dst", "itemsize", "move_src", "move_dst", "move_lo", "move_hi",
                 "lower_bound_bytes", "naive_bytes", "_moves")

    def __init__(self, src: Layout, dst: Layout, itemsize: int, move_src: np.ndarray, move_dst: np.ndarray,
                 move_lo: np.ndarray, move_hi: np.ndarray, lower_bound_bytes: int, naive_bytes: int) -> None:
        self.src, self.dst, self.itemsize = src, dst, itemsize
        self.move_src, self.move_dst, self.move_lo, self.move_hi = move_src, move_dst, move_lo, move_hi
        self.lower_bound_bytes, self.naive_bytes = lower_bound_bytes, naive_bytes
        self._moves: tuple[Move, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src.shape

    @property
    def moves(self) -> tuple[Move, ...]:
        if self._moves is None:
            self._moves = tuple(
                Move(int(s), int(d), Box._trusted(lo, hi))
                for s, d, lo, hi in zip(self.move_src, self.move_dst, self.move_lo, self.move_hi, strict=True)
            )
        return self._moves

    def moves_to(self, device: int) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.dst == device)

    def moves_from(self, device: int) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.src == device)

    @property
    def move_bytes(self) -> np.ndarray:
        vol = np.prod(self.move_hi - self.move_lo, axis=1, dtype=np.int64) if self.src.rank else np.ones(len(self.move_src), np.int64)
        return vol * self.itemsize

    def stats(self) -> PlanStats:
        unit = "bytes" if (self.dst.dtype or self.src.dtype) else "elements"
        return _stats(self.move_src, self.move_dst, self.move_bytes, self.lower_bound_bytes, self.naive_bytes, unit)

    def check(self) -> None:
        """Verifies the invariants; raises ``PlanError`` naming the first violation.

        Every element of every destination shard is written by exactly one move,
        each move's box lies inside its source's shard and its destination's shard,
        and no destination receives over the network what it already holds.
        """
        check_tensor_plan(self)

    def table(self, limit: int | None = 50) -> str:
        """One line per move (the first ``limit`` moves; all with ``None``)."""
        lines = [f"{self.src!r}\n  -> {self.dst!r}"]
        shown = self.moves if limit is None else self.moves[:limit]
        for m in shown:
            kind = "local" if m.is_local else "send "
            lines.append(f"  {kind} {m.src:>5} -> {m.dst:<5} {_box_str(m.box)}  {m.size * self.itemsize:,} {'B' if self.dst.dtype or self.src.dtype else 'el'}")
        if limit is not None and len(self.moves) > limit:
            lines.append(f"  ... {len(self.moves) - limit} more moves")
        return "\n".join(lines)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"TensorPlan({self.shape}, {s.moves} network moves, {s.local_moves} local, "
                f"network {_fmt(s.network_bytes, s.unit)})")

    def __str__(self) -> str:
        return f"{self.table(limit=20)}\n{self.stats()}"


def _box_str(box: Box) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in box) + "]"


class Plan:
    """Per-leaf TensorPlans for a pytree of layouts, balanced across all its tensors.

    ``plan.tensors`` maps each leaf path (``'layers/0/wq'``) to its TensorPlan;
    ``plan[path]`` does the same; ``plan.stats()`` aggregates.
    """

    __slots__ = ("paths", "treedef", "_leaves", "_groups", "_index", "_tensors", "_stats")

    def __init__(self, paths: list[tuple], treedef: Any, leaves: list[tuple[Layout, Layout, int]],
                 groups: list[_GroupResult], index: list[tuple[int, int, int]]) -> None:
        self.paths = tuple(paths)
        self.treedef = treedef
        self._leaves = leaves
        self._groups = groups
        self._index = index  # leaf -> (group, row start, row stop)
        self._tensors: dict[str, TensorPlan] | None = None
        self._stats: PlanStats | None = None

    def _tensor(self, leaf: int) -> TensorPlan:
        g, a, b = self._index[leaf]
        res = self._groups[g]
        src, dst, itemsize = self._leaves[leaf]
        s, d, lo, hi = res.rows(a, b)
        return TensorPlan(src, dst, itemsize, s, d, lo, hi, int(res.lower[leaf]), int(res.naive[leaf]))

    @property
    def tensors(self) -> dict[str, TensorPlan]:
        if self._tensors is None:
            self._tensors = {path_str(p): self._tensor(i) for i, p in enumerate(self.paths)}
        return self._tensors

    @property
    def layouts(self) -> list[tuple[Layout, Layout]]:
        return [(s, d) for s, d, _ in self._leaves]

    def __getitem__(self, path: str | tuple) -> TensorPlan:
        key = path if isinstance(path, str) else path_str(path)
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"no tensor {key!r} in this plan; paths start with {list(self.tensors)[:5]!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.paths)

    def items(self):
        return self.tensors.items()

    def stats(self) -> PlanStats:
        if self._stats is None:
            if self._groups:
                parts = [g.compressed() for g in self._groups]
                src, dst, nb, count = (np.concatenate([p[k] for p in parts]) for k in range(4))
            else:
                src = dst = nb = count = np.zeros(0, np.int64)
            lower = sum(sum(g.lower.values()) for g in self._groups)
            naive = sum(sum(g.naive.values()) for g in self._groups)
            unit = "bytes" if any((s.dtype or d.dtype) for s, d, _ in self._leaves) else "elements"
            self._stats = _stats(src, dst, nb, lower, naive, unit, count)
        return self._stats

    def check(self) -> None:
        """Checks every TensorPlan's invariants (see ``TensorPlan.check``)."""
        for path, tp in self.tensors.items():
            try:
                tp.check()
            except PlanError as exc:
                raise PlanError(f"tensor {path!r}: {exc}") from None

    def __repr__(self) -> str:
        s = self.stats()
        return f"Plan({len(self)} tensors, network {_fmt(s.network_bytes, s.unit)}, {s.messages} messages)"

    def __str__(self) -> str:
        lines = [f"Plan for {len(self)} tensors", str(self.stats())]
        shown = list(self.tensors.items())[:12]
        width = max((len(p) for p, _ in shown), default=4)
        for path, tp in shown:
            s = tp.stats()
            lines.append(f"  {path or '<root>':<{width}}  {str(tp.shape):<16} {s.moves:>4} moves  "
                         f"{_fmt(s.network_bytes, s.unit):>12}  {tp.src.spec_str} -> {tp.dst.spec_str}")
        if len(self) > len(shown):
            lines.append(f"  ... {len(self) - len(shown)} more tensors")
        return "\n".join(lines)


# --------------------------------------------------------------------------- core


@dataclasses.dataclass(slots=True)
class _GroupResult:
    """A group's move rows, tensor after tensor.

    General groups hold the rows as arrays. Regular groups (senders fixed by the mesh
    pair, no split rows) hold one sorted row set per mesh pair instead: tensor k's
    rows are its pair's rows with bytes scaled by its itemsize, so nothing of size
    tensors x pieces is built unless asked for (``src``, ``dst``, ... properties).
    """

    lower: dict  # leaf -> bytes
    naive: dict
    _src: np.ndarray | None = None
    _dst: np.ndarray | None = None
    _nbytes: np.ndarray | None = None
    _lo: np.ndarray | None = None
    _hi: np.ndarray | None = None
    # Regular groups: per mesh pair c, sorted rows psrc[c], pdst[c] of pieces perm[c].
    pieces: _Pieces | None = None
    perm: np.ndarray | None = None  # [C, M], None when every pair keeps piece order
    psrc: np.ndarray | None = None  # [C, M]
    pdst: np.ndarray | None = None  # [C, M]
    inv: np.ndarray | None = None  # [T] pair of each tensor
    itemsize: np.ndarray | None = None  # [T]

    def _piece_boxes(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        if self.perm is None:
            return self.pieces.lo, self.pieces.hi  # read-only, shared
        lo, hi = self.pieces.lo[self.perm[c]], self.pieces.hi[self.perm[c]]
        lo.setflags(write=False)
        hi.setflags(write=False)
        return lo, hi

    def rows(self, a: int, b: int) -> tuple[np.ndarray, ...]:
        """(src, dst, lo, hi) of rows a:b, one tensor's range."""
        if self._src is not None:
            return self._src[a:b], self._dst[a:b], self._lo[a:b], self._hi[a:b]
        M = self.psrc.shape[1]
        c = int(self.inv[a // M])
        lo, hi = self._piece_boxes(c)
        return (self.psrc[c], self.pdst[c], lo, hi)

    def _expand(self) -> None:
        T, M = len(self.inv), self.psrc.shape[1]
        order = np.arange(M)[None, :] if self.perm is None else self.perm[self.inv]
        src, dst = self.psrc[self.inv].ravel(), self.pdst[self.inv].ravel()
        piece = np.broadcast_to(order, (T, M)).ravel()
        lo, hi = self.pieces.lo[piece], self.pieces.hi[piece]
        nb = self.pieces.vol[piece] * np.repeat(self.itemsize, M)
        for x in (src, dst, lo, hi, nb):
            x.setflags(write=False)
        self._src, self._dst, self._lo, self._hi, self._nbytes = src, dst, lo, hi, nb

    def compressed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, nbytes, moves): rows of equal sender and receiver merged, with counts."""
        if self._src is not None or self.psrc is None:
            return self._src, self._dst, self._nbytes, np.ones(len(self._src), np.int64)
        C, M = self.psrc.shape
        weight = np.bincount(self.inv, weights=self.itemsize, minlength=C).astype(np.int64)  # bytes per element
        count = np.bincount(self.inv, minlength=C).astype(np.int64)
        vol = self.pieces.vol[self.perm] if self.perm is not None else np.broadcast_to(self.pieces.vol, (C, M))
        return (self.psrc.ravel(), self.pdst.ravel(), (vol * weight[:, None]).ravel(),
                np.repeat(count, M))

    # Full row arrays, built on first use for regular groups.
    src = property(lambda self: self._full("_src"))
    dst = property(lambda self: self._full("_dst"))
    nbytes = property(lambda self: self._full("_nbytes"))
    lo = property(lambda self: self._full("_lo"))
    hi = property(lambda self: self._full("_hi"))

    def _full(self, field: str) -> np.ndarray:
        if self._src is None:
            self._expand()
        return getattr(self, field)


def _lookup(sorted_keys: np.ndarray, sorted_vals: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Values for ``queries`` in a sorted key table, -1 where absent (row-wise batches)."""
    pos = np.searchsorted(sorted_keys, queries)
    pos = np.minimum(pos, len(sorted_keys) - 1)
    found = sorted_keys[pos] == queries
    return np.where(found, sorted_vals[pos], -1)


def _mesh_table(meshes: list) -> tuple[np.ndarray, np.ndarray, list]:
    """Distinct meshes (by identity: tensors of a model share a few Mesh objects) as an
    id table [C, size], plus each tensor's row in it."""
    rows: dict[int, int] = {}
    uniq: list = []
    inv = np.empty(len(meshes), dtype=np.int64)
    for k, m in enumerate(meshes):
        j = rows.get(id(m))
        if j is None:
            j = rows[id(m)] = len(uniq)
            uniq.append(m)
        inv[k] = j
    return np.array([m.device_ids for m in uniq], dtype=np.int64), inv, uniq


def _combos(members: list[int], leaves: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (src mesh, dst mesh) pairs of a group: src ids [C, S], dst ids [C, D], tensor -> pair."""
    s_tab, s_inv, _ = _mesh_table([leaves[i][0].mesh for i in members])
    d_tab, d_inv, _ = _mesh_table([leaves[i][1].mesh for i in members])
    pair = s_inv * len(d_tab) + d_inv
    uniq, inv = np.unique(pair, return_inverse=True)
    return s_tab[uniq // len(d_tab)], d_tab[uniq % len(d_tab)], inv.ravel()


def _plan_leaves(leaves: list[tuple[Layout, Layout, int]], balance: bool = True) -> tuple[list[_GroupResult], list]:
    """Plans every leaf; returns per-group row arrays and each leaf's row range."""
    by_key: dict[tuple, list[int]] = {}
    for i, (s, d, _) in enumerate(leaves):
        by_key.setdefault((s.shape, _grid_key(s), _grid_key(d)), []).append(i)

    # Step 2, vectorised per group. Rows of tensors with the same pair of meshes differ
    # only in the tensor index, so the mesh-dependent work runs once per pair.
    staged = []
    choice = []  # rows that may come from any of several replicas
    fixed_load: dict[int, float] = {}  # sender -> bytes it must send whatever the balancing
    for key, members in by_key.items():
        shape, skey, dkey = key
        pieces = _pieces(shape, skey, dkey)
        sgrid, dgrid = _grid(shape, *skey), _grid(shape, *dkey)
        T = len(members)
        src_ids, dst_ids, inv = _combos(members, leaves)  # [C, S], [C, D], [T]
        C = len(src_ids)
        itemsize = np.fromiter((leaves[i][2] for i in members), dtype=np.int64, count=T)
        # Where each destination device sits in its pair's source mesh (-1: absent).
        big = int(max(src_ids.max(), dst_ids.max())) + 1
        row_off = np.arange(C, dtype=np.int64)[:, None] * big
        order = np.argsort(src_ids, axis=1)
        skeys = (np.take_along_axis(src_ids, order, axis=1) + row_off).ravel()
        svals = order.ravel()
        dst_src_pos = _lookup(skeys, svals, (dst_ids + row_off).ravel()).reshape(C, -1)
        dst_src_shard = np.where(dst_src_pos >= 0, sgrid.shard_flat[np.maximum(dst_src_pos, 0)], -1)

        # Lower bound and naive bytes, computed from the layouts, not from the moves.
        dvol = np.prod(dgrid.stop - dgrid.start, axis=1, dtype=np.int64) if shape else np.ones(len(dgrid.start), np.int64)
        if (dst_src_pos < 0).all():
            lacking_c = np.full(C, int(dvol.sum()), np.int64)
        else:
            own_lo = np.maximum(dgrid.start[None], np.where(dst_src_pos[..., None] >= 0, sgrid.start[np.maximum(dst_src_pos, 0)], 0))
            own_hi = np.minimum(dgrid.stop[None], np.where(dst_src_pos[..., None] >= 0, sgrid.stop[np.maximum(dst_src_pos, 0)], 0))
            own = np.prod(np.maximum(own_hi - own_lo, 0), axis=2, dtype=np.int64) if shape else (dst_src_pos >= 0).astype(np.int64)
            lacking_c = (dvol[None] - own).sum(axis=1)
        lacking = lacking_c[inv] * itemsize
        naive = int((dvol > 0).sum()) * math.prod(shape) * itemsize
        lower = dict(zip(members, lacking.tolist()))
        naive_d = dict(zip(members, naive.tolist()))

        M = len(pieces.dst_pos)
        groups = sgrid.groups  # [num src shards, R]
        R = groups.shape[1]
        pdst_c = dst_ids[:, pieces.dst_pos]  # [C, M]
        local_c = dst_src_shard[:, pieces.dst_pos] == pieces.src_shard[None, :]
        cands_c = src_ids[:, groups[pieces.src_shard]] if M else np.zeros((C, 0, R), np.int64)  # [C, M, R]
        psrc_c = np.where(local_c, pdst_c, cands_c[:, :, 0] if M else pdst_c)
        # Per-tensor rows are built only where replicas are chosen per row (below);
        # other groups keep their rows per mesh pair.
        pdst = pdst_c[inv].ravel() if R > 1 or not M else None
        psrc = psrc_c[inv].ravel() if R > 1 or not M else None
        staged.append((key, members, pieces, psrc, pdst, itemsize, lower, naive_d, inv, pdst_c, psrc_c))
        if R > 1 and M:
            free = ~local_c[inv].ravel()
            if free.any():
                rows = np.nonzero(free)[0]
                # A row's candidates depend only on its mesh pair and source shard: keep one
                # table of candidate sets and a class per row, not [rows, R] candidates.
                n_shards = len(groups)
                local_cls = inv[rows // M] * n_shards + pieces.src_shard[rows % M]
                uniq, cls = np.unique(local_cls, return_inverse=True)
                table = src_ids[(uniq // n_shards)[:, None], groups[uniq % n_shards]]
                choice.append((len(staged) - 1, rows, table, cls.ravel(),
                               (np.tile(pieces.vol, T) * np.repeat(itemsize, M))[rows]))
        elif M:
            # Fixed senders: each pair's per-piece loads, weighted by its tensors' itemsizes.
            weight = np.bincount(inv, weights=itemsize, minlength=C)
            send = ~local_c
            for c in np.nonzero(weight)[0]:
                ids, b = psrc_c[c][send[c]], pieces.vol[send[c]] * weight[c]
                for sid, total in zip(*_sum_by(ids, b), strict=True):
                    fixed_load[sid] = fixed_load.get(sid, 0.0) + total

    # Step 3: choose replicas across all groups at once.
    splits: dict[int, list] = {}
    if choice:
        fsrc = np.fromiter(fixed_load.keys(), dtype=np.int64, count=len(fixed_load))
        fbytes = np.fromiter(fixed_load.values(), dtype=np.float64, count=len(fixed_load))
        assigned, splits = _balance(staged, choice, fsrc, fbytes, balance)
        for (gi, rows, *_), chosen in zip(choice, assigned, strict=True):
            staged[gi][3][rows] = chosen
    choice_groups = {c[0] for c in choice}

    # Assemble rows, sorted by (tensor, dst, src, box) so each tensor is a contiguous range.
    results: list[_GroupResult] = []
    index: list = [None] * len(leaves)
    for gi, (key, members, pieces, psrc, pdst, itemsize, lower, naive_d, inv, pdst_c, psrc_c) in enumerate(staged):
        T, M = len(members), len(pieces.dst_pos)
        if gi not in splits and M:
            if gi not in choice_groups:
                perms = _pair_order(pieces, pdst_c, psrc_c)
                take = (lambda x: x) if perms is None else (lambda x: np.take_along_axis(x, perms, axis=1))
                ps, pd = take(psrc_c), take(pdst_c)
                for x in (ps, pd, inv, itemsize):
                    x.setflags(write=False)
                for k, m in enumerate(members):
                    index[m] = (gi, k * M, (k + 1) * M)
                results.append(_GroupResult(lower, naive_d, pieces=pieces, perm=perms, psrc=ps, pdst=pd,
                                            inv=inv, itemsize=itemsize))
                continue
            rows = _presorted_rows(pieces, inv, pdst_c, psrc_c, with_src=False)
            if rows is not None:
                uniform = (itemsize == itemsize[0]).all()
                if rows is _IN_ORDER:
                    s, d, piece = psrc, pdst, None
                    nbytes = (np.tile(pieces.vol * int(itemsize[0]), T) if uniform
                              else np.tile(pieces.vol, T) * np.repeat(itemsize, M))
                else:
                    s, d = psrc[rows], pdst[rows]
                    piece = rows % M
                    vol = pieces.vol[piece]
                    nbytes = vol * int(itemsize[0]) if uniform else vol * np.repeat(itemsize, M)
                for a in (s, d, nbytes) + ((piece,) if piece is not None else ()):
                    a.setflags(write=False)
                bounds = np.arange(T + 1) * M
                for k, m in enumerate(members):
                    index[m] = (gi, int(bounds[k]), int(bounds[k + 1]))
                lo, hi = (np.tile(pieces.lo, (T, 1)), np.tile(pieces.hi, (T, 1))) if piece is None else \
                    (pieces.lo[piece], pieces.hi[piece])
                results.append(_GroupResult(lower, naive_d, s, d, nbytes, lo, hi))
                continue
        lo = np.tile(pieces.lo, (T, 1))
        hi = np.tile(pieces.hi, (T, 1))
        t, s, d = np.repeat(np.arange(T, dtype=np.int64), M), psrc, pdst
        if gi in splits:
            # Split rows: an original row shrinks in place, a split-off part is a new row.
            lo, hi = lo.copy(), hi.copy()
            grown = [e for e in splits[gi] if e[4]]
            for row, new_lo, new_hi, _src, is_new in splits[gi]:
                if not is_new:
                    lo[row], hi[row] = new_lo, new_hi
            rank = lo.shape[1]
            t = np.concatenate([t, np.array([t[e[0]] for e in grown], np.int64)])
            s = np.concatenate([s, np.array([e[3] for e in grown], np.int64)])
            d = np.concatenate([d, np.array([d[e[0]] for e in grown], np.int64)])
            lo = np.concatenate([lo, np.array([e[1] for e in grown], np.int64).reshape(-1, rank)])
            hi = np.concatenate([hi, np.array([e[2] for e in grown], np.int64).reshape(-1, rank)])
        vol = np.prod(hi - lo, axis=1, dtype=np.int64) if lo.shape[1] else np.ones(len(t), np.int64)
        keep = vol > 0
        t, s, d, lo, hi, vol = t[keep], s[keep], d[keep], lo[keep], hi[keep], vol[keep]
        sort_keys = [lo[:, k] for k in range(lo.shape[1] - 1, -1, -1)] + [s, d, t]
        order = np.lexsort(sort_keys) if len(t) else np.zeros(0, np.int64)
        t, s, d, lo, hi, vol = t[order], s[order], d[order], lo[order], hi[order], vol[order]
        nbytes = vol * itemsize[t]
        bounds = np.searchsorted(t, np.arange(T + 1))
        for k, m in enumerate(members):
            index[m] = (gi, int(bounds[k]), int(bounds[k + 1]))
        for a in (s, d, lo, hi, nbytes):
            a.setflags(write=False)
        results.append(_GroupResult(lower, naive_d, s, d, nbytes, lo, hi))
    return results, index


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, axis=0, return_inverse=True)`` for many rows with few distinct values.

    Rows are hashed to one int64 (a random linear form, wrapping), uniqued in 1-D, then
    verified against their representatives; a collision falls back to the exact method.
    """
    if len(a) and a.shape[1]:
        w = np.random.default_rng(0).integers(1, 1 << 62, size=a.shape[1], dtype=np.int64) | 1
        _, first, inv = np.unique((a * w).sum(axis=1), return_index=True, return_inverse=True)
        inv = inv.ravel()
        reps = a[first]
        if (reps[inv] == a).all():
            order = np.lexsort(reps.T[::-1])
            rank = np.empty_like(order)
            rank[order] = np.arange(len(order))
            return reps[order], rank[inv]
    classes, inverse = np.unique(a, axis=0, return_inverse=True)
    return classes, inverse.ravel()


def _sum_by(ids: np.ndarray, weights: np.ndarray) -> tuple[list[int], list[float]]:
    uniq, inv = np.unique(ids, return_inverse=True)
    return uniq.tolist(), np.bincount(inv.ravel(), weights=weights, minlength=len(uniq)).tolist()


def _pair_order(pieces: _Pieces, pdst_c: np.ndarray, psrc_c: np.ndarray) -> np.ndarray | None:
    """Per mesh pair, the piece order sorted by (dst, src, box); ``None`` when already sorted."""
    M = len(pieces.dst_pos)
    box_keys = [pieces.lo[:, k] for k in range(pieces.lo.shape[1] - 1, -1, -1)]
    perms = np.empty(pdst_c.shape, dtype=np.int64)
    for c in range(len(pdst_c)):
        perms[c] = np.lexsort(box_keys + [psrc_c[c], pdst_c[c]])
    return None if (perms == np.arange(M)).all() else perms


_IN_ORDER = np.zeros(0, dtype=np.int64)  # sentinel: the tiled rows are already sorted


def _presorted_rows(pieces: _Pieces, inv: np.ndarray, pdst_c: np.ndarray, psrc_c: np.ndarray,
                    with_src: bool) -> np.ndarray | None:
    """Row order (into the tiled [T*M] rows) sorted by (tensor, dst, src, box), or None.

    Sorting a pair's M pieces once and gathering that order for each of its tensors
    avoids a lexsort over all rows. Senders are fixed per pair unless replicas were
    chosen (``with_src`` False); then the order must not depend on them, which holds
    when every destination gets one piece.
    """
    M = len(pieces.dst_pos)
    box_keys = [pieces.lo[:, k] for k in range(pieces.lo.shape[1] - 1, -1, -1)]
    perms = np.empty(pdst_c.shape, dtype=np.int64)
    for c in range(len(pdst_c)):
        keys = box_keys + ([psrc_c[c]] if with_src else []) + [pdst_c[c]]
        perm = np.lexsort(keys)
        if not with_src and M > 1 and (np.diff(pdst_c[c][perm]) == 0).any():
            return None
        perms[c] = perm
    if (perms == np.arange(M)).all():
        return _IN_ORDER
    return (np.arange(len(inv), dtype=np.int64)[:, None] * M + perms[inv]).ravel()


def _balance(staged, choice, fixed_src, fixed_bytes, balance: bool):
    """Assigns a sender to every choice row; may split rows across replicas.

    Greedy longest-processing-time within each class of rows that share their set
    of candidate senders (classes in order of total bytes), then a refinement that
    moves or splits rows off the most loaded sender while that lowers the maximum.
    Returns the chosen sender per row (per choice block) and per-group splits.
    """
    all_ids = np.unique(np.concatenate([fixed_src] + [c[2].ravel() for c in choice]))
    # (tables are small: one row per candidate set of each block)
    load = np.zeros(len(all_ids), dtype=np.float64)
    if len(fixed_src):
        np.add.at(load, np.searchsorted(all_ids, fixed_src), fixed_bytes.astype(np.float64))

    # One flat table of choice rows; candidate sets (dense sender ids, padded with -1)
    # live in a small table of classes that rows point into.
    Rmax = max(c[2].shape[1] for c in choice)
    blocks, tables, offset = [], [], 0
    for b, (gi, rows, table, cls, nbytes) in enumerate(choice):
        dense = np.searchsorted(all_ids, np.sort(table, axis=1))
        pad = np.full((len(table), Rmax), -1, np.int64)
        pad[:, : dense.shape[1]] = dense
        tables.append(pad)
        blocks.append((np.full(len(rows), b), np.arange(len(rows)), cls + offset, nbytes.astype(np.float64),
                       staged[gi][4][rows]))
        offset += len(table)
    rdst = np.concatenate([x[4] for x in blocks])  # receiver of each row
    blk = np.concatenate([x[0] for x in blocks])
    brow = np.concatenate([x[1] for x in blocks])
    nbytes = np.concatenate([x[3] for x in blocks])
    chosen = np.empty(len(blk), np.int64)

    classes, table_class = _unique_rows(np.concatenate(tables))
    inverse = table_class[np.concatenate([x[2] for x in blocks])]
    totals = np.bincount(inverse, weights=nbytes)
    by_class = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[by_class], np.arange(len(classes) + 1))
    for c in np.argsort(-totals, kind="stable"):
        members = classes[c][classes[c] >= 0]
        rows = by_class[bounds[c]:bounds[c + 1]]
        rows = rows[np.argsort(-nbytes[rows], kind="stable")]
        R = len(members)
        if not balance:
            chosen[rows] = members[0]
            load[members[0]] += nbytes[rows].sum()
            continue
        if len(rows) > max(64 * R, 20_000):
            # Many rows: fill the members up to a common level, each taking a contiguous
            # run of rows in receiver order (few sender -> receiver pairs); vectorised.
            rows = rows[np.argsort(rdst[rows], kind="stable")]
            size = nbytes[rows]
            have = load[members]
            srt = np.sort(have)
            # Water level: the first k members (least loaded) filled up to a common level.
            levels = (size.sum() + np.cumsum(srt)) / np.arange(1, R + 1)
            fits = np.nonzero(levels[:-1] <= srt[1:])[0]
            level = levels[fits[0]] if len(fits) else levels[-1]
            quota = np.maximum(level - have, 0.0)
            ends = np.cumsum(quota)
            mid = np.cumsum(size) - size / 2
            chosen[rows] = members[np.minimum(np.searchsorted(ends, mid), R - 1)]
            load[:] += np.bincount(chosen[rows], weights=size, minlength=len(load))
            continue
        # Longest-processing-time in chunks of R rows: each chunk's largest row goes
        # to the least loaded member, and so on.
        for start in range(0, len(rows), R):
            chunk = rows[start:start + R]
            targets = members[np.argsort(load[members], kind="stable")[: len(chunk)]]
            chosen[chunk] = targets
            load[targets] += nbytes[chunk]

    splits: dict[int, list] = {}
    n_orig = len(blk)
    if balance:
        blk, brow, inverse, nbytes, chosen, boxes = _refine(staged, choice, blk, brow, classes, inverse, nbytes,
                                                            chosen, load)
        # Shrunk original rows keep their sender; split-off rows are new rows.
        for r, (lo, hi) in boxes.items():
            gi, rows, *_ = choice[int(blk[r])]
            grow = int(rows[brow[r]])
            splits.setdefault(gi, []).append((grow, lo, hi, int(all_ids[chosen[r]]), r >= n_orig))
    assigned = [all_ids[chosen[:n_orig][blk[:n_orig] == b]] for b in range(len(choice))]
    return assigned, splits


def _refine(staged, choice, blk, brow, classes, cls, nbytes, chosen, load, max_rounds: int | None = None):
    """Moves or splits rows off the most loaded sender while that lowers the maximum.

    Returns the (possibly grown) row table and the boxes of rows that were split:
    row -> (lo, hi); rows past the original table are the split-off parts.
    """
    rounds = max_rounds if max_rounds is not None else 4 * len(load) + 16
    n = len(blk)
    boxes: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def least_loaded_alternative(dev: int):
        mine = np.nonzero(chosen[:n] == dev)[0]
        if not len(mine):
            return None
        alt = classes[cls[mine]]
        valid = (alt >= 0) & (alt != dev)
        if not valid.any():
            return None
        alt_load = np.where(valid, load[np.maximum(alt, 0)], np.inf)
        best = int(alt[np.unravel_index(np.argmin(alt_load), alt.shape)])
        return best, mine, alt

    for _ in range(rounds):
        top = int(np.argmax(load))
        slack = max(1.0, 1e-4 * load[top])
        found = least_loaded_alternative(top)
        if found is not None and load[top] - load[found[0]] <= slack:
            # Every replica partner of the top sender is as loaded as it: let one of
            # them shed load to a third device first (a two-step move).
            peers = np.unique(found[2][(found[2] >= 0) & (found[2] != top)])
            found = None
            for peer in peers[np.argsort(-load[peers], kind="stable")][:4]:  # bounded work per round
                step = least_loaded_alternative(int(peer))
                if step is not None and load[peer] - load[step[0]] > slack:
                    top, found = int(peer), step
                    break
        if found is None:
            break
        best, mine, alt = found
        gap = load[top] - load[best]
        if gap <= slack:
            break
        delta = gap / 2
        movable = mine[(alt == best).any(axis=1)]
        sizes = nbytes[movable]
        fits = sizes <= delta
        if fits.any():
            r = int(movable[fits][np.argmax(sizes[fits])])
            chosen[r] = best
            load[top] -= nbytes[r]
            load[best] += nbytes[r]
            continue
        r = int(movable[np.argmin(sizes)])
        if r in boxes:
            lo, hi = boxes[r]
        else:
            gi, rows, *_ = choice[int(blk[r])]
            pieces = staged[gi][2]
            m = int(rows[brow[r]]) % len(pieces.dst_pos)
            lo, hi = pieces.lo[m], pieces.hi[m]
        ext = hi - lo
        if not len(ext):
            break
        dim = int(np.argmax(ext))
        per_row = nbytes[r] / ext[dim]
        k = int(delta // per_row)
        if k < 1:
            break
        # Cut the last k rows of `dim` off into a new row sent by `best`.
        cut_lo, new_hi = lo.copy(), hi.copy()
        cut_lo[dim] = hi[dim] - k
        new_hi[dim] -= k
        boxes[r] = (lo, new_hi)
        boxes[n] = (cut_lo, hi.copy())
        if n == len(blk):
            # Room for split-off rows, made on the first split (at most one per round).
            blk, brow, cls, nbytes, chosen = (np.concatenate([a, np.zeros(rounds, a.dtype)])
                                              for a in (blk, brow, cls, nbytes, chosen))
        blk[n], brow[n], cls[n], nbytes[n], chosen[n] = blk[r], brow[r], cls[r], per_row * k, best
        nbytes[r] -= per_row * k
        load[top] -= per_row * k
        load[best] += per_row * k
        n += 1
    return blk[:n], brow[:n], cls[:n], nbytes[:n], chosen[:n], boxes


# --------------------------------------------------------------------------- checks


def check_tensor_plan(tp: TensorPlan) -> None:
    """Raises ``PlanError`` unless ``tp`` writes every destination element exactly once."""
    src, dst = tp.src, tp.dst
    rank = src.rank
    counts: dict[int, np.ndarray] = {}
    dst_boxes = dst.shards()
    src_boxes = src.shards()
    for d, box in dst_boxes.items():
        counts[d] = np.zeros(tuple(s.stop - s.start for s in box), dtype=np.int32)
    for m in tp.moves:
        if m.dst not in counts:
            raise PlanError(f"{m!r} targets device {m.dst}, which is not in the destination mesh")
        if m.src not in src_boxes:
            raise PlanError(f"{m!r} reads from device {m.src}, which is not in the source mesh")
        if m.size == 0:
            raise PlanError(f"{m!r} is empty")
        for k in range(rank):
            s_have, d_have, want = src_boxes[m.src][k], dst_boxes[m.dst][k], m.box[k]
            if not (s_have.start <= want.start and want.stop <= s_have.stop):
                raise PlanError(f"{m!r} reads outside source shard {_box_str(src_boxes[m.src])} of device {m.src}")
            if not (d_have.start <= want.start and want.stop <= d_have.stop):
                raise PlanError(f"{m!r} writes outside destination shard {_box_str(dst_boxes[m.dst])} of device {m.dst}")
        if not m.is_local and m.dst in src_boxes:
            own = src_boxes[m.dst]
            if all(max(o.start, w.start) < min(o.stop, w.stop) for o, w in zip(own, m.box, strict=True)):
                raise PlanError(f"{m!r} sends device {m.dst} data it already holds in {_box_str(own)}")
        region = tuple(slice(w.start - h.start, w.stop - h.start) for w, h in zip(m.box, dst_boxes[m.dst], strict=True))
        counts[m.dst][region] += 1
    for d, c in counts.items():
        if c.size and (c != 1).any():
            where = tuple(int(x) for x in np.argwhere(c != 1)[0])
            glob = tuple(w + h.start for w, h in zip(where, dst_boxes[d], strict=True))
            raise PlanError(f"element {glob} of device {d}'s shard is written {int(c[where])} times, not once")


# --------------------------------------------------------------------------- entry point

_PLAN_CACHE: OrderedDict = OrderedDict()
_PLAN_CACHE_SIZE = 32


def clear_cache() -> None:
    """Forgets cached plans, pieces and grids (for cold-start measurements)."""
    _PLAN_CACHE.clear()
    _IDENTITY_CACHE.clear()
    _pieces.cache_clear()
    _grid.cache_clear()


def _itemsize(src: Layout, dst: Layout) -> int:
    # Bytes on the wire are the destination's: a cast happens at the sender.
    return itemsize_of(dst.dtype or src.dtype)


def _check_pair(path: str, src: Any, dst: Any) -> None:
    where = f" at {path!r}" if path else ""
    for arg, value in (("src", src), ("dst", dst)):
        if not isinstance(value, Layout):
            raise TypeError(
                f"{arg}{where} must be a jreshard.Layout, got {type(value).__name__}; "
                "build one with Layout(shape, mesh, spec) (jax arrays and shardings are accepted by "
                "jreshard.plan once jax is installed)."
            )
    if src.shape != dst.shape:
        raise ValueError(
            f"src and dst{where} have different shapes {src.shape} and {dst.shape}; "
            "a reshard keeps the global shape (reshape before or after)."
        )


def _is_jax_like(x: Any) -> bool:
    return hasattr(x, "sharding") and hasattr(x, "shape") and not isinstance(x, Layout)


def plan(src: Any, dst: Any, *, balance: bool = True, **kwargs: Any) -> TensorPlan | Plan:
    """Plans a reshard from ``src`` to ``dst``.

    Args:
      src: a Layout, or a pytree of Layouts (dicts, lists, tuples).
      dst: a Layout, or a pytree of Layouts of the same structure.
      balance: choose among replicated senders to minimise the largest sender load
        (splitting boxes where that helps); ``False`` always uses the first replica.

    Returns:
      A ``TensorPlan`` for two Layouts, a ``Plan`` for pytrees.

    Raises:
      TypeError: a leaf is not a Layout.
      ValueError: shapes or pytree structures differ.

    Example:
      >>> from jreshard import Layout, Mesh
      >>> src = Layout((8, 4), Mesh([0, 1, 2, 3], "fsdp"), ("fsdp",), dtype="float32")
      >>> dst = Layout((8, 4), Mesh([[4, 5], [6, 7]], ("dp", "tp")), (None, "tp"), dtype="float32")
      >>> p = plan(src, dst)
      >>> p.stats().network_bytes == p.stats().lower_bound_bytes == 2 * 8 * 4 * 4
      True
    """
    if isinstance(src, Layout) and isinstance(dst, Layout):
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)!r} for planning two Layouts")
        _check_pair("", src, dst)
        key = ("tensor", src, dst, balance)
        hit = _PLAN_CACHE.get(key)
        if hit is None:
            hit = _plan_tree([()], "leaf", [src], [dst], balance)[""]
            _remember(key, hit)
        return hit
    ident = (id(src), id(dst), balance)
    hit = _IDENTITY_CACHE.get(ident)
    if hit is not None and hit[0] is src and hit[1] is dst and _same_content(src, dst, hit[2]):
        return hit[3]
    flat = _flat_layout_dict(src, dst)
    if flat is not None:
        src_paths, src_leaves, src_def, dst_leaves = flat
        key = ("tree", src_def, tuple(src_leaves), tuple(dst_leaves), balance)
        hit = _PLAN_CACHE.get(key)
        if hit is None:
            hit = _plan_tree(src_paths, src_def, src_leaves, dst_leaves, balance)
            _remember(key, hit)
        _remember_identity(ident, src, dst, hit)
        return hit
    src_paths, src_leaves, src_def = flatten(src)
    if src_leaves and any(_is_jax_like(x) for x in src_leaves):
        from jreshard.jax_executor import adapter as _jax_plan  # the JAX executor's adapter; imports jax

        return _jax_plan.plan_from_jax(src, dst, balance=balance, **kwargs)
    if kwargs:
        raise TypeError(f"unexpected arguments {sorted(kwargs)!r}; they apply to jax arrays only")
    dst_paths, dst_leaves, dst_def = flatten(dst, is_leaf=lambda x: isinstance(x, Layout))
    if src_def != dst_def:
        raise ValueError(
            f"src and dst must be pytrees of the same structure; src is {describe(src_def)} and "
            f"dst is {describe(dst_def)}."
        )
    for p, s, d in zip(src_paths, src_leaves, dst_leaves, strict=True):
        _check_pair(path_str(p), s, d)
    key = ("tree", src_def, tuple(src_leaves), tuple(dst_leaves), balance)
    hit = _PLAN_CACHE.get(key)
    if hit is None:
        hit = _plan_tree(src_paths, src_def, src_leaves, dst_leaves, balance)
        _remember(key, hit)
    return hit


# Whole models are usually flat dicts {name: Layout} planned again and again with the
# same objects: a hit on (id(src), id(dst)) only re-checks keys and values by identity.
_IDENTITY_CACHE: OrderedDict = OrderedDict()


def _content(src: dict, dst: dict) -> tuple:
    return (tuple(src), tuple(src.values()), tuple(dst), tuple(dst.values()))


def _same_content(src: Any, dst: Any, snapshot: tuple) -> bool:
    return type(src) is dict and type(dst) is dict and _content(src, dst) == snapshot


def _remember_identity(ident: tuple, src: dict, dst: dict, value: Any) -> None:
    # Holding src and dst keeps their ids from being reused by other objects.
    _IDENTITY_CACHE[ident] = (src, dst, _content(src, dst), value)
    _IDENTITY_CACHE.move_to_end(ident)
    while len(_IDENTITY_CACHE) > _PLAN_CACHE_SIZE:
        _IDENTITY_CACHE.popitem(last=False)


def _flat_layout_dict(src: Any, dst: Any) -> tuple | None:
    """(paths, src leaves, treedef, dst leaves) when src and dst are flat dicts of Layouts
    with the same keys, the usual whole-model input; ``None`` sends other trees the general way."""
    if type(src) is not dict or type(dst) is not dict or len(src) != len(dst) or not src:
        return None
    keys = _sorted_keys(src)
    try:
        srcs = [src[k] for k in keys]
        dsts = [dst[k] for k in keys]
    except KeyError:
        return None
    if not (all(type(x) is Layout for x in srcs) and all(type(x) is Layout for x in dsts)):
        return None
    if any(s.shape != d.shape for s, d in zip(srcs, dsts, strict=True)):
        for k, s, d in zip(keys, srcs, dsts, strict=True):
            _check_pair(path_str((k,)), s, d)
    return [(k,) for k in keys], srcs, ("dict", tuple(keys), ("leaf",) * len(keys)), dsts


def _remember(key: tuple, value: Any) -> None:
    _PLAN_CACHE[key] = value
    _PLAN_CACHE.move_to_end(key)
    while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
        _PLAN_CACHE.popitem(last=False)


def _plan_tree(paths: list[tuple], treedef: Any, srcs: list[Layout], dsts: list[Layout], balance: bool) -> Plan:
    sizes: dict[tuple, int] = {}
    leaves = []
    for s, d in zip(srcs, dsts, strict=True):
        k = (s.dtype, d.dtype)
        size = sizes.get(k)
        if size is None:
            size = sizes[k] = _itemsize(s, d)
        leaves.append((s, d, size))
    groups, index = _plan_leaves(leaves, balance)
    return Plan(paths, treedef, leaves, groups, index)


def plan_layouts(pairs: list[tuple[str, Layout, Layout]], *, balance: bool = True) -> Plan:
    """Plans a flat list of (name, src, dst); executors use it after their own flattening."""
    paths = [(name,) if name else () for name, _, _ in pairs]
    for name, s, d in pairs:
        _check_pair(name, s, d)
    key = ("flat", tuple((n, s, d) for n, s, d in pairs), balance)
    hit = _PLAN_CACHE.get(key)
    if hit is None:
        hit = _plan_tree(paths, ("dict", tuple(n for n, _, _ in pairs), ("leaf",) * len(pairs)),
                         [s for _, s, _ in pairs], [d for _, _, d in pairs], balance)
        _remember(key, hit)
    return hit
