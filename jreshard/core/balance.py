"""Balancing: choose, among the replicas holding each overlap, the sender (docs/glossary.md).

Greedy longest-processing-time within each class of rows that share their set of
candidate senders (classes in order of total bytes), then a refinement that moves
or splits rows off the most loaded sender while that lowers the maximum.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from jreshard.core.overlaps import Overlaps
from jreshard.core.water import Fill, water_ends, water_rows

__all__ = ["Choice", "Split", "balance_senders"]


class Choice(NamedTuple):
    """The rows of one group whose sender may be any of several replicas.

    ``table[cls[r]]`` lists row r's candidate senders (device ids); ``rows`` index the
    group's tiled [tensors x overlaps] rows.
    """

    group: int
    rows: np.ndarray  # [N] row in the group
    table: np.ndarray  # [K, R] candidate sets
    cls: np.ndarray  # [N] candidate set of each row
    nbytes: np.ndarray  # [N]
    receivers: np.ndarray  # [N]
    overlaps: Overlaps  # the group's overlaps (row % M is an overlap)


class Split(NamedTuple):
    """A row cut by the refinement: it shrinks to ``[lo, hi)``, or is a new part (``is_new``)."""

    row: int  # row in the group
    lo: np.ndarray
    hi: np.ndarray
    src: int  # sender of a new part
    is_new: bool


@dataclasses.dataclass(slots=True)
class _Rows:
    """All choice rows of all groups in one table, the Choices' rows in turn; grows when the refinement
    splits a row."""

    cls: np.ndarray  # [N] dense candidate set (into the class table)
    nbytes: np.ndarray  # [N] float64
    chosen: np.ndarray  # [N] dense sender index
    starts: np.ndarray  # [Choices + 1] the first row of each Choice, then the original rows' count
    parent: dict[int, int] = dataclasses.field(default_factory=dict)  # split-off row -> original row

    def origin(self, r: int) -> tuple[int, int]:
        """The Choice row ``r`` comes from (its original row's, for a split-off part) and its row there."""
        r = self.parent.get(r, r)
        b = int(np.searchsorted(self.starts, r, side="right")) - 1
        return b, r - int(self.starts[b])

    PER_ROW = ("cls", "nbytes", "chosen")

    def grow(self, extra: int) -> None:
        for name in self.PER_ROW:
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros(extra, a.dtype)]))

    def truncate(self, n: int) -> None:
        for name in self.PER_ROW:
            setattr(self, name, getattr(self, name)[:n])


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


def balance_senders(choices: list[Choice], fixed_src: np.ndarray, fixed_bytes: np.ndarray,
                    balance: bool) -> tuple[list[np.ndarray], dict[int, list[Split]]]:
    """Assigns a sender to every choice row; may split rows across replicas.

    ``fixed_src``/``fixed_bytes`` are the loads senders carry whatever the choice.
    Returns the chosen sender per row of each Choice and, per group, its splits.
    """
    all_ids = np.unique(np.concatenate([fixed_src] + [c.table.ravel() for c in choices]))
    load = np.zeros(len(all_ids), dtype=np.float64)
    if len(fixed_src):
        np.add.at(load, np.searchsorted(all_ids, fixed_src), fixed_bytes.astype(np.float64))

    # Candidate sets (dense sender ids, padded with -1) live in a small table of
    # classes that rows point into.
    width = max(c.table.shape[1] for c in choices)
    tables, offsets = [], np.cumsum([0] + [len(c.table) for c in choices[:-1]]).tolist()
    for c in choices:
        dense = np.searchsorted(all_ids, np.sort(c.table, axis=1))
        pad = np.full((len(c.table), width), -1, np.int64)
        pad[:, : dense.shape[1]] = dense
        tables.append(pad)
    classes, table_class = _unique_rows(np.concatenate(tables))
    starts = np.concatenate([[0], np.cumsum([len(c.rows) for c in choices])])
    n_orig = int(starts[-1])
    # Each row array written Choice by Choice into one allocation (the rows of a frontier plan are many).
    rows = _Rows(cls=np.empty(n_orig, np.int64), nbytes=np.empty(n_orig, np.float64),
                 chosen=np.empty(n_orig, np.int64), starts=starts)
    for c, off, a, z in zip(choices, offsets, starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        rows.cls[a:z] = table_class[c.cls + off]
        rows.nbytes[a:z] = c.nbytes
    receivers = choices[0].receivers if len(choices) == 1 else np.concatenate([c.receivers for c in choices])
    _greedy(rows, classes, receivers, load, balance)

    splits: dict[int, list[Split]] = {}
    if balance:
        boxes = _refine(choices, rows, classes, load)
        # Shrunk original rows keep their sender; split-off rows are new rows.
        for r, (lo, hi) in boxes.items():
            b, brow = rows.origin(r)
            c = choices[b]
            splits.setdefault(c.group, []).append(
                Split(int(c.rows[brow]), lo, hi, int(all_ids[rows.chosen[r]]), r >= n_orig))
    assigned = [all_ids[rows.chosen[a:z]] for a, z in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)]
    return assigned, splits


def _greedy(rows: _Rows, classes: np.ndarray, receivers: np.ndarray, load: np.ndarray, balance: bool) -> None:
    """A first sender for every row, class after class (largest total bytes first)."""
    inverse, nbytes, chosen = rows.cls, rows.nbytes, rows.chosen
    totals = np.bincount(inverse, weights=nbytes, minlength=len(classes))
    fill = Fill.of(inverse, receivers, nbytes, len(classes)) if balance else None
    rest = None  # the rows of the classes the fill does not take, class after class in row order, and bounds
    for c in np.argsort(-totals, kind="stable"):
        members = classes[c][classes[c] >= 0]
        R = len(members)
        if fill is not None and fill.takes(c, R):
            fill.level(c, members, load)
            continue
        if rest is None:
            rest = _by_class(inverse, None if fill is None else fill.taken, len(classes))
        mine = rest[0][rest[1][c]:rest[1][c + 1]]
        size = nbytes[mine]
        if len(size) and not (size == size[0]).all():  # equal sizes: a stable sort keeps the order
            mine = mine[np.argsort(-size, kind="stable")]
        if not balance:
            chosen[mine] = members[0]
            load[members[0]] += nbytes[mine].sum()
        elif len(mine) > water_rows(R):
            _water_fill(mine[_stable_argsort(receivers[mine])], members, nbytes, chosen, load)
        else:
            # Longest-processing-time in chunks of R rows: each chunk's largest row goes
            # to the least loaded member, and so on.
            for start in range(0, len(mine), R):
                chunk = mine[start:start + R]
                senders = members[np.argsort(load[members], kind="stable")[: len(chunk)]]
                chosen[chunk] = senders
                load[senders] += nbytes[chunk]
    if fill is not None:
        fill.assign(chosen)


def _by_class(inverse: np.ndarray, taken: np.ndarray | None, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of every class not ``taken`` (of all, for ``None``), class after class in row order, and each
    class's bounds in them [n_classes + 1]."""
    rows = np.arange(len(inverse)) if taken is None else np.flatnonzero(~taken[inverse])
    order = rows[_stable_argsort(inverse[rows])]
    return order, np.concatenate([[0], np.cumsum(np.bincount(inverse[rows], minlength=n_classes))])


def _stable_argsort(a: np.ndarray) -> np.ndarray:
    """``np.argsort(a, kind="stable")`` of non-negative ints, by radix sort when they fit in 16 bits."""
    if len(a) and a.min() >= 0 and a.max() < 1 << 16:
        a = a.astype(np.uint16)  # the same permutation (a stable sort has one), in linear time
    return np.argsort(a, kind="stable")


def _water_fill(mine: np.ndarray, members: np.ndarray, nbytes: np.ndarray, chosen: np.ndarray,
                load: np.ndarray) -> None:
    """Fills ``members`` by water (``jreshard.core.water``) with rows ``mine``, sorted: each takes one run."""
    size = nbytes[mine]
    ends = water_ends(load[members], size.sum())
    # The middles increase, so each member's run ends where the next member's quota begins.
    cut = np.concatenate([[0], np.searchsorted(np.cumsum(size) - size / 2, ends[:-1], side="right"), [len(mine)]])
    runs = np.diff(cut)
    chosen[mine] = np.repeat(members, runs)
    np.add.at(load, members[runs > 0], np.add.reduceat(size, cut[:-1][runs > 0]))


def _refine(choices: list[Choice], rows: _Rows, classes: np.ndarray, load: np.ndarray,
            max_rounds: int | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Moves or splits rows off the most loaded sender while that lowers the maximum.

    Grows ``rows`` by the split-off parts and returns the boxes of rows that were
    split: row -> (lo, hi); rows past the original table are the split-off parts.
    """
    rounds = max_rounds if max_rounds is not None else 4 * len(load) + 16
    n = n_orig = len(rows.cls)
    boxes: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def least_loaded_alternative(dev: int):
        mine = np.nonzero(rows.chosen[:n] == dev)[0]
        if not len(mine):
            return None
        alt = classes[rows.cls[mine]]
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
        sizes = rows.nbytes[movable]
        fits = sizes <= delta
        if fits.any():
            r = int(movable[fits][np.argmax(sizes[fits])])
            rows.chosen[r] = best
            load[top] -= rows.nbytes[r]
            load[best] += rows.nbytes[r]
            continue
        r = int(movable[np.argmin(sizes)])
        if r in boxes:
            lo, hi = boxes[r]
        else:
            b, brow = rows.origin(r)
            c = choices[b]
            m = int(c.rows[brow]) % len(c.overlaps.dst_pos)
            lo, hi = c.overlaps.lo[m], c.overlaps.hi[m]
        ext = hi - lo
        if not len(ext):
            break
        dim = int(np.argmax(ext))
        per_row = rows.nbytes[r] / ext[dim]
        k = int(delta // per_row)
        if k < 1:
            break
        # Cut the last k rows of `dim` off into a new row sent by `best`.
        cut_lo, new_hi = lo.copy(), hi.copy()
        cut_lo[dim] = hi[dim] - k
        new_hi[dim] -= k
        boxes[r] = (lo, new_hi)
        boxes[n] = (cut_lo, hi.copy())
        if n == n_orig:
            rows.grow(rounds)  # room for split-off rows (at most one per round)
        rows.parent[n], rows.cls[n] = rows.parent.get(r, r), rows.cls[r]
        rows.nbytes[n], rows.chosen[n] = per_row * k, best
        rows.nbytes[r] -= per_row * k
        load[top] -= per_row * k
        load[best] += per_row * k
        n += 1
    rows.truncate(n)
    return boxes
