"""Params and their regions: which boxes of which leaves fill each torch tensor on each rank.

The words follow ``docs/glossary.md``: a *param* is one tensor of the inference
engine on one rank; a *region* is the part of a param filled from one box of one
leaf, through an axis permutation (``transpose``: torch dim ``i`` is leaf dim
``transpose[i]``), in the param seen through a reshape (``view``) when the leaf's
dims and the param's differ (a layer of a stacked leaf, heads as their own dims,
one expert's leaf in a stacked param). A fused param (``qkv_proj``) has several regions; a padded
vocabulary leaves rows that no region covers (they keep their values). A
``ParamMap`` holds every rank's params; ``bridge.tp_param_map`` builds one from
rules, ``bridge.dtensor_params`` from DTensor placements.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from bridge.plan.source import SOURCE_BASE, Source
from jreshard.core.args import check_int, check_ints, check_name
from jreshard.core.box import Box
from jreshard.core.dtypes import canonical_dtype

__all__ = ["Region", "Param", "ParamMap", "param_dtype"]


def param_dtype(dtype: Any, arg: str = "dtype") -> str:
    """The canonical name of a param dtype (numeric, bool included); params always have one.

    Example:
      >>> import numpy as np
      >>> from bridge.plan.param_map import param_dtype
      >>> param_dtype(np.float32), param_dtype("bfloat16")
      ('float32', 'bfloat16')
    """
    name = canonical_dtype(dtype, arg=arg)
    if name is None:
        raise TypeError(f"{arg} must be a dtype or its name, such as 'bfloat16', got None.")
    return name


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """Fill ``param.view(view)[offset : offset + shape]`` with ``leaf[box]`` permuted by ``transpose``.

    ``box`` may be given as slices or ``(lo, hi)`` pairs; it is stored as a ``jreshard.Box``.
    ``view`` is a shape of the param's elements with one dim per leaf dim (the param read
    as C-contiguous), or ``None`` for the param's own shape: a layer ``l`` of a stacked
    leaf ``[L, in, out]`` fills a ``[out, in]`` param through the view ``(1, out, in)``.
    """

    leaf: str  # the leaf's path in the Source
    box: Box  # per leaf dim
    offset: tuple[int, ...]  # per view dim
    transpose: tuple[int, ...]  # view dim i <- leaf dim transpose[i]
    view: tuple[int, ...] | None = None  # the param's shape as this region sees it; None: its own

    def __post_init__(self) -> None:
        check_name("Region leaf", self.leaf, "the leaf's path in the Source")
        if not isinstance(self.box, Box):
            object.__setattr__(self, "box", Box(self.box))
        ndim = len(self.box)
        offset = check_ints("Region offset", self.offset)
        transpose = check_ints("Region transpose", self.transpose)
        if len(offset) != ndim or sorted(transpose) != list(range(ndim)):
            raise ValueError(
                f"Region of leaf {self.leaf!r}: box {self.box} has {ndim} dims, so offset {offset} needs {ndim} "
                f"entries and transpose {transpose} must be a permutation of {tuple(range(ndim))}.")
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "transpose", transpose)
        if self.view is not None:
            view = check_ints("Region view", self.view)
            if len(view) != ndim:
                raise ValueError(f"Region of leaf {self.leaf!r}: view {view} needs one size per leaf dim ({ndim}).")
            object.__setattr__(self, "view", view)

    def view_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape in which ``offset`` and ``shape`` are given, for a param of ``param_shape``."""
        return param_shape if self.view is None else self.view

    @property
    def shape(self) -> tuple[int, ...]:
        """The region's shape in torch dims."""
        ext = self.box.shape
        return tuple(ext[p] for p in self.transpose)



@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """One tensor of the inference engine on one rank: its name, local shape, dtype and regions."""

    name: str
    rank: int
    shape: tuple[int, ...]
    dtype: str
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        check_name("Param name", self.name, "the tensor's name in the inference engine")
        where = f"param {self.name!r}"
        object.__setattr__(self, "rank", check_int(f"{where}: rank", self.rank, maximum=SOURCE_BASE - 1))
        object.__setattr__(self, "shape", check_ints(f"{where}: shape", self.shape))
        object.__setattr__(self, "dtype", param_dtype(self.dtype, f"{where}: dtype"))
        if not isinstance(self.regions, (tuple, list)):
            raise TypeError(f"{where}: regions must be a tuple of bridge.Region, got {type(self.regions).__name__}.")
        object.__setattr__(self, "regions", tuple(self.regions))
        for i, r in enumerate(self.regions):
            if not isinstance(r, Region):
                raise TypeError(f"{where}: regions[{i}] must be a bridge.Region, got {type(r).__name__} {r!r}.")
        for r in self.regions:
            view = r.view_shape(self.shape)
            ndim = len(view)
            if r.view is not None and math.prod(view) != math.prod(self.shape):
                raise ValueError(
                    f"param {self.name!r} on rank {self.rank}: region view {view} does not hold the "
                    f"{math.prod(self.shape)} elements of its shape {self.shape}; give a reshape of it."
                )
            if len(r.offset) != ndim or sorted(r.transpose) != list(range(ndim)):
                raise ValueError(
                    f"param {self.name!r} on rank {self.rank} has shape {view} but a region with "
                    f"offset {r.offset} and transpose {r.transpose}; give one entry per torch dim."
                )
            if len(r.box) != ndim:
                raise ValueError(
                    f"param {self.name!r}: region box {r.box} has {len(r.box)} dims, the param {ndim}; "
                    "give one (lo, hi) per leaf dim."
                )
            for i, (o, n) in enumerate(zip(r.offset, r.shape, strict=True)):
                if o < 0 or o + n > view[i]:
                    raise ValueError(
                        f"param {self.name!r} on rank {self.rank}: region from {r.leaf!r} "
                        f"(offset {r.offset}, shape {r.shape}) leaves the local shape {view} in dim {i}."
                    )
        _check_disjoint(self)


def _check_disjoint(p: Param) -> None:
    """Refuses two regions of ``p`` seen through the same view that fill the same elements."""
    if len(p.regions) < 2:
        return
    by_view: dict[tuple[int, ...], list[Region]] = {}
    for r in p.regions:
        if math.prod(r.shape):
            by_view.setdefault(r.view_shape(p.shape), []).append(r)
    for regions in by_view.values():
        hit = _first_overlap(regions) if len(regions) > 1 else None
        if hit is not None:
            a, b = regions[hit[0]], regions[hit[1]]
            raise ValueError(
                f"param {p.name!r} on rank {p.rank}: regions from {a.leaf!r} (offset {a.offset}, shape "
                f"{a.shape}) and {b.leaf!r} (offset {b.offset}, shape {b.shape}) overlap; each element of a "
                "param is filled from one place (fused parts need distinct part= numbers).")


def _first_overlap(regions: list[Region]) -> tuple[int, int] | None:
    """The indices of the first two regions (boxes ``[offset, offset + shape)``) that intersect, if any."""
    lo = [r.offset for r in regions]
    hi = [tuple(o + n for o, n in zip(r.offset, r.shape, strict=True)) for r in regions]
    if len(regions) <= 8:  # a fused param's few parts: cheaper in Python than in NumPy
        for i in range(len(regions)):
            for j in range(i + 1, len(regions)):
                if all(a < d and c < b for a, b, c, d in zip(lo[i], hi[i], lo[j], hi[j], strict=True)):
                    return i, j
        return None
    lo_a, hi_a = np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64)
    for i in range(len(regions) - 1):  # one row of the pairwise test at a time: O(n) memory
        k = np.flatnonzero(((lo_a[i] < hi_a[i + 1:]) & (lo_a[i + 1:] < hi_a[i])).all(axis=1))
        if k.size:
            return i, i + 1 + int(k[0])
    return None


class ParamMap:
    """Every rank's params; both sides of a sync build the same one.

    Example:
      >>> from bridge import Rule, Source, tp_param_map, trainer_mesh
      >>> from jreshard import Layout
      >>> src = Source({"w": Layout((4, 6), trainer_mesh((2,), "fsdp", [0], 2), ("fsdp",), "float32")})
      >>> m = tp_param_map(src, [Rule("w", "linear.weight", transpose=True, dim=0)], tp_ranks=[1, 2])
      >>> str(m.for_rank(2)[0].regions[0].box)
      '[0:4, 3:6]'
    """

    __slots__ = ("params", "_key")

    def __init__(self, params: Iterable[Param]) -> None:
        try:
            ps = tuple(params)
        except TypeError:
            raise TypeError(f"params must be an iterable of bridge.Param, got {type(params).__name__}.") from None
        for p in ps:
            if not isinstance(p, Param):
                raise TypeError(f"params must hold bridge.Param, got {type(p).__name__}.")
        seen = set()
        for p in ps:
            if (p.name, p.rank) in seen:
                raise ValueError(f"param {p.name!r} appears twice on rank {p.rank}; merge its regions.")
            seen.add((p.name, p.rank))
        self.params = tuple(sorted(ps, key=lambda p: (p.rank, p.name)))
        self._key = tuple(dataclasses.astuple(p) for p in self.params)

    def __add__(self, other: ParamMap) -> ParamMap:
        if not isinstance(other, ParamMap):
            return NotImplemented
        return ParamMap(self.params + other.params)


    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({p.rank for p in self.params}))

    def for_rank(self, rank: int) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.rank == rank)

    def names(self, rank: int | None = None) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if rank is None or p.rank == rank)

    def check(self, source: Source) -> None:
        """Raises ValueError if a region names a missing leaf or leaves the leaf's shape."""
        for p in self.params:
            for r in p.regions:
                shape = source.layout(r.leaf).shape
                if not Box.from_bounds((0,) * len(shape), shape).contains(r.box):
                    raise ValueError(
                        f"param {p.name!r} on rank {p.rank} reads box {r.box} of leaf {r.leaf!r}, "
                        f"whose shape is {shape}; the box must lie inside it."
                    )

    def key(self) -> tuple:
        """A canonical, hashable description (what the plan's fingerprint covers)."""
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParamMap) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __len__(self) -> int:
        return len(self.params)

    def __repr__(self) -> str:
        return f"ParamMap({len(self.params)} params on ranks {list(self.ranks)})"
