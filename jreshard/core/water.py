"""The water fill that balances a large class of rows over its candidate senders (``jreshard.core.balance``).

A class's rows, ordered by (receiver, larger bytes first, row), fill its members up to a common
level of load, each member taking one contiguous run of them (so few sender -> receiver pairs):
row i goes to the first member whose running quota ``ends[k]`` reaches the middle of row i in the
running sum of bytes. ``water_ends`` computes the quotas; ``Fill`` gives every row of every large
class its member without sorting or gathering rows: rows of one (class, receiver, size) are
consecutive in that order, so a table of such blocks names every row's member in one pass in
row order, and only the rows of a block that a run ends inside are ranked among their block.

Byte counts are integers, exact in float64 (below 2**53), so no sum here depends on the order it
is taken in: the fill gives the same members and loads as filling the sorted rows one by one.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Fill", "water_ends", "water_rows"]

MOST_SIZES = 8  # distinct row sizes (over all classes) the fill handles
MOST_BLOCKS = 1 << 22  # (class, receiver, size) blocks the fill's tables may have


def water_rows(R: int) -> int:
    """A class with more rows than this (``R`` candidate senders) is filled by water, not row by row."""
    return max(64 * R, 20_000)


def water_ends(have: np.ndarray, total: float) -> np.ndarray:
    """The running quotas [R] of members loaded ``have`` that take ``total`` bytes: the least loaded
    are filled up to a common level."""
    R = len(have)
    srt = np.sort(have)
    levels = (total + np.cumsum(srt)) / np.arange(1, R + 1)
    fits = np.nonzero(levels[:-1] <= srt[1:])[0]
    level = levels[fits[0]] if len(fits) else levels[-1]
    return np.cumsum(np.maximum(level - have, 0.0))


def _sizes(nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The distinct row sizes, largest first, and each row's rank among them (0 for the largest);
    ``None`` past ``MOST_SIZES``.

    Rows come in long runs of one size (a group's rows tile its tensors), so the sizes are read off
    the runs' first rows and the ranks written run by run: a few passes over the rows, not one per size.
    """
    starts = np.flatnonzero(nbytes[1:] != nbytes[:-1]) + 1
    if len(starts) > len(nbytes) // 16:  # short runs: size after size, over the rows themselves
        found: list[float] = []
        rest = nbytes
        while float(rest.max()) != -np.inf:
            if len(found) == MOST_SIZES:
                return None
            found.append(float(rest.max()))
            rest = np.where(rest == found[-1], -np.inf, rest)
        sizes = np.array(found)
        return sizes, np.searchsorted(-sizes, -nbytes)
    starts = np.concatenate([[0], starts])
    first = nbytes[starts]
    sizes = np.unique(first)[::-1]
    if len(sizes) > MOST_SIZES:
        return None
    rank_of_run = np.searchsorted(-sizes, -first)
    return sizes, np.repeat(rank_of_run, np.diff(np.concatenate([starts, [len(nbytes)]])))


class Fill:
    """The water fill of every large class: ``level`` each in its turn (loads grow), then ``assign``."""

    def __init__(self, key: np.ndarray, shape: tuple[int, int, int], sizes: np.ndarray) -> None:
        C, span, S = shape
        self.key, self.span_s, self.sizes = key, span * S, sizes
        self.per = np.bincount(key, minlength=C * span * S).reshape(C, span * S)  # rows per block
        self.count = self.per.sum(axis=1)
        self.block_size = np.tile(sizes, span)  # [span * S] bytes of a row of each block, in block order
        self.table = np.full(self.per.shape, -1, np.int64)  # the member of each block's rows
        self.cut: list[tuple[int, int, float, float, np.ndarray, np.ndarray]] = []  # blocks a run ends in
        self.taken = np.zeros(C, bool)

    @classmethod
    def of(cls, inverse: np.ndarray, receivers: np.ndarray, nbytes: np.ndarray, n_classes: int) -> Fill | None:
        """``None`` where no class is large, the rows have many sizes or the tables would be large."""
        if not len(inverse) or np.bincount(inverse, minlength=n_classes).max() <= water_rows(1):
            return None
        low = int(receivers.min())
        span = int(receivers.max()) - low + 1
        if n_classes * span * MOST_SIZES > MOST_BLOCKS:
            return None
        found = _sizes(nbytes)
        if found is None:
            return None
        sizes, rank = found
        # (class, receiver, size) of every row, in place: each temporary is as long as the rows.
        key = inverse * span
        key += receivers
        key -= low
        key *= len(sizes)
        key += rank
        return cls(key, (n_classes, span, len(sizes)), sizes)

    def takes(self, c: int, R: int) -> bool:
        return int(self.count[c]) > water_rows(R)

    def level(self, c: int, members: np.ndarray, load: np.ndarray) -> None:
        """Fills class ``c``'s members: ``load`` grows by what each takes; its rows' members are kept."""
        per, size = self.per[c], self.block_size
        nbytes = per * size
        before = np.cumsum(nbytes) - nbytes  # bytes of the class's rows before each block
        heads = water_ends(load[members], float(nbytes.sum()))[:-1]
        first = np.searchsorted(heads, before + size / 2)
        last = np.searchsorted(heads, before + (per - 1) * size + size / 2)
        self.table[c] = members[first]
        whole = (per > 0) & (first == last)
        np.add.at(load, members[first[whole]], nbytes[whole])
        for b in np.flatnonzero((per > 0) & (first != last)).tolist():
            at = np.searchsorted(heads, before[b] + np.arange(per[b]) * size[b] + size[b] / 2)
            np.add.at(load, members[at], size[b])
            self.cut.append((c, b, float(before[b]), float(size[b]), heads, members))
        self.taken[c] = True

    def assign(self, chosen: np.ndarray) -> None:
        """Writes the member of every row of the classes levelled into ``chosen``."""
        table = self.table.ravel()
        if self.taken.all():
            np.take(table, self.key, out=chosen)  # no temporary as long as the rows
        elif self.taken.any():
            rows = np.flatnonzero(self.taken[self.key // self.span_s])
            chosen[rows] = table[self.key[rows]]
        if not self.cut:
            return
        # The rows of blocks a run ends in, block after block, each in row order: its place in the block.
        where = {c * self.span_s + b: (before, size, heads, members) for c, b, before, size, heads, members in self.cut}
        mark = np.zeros(len(table), bool)
        mark[list(where)] = True
        rows = np.flatnonzero(mark[self.key])
        keys = self.key[rows]
        order = np.argsort(keys, kind="stable")
        rows, keys = rows[order], keys[order]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(keys)) + 1, [len(keys)]])
        for a, z in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
            before, size, heads, members = where[int(keys[a])]
            chosen[rows[a:z]] = members[np.searchsorted(heads, before + np.arange(z - a) * size + size / 2)]
