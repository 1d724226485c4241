"""Overlap geometry: every destination shard cut by the source shards it overlaps.

An *overlap* is the box one destination shard shares with one source shard; the planner
makes each one a move (or several, split across replicas), and the schedule places moves as
pieces (docs/glossary.md). Overlaps depend on the shape and the two grids only (not on device
ids), so tensors that share them share one cached ``Overlaps``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jreshard.core.layout import Layout, _grid

__all__ = ["GridKey", "Overlaps", "grid_key", "overlaps"]

# (mesh shape, axis names, axes per dim): what a layout's grid depends on.
GridKey = tuple[tuple[int, ...], tuple[str, ...], tuple[tuple[str, ...], ...]]


@dataclasses.dataclass(frozen=True, slots=True)
class Overlaps:
    """Row m is the overlap feeding destination mesh position ``dst_pos[m]`` from source shard ``src_shard[m]``.

    Rows are grouped by destination position; arrays are read-only.
    """

    dst_pos: np.ndarray  # [M] destination mesh position
    src_shard: np.ndarray  # [M] flat source shard id
    lo: np.ndarray  # [M, ndim]
    hi: np.ndarray  # [M, ndim]
    vol: np.ndarray  # [M] elements


def grid_key(layout: Layout) -> GridKey:
    return (layout.mesh.shape, layout.mesh.axis_names, layout.dim_axes)


def _dim_overlaps(n: int, cs: int, ct: int) -> tuple[np.ndarray, ...]:
    """Segments of [0, n) cut by both chunkings: (dst chunk, src chunk, lo, hi)."""
    if n == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e, e
    bp = np.unique(np.concatenate([np.arange(0, n, cs), np.arange(0, n, ct), [n]]).astype(np.int64))
    lo, hi = bp[:-1], bp[1:]
    return lo // ct, lo // cs, lo, hi


@functools.lru_cache(maxsize=4096)
def overlaps(shape: tuple[int, ...], src_key: GridKey, dst_key: GridKey) -> Overlaps:
    """The overlaps of every destination position for one shape and pair of grids."""
    src, dst = _grid(shape, *src_key), _grid(shape, *dst_key)
    ndim = len(shape)
    per_dim = [_dim_overlaps(n, cs, ct) for n, cs, ct in zip(shape, src.chunk, dst.chunk, strict=True)]
    counts = tuple(len(p[0]) for p in per_dim)
    total = math.prod(counts)
    idx = np.indices(counts, dtype=np.int64).reshape(ndim, total)

    def column(k: int, axis: int) -> np.ndarray:
        if not ndim:
            return np.zeros((0, total) if axis == 0 else (total, 0), np.int64)
        return np.stack([per_dim[d][k][idx[d]] for d in range(ndim)], axis=axis)

    j, i, lo, hi = column(0, 0), column(1, 0), column(2, 1), column(3, 1)
    j_flat = np.ravel_multi_index(j, dst.parts) if ndim else np.zeros(total, np.int64)
    i_flat = np.ravel_multi_index(i, src.parts) if ndim else np.zeros(total, np.int64)
    order = np.argsort(j_flat, kind="stable")
    j_flat, i_flat, lo, hi = j_flat[order], i_flat[order], lo[order], hi[order]
    per_shard = np.bincount(j_flat, minlength=math.prod(dst.parts))
    first = np.concatenate([[0], np.cumsum(per_shard)[:-1]])
    # Every destination position receives the overlaps of its shard.
    want = per_shard[dst.shard_flat]
    dst_pos = np.repeat(np.arange(len(dst.shard_flat), dtype=np.int64), want)
    offsets = np.arange(int(want.sum()), dtype=np.int64) - np.repeat(np.cumsum(want) - want, want)
    rows = np.repeat(first[dst.shard_flat], want) + offsets
    out = Overlaps(
        dst_pos=dst_pos,
        src_shard=np.asarray(i_flat, dtype=np.int64)[rows],
        lo=lo[rows],
        hi=hi[rows],
        vol=np.prod(hi[rows] - lo[rows], axis=1, dtype=np.int64) if ndim else np.ones(len(rows), np.int64),
    )
    for a in (out.dst_pos, out.src_shard, out.lo, out.hi, out.vol):
        a.setflags(write=False)
    return out
