"""Tensors of a sync grouped into classes that share their source and destination layouts.

A model of 70,000 tensors has a few hundred distinct (source, destination) layout
pairs: a layout holds the shape, the dtype, the mesh and the spec. Whatever does not
choose senders across tensors (the baselines, flat direct sends) plans one tensor
per class and counts it as many times as the class has tensors; the bytes, the
messages and the per-device loads are then the same as tensor by tensor.

Example:
  >>> from jreshard import Layout, Mesh
  >>> from jreshard.fleet.classes import classes
  >>> a = Layout((4,), Mesh([0, 1], "x"), ("x",), "float32")
  >>> b = Layout((4,), Mesh([2], "y"), (), "float32")
  >>> k = classes({"w": a, "v": a, "u": b}, {"w": b, "v": b, "u": b})
  >>> k.names, k.of.tolist(), k.counts.tolist()
  (['u', 'v', 'w'], [0, 1, 1], [1, 2])
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

import numpy as np

from jreshard.core.layout import Layout
from jreshard.core.planner import Plan, plan_layouts
from jreshard.core.rows import MoveArrays

__all__ = ["Classes", "classes", "class_parts", "class_rows"]


class Classes(NamedTuple):
    """Tensors ``names`` (sorted) and, per class ``k``, its layouts ``pairs[k]`` and ``counts[k]`` tensors."""

    names: list[str]
    pairs: list[tuple[Layout, Layout]]
    of: np.ndarray  # [T] the class of names[t]
    counts: np.ndarray  # [K] tensors per class

    def per_tensor(self, values: Iterable[float]) -> np.ndarray:
        """A value per class spread to a value per tensor, in ``names`` order."""
        return np.fromiter(values, dtype=float, count=len(self.pairs))[self.of]

    def without(self, names: Collection[str]) -> Classes:
        """The same classes without the tensors ``names`` (classes left empty dropped, the rest renumbered)."""
        if not names:
            return self
        keep = np.fromiter((n not in names for n in self.names), dtype=bool, count=len(self.names))
        used, of = np.unique(self.of[keep], return_inverse=True)
        return Classes([n for n, k in zip(self.names, keep.tolist(), strict=True) if k],
                       [self.pairs[c] for c in used.tolist()], of.ravel(), np.bincount(of.ravel(), minlength=len(used)))


def classes(src: Mapping[str, Layout], dst: Mapping[str, Layout], names: Iterable[str] | None = None) -> Classes:
    """The tensors ``names`` (default: all of ``src``, sorted) grouped by their pair of layouts."""
    names = sorted(src) if names is None else list(names)
    # By identity first (cheap: a model's tensors share a few Layout objects), then by value;
    # the passes over every tensor run in C (map, zip, dict), not in Python.
    srcs, dsts = list(map(src.__getitem__, names)), list(map(dst.__getitem__, names))
    ids = list(zip(map(id, srcs), map(id, dsts), strict=True))
    pair_of = dict(zip(ids, zip(srcs, dsts, strict=True), strict=True))  # identity -> the pair
    by_id = dict(zip(dict.fromkeys(ids), itertools.count()))  # numbered in order of first tensor
    first = list(map(pair_of.__getitem__, by_id))
    of_id = np.fromiter(map(by_id.__getitem__, ids), dtype=np.int64, count=len(names))
    index: dict[tuple[Layout, Layout], int] = {}
    merge = np.array([index.setdefault(pair, len(index)) for pair in first], np.int64)
    of = merge[of_id] if len(names) else of_id
    return Classes(names, list(index), of, np.bincount(of, minlength=len(index)))


def class_rows(pairs: list[tuple[Layout, Layout]], count: np.ndarray) -> MoveArrays:
    """The unbalanced plan of one tensor per class (senders: first replicas), each row counted ``count`` times.

    Without balancing a tensor's moves depend on its layouts alone, so the rows of a
    class stand for the same moves of every tensor in it: ``nbytes`` and ``moves`` are
    multiplied by the class's count.
    """
    parts = class_parts(pairs, count)
    if not parts:
        empty = np.zeros(0, np.int64)
        return MoveArrays(empty, empty, empty, empty)
    return MoveArrays(*(np.concatenate(column) for column in zip(*parts, strict=True)))


def class_parts(pairs: list[tuple[Layout, Layout]], count: np.ndarray) -> list[MoveArrays]:
    """``class_rows`` class by class: what a sum over the rows reads without joining millions of them."""
    if not pairs:
        return []
    p: Plan = plan_layouts([(str(k), s, d) for k, (s, d) in enumerate(pairs)], balance=False)
    parts = (p[str(k)].move_arrays() for k in range(len(pairs)))
    return [MoveArrays(a.src, a.dst, a.nbytes * n, a.moves * n) for a, n in zip(parts, count.tolist(), strict=True)]
