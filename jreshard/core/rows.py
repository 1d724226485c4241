"""Move rows of a group of tensors, stored compactly, and their sort orders.

A group is the tensors that share a shape and a pair of grids. Its rows are
sorted by (tensor, receiver, sender, box), so each tensor is a contiguous range.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from jreshard.core.pieces import Pieces

__all__ = ["GroupRows", "LeafRange", "MoveRows", "pair_order", "presorted_rows", "IN_ORDER"]


class LeafRange(NamedTuple):
    """Where one leaf's rows are: group ``group``, rows ``start:stop``."""

    group: int
    start: int
    stop: int


class MoveRows(NamedTuple):
    """One tensor's moves as arrays: sender, receiver, box lower and upper bounds."""

    src: np.ndarray
    dst: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


class CompressedRows(NamedTuple):
    """Rows of equal sender and receiver merged: bytes summed, ``count`` moves per row."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    count: np.ndarray


@dataclasses.dataclass(slots=True)
class GroupRows:
    """A group's move rows, tensor after tensor.

    General groups hold the rows as arrays. Regular groups (senders fixed by the mesh
    pair, no split rows) hold one sorted row set per mesh pair instead: tensor k's
    rows are its pair's rows with bytes scaled by its itemsize, so nothing of size
    tensors x pieces is built unless asked for (``src``, ``dst``, ... properties).
    """

    lower: dict[int, int]  # leaf -> lower bound bytes
    naive: dict[int, int]  # leaf -> gather-then-broadcast bytes
    _src: np.ndarray | None = None
    _dst: np.ndarray | None = None
    _nbytes: np.ndarray | None = None
    _lo: np.ndarray | None = None
    _hi: np.ndarray | None = None
    # Regular groups: per mesh pair c, sorted rows psrc[c], pdst[c] of pieces perm[c].
    pieces: Pieces | None = None
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

    def rows(self, a: int, b: int) -> MoveRows:
        """Rows a:b, one tensor's range."""
        if self._src is not None:
            return MoveRows(self._src[a:b], self._dst[a:b], self._lo[a:b], self._hi[a:b])
        c = int(self.inv[a // self.psrc.shape[1]])
        lo, hi = self._piece_boxes(c)
        return MoveRows(self.psrc[c], self.pdst[c], lo, hi)

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

    def compressed(self) -> CompressedRows:
        """Rows with counts: regular groups give one row per (pair, piece) for all their tensors."""
        if self._src is not None or self.psrc is None:
            return CompressedRows(self._src, self._dst, self._nbytes, np.ones(len(self._src), np.int64))
        C, M = self.psrc.shape
        weight = np.bincount(self.inv, weights=self.itemsize, minlength=C).astype(np.int64)  # bytes per element
        count = np.bincount(self.inv, minlength=C).astype(np.int64)
        vol = self.pieces.vol[self.perm] if self.perm is not None else np.broadcast_to(self.pieces.vol, (C, M))
        return CompressedRows(self.psrc.ravel(), self.pdst.ravel(), (vol * weight[:, None]).ravel(), np.repeat(count, M))

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


def _box_keys(p: Pieces) -> list[np.ndarray]:
    # np.lexsort sorts by its last key first: minor box dims go first.
    return [p.lo[:, k] for k in range(p.lo.shape[1] - 1, -1, -1)]


def pair_order(p: Pieces, pdst_c: np.ndarray, psrc_c: np.ndarray) -> np.ndarray | None:
    """Per mesh pair, the piece order sorted by (dst, src, box); ``None`` when already sorted."""
    keys = _box_keys(p)
    perms = np.empty(pdst_c.shape, dtype=np.int64)
    for c in range(len(pdst_c)):
        perms[c] = np.lexsort(keys + [psrc_c[c], pdst_c[c]])
    return None if (perms == np.arange(len(p.dst_pos))).all() else perms


IN_ORDER = np.zeros(0, dtype=np.int64)  # sentinel: the tiled rows are already sorted


def presorted_rows(p: Pieces, inv: np.ndarray, pdst_c: np.ndarray) -> np.ndarray | None:
    """Row order (into the tiled [T*M] rows) sorted by (tensor, dst, box), or None.

    Sorting a pair's M pieces once and gathering that order for each of its tensors
    avoids a lexsort over all rows. Senders were chosen per row, so the order must
    not depend on them: it holds only when every destination gets one piece.
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
