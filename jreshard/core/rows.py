"""Move rows of a group of tensors, stored compactly, and their sort orders.

A group is the tensors that share a shape and a pair of grids. Its rows are
sorted by (tensor, receiver, sender, box), so each tensor is a contiguous range.
A group is one of two kinds (``GroupRows``): ``ArrayRows`` hold every row, and
``PairRows`` hold one row set per mesh pair where the mesh pair fixes the senders.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from jreshard.core.overlaps import Overlaps

__all__ = ["ArrayRows", "GroupRows", "LeafBytes", "LeafRange", "LeafRanges", "MoveArrays", "MoveRows", "PairRows",
           "pair_order", "presorted_rows", "IN_ORDER"]


class LeafRange(NamedTuple):
    """Where one leaf's rows are: group ``group``, rows ``start:stop``."""

    group: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class LeafRanges:
    """Every leaf's ``LeafRange``, kept as three arrays (a plan of 200,000 leaves reads a few)."""

    group: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    def __len__(self) -> int:
        return len(self.group)

    def __getitem__(self, leaf: int) -> LeafRange:
        return LeafRange(int(self.group[leaf]), int(self.start[leaf]), int(self.stop[leaf]))


@dataclasses.dataclass(frozen=True, slots=True)
class LeafBytes:
    """A byte count per leaf of a group, as two arrays: the group's leaves, ascending, and their counts.

    A group of 200,000 tensors keeps two arrays, not a dict of 200,000 entries; a plan reads
    the total, and a tensor's count when its ``TensorPlan`` is built.
    """

    leaves: np.ndarray  # int64, ascending
    nbytes: np.ndarray  # int64

    def __getitem__(self, leaf: int) -> int:
        at = int(np.searchsorted(self.leaves, leaf))
        if at == len(self.leaves) or self.leaves[at] != leaf:
            raise KeyError(leaf)
        return int(self.nbytes[at])

    def total(self) -> int:
        """The counts' sum, as a Python int (exact: each group's total fits int64, ``_check_byte_counts``)."""
        return int(self.nbytes.sum())


class MoveRows(NamedTuple):
    """One tensor's moves as arrays: sender, receiver, box lower and upper bounds."""

    src: np.ndarray
    dst: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


class MoveArrays(NamedTuple):
    """A plan's moves as parallel arrays, one row per sender, receiver and bytes.

    A row stands for ``moves[i]`` moves from ``src[i]`` to ``dst[i]`` that carry
    ``nbytes[i]`` bytes together (elements when the layouts have no dtype). Rows
    with ``src == dst`` are local copies. Several rows may share a sender and a
    receiver; sum over them for per-pair totals.
    """

    src: np.ndarray  # int64 device ids
    dst: np.ndarray  # int64 device ids
    nbytes: np.ndarray  # int64
    moves: np.ndarray  # int64, at least 1


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayRows:
    """A group's move rows as arrays [rows], tensor after tensor."""

    lower: LeafBytes  # lower bound bytes per leaf
    naive: LeafBytes  # gather-then-broadcast bytes per leaf
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    lo: np.ndarray  # [rows, ndim]
    hi: np.ndarray  # [rows, ndim]

    def rows(self, a: int, b: int) -> MoveRows:
        """Rows a:b, one tensor's range."""
        return MoveRows(self.src[a:b], self.dst[a:b], self.lo[a:b], self.hi[a:b])

    def move_arrays(self) -> MoveArrays:
        """Every row, one move each."""
        return MoveArrays(self.src, self.dst, self.nbytes, np.ones(len(self.src), np.int64))



@dataclasses.dataclass(frozen=True, slots=True)
class PairRows:
    """A group whose senders the mesh pair fixes, without split rows: one row set per pair.

    Per mesh pair c, the sorted rows ``psrc[c]``, ``pdst[c]`` of overlaps ``perm[c]``;
    tensor k's rows are its pair's rows with bytes scaled by its itemsize, so nothing
    of size tensors x overlaps is built.
    """

    lower: LeafBytes  # lower bound bytes per leaf
    naive: LeafBytes  # gather-then-broadcast bytes per leaf
    overlaps: Overlaps
    perm: np.ndarray | None  # [C, M], None when every pair keeps overlap order
    psrc: np.ndarray  # [C, M]
    pdst: np.ndarray  # [C, M]
    inv: np.ndarray  # [T] pair of each tensor
    itemsize: np.ndarray  # [T]

    def rows(self, a: int, b: int) -> MoveRows:
        """Rows a:b, one tensor's range."""
        c = int(self.inv[a // self.psrc.shape[1]])
        if self.perm is None:
            lo, hi = self.overlaps.lo, self.overlaps.hi  # read-only, shared
        else:
            lo, hi = self.overlaps.lo[self.perm[c]], self.overlaps.hi[self.perm[c]]
            lo.setflags(write=False)
            hi.setflags(write=False)
        return MoveRows(self.psrc[c], self.pdst[c], lo, hi)

    def move_arrays(self) -> MoveArrays:
        """One row per (pair, overlap) for all the pair's tensors."""
        C, M = self.psrc.shape
        weight = np.bincount(self.inv, weights=self.itemsize, minlength=C).astype(np.int64)  # bytes per element
        count = np.bincount(self.inv, minlength=C).astype(np.int64)
        vol = self.overlaps.vol[self.perm] if self.perm is not None else np.broadcast_to(self.overlaps.vol, (C, M))
        nbytes = (vol * weight[:, None]).ravel()
        return MoveArrays(self.psrc.ravel(), self.pdst.ravel(), nbytes, np.repeat(count, M))



@dataclasses.dataclass(frozen=True, slots=True)
class TiledRows:
    """A group whose senders were chosen per row, without split rows, whose rows are sorted as they come:
    every tensor's rows are the group's overlaps in their own order, so only the senders are kept per row.

    Tensor k's rows are ``src[k*M:(k+1)*M]`` to ``pdst[inv[k]]``, boxes ``overlaps.lo``/``hi``, bytes
    the overlaps' volumes times ``itemsize[k]``; ``move_arrays`` expands them, nothing else does.
    """

    lower: LeafBytes  # lower bound bytes per leaf
    naive: LeafBytes  # gather-then-broadcast bytes per leaf
    overlaps: Overlaps
    src: np.ndarray  # [T*M] sender per row, tensor after tensor
    pdst: np.ndarray  # [C, M] receiver per pair and overlap
    inv: np.ndarray  # [T] pair of each tensor
    itemsize: np.ndarray  # [T]

    def rows(self, a: int, b: int) -> MoveRows:
        """Rows a:b, one tensor's range."""
        c = int(self.inv[a // self.pdst.shape[1]])
        return MoveRows(self.src[a:b], self.pdst[c], self.overlaps.lo, self.overlaps.hi)  # read-only, shared

    def move_arrays(self) -> MoveArrays:
        """Every row, one move each."""
        nbytes = (self.itemsize[:, None] * self.overlaps.vol[None, :]).ravel()
        return MoveArrays(self.src, self.pdst[self.inv].ravel(), nbytes, np.ones(len(self.src), np.int64))


GroupRows = ArrayRows | PairRows | TiledRows


def _box_keys(p: Overlaps) -> list[np.ndarray]:
    # np.lexsort sorts by its last key first: minor box dims go first.
    return [p.lo[:, k] for k in range(p.lo.shape[1] - 1, -1, -1)]


def pair_order(p: Overlaps, pdst_c: np.ndarray, psrc_c: np.ndarray) -> np.ndarray | None:
    """Per mesh pair, the overlap order sorted by (dst, src, box); ``None`` when already sorted."""
    keys = _box_keys(p)
    perms = np.empty(pdst_c.shape, dtype=np.int64)
    for c in range(len(pdst_c)):
        perms[c] = np.lexsort(keys + [psrc_c[c], pdst_c[c]])
    return None if (perms == np.arange(len(p.dst_pos))).all() else perms


IN_ORDER = np.zeros(0, dtype=np.int64)  # sentinel: the tiled rows are already sorted


def presorted_rows(p: Overlaps, inv: np.ndarray, pdst_c: np.ndarray) -> np.ndarray | None:
    """Row order (into the tiled [T*M] rows) sorted by (tensor, dst, box), or None.

    Sorting a pair's M overlaps once and gathering that order for each of its tensors
    avoids a lexsort over all rows. Senders were chosen per row, so the order must
    not depend on them: it holds only when every destination gets one overlap.
    """
    M = len(p.dst_pos)
    keys = _box_keys(p)
    perms = np.empty(pdst_c.shape, dtype=np.int64)
    for c in range(len(pdst_c)):
        perm = np.lexsort(keys + [pdst_c[c]])
        if M > 1 and (np.diff(pdst_c[c][perm]) == 0).any():
            return None
        perms[c] = perm
    if (perms == np.arange(M)).all():
        return IN_ORDER
    return (np.arange(len(inv), dtype=np.int64)[:, None] * M + perms[inv]).ravel()
