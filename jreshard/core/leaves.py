"""Planning leaves in groups: candidates per mesh pair, balanced senders, sorted rows.

Leaves that share a shape and a pair of grids form a group with one set of overlaps
(``core/overlaps.py``). Within a group, rows of tensors with the same pair of meshes
differ only in the tensor index, so the mesh-dependent work runs once per pair.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple

import numpy as np

from jreshard.core.balance import Choice, Split, balance_senders
from jreshard.core.layout import Layout, _Grid, _grid
from jreshard.core.mesh import Mesh
from jreshard.core.overlaps import GridKey, Overlaps, grid_key, overlaps
from jreshard.core.rows import (
    IN_ORDER,
    ArrayRows,
    GroupRows,
    LeafBytes,
    LeafRanges,
    PairRows,
    TiledRows,
    pair_order,
    presorted_rows,
)

__all__ = ["Leaf", "plan_leaves"]


class Leaf(NamedTuple):
    """One tensor to plan: its two layouts and the bytes per element on the wire."""

    src: Layout
    dst: Layout
    itemsize: int


class GroupKey(NamedTuple):
    shape: tuple[int, ...]
    src: GridKey
    dst: GridKey


@dataclasses.dataclass(frozen=True, slots=True)
class _Stage:
    """A group after step 2: per mesh pair c, each overlap's receiver and first sender."""

    members: np.ndarray  # leaf indices, ascending
    overlaps: Overlaps
    src_ids: np.ndarray  # [C, S] source device ids per mesh pair
    itemsize: np.ndarray  # [T]
    inv: np.ndarray  # [T] mesh pair of each tensor
    pdst_c: np.ndarray  # [C, M] receiver per pair and overlap
    psrc_c: np.ndarray  # [C, M] sender per pair and overlap (local copy, or the first replica)
    local_c: np.ndarray  # [C, M] whether the receiver holds the overlap already
    lower: LeafBytes
    naive: LeafBytes


class _Chosen(NamedTuple):
    """Senders picked in step 3: ``src[i]`` sends row ``rows[i]`` of the group's tiled rows."""

    rows: np.ndarray
    src: np.ndarray


class _Pairs(NamedTuple):
    """The distinct leaves (by the identity of their layouts: a model's tensors share a few), and each leaf's."""

    uniq: list[Leaf]
    of: np.ndarray  # [leaves] index into uniq
    itemsize: np.ndarray  # [uniq]


def _distinct(leaves: list[Leaf]) -> _Pairs:
    # Leaves are often shared objects (the planner makes one per pair of layouts): number the
    # objects in C first, then their pairs in Python once per object.
    objs = list(map(id, leaves))
    by_obj = dict(zip(dict.fromkeys(objs), itertools.count()))  # in order of first leaf
    of_obj = np.fromiter(map(by_obj.__getitem__, objs), np.int64, count=len(objs))
    first_obj = np.unique(of_obj, return_index=True)[1].tolist()
    seen: dict[tuple[int, int, int], int] = {}
    pair_of = np.array([seen.setdefault((id(leaves[i].src), id(leaves[i].dst), leaves[i].itemsize), len(seen))
                        for i in first_obj], np.int64)
    of = pair_of[of_obj] if len(objs) else of_obj
    first = np.unique(of, return_index=True)[1]  # the first leaf of each distinct pair
    uniq = [leaves[i] for i in first.tolist()]
    return _Pairs(uniq, of, np.array([leaf.itemsize for leaf in uniq], np.int64))


def _groups(pairs: _Pairs) -> dict[GroupKey, np.ndarray]:
    """Leaves that share a shape and a pair of grids, in leaf order; groups in order of their first leaf."""
    keys: dict[GroupKey, int] = {}
    group_of = np.fromiter((keys.setdefault(GroupKey(s.shape, grid_key(s), grid_key(d)), len(keys))
                            for s, d, _ in pairs.uniq), np.int64, count=len(pairs.uniq))[pairs.of]
    order = np.argsort(group_of, kind="stable")
    bounds = np.searchsorted(group_of[order], np.arange(len(keys) + 1))
    return {key: order[bounds[g]:bounds[g + 1]] for key, g in keys.items()}


def plan_leaves(leaves: list[Leaf], balance: bool = True,
                of: np.ndarray | None = None) -> tuple[list[GroupRows], LeafRanges]:
    """Plans every leaf; returns per-group rows and each leaf's range in them.

    ``of``: the leaves are given by class, leaf ``i`` being ``leaves[of[i]]``; classes must be
    numbered in the order of their first leaf.
    """
    pairs = _distinct(leaves) if of is None else _Pairs(leaves, of, np.array([x.itemsize for x in leaves], np.int64))
    stages: list[_Stage] = []
    choices: list[Choice] = []
    fixed_load: dict[int, float] = {}  # sender -> bytes it must send whatever the balancing
    for key, members in _groups(pairs).items():
        stage = _stage(key, members, pairs)
        choice = _choice(len(stages), stage, key)
        stages.append(stage)
        if choice is not None:
            choices.append(choice)
        else:
            _add_fixed_load(stage, fixed_load)

    # Step 3: choose replicas across all groups at once.
    splits: dict[int, list[Split]] = {}
    chosen: dict[int, _Chosen] = {}
    if choices:
        fsrc = np.fromiter(fixed_load.keys(), dtype=np.int64, count=len(fixed_load))
        fbytes = np.fromiter(fixed_load.values(), dtype=np.float64, count=len(fixed_load))
        assigned, splits = balance_senders(choices, fsrc, fbytes, balance)
        for c, senders in zip(choices, assigned, strict=True):
            chosen[c.group] = _Chosen(c.rows, senders)

    results: list[GroupRows] = []
    group, start, stop = (np.zeros(len(pairs.of), np.int64) for _ in range(3))
    for gi, stage in enumerate(stages):
        rows, bounds = _assemble(stage, chosen.get(gi), splits.get(gi))
        group[stage.members], start[stage.members], stop[stage.members] = gi, bounds[:-1], bounds[1:]
        results.append(rows)
    return results, LeafRanges(group, start, stop)


def _mesh_table(meshes: list[Mesh]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct meshes (by identity: tensors of a model share a few Mesh objects) as an
    id table [C, size], plus each tensor's row in it."""
    rows: dict[int, int] = {}
    uniq: list[Mesh] = []
    inv = np.empty(len(meshes), dtype=np.int64)
    for k, m in enumerate(meshes):
        j = rows.get(id(m))
        if j is None:
            j = rows[id(m)] = len(uniq)
            uniq.append(m)
        inv[k] = j
    return np.array([m.device_ids for m in uniq], dtype=np.int64), inv


def _combos(members: np.ndarray, pairs: _Pairs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (src mesh, dst mesh) pairs of a group: src ids [C, S], dst ids [C, D], tensor -> pair."""
    # Distinct leaves are numbered in order of their first leaf, so their meshes are met in
    # the same order as the members' meshes.
    mine, local = _unique_small(pairs.of[members], len(pairs.uniq))
    local = local.ravel()
    s_tab, s_inv = _mesh_table([pairs.uniq[i].src.mesh for i in mine.tolist()])
    d_tab, d_inv = _mesh_table([pairs.uniq[i].dst.mesh for i in mine.tolist()])
    uniq, inv = _unique_small(s_inv[local] * len(d_tab) + d_inv[local], len(s_tab) * len(d_tab))
    return s_tab[uniq // len(d_tab)], d_tab[uniq % len(d_tab)], inv.ravel()


def _lookup(sorted_keys: np.ndarray, sorted_vals: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Values for ``queries`` in a sorted key table, -1 where absent."""
    pos = np.minimum(np.searchsorted(sorted_keys, queries), len(sorted_keys) - 1)
    return np.where(sorted_keys[pos] == queries, sorted_vals[pos], -1)


def _own_position(src_ids: np.ndarray, dst_ids: np.ndarray) -> np.ndarray:
    """[C, D]: where each destination device sits in its pair's source mesh (-1: absent)."""
    C = len(src_ids)
    big = int(max(src_ids.max(), dst_ids.max())) + 1
    row_off = np.arange(C, dtype=np.int64)[:, None] * big
    order = np.argsort(src_ids, axis=1)
    keys = (np.take_along_axis(src_ids, order, axis=1) + row_off).ravel()
    return _lookup(keys, order.ravel(), (dst_ids + row_off).ravel()).reshape(C, -1)


def _lacking(sgrid: _Grid, dgrid: _Grid, dst_src_pos: np.ndarray, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """Per pair, the elements destinations lack (the lower bound); and each destination shard's size."""
    dvol = np.prod(dgrid.stop - dgrid.start, axis=1, dtype=np.int64) if ndim else np.ones(len(dgrid.start), np.int64)
    if (dst_src_pos < 0).all():
        return np.full(len(dst_src_pos), int(dvol.sum()), np.int64), dvol
    held = dst_src_pos[..., None] >= 0
    at = np.maximum(dst_src_pos, 0)
    own_lo = np.maximum(dgrid.start[None], np.where(held, sgrid.start[at], 0))
    own_hi = np.minimum(dgrid.stop[None], np.where(held, sgrid.stop[at], 0))
    if ndim:
        own = np.prod(np.maximum(own_hi - own_lo, 0), axis=2, dtype=np.int64)
    else:
        own = (dst_src_pos >= 0).astype(np.int64)
    return (dvol[None] - own).sum(axis=1), dvol


def _stage(key: GroupKey, members: np.ndarray, pairs: _Pairs) -> _Stage:
    """Step 2 for one group: receivers, local copies and first senders per mesh pair."""
    p = overlaps(*key)
    sgrid, dgrid = _grid(key.shape, *key.src), _grid(key.shape, *key.dst)
    src_ids, dst_ids, inv = _combos(members, pairs)  # [C, S], [C, D], [T]
    itemsize = pairs.itemsize[pairs.of[members]]
    dst_src_pos = _own_position(src_ids, dst_ids)
    dst_src_shard = np.where(dst_src_pos >= 0, sgrid.shard_flat[np.maximum(dst_src_pos, 0)], -1)

    # Lower bound and naive bytes, computed from the layouts, not from the moves.
    lacking_c, dvol = _lacking(sgrid, dgrid, dst_src_pos, len(key.shape))
    lacking = lacking_c[inv] * itemsize
    naive = int((dvol > 0).sum()) * math.prod(key.shape) * itemsize

    M = len(p.dst_pos)
    pdst_c = dst_ids[:, p.dst_pos]  # [C, M]
    local_c = dst_src_shard[:, p.dst_pos] == p.src_shard[None, :]
    first = src_ids[:, sgrid.groups[p.src_shard, 0]] if M else pdst_c
    psrc_c = np.where(local_c, pdst_c, first)
    _frozen(members, lacking, naive)
    return _Stage(members, p, src_ids, itemsize, inv, pdst_c, psrc_c, local_c,
                  LeafBytes(members, lacking), LeafBytes(members, naive))


def _choice(gi: int, stage: _Stage, key: GroupKey) -> Choice | None:
    """The rows of a group whose sender is free among replicas (``None`` if senders are fixed)."""
    p, inv = stage.overlaps, stage.inv
    groups = _grid(key.shape, *key.src).groups  # [num src shards, R]
    M, R = len(p.dst_pos), groups.shape[1]
    if R == 1 or not M:
        return None
    n_shards, T = len(groups), len(inv)
    # A row's candidates depend only on its mesh pair and source shard: keep one table
    # of candidate sets and a class per row, not [rows, R] candidates.
    if not stage.local_c.any():  # every row free: per-row arrays tiled from [pairs, overlaps] tables
        pair_key = np.arange(len(stage.src_ids))[:, None] * n_shards + p.src_shard[None, :]  # [C, M]
        uniq, pair_cls = _unique_small(pair_key.ravel(), len(stage.src_ids) * n_shards)
        rows = np.arange(T * M)
        cls = pair_cls.reshape(pair_key.shape)[inv].ravel()
        nbytes = (stage.itemsize[:, None] * p.vol[None, :]).ravel()
        receivers = stage.pdst_c[inv].ravel()
    else:
        free = ~stage.local_c[inv].ravel()
        if not free.any():
            return None
        rows = np.nonzero(free)[0]
        tensor, overlap = np.divmod(rows, M)
        combo = inv[tensor]
        uniq, cls = _unique_small(combo * n_shards + p.src_shard[overlap], len(stage.src_ids) * n_shards)
        cls = cls.ravel()
        nbytes = p.vol[overlap] * stage.itemsize[tensor]
        receivers = stage.pdst_c[combo, overlap]
    table = stage.src_ids[(uniq // n_shards)[:, None], groups[uniq % n_shards]]
    return Choice(gi, rows, table, cls, nbytes, receivers, p)


def _add_fixed_load(stage: _Stage, fixed_load: dict[int, float]) -> None:
    """Adds the bytes each sender of a fixed-sender group sends, per mesh pair."""
    if not len(stage.overlaps.dst_pos):
        return
    weight = np.bincount(stage.inv, weights=stage.itemsize, minlength=len(stage.pdst_c))
    pairs = np.nonzero(weight)[0]
    send = ~stage.local_c[pairs]  # [pairs, M]: every mesh pair at once
    ids = stage.psrc_c[pairs][send]
    b = (stage.overlaps.vol[None, :] * weight[pairs][:, None])[send]
    uniq, inv = _unique_small(ids, int(ids.max(initial=-1)) + 1)  # device ids: non-negative (Mesh)
    # Whole byte counts: float64 adds them exactly (below 2**53), in any order.
    totals = np.bincount(inv.ravel(), weights=b, minlength=len(uniq))
    for sid, total in zip(uniq.tolist(), totals.tolist(), strict=True):
        fixed_load[sid] = fixed_load.get(sid, 0.0) + total


def _frozen(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.setflags(write=False)


class _Tiled(NamedTuple):
    """A group's rows tiled over its tensors, unsorted: sender and receiver of each [T*M]."""

    src: np.ndarray
    dst: np.ndarray


def _assemble(stage: _Stage, chosen: _Chosen | None, splits: list[Split] | None) -> tuple[GroupRows, np.ndarray]:
    """A group's rows sorted by (tensor, dst, src, box), and each tensor's row bounds [T + 1]."""
    p, T, M = stage.overlaps, len(stage.members), len(stage.overlaps.dst_pos)
    if chosen is None and splits is None and M:
        # Senders fixed by the mesh pair: keep one sorted row set per pair.
        perms = pair_order(p, stage.pdst_c, stage.psrc_c)
        take = (lambda x: x) if perms is None else (lambda x: np.take_along_axis(x, perms, axis=1))
        ps, pd = take(stage.psrc_c), take(stage.pdst_c)
        _frozen(ps, pd, stage.inv, stage.itemsize)
        pair_rows = PairRows(stage.lower, stage.naive, overlaps=p, perm=perms, psrc=ps, pdst=pd,
                             inv=stage.inv, itemsize=stage.itemsize)
        return pair_rows, np.arange(T + 1) * M
    # Senders chosen per row: tile the pairs' rows over the tensors [T*M].
    tiled = _Tiled(stage.psrc_c[stage.inv].ravel(), stage.pdst_c[stage.inv].ravel())
    if chosen is not None:
        tiled.src[chosen.rows] = chosen.src
    if splits is None and M:
        order = presorted_rows(p, stage.inv, stage.pdst_c)
        if order is IN_ORDER or (order is None and _in_order(stage, tiled.src)):
            _frozen(tiled.src, stage.pdst_c)
            tiled_rows = TiledRows(stage.lower, stage.naive, overlaps=p, src=tiled.src, pdst=stage.pdst_c,
                                   inv=stage.inv, itemsize=stage.itemsize)
            return tiled_rows, np.arange(T + 1) * M
        if order is not None:
            return _presorted_group(stage, tiled, order), np.arange(T + 1) * M
    return _general_group(stage, tiled, splits or [])


def _in_order(stage: _Stage, src: np.ndarray) -> bool:
    """Whether the tiled rows (senders ``src`` [T*M]) are sorted already, as ``_general_group`` would sort
    them by ``_row_key`` (tensor, dst, src, box), every overlap kept; without building the key."""
    p, T, M = stage.overlaps, len(stage.members), len(stage.overlaps.dst_pos)
    if _row_key_bound(p, T, src, stage.pdst_c) is None or not (p.vol > 0).all():
        return False
    if M < 2:
        return True
    pd = stage.pdst_c[np.unique(stage.inv)]
    if (pd[:, 1:] < pd[:, :-1]).any():
        return False
    same_dst = (stage.pdst_c[:, 1:] == stage.pdst_c[:, :-1])[stage.inv]  # [T, M-1]
    rank = _box_rank(p)
    s = src.reshape(T, M)
    up = (s[:, 1:] > s[:, :-1]) | ((s[:, 1:] == s[:, :-1]) & (rank[1:] > rank[:-1]))
    return bool((up | ~same_dst).all())


def _presorted_group(stage: _Stage, tiled: _Tiled, order: np.ndarray) -> ArrayRows:
    p, T, M, itemsize = stage.overlaps, len(stage.members), len(stage.overlaps.dst_pos), stage.itemsize
    uniform = bool((itemsize == itemsize[0]).all())
    if order is IN_ORDER:
        s, d = tiled.src, tiled.dst
        nbytes = np.tile(p.vol * int(itemsize[0]), T) if uniform else np.tile(p.vol, T) * np.repeat(itemsize, M)
        lo, hi = np.tile(p.lo, (T, 1)), np.tile(p.hi, (T, 1))
    else:
        s, d = tiled.src[order], tiled.dst[order]
        overlap = order % M
        vol = p.vol[overlap]
        nbytes = vol * int(itemsize[0]) if uniform else vol * np.repeat(itemsize, M)
        lo, hi = p.lo[overlap], p.hi[overlap]
    _frozen(s, d, nbytes)
    return ArrayRows(stage.lower, stage.naive, s, d, nbytes, lo, hi)


def _general_group(stage: _Stage, tiled: _Tiled, splits: list[Split]) -> tuple[ArrayRows, np.ndarray]:
    """Rows built and sorted one by one: split rows, or orders that depend on the senders."""
    p, T, M = stage.overlaps, len(stage.members), len(stage.overlaps.dst_pos)
    lo, hi = np.tile(p.lo, (T, 1)), np.tile(p.hi, (T, 1))
    t, s, d = np.repeat(np.arange(T, dtype=np.int64), M), tiled.src, tiled.dst
    if splits:
        # An original row shrinks in place, a split-off part is a new row.
        for e in splits:
            if not e.is_new:
                lo[e.row], hi[e.row] = e.lo, e.hi
        grown = [e for e in splits if e.is_new]
        ndim = lo.shape[1]
        t = np.concatenate([t, np.array([t[e.row] for e in grown], np.int64)])
        s = np.concatenate([s, np.array([e.src for e in grown], np.int64)])
        d = np.concatenate([d, np.array([d[e.row] for e in grown], np.int64)])
        lo = np.concatenate([lo, np.array([e.lo for e in grown], np.int64).reshape(-1, ndim)])
        hi = np.concatenate([hi, np.array([e.hi for e in grown], np.int64).reshape(-1, ndim)])
    vol = np.prod(hi - lo, axis=1, dtype=np.int64) if lo.shape[1] else np.ones(len(t), np.int64)
    keep = vol > 0
    key = None if splits else _row_key(p, T, s, d)
    if not keep.all():
        t, s, d, lo, hi, vol = t[keep], s[keep], d[keep], lo[keep], hi[keep], vol[keep]
        key = None if key is None else key[keep]
    order: np.ndarray | None
    if key is not None:  # one int64 per row: one sort, not one per key, and none if already in order
        order = None if bool((key[1:] > key[:-1]).all()) else np.argsort(key)
    else:
        sort_keys = [lo[:, k] for k in range(lo.shape[1] - 1, -1, -1)] + [s, d, t]
        order = np.lexsort(sort_keys) if len(t) else np.zeros(0, np.int64)
    if order is not None:
        t, s, d, lo, hi, vol = t[order], s[order], d[order], lo[order], hi[order], vol[order]
    nbytes = vol * stage.itemsize[t]
    _frozen(s, d, lo, hi, nbytes)
    return ArrayRows(stage.lower, stage.naive, s, d, nbytes, lo, hi), np.searchsorted(t, np.arange(T + 1))


def _row_key(p: Overlaps, T: int, s: np.ndarray, d: np.ndarray) -> np.ndarray | None:
    """Rows tiled over ``T`` tensors (``M`` overlaps each) as one int64 that sorts like (tensor, dst, src, box).

    Without splits every tensor has the group's ``M`` boxes, so a box's place in that order is its
    rank among the ``M`` (ties by overlap index, as a stable sort leaves them): the key is unique per
    row. ``None`` when the key would not fit in int64 or a device id is negative.
    """
    M = len(p.dst_pos)
    bound = _row_key_bound(p, T, s, d)
    if bound is None:
        return None
    n_s, n_d = bound
    t = np.repeat(np.arange(T, dtype=np.int64), M)
    return ((t * n_d + d) * n_s + s) * M + np.tile(_box_rank(p), T)


def _row_key_bound(p: Overlaps, T: int, s: np.ndarray, d: np.ndarray) -> tuple[int, int] | None:
    """The radixes (senders, receivers) of ``_row_key``, or ``None`` where it has no key."""
    M = len(p.dst_pos)
    if not len(s) or s.min() < 0 or d.min() < 0:
        return None
    n_s, n_d = int(s.max()) + 1, int(d.max()) + 1
    return None if T * n_d * n_s * M >= 1 << 62 else (n_s, n_d)


def _box_rank(p: Overlaps) -> np.ndarray:
    """Each overlap's place among the group's boxes sorted by their lower corners (ties by overlap index)."""
    M, ndim = len(p.dst_pos), p.lo.shape[1]
    rank = np.empty(M, np.int64)
    rank[np.lexsort([p.lo[:, k] for k in range(ndim - 1, -1, -1)]) if ndim else np.arange(M)] = np.arange(M)
    return rank


def _unique_small(a: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, return_inverse=True)`` of ints in ``[0, bound)``; by a table, not a sort, for a small bound."""
    if bound > 4 * len(a) + 1024:
        return np.unique(a, return_inverse=True)
    present = np.zeros(bound, bool)
    present[a] = True
    return np.flatnonzero(present), (np.cumsum(present) - 1)[a]

