"""Rules that turn trainer leaves into params on tensor- and expert-parallel ranks.

A ``Rule`` names the leaves it applies to (a regular expression over the leaf path)
and how each becomes a param: its dims permuted, merged or split (``dims``), one layer
of a stacked leaf per param, split over the TP ranks (whole attention heads, as vLLM
splits them), its experts split over expert-parallel groups, fused with other leaves,
one leaf per expert placed in a stacked param, padded. ``tp_param_map`` applies a
rule list to every leaf for a grid of ranks. Model recipes (``bridge.recipes``) are
rule lists; ``bridge.plan.dtensor`` gives the params of DTensors.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import string
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

from bridge.plan.dims import DimSpec
from bridge.plan.param_map import Param, ParamMap, Region, param_dtype
from bridge.plan.source import SOURCE_BASE, Source
from jreshard.core.args import check_flag, check_int, check_ints, check_name
from jreshard.core.box import Box
from jreshard.core.degrees import rank_grid
from jreshard.core.tp_split import TpSplit, tp_split

__all__ = ["Rule", "tp_param_map", "param_dtype"]


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """Map trainer leaves matching ``pattern`` to a param on every rank of a grid.

    Args:
      pattern: a regular expression that must match the whole leaf path.
      name: the param name; ``{1}``, ``{2}`` ... are the pattern's groups, ``{layer}`` a
        named group ``(?P<layer>...)`` or a stacked dim of ``dims``.
      transpose: ``True`` reverses the two dims of a 2-dim leaf (flax ``Dense`` kernel
        ``[in, out]`` to torch ``Linear`` weight ``[out, in]``), or give the permutation (torch
        dim i <- leaf dim p[i]). Leaves of more dims need ``dims`` or a permutation.
      dims: the leaf's dims by name and the param's (``"L emb heads hd -> (heads hd) emb"``,
        see ``bridge.plan.dims``): names moved, merged in parentheses, stacked (left only: one
        param per index, ``{L}`` in ``name``) or new (right only: placed by ``at``).
      dim: the param dim split across a row's TP ranks (column parallel: 0, row parallel: 1),
        or its name in ``dims``; ``None`` to replicate.
      ep_dim: the param dim (or name) whose experts are split linearly across the rows of
        the rank grid: row ``r`` of ``ep`` holds ``[r*E/ep, (r+1)*E/ep)``. ``None``: rows are replicas.
      at: the index of this leaf along the new dim of ``dims``, a template like ``name``
        (``"{2}"`` for ``experts_(\\d+)``): many leaves fill one stacked param.
      part: the position of this leaf in a fused param: rules with the same param name
        are concatenated per rank along ``dim`` (the first param dim when replicated) in ``part`` order.
      pad_to: pad that dim to a multiple of this (a padded vocabulary); the padded
        rows of each rank are left untouched.
      dtype: the param dtype (default: the param map's).
      heads: that dim is this many equal attention heads; TP splits whole heads
        (``jreshard.core.heads.split_heads``, the rule vLLM follows).
      replicate_heads: with more TP ranks than ``heads``, replicate each head on
        ``tp // heads`` consecutive ranks instead of refusing, as vLLM does for KV heads.
    """

    pattern: str
    name: str
    transpose: bool | tuple[int, ...] = False
    dim: int | str | None = None
    part: int = 0
    pad_to: int = 1
    dtype: str | None = None
    heads: int | None = None
    replicate_heads: bool = False
    dims: str | None = None
    ep_dim: int | str | None = None
    at: str | int | None = None

    def __post_init__(self) -> None:
        check_name("Rule pattern", self.pattern, "a regular expression over leaf paths")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"Rule pattern {self.pattern!r} is not a regular expression: {e}.") from None
        self._check_args()
        if self.heads is not None:
            if self.dim is None or self.pad_to != 1:
                raise ValueError(f"Rule {self.pattern!r}: heads needs a split dim (dim=) and no padding (pad_to=1).")
        elif self.replicate_heads:
            raise ValueError(f"Rule {self.pattern!r}: replicate_heads needs heads (the number of heads).")
        if self.dims is not None:
            if self.transpose is not False:
                raise ValueError(f"Rule {self.pattern!r}: give dims or transpose, not both (dims names the moves).")
            spec = _parse(self.dims, self.pattern)
            for arg in ("dim", "ep_dim"):
                v = getattr(self, arg)
                if isinstance(v, str) and v not in spec.flat:
                    raise ValueError(f"Rule {self.pattern!r}: {arg}={v!r} is not a param dim of dims "
                                     f"{self.dims!r}; name one of {list(spec.flat)}.")
            if bool(spec.new) != (self.at is not None):
                raise ValueError(f"Rule {self.pattern!r}: a new param dim in dims and at= go together "
                                 f"(dims {self.dims!r}, at={self.at!r}); at places the leaf along that dim.")
        else:
            for arg in ("dim", "ep_dim"):
                if isinstance(getattr(self, arg), str):
                    raise ValueError(f"Rule {self.pattern!r}: {arg} names a dim; name the dims with dims=.")
            if self.at is not None:
                raise ValueError(f"Rule {self.pattern!r}: at= needs dims= with a new param dim to place the leaf in.")

    def _check_args(self) -> None:
        """Checks (and normalises: numpy ints to ints, dtypes to names) every argument but ``pattern``."""
        rule = f"Rule {self.pattern!r}"

        def put(arg: str, value: Any) -> None:
            object.__setattr__(self, arg, value)

        check_name(f"{rule} name", self.name, "the param name, a template such as 'layers.{1}.weight'")
        _check_template(f"{rule} name", self.name)
        if not isinstance(self.transpose, bool):
            perm = check_ints(f"{rule} transpose", self.transpose)
            if sorted(perm) != list(range(len(perm))):
                raise ValueError(f"{rule} transpose {perm} must be a permutation of {tuple(range(len(perm)))} "
                                 "(torch dim i <- leaf dim transpose[i]), or True/False.")
            put("transpose", perm)
        for arg in ("dim", "ep_dim"):
            v = getattr(self, arg)
            if v is not None and not isinstance(v, str):
                put(arg, check_int(f"{rule} {arg} (a param dim, its name in dims, or None)", v))
            elif isinstance(v, str) and not v:
                raise ValueError(f"{rule} {arg} is an empty name; name a dim of dims, give its index, or None.")
        put("part", check_int(f"{rule} part", self.part))
        put("pad_to", check_int(f"{rule} pad_to", self.pad_to, minimum=1))
        if self.dtype is not None:
            put("dtype", param_dtype(self.dtype, f"{rule} dtype"))
        if self.heads is not None:
            put("heads", check_int(f"{rule} heads", self.heads, minimum=1))
        put("replicate_heads", check_flag(f"{rule} replicate_heads", self.replicate_heads))
        if self.dims is not None and not isinstance(self.dims, str):
            raise TypeError(f"{rule} dims must be a str such as 'L i o -> o i', or None; got "
                            f"{type(self.dims).__name__} {self.dims!r}.")
        if self.at is not None and not isinstance(self.at, str):
            put("at", check_int(f"{rule} at", self.at))
        elif isinstance(self.at, str):
            _check_template(f"{rule} at", self.at)

    def spec(self, ndim: int) -> DimSpec:
        """The named dims of a leaf of ``ndim`` dims under this rule."""
        if self.dims is None:
            return DimSpec.from_perm(self.perm(ndim))
        spec = _parse(self.dims, self.pattern)
        if len(spec.leaf) != ndim:
            raise ValueError(f"Rule {self.pattern!r}: dims {self.dims!r} names {len(spec.leaf)} leaf dims, but "
                             f"the leaf has {ndim}; name every leaf dim.")
        return spec

    def perm(self, ndim: int) -> tuple[int, ...]:
        """The permutation torch dim ``i`` <- leaf dim ``perm[i]`` for a leaf of ``ndim`` dims."""
        if self.dims is not None:
            spec = self.spec(ndim)
            if spec.stacked or spec.new or len(spec.param) != ndim:
                raise ValueError(f"Rule {self.pattern!r}: dims {self.dims!r} is not a plain permutation.")
            return tuple(spec.leaf.index(n) for n in spec.flat)
        if self.transpose is True:
            if ndim > 2:
                raise ValueError(
                    f"Rule {self.pattern!r}: transpose=True on a {ndim}-dim leaf is ambiguous (reversing every "
                    "dim moves a stacked layer or expert dim too); name the dims, e.g. "
                    "dims='e h i -> e i h', or give the permutation.")
            return tuple(range(ndim))[::-1]
        if self.transpose is False:
            return tuple(range(ndim))
        perm = tuple(int(p) for p in self.transpose)
        if sorted(perm) != list(range(ndim)):
            raise ValueError(f"Rule {self.pattern!r}: transpose {perm} is not a permutation of {ndim} dims.")
        return perm


def _check_template(arg: str, template: str) -> None:
    """Refuses a template ``_format`` cannot fill: only ``{1}``, ``{name}`` fields and ``{{``/``}}`` escapes."""
    fix = ("use only fields such as {1} (a pattern group), {layer} (a named group or stacked dim) and "
           "{{ }} for literal braces")
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"{arg} {template!r} is not a valid template ({e}); {fix}.") from None
    for field, spec, conv in fields:
        if spec or conv or not (field.isdigit() or field.isidentifier()):
            text = "{" + field + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"{arg} {template!r} has the field {text}, which names no group plainly; {fix}.")


@functools.lru_cache(maxsize=256)
def _parse(dims: str, pattern: str) -> DimSpec:
    return DimSpec.parse(dims, f"Rule {pattern!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Part:
    """One leaf of a (possibly fused or expert-stacked) param: its rule, stacked indices and slot."""

    part: int
    path: str
    rule: Rule
    spec: DimSpec
    fixed: tuple[tuple[str, int], ...]  # stacked dim name -> the index this param takes
    at: int | None  # the index along the new dim


def _format(rule: Rule, template: str, m: re.Match, fields: dict[str, int], path: str, what: str) -> str:
    try:
        return template.format(m.group(0), *m.groups(), **m.groupdict(), **fields)
    except (IndexError, KeyError) as e:
        raise ValueError(
            f"Rule {rule.pattern!r}: its {what} {template!r} cannot be filled for leaf {path!r} ({e!r}): the "
            f"pattern's groups are {m.groups()} ({{0}} is the whole path), named {m.groupdict()}, stacked dims "
            f"{fields}; add the group to the pattern or fix the template."
        ) from None


def _match(source: Source, rules: Sequence[Rule], strict: bool) -> dict[str, list[_Part]]:
    """Param name -> its leaves, by the first rule whose pattern matches each leaf path."""
    parts: dict[str, list[_Part]] = defaultdict(list)
    for path, layout in source.items():
        for rule in rules:
            m = re.fullmatch(rule.pattern, path)
            if m:
                break
        else:
            if strict:
                raise ValueError(
                    f"trainer leaf {path!r} matches no rule; add a Rule for it or pass strict=False to skip it."
                )
            continue
        spec = rule.spec(len(layout.shape))
        stacked = spec.stacked
        sizes = [range(layout.shape[spec.leaf.index(n)]) for n in stacked]
        for idx in itertools.product(*sizes):
            fields = dict(zip(stacked, idx, strict=True))
            name = _format(rule, rule.name, m, fields, path, "name")
            at = None
            if rule.at is not None:
                text = _format(rule, str(rule.at), m, fields, path, "at")
                if not text.isdigit():
                    raise ValueError(f"Rule {rule.pattern!r}: at {rule.at!r} gives {text!r} for leaf {path!r}; "
                                     "it must give a non-negative int.")
                at = int(text)
            parts[name].append(_Part(rule.part, path, rule, spec, tuple(fields.items()), at))
    return dict(parts)


def _role(v: int | str | None, spec: DimSpec, rule: Rule, arg: str) -> str | None:
    """The flat name a rule's ``dim``/``ep_dim`` refers to."""
    if v is None or isinstance(v, str):
        return v
    if not 0 <= v < len(spec.param) or len(spec.param[v]) != 1:
        raise ValueError(f"Rule {rule.pattern!r}: {arg}={v} is not a param dim of one leaf dim "
                         f"(param dims {spec.param}); name the dim instead.")
    return spec.param[v][0]


class _PartGeom(NamedTuple):
    """The leaves of one part of a param, the names of their split dims and every dim's split."""

    leaves: list[_Part]
    splits: dict[str, TpSplit]
    tp: str | None
    ep: str | None
    concat: str
    offset: int  # along ``concat``, where this part starts in the param


def _part_geom(source: Source, name: str, leaves: list[_Part], rows: int, cols: int, slots: int,
               offset: int) -> _PartGeom:
    first = leaves[0]
    rule, spec = first.rule, first.spec
    if len(leaves) > 1 and first.at is None:
        raise ValueError(f"param {name!r} gets two leaves with the same part ({first.path!r}, "
                         f"{leaves[1].path!r}); number them with part= or place them with dims and at=.")
    if len({p.at for p in leaves}) != len(leaves):
        raise ValueError(f"param {name!r}: two leaves of part {first.part} have the same at index; each once.")
    shape = source.layout(first.path).shape
    if any(source.layout(p.path).shape != shape for p in leaves):
        raise ValueError(f"param {name!r}: the leaves of part {first.part} differ in shape; stack equal leaves.")
    tp, ep = _role(rule.dim, spec, rule, "dim"), _role(rule.ep_dim, spec, rule, "ep_dim")
    splits: dict[str, TpSplit] = {}
    leaf = f"leaf {first.path!r} -> {name!r}"
    for x in spec.flat:
        what = f"{leaf} dim {x!r}"
        if x in spec.new:
            k = rows if x == ep else 1
            if slots % k:
                raise ValueError(f"{what}: {slots} experts do not split evenly over {k} expert-parallel "
                                 "groups; use a degree dividing the number of experts.")
            splits[x] = TpSplit(slots // k, tuple((r * slots // k, (r + 1) * slots // k) for r in range(k)))
            continue
        n = shape[spec.leaf.index(x)]
        if x == tp:
            splits[x] = tp_split(n, cols, heads=rule.heads, replicate_heads=rule.replicate_heads, pad_to=rule.pad_to,
                                 what=leaf, dim=repr(x))
        elif x == ep:
            splits[x] = tp_split(n, rows, what=leaf, dim=repr(x), degree="the expert-parallel degree")
        else:
            splits[x] = TpSplit(n, ((0, n),))
    return _PartGeom(leaves, splits, tp, ep, tp or spec.flat[0], offset)


def _group_params(source: Source, name: str, plist: list[_Part], grid: list[list[int]], dtype: str) -> list[Param]:
    """One param per rank of the grid: its parts concatenated along the split dim, its experts placed."""
    rows, cols = len(grid), len(grid[0])
    by_part: dict[int, list[_Part]] = defaultdict(list)
    for p in plist:
        by_part[p.part].append(p)
    slots = max((p.at for p in plist if p.at is not None), default=-1) + 1
    geoms: list[_PartGeom] = []
    total = 0
    for part in sorted(by_part):
        g = _part_geom(source, name, by_part[part], rows, cols, slots, total)
        total += g.splits[g.concat].local
        geoms.append(g)
    # Every part must give the same local dims but along the concatenated one.
    keys = set()
    for g in geoms:
        spec = g.leaves[0].spec
        sizes = {x: (total if x == g.concat else s.local) for x, s in g.splits.items()}
        keys.add((tuple(len(grp) for grp in spec.param), spec.flat.index(g.concat),
                  tuple(sizes[x] for x in spec.flat)))
    if len(keys) != 1:
        raise ValueError(f"fused param {name!r}: its parts give local dims {sorted(k[2] for k in keys)}, which do "
                         "not concatenate along the split dim; their rules must agree on every other dim.")
    spec = geoms[0].leaves[0].spec
    sizes = {x: (total if x == geoms[0].concat else s.local) for x, s in geoms[0].splits.items()}
    local_shape = tuple(math.prod(sizes[x] for x in grp) for grp in spec.param)
    per_rank: list[list[Region]] = [[] for _ in range(rows * cols)]
    for g in geoms:
        for r, c in itertools.product(range(rows), range(cols)):
            for p in g.leaves:
                region = _region(p, g, total, r, c)
                if region is not None:
                    if region.view == local_shape:
                        region = dataclasses.replace(region, view=None)
                    per_rank[r * cols + c].append(region)
    return [Param(name, int(rank), local_shape, dtype, tuple(per_rank[i]))
            for i, rank in enumerate(itertools.chain(*grid))]


def _region(p: _Part, g: _PartGeom, total: int, r: int, c: int) -> Region | None:
    """The region leaf ``p`` fills on grid rank ``(r, c)``, or None if it fills nothing there."""
    spec = p.spec
    box = [(0, 0)] * len(spec.leaf)
    view: list[int] = []
    off: list[int] = []
    perm: list[int] = []
    for n, k in p.fixed:  # a stacked dim: one index, a size-1 dim of the view
        d = spec.leaf.index(n)
        box[d] = (k, k + 1)
        view.append(1)
        off.append(0)
        perm.append(d)
    carry: tuple[int, int] | None = None  # a new dim's (local size, slot), merged into the next dim
    for x in spec.flat:
        s = g.splits[x]
        lo, hi = s.ranges[r if x == g.ep else c if x == g.tp else 0]
        if x in spec.new:
            if p.at is None or not lo <= p.at < hi:
                return None
            carry = (s.local, p.at - lo)
            continue
        if hi <= lo:
            return None
        d = spec.leaf.index(x)
        box[d] = (lo, hi)
        size, o = (total, g.offset) if x == g.concat else (s.local, 0)
        if carry is not None:
            size, o, carry = carry[0] * size, carry[1] * size + o, None
        view.append(size)
        off.append(o)
        perm.append(d)
    return Region(p.path, Box(box), tuple(off), tuple(perm), tuple(view))


def tp_param_map(source: Source, rules: Sequence[Rule], tp_ranks: Any, *, dtype: Any = "float32",
                 strict: bool = True) -> ParamMap:
    """Applies rules to every trainer leaf, for a grid of inference ranks.

    Args:
      source: the trainer leaves.
      rules: the first rule whose pattern matches a leaf path applies.
      tp_ranks: torch ranks in TP order (one TP group), or a list of such lists: the rows
        are inference replicas, or, for rules with ``ep_dim``, expert-parallel groups
        (row ``r`` holds the ``r``-th block of experts, each split over its row's TP ranks).
      dtype: the dtype of every param whose rule gives none.
      strict: raise if a leaf matches no rule (``False`` skips it, for rule lists that cover
        part of a tree; a call where no leaf matches any rule is refused either way).

    Raises:
      ValueError: a leaf matches no rule (no leaf at all with ``strict=False``), a rule's name
        does not fit the leaf, a split is uneven, or fused parts disagree (the message names
        the rule or the leaf).

    Example (one layer of a scanned ``[L, in, out]`` leaf per param):
      >>> from bridge import Rule, Source, tp_param_map, trainer_mesh
      >>> from jreshard import Layout
      >>> src = Source({"mlp/wi": Layout((3, 4, 8), trainer_mesh((2,), "fsdp", [0], 2), (None, "fsdp"))})
      >>> rule = Rule("mlp/wi", "layers.{L}.up.weight", dims="L i o -> o i", dim="o")
      >>> m = tp_param_map(src, [rule], tp_ranks=[1, 2])
      >>> p = [p for p in m.for_rank(2) if p.name == "layers.1.up.weight"][0]
      >>> p.shape, str(p.regions[0].box), p.regions[0].view
      ((4, 4), '[1:2, 0:4, 4:8]', (1, 4, 4))
    """
    if not isinstance(source, Source):
        raise TypeError(f"source must be a bridge.Source, got {type(source).__name__}.")
    if isinstance(rules, (str, Rule)) or not hasattr(rules, "__iter__"):
        raise TypeError(f"rules must be a list of bridge.Rule, got {type(rules).__name__} {rules!r}.")
    rules = list(rules)
    for i, rule in enumerate(rules):
        if not isinstance(rule, Rule):
            raise TypeError(f"rules[{i}] must be a bridge.Rule, got {type(rule).__name__} {rule!r}.")
    strict = check_flag("strict", strict)
    grid = rank_grid(tp_ranks, "tp_ranks", below=SOURCE_BASE).tolist()
    default = param_dtype(dtype)  # BridgePlan refuses the dtypes its wire cannot carry
    matched = _match(source, rules, strict)
    if not matched:
        raise ValueError(f"no trainer leaf matches any of the {len(rules)} rules (first leaves "
                         f"{list(source.paths[:3])}, first patterns {[r.pattern for r in rules[:3]]}); strict=False "
                         "skips the leaves that match none, but at least one must match. Fix the patterns to match "
                         "whole leaf paths.")
    params = []
    for name, plist in matched.items():
        splits = {(p.rule.dim, p.rule.ep_dim) for p in plist}
        dtypes = {default if p.rule.dtype is None else param_dtype(p.rule.dtype, "Rule dtype") for p in plist}
        if len(splits) != 1 or len(dtypes) != 1:
            raise ValueError(f"fused param {name!r}: its rules must agree on dim, ep_dim and dtype.")
        (dt,) = dtypes
        params += _group_params(source, name, plist, grid, dt)
    return ParamMap(params)
