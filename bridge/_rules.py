"""Rules that turn trainer leaves into params on tensor-parallel ranks, and DTensor params.

A ``Rule`` names the leaves it applies to (a regular expression over the leaf path)
and how each becomes a param: transposed, split over the TP ranks (whole attention
heads, as vLLM splits them), fused with other leaves, padded. ``tp_param_map``
applies a rule list to every leaf for one or more TP groups; ``dtensor_params``
gives the params of one DTensor from its mesh and ``Shard``/``Replicate`` placements.
Model recipes (``bridge.recipes``) are rule lists.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from bridge._param_map import Param, ParamMap, Region
from bridge._source import Source
from jreshard.core.box import Box
from jreshard.core.dtypes import canonical_dtype
from jreshard.core.heads import split_heads

__all__ = ["Rule", "tp_param_map", "dtensor_params"]


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """Map trainer leaves matching ``pattern`` to a tensor-parallel param.

    Args:
      pattern: a regular expression that must match the whole leaf path.
      name: the param name; ``{1}``, ``{2}`` ... are the pattern's groups.
      transpose: ``True`` reverses the dims (flax ``Dense`` kernel ``[in, out]`` to torch
        ``Linear`` weight ``[out, in]``), or give the permutation (torch dim i <- leaf dim p[i]).
      shard: the torch dim split across the TP ranks (column parallel: 0, row parallel: 1),
        ``None`` to replicate.
      part: the position of this leaf in a fused param: rules with the same param name
        are concatenated per rank along ``shard`` (dim 0 when replicated) in ``part`` order.
      pad_to: pad the ``shard`` dim to a multiple of this (a padded vocabulary); the padded
        rows of each rank are left untouched.
      dtype: the param dtype (default: the param map's).
      heads: the ``shard`` dim is this many equal attention heads; TP splits whole heads
        (``jreshard.core.heads.split_heads``, the rule vLLM follows).
      replicate_heads: with more TP ranks than ``heads``, replicate each head on
        ``tp // heads`` consecutive ranks instead of refusing, as vLLM does for KV heads.
    """

    pattern: str
    name: str
    transpose: bool | tuple[int, ...] = False
    shard: int | None = None
    part: int = 0
    pad_to: int = 1
    dtype: str | None = None
    heads: int | None = None
    replicate_heads: bool = False

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"Rule pattern {self.pattern!r} is not a regular expression: {e}.") from None
        if not isinstance(self.pad_to, numbers.Integral) or self.pad_to < 1:
            raise ValueError(f"Rule pad_to must be a positive int, got {self.pad_to!r}.")
        if self.heads is not None:
            if isinstance(self.heads, bool) or not isinstance(self.heads, numbers.Integral) or self.heads < 1:
                raise ValueError(f"Rule heads must be a positive int or None, got {self.heads!r}.")
            if self.shard is None or self.pad_to != 1:
                raise ValueError(f"Rule {self.pattern!r}: heads needs a shard dim and no padding (pad_to=1).")
        elif self.replicate_heads:
            raise ValueError(f"Rule {self.pattern!r}: replicate_heads needs heads (the number of heads).")

    def perm(self, ndim: int) -> tuple[int, ...]:
        """The permutation torch dim ``i`` <- leaf dim ``perm[i]`` for a leaf of ``ndim`` dims."""
        if self.transpose is True:
            return tuple(range(ndim))[::-1]
        if self.transpose is False:
            return tuple(range(ndim))
        perm = tuple(int(p) for p in self.transpose)
        if sorted(perm) != list(range(ndim)):
            raise ValueError(f"Rule {self.pattern!r}: transpose {perm} is not a permutation of {ndim} dims.")
        return perm


@dataclasses.dataclass(frozen=True, slots=True)
class _Part:
    """One leaf of a (possibly fused) param: its position, path and rule."""

    part: int
    path: str
    rule: Rule


@dataclasses.dataclass(frozen=True, slots=True)
class _Split:
    """How a dim is split over TP ranks: every rank's local size and its ``(lo, hi)`` of the dim."""

    local: int
    ranges: tuple[tuple[int, int], ...]


def _dtype(dtype: Any, arg: str = "dtype") -> str:
    """The canonical name of a param dtype; params always have one."""
    name = canonical_dtype(dtype, arg=arg)
    if name is None:
        raise TypeError(f"{arg} must be a dtype or its name, such as 'bfloat16', got None.")
    return name


def _tp_groups(tp_ranks: Any) -> list[list[int]]:
    arr = np.asarray(tp_ranks)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(
            f"tp_ranks must be a list of torch ranks (one TP group) or a list of equal-length lists "
            f"(one per replica), got {tp_ranks!r}."
        )
    if len(set(arr.ravel().tolist())) != arr.size or (arr < 0).any():
        raise ValueError(f"tp_ranks must hold distinct non-negative ranks, got {arr.tolist()}.")
    return arr.tolist()


def _split(n: int, tp: int, rule: Rule, what: str) -> _Split:
    """The vLLM split of a dim of size ``n`` over ``tp`` ranks under ``rule`` (heads, padding)."""
    if rule.heads is not None:
        if n % rule.heads:
            raise ValueError(f"{what}: size {n} is not {rule.heads} equal heads; fix the Rule's heads.")
        heads = split_heads(rule.heads, n // rule.heads, tp, replicate=rule.replicate_heads, what=what)
        return _Split(heads.local_size, heads.ranges())
    padded = -(-n // rule.pad_to) * rule.pad_to
    if padded % tp:
        raise ValueError(
            f"{what}: size {n} (padded to {padded} with pad_to={rule.pad_to}) does not split evenly over "
            f"{tp} tensor-parallel ranks; use pad_to a multiple of {tp} or a TP degree dividing {padded}."
        )
    s = padded // tp
    return _Split(s, tuple((min(r * s, n), min((r + 1) * s, n)) for r in range(tp)))


def _match(source: Source, rules: Sequence[Rule], strict: bool) -> dict[str, list[_Part]]:
    """Param name -> its leaves, by the first rule whose pattern matches each leaf path."""
    parts: dict[str, list[_Part]] = {}
    for path, _ in source.items():
        for rule in rules:
            m = re.fullmatch(rule.pattern, path)
            if m:
                name = rule.name.format(m.group(0), *m.groups())
                parts.setdefault(name, []).append(_Part(rule.part, path, rule))
                break
        else:
            if strict:
                raise ValueError(
                    f"trainer leaf {path!r} matches no rule; add a Rule for it or pass strict=False to skip it."
                )
    return parts


def _group_params(source: Source, name: str, plist: list[_Part], group: list[int], dtype: str) -> list[Param]:
    """One param per rank of a TP group: its parts concatenated along the shard dim."""
    shard = plist[0].rule.shard
    tp = len(group)
    per_rank: list[list[Region]] = [[] for _ in range(tp)]
    cat = 0 if shard is None else shard
    offsets = [0] * tp
    other: tuple[int, ...] | None = None
    for p in plist:
        shape = source.layout(p.path).shape
        perm = p.rule.perm(len(shape))
        tshape = tuple(shape[d] for d in perm)
        if not 0 <= cat < len(tshape):
            raise ValueError(f"Rule {p.rule.pattern!r}: shard dim {cat} is out of range for torch shape {tshape}.")
        rest = tshape[:cat] + tshape[cat + 1:]
        if other is not None and rest != other:
            raise ValueError(
                f"fused param {name!r}: leaf {p.path!r} has torch shape {tshape}, which does not "
                f"concatenate along dim {cat} with the other parts (other dims {other})."
            )
        other = rest
        if shard is None:
            split = _Split(tshape[cat], ((0, tshape[cat]),) * tp)
        else:
            split = _split(tshape[cat], tp, p.rule, f"leaf {p.path!r} -> {name!r} dim {cat}")
        for r, (lo, hi) in enumerate(split.ranges):
            box = [(0, n) for n in shape]
            box[perm[cat]] = (lo, hi)
            offset = [0] * len(tshape)
            offset[cat] = offsets[r]
            if hi > lo:
                per_rank[r].append(Region(p.path, Box(box), tuple(offset), perm))
            offsets[r] += split.local
    out = []
    for r, rank in enumerate(group):
        local = list(other or ())
        local.insert(cat, offsets[r])
        out.append(Param(name, int(rank), tuple(local), dtype, tuple(per_rank[r])))
    return out


def tp_param_map(source: Source, rules: Sequence[Rule], tp_ranks: Any, *, dtype: Any = "float32",
                 strict: bool = True) -> ParamMap:
    """Applies rules to every trainer leaf, for one or more tensor-parallel groups.

    Args:
      source: the trainer leaves.
      rules: the first rule whose pattern matches a leaf path applies.
      tp_ranks: torch ranks in TP order, or a list of such lists (inference replicas).
      dtype: the dtype of every param whose rule gives none.
      strict: raise if a leaf matches no rule (``False`` skips it).

    Raises:
      ValueError: a leaf matches no rule, a split is uneven, or fused parts disagree.
    """
    groups = _tp_groups(tp_ranks)
    default = _dtype(dtype)
    params = []
    for name, plist in _match(source, rules, strict).items():
        plist.sort(key=lambda p: p.part)
        if len({p.part for p in plist}) != len(plist):
            raise ValueError(f"param {name!r} gets two leaves with the same part; number them.")
        shards = {p.rule.shard for p in plist}
        dtypes = {default if p.rule.dtype is None else _dtype(p.rule.dtype, "Rule dtype") for p in plist}
        if len(shards) != 1 or len(dtypes) != 1:
            raise ValueError(f"fused param {name!r}: its rules must agree on shard and dtype.")
        (param_dtype,) = dtypes
        for group in groups:
            params += _group_params(source, name, plist, group, param_dtype)
    return ParamMap(params)


def _placement(p: Any) -> int | None:
    """A placement as the sharded torch dim, or None for Replicate."""
    kind = type(p).__name__
    if kind == "Shard" or (isinstance(p, tuple) and len(p) == 2 and p[0] == "shard"):
        return int(p.dim if kind == "Shard" else p[1])
    if kind == "Replicate" or p == "replicate" or p == ("replicate",):
        return None
    raise TypeError(
        f"placement {p!r} is not supported; use torch.distributed.tensor.Shard(dim) or Replicate() "
        "(or ('shard', dim) / 'replicate')."
    )


def dtensor_params(name: str, source: Source, leaf: str, mesh_ranks: Any, placements: Sequence[Any],
                   *, transpose: bool | Sequence[int] = False, dtype: Any = "float32") -> ParamMap:
    """The params of one DTensor: every rank of its mesh gets its local shard (torch chunk rules).

    Args:
      name: the param name.
      source: the trainer leaves; ``leaf`` names the one to read.
      mesh_ranks: the DeviceMesh's ``mesh`` (an array of global ranks), or the DeviceMesh.
      placements: one ``Shard(d)``/``Replicate()`` per mesh dim.
      transpose: as in ``Rule``; the DTensor's global shape is the permuted leaf shape.

    Example:
      >>> from bridge import Source, dtensor_params, trainer_mesh
      >>> from jreshard import Layout
      >>> src = Source({"w": Layout((5, 3), trainer_mesh((2,), "x", [0], 2), ("x",), "float32")})
      >>> m = dtensor_params("w", src, "w", [[4, 5], [6, 7]], [("shard", 1), "replicate"], transpose=True)
      >>> [(p.rank, p.shape, str(p.regions[0].box)) for p in m.params]  # doctest: +NORMALIZE_WHITESPACE
      [(4, (3, 3), '[0:3, 0:3]'), (5, (3, 3), '[0:3, 0:3]'),
       (6, (3, 2), '[3:5, 0:3]'), (7, (3, 2), '[3:5, 0:3]')]
    """
    mesh_arr = getattr(mesh_ranks, "mesh", mesh_ranks)
    mesh_arr = np.asarray(mesh_arr.tolist() if hasattr(mesh_arr, "tolist") else mesh_arr, dtype=np.int64)
    if mesh_arr.ndim != len(placements):
        raise ValueError(
            f"placements {list(placements)!r} give {len(placements)} entries for a mesh of "
            f"{mesh_arr.ndim} dims (shape {mesh_arr.shape}); give one per mesh dim."
        )
    param_dtype = _dtype(dtype)
    shape = source.layout(leaf).shape
    perm = Rule(leaf, name, transpose=transpose if isinstance(transpose, bool) else tuple(transpose)).perm(len(shape))
    tshape = tuple(shape[p] for p in perm)
    dims = [_placement(p) for p in placements]
    for d in dims:
        if d is not None and not 0 <= d < len(tshape):
            raise ValueError(f"placement Shard({d}) is out of range for the global shape {tshape}.")
    params = []
    for coord in np.ndindex(*mesh_arr.shape):
        lo, hi = [0] * len(tshape), list(tshape)
        for axis, d in enumerate(dims):
            if d is None:
                continue
            k, j = mesh_arr.shape[axis], coord[axis]
            size = hi[d] - lo[d]
            c = math.ceil(size / k) if size else 0
            lo[d], hi[d] = lo[d] + min(j * c, size), lo[d] + min((j + 1) * c, size)
        box = [(0, 0)] * len(shape)
        for i, p in enumerate(perm):
            box[p] = (lo[i], hi[i])
        local = tuple(b - a for a, b in zip(lo, hi, strict=True))
        regions = (Region(leaf, Box(box), (0,) * len(tshape), perm),) if math.prod(local) else ()
        params.append(Param(name, int(mesh_arr[coord]), local, param_dtype, regions))
    return ParamMap(params)
