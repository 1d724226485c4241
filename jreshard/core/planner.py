"""The pure reshard planner's entry points: which box moves from which device to which.

Planning runs in three steps:

1. *Overlaps* (``core/overlaps.py``, cached per shape and pair of grids, independent of
   device ids): cut every destination shard by the source shards it overlaps.
2. *Candidates* (``core/leaves.py``, vectorised over the tensors that share overlaps):
   map mesh positions to device ids. An overlap whose destination already holds its
   source shard is a local copy; an overlap whose source shard has one holder is fixed;
   the rest may come from any replica.
3. *Balancing* (``core/balance.py``, over the whole pytree at once): give every
   remaining overlap a sender so that the largest number of bytes any device sends is
   small, splitting an overlap across replicas where that lowers the maximum.

Network bytes equal the lower bound by construction: a destination receives each
element it lacks exactly once and never receives what it already holds. This module
knows nothing of jax: ``jreshard.plan`` hands jax arrays to the JAX executor's adapter.
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jreshard.core.args import INT64_MAX
from jreshard.core.check import PlanError, check_tensor_plan
from jreshard.core.dtypes import itemsize_of
from jreshard.core.layout import Layout, _grid
from jreshard.core.leaves import Leaf, plan_leaves
from jreshard.core.overlaps import overlaps
from jreshard.core.plans import Move, MoveArrays, Plan, TensorPlan
from jreshard.core.stats import PlanStats
from jreshard.core.tree import TreeDef, _sorted_keys, describe, flatten, path_str

__all__ = ["Move", "MoveArrays", "TensorPlan", "Plan", "PlanStats", "plan", "plan_layouts", "plan_classes",
           "PlanError", "clear_cache", "check_tensor_plan"]

_CACHE_SIZE = 32  # plans; whole-model plans are large, and a process plans a few reshards


def clear_cache() -> None:
    """Forgets cached plans, overlaps and grids (for cold-start measurements)."""
    for cached in (_plan_pair, _plan_tree, _identity_slot, overlaps, _grid):
        cached.cache_clear()


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


def plan(src: Any, dst: Any, *, balance: bool = True) -> TensorPlan | Plan:
    """Plans a reshard from ``src`` to ``dst``.

    Args:
      src: a Layout, or a pytree of Layouts (dicts, lists, tuples).
      dst: a Layout, or a pytree of Layouts of the same structure.
      balance: choose among replicated senders to minimise the largest sender load
        (splitting boxes where that helps); ``False`` always uses the first replica.

    Returns:
      A ``TensorPlan`` for two Layouts, a ``Plan`` for pytrees. Plans are cached:
      planning equal layouts again returns the same object.

    Raises:
      TypeError: a leaf is not a Layout.
      ValueError: shapes or pytree structures differ.

    Example:
      >>> from jreshard import Layout, Mesh
      >>> from jreshard.core.planner import plan
      >>> src = Layout((8, 4), Mesh([0, 1, 2, 3], "fsdp"), ("fsdp",), dtype="float32")
      >>> dst = Layout((8, 4), Mesh([[4, 5], [6, 7]], ("dp", "tp")), (None, "tp"), dtype="float32")
      >>> p = plan(src, dst)
      >>> p.stats().network_bytes == p.stats().lower_bound_bytes == 2 * 8 * 4 * 4
      True
    """
    balance = _check_balance(balance)
    if isinstance(src, Layout) and isinstance(dst, Layout):
        _check_pair("", src, dst)
        return _plan_pair(src, dst, balance)
    slot = _identity_slot(id(src), id(dst), balance) if type(src) is dict and type(dst) is dict else None
    if slot:
        hit = slot[0]
        if hit.src is src and hit.dst is dst and _content(src, dst) == hit.content:
            return hit.plan
    flat = _flat_layout_dict(src, dst)
    if flat is None:
        return _plan_tree(*_flat_tree(src, dst), balance)
    out = _plan_tree(*flat, balance)
    if slot is not None:  # values are Layouts, immutable: equal content means an equal plan
        slot[:] = [_IdentityHit(src, dst, _content(src, dst), out)]
    return out


def plan_layouts(pairs: Sequence[tuple[str, Layout, Layout]], *, balance: bool = True) -> Plan:
    """Plans a flat list of (name, src, dst); executors use it after their own flattening.

    Example:
      >>> from jreshard import Layout, Mesh, plan_layouts
      >>> w = Layout((4,), Mesh([0, 1], "x"), ("x",))
      >>> list(plan_layouts([("layers/0/w", w, w.with_dtype("float32"))]))
      ['layers/0/w']
    """
    balance = _check_balance(balance)
    names = _checked_names(pairs)
    return _plan_tree(tuple((n,) if n else () for n in names), ("dict", names, ("leaf",) * len(pairs)),
                      tuple(s for _, s, _ in pairs), tuple(d for _, _, d in pairs), balance)


def plan_classes(pairs: Sequence[tuple[Layout, Layout]], of: Any, *, balance: bool = True) -> MoveArrays:
    """The moves of tensors given by class: tensor ``i`` has the layouts ``pairs[of[i]]``.

    The plan is ``plan_layouts`` of those tensors in that order, balanced alike, built
    without a name or an object per tensor; its moves come as ``Plan.move_arrays`` gives
    them (a row may stand for the same move of several tensors). Classes are numbered in
    the order of their first tensor. The cost model plans the parts of hierarchical
    delivery, hundreds of thousands of them, this way.

    Example:
      >>> from jreshard import Layout, Mesh
      >>> from jreshard.core.planner import plan_classes
      >>> a = Layout((4,), Mesh([0, 1], "x"), ("x",), "float32")
      >>> b = Layout((4,), Mesh([2], "y"), (), "float32")
      >>> rows = plan_classes([(a, b)], [0, 0, 0])  # three tensors of one class
      >>> rows.src.tolist(), rows.dst.tolist(), rows.nbytes.tolist(), rows.moves.tolist()
      ([0, 1], [2, 2], [24, 24], [3, 3])
    """
    balance = _check_balance(balance)
    for k, (s, d) in enumerate(pairs):
        _check_pair(f"pairs[{k}]", s, d)
    of = _check_classes(of, len(pairs))
    leaves = [Leaf(s, d, itemsize_of(d.dtype or s.dtype)) for s, d in pairs]
    groups, _ = plan_leaves(leaves, balance, of=of)
    if not groups:
        empty = np.zeros(0, np.int64)
        return MoveArrays(empty, empty, empty, empty)
    return MoveArrays(*(np.concatenate(column) for column in zip(*(g.move_arrays() for g in groups), strict=True)))


def _check_classes(of: Any, n: int) -> np.ndarray:
    of = np.asarray(of)
    if of.ndim != 1 or (len(of) and of.dtype.kind not in "iu"):
        raise TypeError(f"of must be a 1-d array of class numbers, got {of!r}.")
    of = of.astype(np.int64)
    classes, first = np.unique(of, return_index=True)
    if len(of) and (classes[0] < 0 or classes[-1] >= n or (np.diff(first) < 0).any()):
        raise ValueError(f"of must number the {n} classes from 0, in the order of their first tensor; "
                         f"got classes {classes[:8].tolist()} first met at {first[:8].tolist()}.")
    return of


def _checked_names(pairs: Sequence[tuple[str, Layout, Layout]]) -> tuple[str, ...]:
    """The names of ``pairs``, each checked; a pair of layouts shared by many tensors is checked once."""
    if all(type(pair) is tuple and len(pair) == 3 for pair in pairs):
        names = tuple(name for name, _, _ in pairs)
        if all(type(name) is str for name in names) and len(set(names)) == len(names):
            checked: set[tuple[int, int]] = set()
            for name, s, d in pairs:
                if (id(s), id(d)) not in checked:
                    _check_pair(name, s, d)
                    checked.add((id(s), id(d)))
            return names
    seen: set[str] = set()
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 3:
            raise TypeError(f"pairs[{i}] must be a (name, src Layout, dst Layout) tuple, got {pair!r}.")
        name, s, d = pair
        if not isinstance(name, str):
            raise TypeError(f"pairs[{i}] name must be a str (the tensor's path), got {type(name).__name__} {name!r}.")
        if name in seen:
            raise ValueError(f"pairs[{i}] name {name!r} appears twice; give every tensor its own name.")
        seen.add(name)
        _check_pair(name, s, d)
    return tuple(name for name, _, _ in pairs)


def _check_balance(balance: Any) -> bool:
    if type(balance).__module__ == "numpy" and type(balance).__name__ in ("bool", "bool_"):  # numpy.bool_
        return bool(balance)
    if not isinstance(balance, bool):
        raise TypeError(f"balance must be True or False, got {type(balance).__name__} {balance!r}.")
    return balance


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _plan_pair(src: Layout, dst: Layout, balance: bool) -> TensorPlan:
    return _plan_tree(((),), "leaf", (src,), (dst,), balance)[""]


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _plan_tree(paths: tuple[tuple, ...], treedef: TreeDef, srcs: tuple[Layout, ...], dsts: tuple[Layout, ...],
               balance: bool) -> Plan:
    leaves = _leaves(srcs, dsts)
    _check_byte_counts(paths, dsts, leaves)
    groups, index = plan_leaves(leaves, balance)
    return Plan(paths, treedef, leaves, groups, index)


def _leaves(srcs: tuple[Layout, ...], dsts: tuple[Layout, ...]) -> list[Leaf]:
    """One Leaf per pair, made once per pair of Layout objects (a model's tensors share a few).

    The passes over every tensor run in C (map, zip, dict); Python runs once per distinct pair.
    """
    ids = list(zip(map(id, srcs), map(id, dsts), strict=True))
    pairs = dict(zip(ids, zip(srcs, dsts, strict=True), strict=True))  # identity -> the pair
    # Bytes on the wire are the destination's: a cast happens at the sender.
    made = {k: Leaf(s, d, itemsize_of(d.dtype or s.dtype)) for k, (s, d) in pairs.items()}
    return list(map(made.__getitem__, ids))


def _check_byte_counts(paths: tuple[tuple, ...], dsts: tuple[Layout, ...], leaves: list[Leaf]) -> None:
    """Refuses a plan whose statistics would pass int64: at most every destination device receives each tensor."""
    # Whole models repeat a few layouts: bound with the widest element (16 bytes) per distinct layout first.
    distinct = dict(zip(map(id, dsts), dsts, strict=True))  # by identity, counted in C
    if sum(n * distinct[i].size * distinct[i].mesh.size for i, n in Counter(map(id, dsts)).items()) * 16 <= INT64_MAX:
        return
    total = 0
    for path, leaf in zip(paths, leaves, strict=True):
        total += leaf.dst.size * leaf.itemsize * leaf.dst.mesh.size
        if total > INT64_MAX:
            where = f" by tensor {path_str(path)!r}" if path else ""
            raise ValueError(
                f"src and dst are too large to plan in one call: each tensor's bytes times its destination devices "
                f"sum to {total}{where}, more than the 2**63 - 1 a plan's statistics count in (gather-then-broadcast "
                "moves that much); plan fewer or smaller tensors per call."
            )


class _Flat(NamedTuple):
    """Two pytrees of Layouts flattened alike: paths, treedef, and the leaves of each."""

    paths: tuple[tuple, ...]
    treedef: TreeDef
    srcs: tuple[Layout, ...]
    dsts: tuple[Layout, ...]


def _flat_tree(src: Any, dst: Any) -> _Flat:
    src_paths, src_leaves, src_def = flatten(src)
    _, dst_leaves, dst_def = flatten(dst, is_leaf=lambda x: isinstance(x, Layout))
    if src_def != dst_def:
        raise ValueError(
            f"src and dst must be pytrees of the same structure; src is {describe(src_def)} and "
            f"dst is {describe(dst_def)}."
        )
    for p, s, d in zip(src_paths, src_leaves, dst_leaves, strict=True):
        _check_pair(path_str(p), s, d)
    return _Flat(tuple(src_paths), src_def, tuple(src_leaves), tuple(dst_leaves))


def _flat_layout_dict(src: Any, dst: Any) -> _Flat | None:
    """The flattened form of two flat dicts of Layouts with the same keys, the usual
    whole-model input, built without walking a tree; ``None`` for other trees."""
    if type(src) is not dict or type(dst) is not dict or len(src) != len(dst) or not src:
        return None
    keys = _sorted_keys(src)
    try:  # the passes over every tensor run in C (map, zip, set)
        srcs = tuple(map(src.__getitem__, keys))
        dsts = tuple(map(dst.__getitem__, keys))
    except KeyError:
        return None
    if set(map(type, srcs)) != {Layout} or set(map(type, dsts)) != {Layout}:
        return None
    if list(map(_shape, srcs)) != list(map(_shape, dsts)):
        for k, s, d in zip(keys, srcs, dsts, strict=True):
            _check_pair(path_str((k,)), s, d)
    return _Flat(tuple(zip(keys)), ("dict", tuple(keys), ("leaf",) * len(keys)), srcs, dsts)


_shape = operator.attrgetter("shape")


# Whole models are usually flat dicts {name: Layout} planned again and again with the
# same objects: a hit on (id(src), id(dst)) only re-checks keys and values by identity.
class _IdentityHit(NamedTuple):
    src: dict  # held so that its id is not reused while the slot lives
    dst: dict
    content: tuple
    plan: Plan


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _identity_slot(src_id: int, dst_id: int, balance: bool) -> list[_IdentityHit]:
    """The last plan made for the dicts with these ids (an empty list until one is)."""
    return []


def _content(src: dict, dst: dict) -> tuple:
    return (tuple(src), tuple(src.values()), tuple(dst), tuple(dst.values()))
