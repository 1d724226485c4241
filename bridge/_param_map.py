"""Params and their regions: which boxes of which leaves fill each torch tensor on each rank.

The words follow ``docs/glossary.md``: a *param* is one tensor of the inference
engine on one rank; a *region* is the part of a param filled from one box of one
leaf, through an axis permutation (``transpose``: torch dim ``i`` is leaf dim
``transpose[i]``). A fused param (``qkv_proj``) has several regions; a padded
vocabulary leaves rows that no region covers (they keep their values). A
``ParamMap`` holds every rank's params; ``bridge.tp_param_map`` builds one from
rules, ``bridge.dtensor_params`` from DTensor placements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from bridge._source import Source
from jreshard.core.box import Box

__all__ = ["Region", "Param", "ParamMap"]


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """Fill ``param[offset : offset + shape]`` with ``leaf[box]`` permuted by ``transpose``.

    ``box`` may be given as slices or ``(lo, hi)`` pairs; it is stored as a ``jreshard.Box``.
    """

    leaf: str  # the leaf's path in the Source
    box: Box  # per leaf dim
    offset: tuple[int, ...]  # per torch dim
    transpose: tuple[int, ...]  # torch dim i <- leaf dim transpose[i]

    def __post_init__(self) -> None:
        if not isinstance(self.box, Box):
            object.__setattr__(self, "box", Box(self.box))

    @property
    def shape(self) -> tuple[int, ...]:
        """The region's shape in torch dims."""
        ext = self.box.shape
        return tuple(ext[p] for p in self.transpose)

    @property
    def source(self) -> str:
        """The old name of ``leaf``."""
        return self.leaf


@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """One tensor of the inference engine on one rank: its name, local shape, dtype and regions."""

    name: str
    rank: int
    shape: tuple[int, ...]
    dtype: str
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        ndim = len(self.shape)
        for r in self.regions:
            if len(r.offset) != ndim or sorted(r.transpose) != list(range(ndim)):
                raise ValueError(
                    f"param {self.name!r} on rank {self.rank} has shape {self.shape} but a region with "
                    f"offset {r.offset} and transpose {r.transpose}; give one entry per torch dim."
                )
            if len(r.box) != ndim:
                raise ValueError(
                    f"param {self.name!r}: region box {r.box} has {len(r.box)} dims, the param {ndim}; "
                    "give one (lo, hi) per leaf dim."
                )
            for i, (o, n) in enumerate(zip(r.offset, r.shape, strict=True)):
                if o < 0 or o + n > self.shape[i]:
                    raise ValueError(
                        f"param {self.name!r} on rank {self.rank}: region from {r.leaf!r} "
                        f"(offset {r.offset}, shape {r.shape}) leaves the local shape {self.shape} in dim {i}."
                    )


class ParamMap:
    """Every rank's params; both sides of a sync build the same one.

    Example:
      >>> from bridge import Rule, Source, tp_param_map, trainer_mesh
      >>> from jreshard import Layout
      >>> src = Source({"w": Layout((4, 6), trainer_mesh((2,), "fsdp", [0], 2), ("fsdp",), "float32")})
      >>> m = tp_param_map(src, [Rule("w", "linear.weight", transpose=True, shard=0)], tp_ranks=[1, 2])
      >>> str(m.for_rank(2)[0].regions[0].box)
      '[0:4, 3:6]'
    """

    __slots__ = ("params", "_key")

    def __init__(self, params: Iterable[Param]) -> None:
        ps = tuple(params)
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
    def targets(self) -> tuple[Param, ...]:
        """The old name of ``params``."""
        return self.params

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
