"""Box: one half-open range ``[lo, hi)`` per dim, the only representation of a region.

See docs/glossary.md (*box*, *shard*). A ``Box`` is a tuple of ``slice`` objects, so
``array[box]`` indexes NumPy arrays, torch tensors and jax arrays directly, and a box
compares equal to the plain tuple of slices it holds.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from jreshard.core.args import INT64_MAX, check_int

__all__ = ["Box", "split_box"]


def _index(value: Any, what: str) -> int:
    """``value`` as a Python int (NumPy integers included), or TypeError naming ``what``."""
    return check_int(what, value, minimum=-INT64_MAX - 1)


class Box(tuple):
    """One half-open range ``[lo, hi)`` per dim, as a tuple of ``slice(lo, hi)``.

    Build one from slices or ``(lo, hi)`` pairs, or with ``Box.from_bounds(lo, hi)``.
    Bounds are non-negative ints with ``lo <= hi`` (an empty range is allowed).

    Example:
      >>> from jreshard import Box
      >>> box = Box([(0, 6), (2, 4)])
      >>> box == (slice(0, 6), slice(2, 4)), box.shape, box.size, str(box)
      (True, (6, 2), 12, '[0:6, 2:4]')
      >>> str(box.intersect(Box.from_bounds((4, 0), (8, 3))))
      '[4:6, 2:3]'
    """

    __slots__ = ()

    def __new__(cls, dims: Iterable[Any] = ()) -> Box:
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Iterable):
            raise TypeError(
                f"box must be a sequence of slices or (lo, hi) pairs, got {type(dims).__name__} {dims!r}."
            )
        out = []
        for dim, entry in enumerate(dims):
            if isinstance(entry, slice):
                if entry.step not in (None, 1):
                    raise ValueError(f"box dim {dim} has step {entry.step!r}; a box holds unit-step ranges.")
                lo, hi = entry.start, entry.stop
                if lo is None or hi is None:
                    raise ValueError(
                        f"box dim {dim} is {entry!r}; give both bounds, e.g. slice(0, n) "
                        "(Layout.holders clips open slices to the shape)."
                    )
            elif isinstance(entry, Sequence) and not isinstance(entry, (str, bytes)) and len(entry) == 2:
                lo, hi = entry
            else:
                raise TypeError(f"box dim {dim} must be a slice or a (lo, hi) pair, got {entry!r}.")
            lo, hi = _index(lo, f"box dim {dim} lower bound"), _index(hi, f"box dim {dim} upper bound")
            if not 0 <= lo <= hi:
                raise ValueError(f"box dim {dim} is [{lo}, {hi}); bounds must satisfy 0 <= lo <= hi.")
            out.append(slice(lo, hi))
        return tuple.__new__(cls, out)

    @classmethod
    def from_bounds(cls, lo: Iterable[Any], hi: Iterable[Any]) -> Box:
        """The box ``[lo[d], hi[d])`` per dim (``lo`` and ``hi`` of equal length)."""
        lo_t, hi_t = tuple(lo), tuple(hi)
        if len(lo_t) != len(hi_t):
            raise ValueError(f"lo {lo_t!r} and hi {hi_t!r} must have one bound per dim each.")
        return cls(zip(lo_t, hi_t, strict=True))

    @classmethod
    def _trusted(cls, lo: Iterable[Any], hi: Iterable[Any]) -> Box:
        # Hot paths (shards, moves) pass bounds that are already valid.
        return tuple.__new__(cls, [slice(int(a), int(b)) for a, b in zip(lo, hi, strict=True)])

    @property
    def lo(self) -> tuple[int, ...]:
        return tuple(s.start for s in self)

    @property
    def hi(self) -> tuple[int, ...]:
        return tuple(s.stop for s in self)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self)

    @property
    def size(self) -> int:
        """Elements in the box (1 for a 0-d box)."""
        return math.prod(self.shape)

    @property
    def empty(self) -> bool:
        return any(s.stop == s.start for s in self)

    def slices(self) -> tuple[slice, ...]:
        """The box as a plain tuple of slices."""
        return tuple(self)

    def bounds(self) -> tuple[tuple[int, int], ...]:
        """The box as ``((lo, hi), ...)`` pairs."""
        return tuple((s.start, s.stop) for s in self)

    def intersect(self, other: Sequence[slice]) -> Box:
        """The common part of two boxes of the same ndim; empty (``lo == hi``) where they miss."""
        if len(other) != len(self):
            raise ValueError(f"cannot intersect a {len(self)}-dim box with a {len(other)}-dim box {other!r}.")
        out = []
        for a, b in zip(self, other, strict=True):
            lo = max(a.start, b.start)
            out.append(slice(lo, max(lo, min(a.stop, b.stop))))
        return tuple.__new__(Box, out)

    def contains(self, other: Sequence[slice]) -> bool:
        """Whether ``other`` lies inside this box (an empty ``other`` lies inside if its bounds do)."""
        return len(other) == len(self) and all(
            a.start <= b.start and b.stop <= a.stop for a, b in zip(self, other, strict=True)
        )

    def relative_to(self, outer: Sequence[slice]) -> Box:
        """This box in the coordinates of ``outer`` (a shard that contains it)."""
        if len(outer) != len(self) or not all(
            o.start <= a.start and a.stop <= o.stop for a, o in zip(self, outer, strict=True)
        ):
            raise ValueError(f"box {self} does not lie inside {Box(outer)}.")
        pairs = zip(self, outer, strict=True)
        return tuple.__new__(Box, [slice(a.start - o.start, a.stop - o.start) for a, o in pairs])

    def __str__(self) -> str:
        return "[" + ", ".join(f"{s.start}:{s.stop}" for s in self) + "]"

    if sys.version_info < (3, 12):
        # slices are unhashable before 3.12; from 3.12 on tuple's hash agrees with
        # equality to a plain tuple of slices.
        def __hash__(self) -> int:
            return hash(self.bounds())

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (tuple(self),)


def split_box(box: Sequence[slice], itemsize: int, limit: int) -> list[Box]:
    """Cuts ``box`` into parts of at most ``limit`` bytes, each contiguous in row-major order.

    Parts come in row-major order and cover ``box`` exactly once: outer dims are cut
    into single rows until the inner rows fit, then runs of ``limit // row bytes``
    rows are taken. A single element larger than ``limit`` is a part of its own; an
    empty box is returned whole.

    Example:
      >>> from jreshard.core.box import Box, split_box
      >>> [str(b) for b in split_box(Box([(0, 3), (0, 4)]), 4, 40)]
      ['[0:2, 0:4]', '[2:3, 0:4]']
      >>> [str(b) for b in split_box(Box([(0, 2), (0, 4)]), 4, 8)]
      ['[0:1, 0:2]', '[0:1, 2:4]', '[1:2, 0:2]', '[1:2, 2:4]']
    """
    box = box if isinstance(box, Box) else Box(box)
    itemsize = _index(itemsize, "itemsize")
    limit = _index(limit, "limit")
    if itemsize < 1 or limit < 1:
        raise ValueError(f"itemsize and limit must be positive byte counts, got {itemsize} and {limit}.")
    ext = box.shape
    if box.size * itemsize <= limit or not ext:
        return [box]
    # inner[k]: bytes of one index of dim k (all dims after k whole).
    inner = [itemsize] * len(ext)
    for k in range(len(ext) - 2, -1, -1):
        inner[k] = inner[k + 1] * ext[k + 1]
    k = next(j for j in range(len(ext)) if inner[j] <= limit or j == len(ext) - 1)
    step = max(1, limit // inner[k])
    lo, hi = box.lo, box.hi
    out = []
    for outer in itertools.product(*(range(lo[j], hi[j]) for j in range(k))):
        for a in range(lo[k], hi[k], step):
            b = min(a + step, hi[k])
            out.append(Box._trusted(outer + (a,) + lo[k + 1:], tuple(x + 1 for x in outer) + (b,) + hi[k + 1:]))
    return out
