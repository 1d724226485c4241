"""Declarative mappings from torch parameters (per rank) to boxes of JAX leaves.

Vocabulary: a *target* is one torch parameter's local tensor on one torch rank;
a *region* is a part of a target filled from one box of one JAX leaf, through an
axis permutation (``transpose``: torch dim ``i`` is leaf dim ``transpose[i]``).
A fused parameter (``qkv_proj``) has several regions; a padded vocabulary leaves
rows that no region covers (they keep their values). ``Rule`` lists turn into
mappings for tensor-parallel ranks; ``dtensor_targets`` does the same for a torch
``DeviceMesh`` with ``Shard``/``Replicate`` placements.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jreshard.core.layout import canonical_dtype
from jreshard.nn.config import LlamaConfig

from bridge._source import Source

__all__ = ["Region", "Target", "Mapping", "Rule", "tp_mapping", "llama_rules", "llama_mapping",
           "dtensor_targets"]

Bounds = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """Fill ``target[offset : offset + shape]`` with ``leaf[box]`` permuted by ``transpose``."""

    source: str
    box: Bounds  # (lo, hi) per leaf dim
    offset: tuple[int, ...]  # per torch dim
    transpose: tuple[int, ...]  # torch dim i <- leaf dim transpose[i]

    @property
    def shape(self) -> tuple[int, ...]:
        """The region's shape in torch dims."""
        return tuple(self.box[p][1] - self.box[p][0] for p in self.transpose)


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """One torch parameter's local tensor on one rank."""

    name: str
    rank: int
    shape: tuple[int, ...]
    dtype: str
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        for r in self.regions:
            if len(r.offset) != len(self.shape) or sorted(r.transpose) != list(range(len(self.shape))):
                raise ValueError(
                    f"target {self.name!r} on rank {self.rank} has shape {self.shape} but a region with "
                    f"offset {r.offset} and transpose {r.transpose}; give one entry per torch dim."
                )
            if len(r.box) != len(self.shape):
                raise ValueError(f"target {self.name!r}: region box {r.box} must have rank {len(self.shape)}.")
            for i, (o, n) in enumerate(zip(r.offset, r.shape, strict=True)):
                if o < 0 or o + n > self.shape[i]:
                    raise ValueError(
                        f"target {self.name!r} on rank {self.rank}: region from {r.source!r} "
                        f"(offset {r.offset}, shape {r.shape}) leaves the local shape {self.shape} in dim {i}."
                    )


class Mapping:
    """Every rank's targets; both sides of a sync build the same one.

    Example:
      >>> from bridge._source import trainer_mesh
      >>> from jreshard import Layout
      >>> src = Source({"w": Layout((4, 6), trainer_mesh((2,), "fsdp", [0], 2), ("fsdp",), "float32")})
      >>> m = tp_mapping(src, [Rule("w", "linear.weight", transpose=True, shard=0)], tp_ranks=[1, 2])
      >>> m.for_rank(2)[0].regions[0].box
      ((0, 4), (3, 6))
    """

    __slots__ = ("targets", "_key")

    def __init__(self, targets: Iterable[Target]) -> None:
        ts = tuple(targets)
        for t in ts:
            if not isinstance(t, Target):
                raise TypeError(f"targets must hold bridge.Target, got {type(t).__name__}.")
        seen = set()
        for t in ts:
            if (t.name, t.rank) in seen:
                raise ValueError(f"target {t.name!r} appears twice on rank {t.rank}; merge its regions.")
            seen.add((t.name, t.rank))
        self.targets = tuple(sorted(ts, key=lambda t: (t.rank, t.name)))
        self._key = tuple(dataclasses.astuple(t) for t in self.targets)

    def __add__(self, other: Mapping) -> Mapping:
        return Mapping(self.targets + other.targets)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({t.rank for t in self.targets}))

    def for_rank(self, rank: int) -> tuple[Target, ...]:
        return tuple(t for t in self.targets if t.rank == rank)

    def names(self, rank: int | None = None) -> tuple[str, ...]:
        return tuple(t.name for t in self.targets if rank is None or t.rank == rank)

    def check(self, source: Source) -> None:
        """Raises ValueError if a region names a missing leaf or leaves the leaf's shape."""
        for t in self.targets:
            for r in t.regions:
                shape = source.layout(r.source).shape
                inside = len(shape) == len(r.box) and all(
                    0 <= lo <= hi <= n for (lo, hi), n in zip(r.box, shape, strict=True))
                if not inside:
                    raise ValueError(
                        f"target {t.name!r} on rank {t.rank} reads box {r.box} of leaf {r.source!r}, "
                        f"whose shape is {shape}; the box must lie inside it."
                    )

    def key(self) -> tuple:
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __len__(self) -> int:
        return len(self.targets)

    def __repr__(self) -> str:
        return f"Mapping({len(self.targets)} targets on ranks {list(self.ranks)})"


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """Map trainer leaves matching ``pattern`` to a tensor-parallel torch parameter.

    Args:
      pattern: a regular expression that must match the whole leaf path.
      name: the torch name; ``{1}``, ``{2}`` ... are the pattern's groups.
      transpose: ``True`` reverses the dims (flax ``Dense`` kernel ``[in, out]`` to torch
        ``Linear`` weight ``[out, in]``), or give the permutation (torch dim i <- leaf dim p[i]).
      shard: the torch dim split across the TP ranks (column parallel: 0, row parallel: 1),
        ``None`` to replicate.
      part: the position of this leaf in a fused parameter: rules with the same torch name
        are concatenated per rank along ``shard`` (dim 0 when replicated) in ``part`` order.
      pad_to: pad the ``shard`` dim to a multiple of this (a padded vocabulary); the padded
        rows of each rank are left untouched.
      dtype: the torch dtype (default: the mapping's).
      heads: the ``shard`` dim is this many equal attention heads; TP splits whole heads (the
        head count must be a multiple of the TP degree).
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

    def perm(self, rank: int) -> tuple[int, ...]:
        if self.transpose is True:
            return tuple(range(rank))[::-1]
        if self.transpose is False:
            return tuple(range(rank))
        perm = tuple(int(p) for p in self.transpose)
        if sorted(perm) != list(range(rank)):
            raise ValueError(f"Rule {self.pattern!r}: transpose {perm} is not a permutation of {rank} dims.")
        return perm


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


def _split(n: int, tp: int, pad_to: int, what: str, heads: int | None = None,
           replicate: bool = False) -> tuple[int, list[tuple[int, int]]]:
    """Per-rank (lo, hi) of a dim of size n split tp ways, vLLM-style; returns (local size, ranges)."""
    if heads is not None:
        if n % heads:
            raise ValueError(f"{what}: size {n} is not {heads} equal heads; fix the Rule's heads.")
        if tp > heads and not replicate:
            raise ValueError(
                f"{what}: {tp} tensor-parallel ranks for {heads} heads; use a TP degree dividing {heads} "
                "(only KV heads are replicated: Rule(replicate_heads=True))."
            )
        if tp > heads:  # each head on tp // heads consecutive ranks
            if tp % heads:
                raise ValueError(
                    f"{what}: {heads} heads cannot be replicated evenly over {tp} tensor-parallel ranks; "
                    f"use a TP degree that is a multiple or a divisor of {heads}."
                )
            s = n // heads
            return s, [((r * heads // tp) * s, (r * heads // tp + 1) * s) for r in range(tp)]
        if heads % tp:
            raise ValueError(
                f"{what}: {heads} heads do not split evenly over {tp} tensor-parallel ranks (a head would be "
                f"cut); use a TP degree dividing {heads}."
            )
    padded = -(-n // pad_to) * pad_to
    if padded % tp:
        raise ValueError(
            f"{what}: size {n} (padded to {padded} with pad_to={pad_to}) does not split evenly over "
            f"{tp} tensor-parallel ranks; use pad_to a multiple of {tp} or a TP degree dividing {padded}."
        )
    s = padded // tp
    return s, [(min(r * s, n), min((r + 1) * s, n)) for r in range(tp)]


def tp_mapping(source: Source, rules: Sequence[Rule], tp_ranks: Any, *, dtype: Any = "float32",
               strict: bool = True) -> Mapping:
    """Applies name rules to every trainer leaf, for one or more tensor-parallel groups.

    Args:
      source: the trainer leaves.
      rules: the first rule whose pattern matches a leaf path applies.
      tp_ranks: torch ranks in TP order, or a list of such lists (inference replicas).
      dtype: the torch dtype of every target without its own.
      strict: raise if a leaf matches no rule (``False`` skips it).

    Raises:
      ValueError: a leaf matches no rule, a split is uneven, or fused parts disagree.
    """
    groups = _tp_groups(tp_ranks)
    default = canonical_dtype(dtype)
    parts: dict[str, list[tuple[int, str, Rule]]] = {}
    for path, _ in source.items():
        for rule in rules:
            m = re.fullmatch(rule.pattern, path)
            if m:
                name = rule.name.format(m.group(0), *m.groups())
                parts.setdefault(name, []).append((rule.part, path, rule))
                break
        else:
            if strict:
                raise ValueError(
                    f"trainer leaf {path!r} matches no rule; add a Rule for it or pass strict=False to skip it."
                )
    targets = []
    for name, plist in parts.items():
        plist.sort(key=lambda x: x[0])
        if len({p for p, _, _ in plist}) != len(plist):
            raise ValueError(f"torch parameter {name!r} gets two leaves with the same part; number them.")
        shards = {rule.shard for _, _, rule in plist}
        dtypes = {canonical_dtype(rule.dtype) or default for _, _, rule in plist}
        if len(shards) != 1 or len(dtypes) != 1:
            raise ValueError(f"fused parameter {name!r}: its rules must agree on shard and dtype.")
        (shard,) = shards
        (tdtype,) = dtypes
        for group in groups:
            tp = len(group)
            per_rank: list[list[Region]] = [[] for _ in range(tp)]
            cat = 0 if shard is None else shard
            offsets = [0] * tp
            other: tuple[int, ...] | None = None
            for _, path, rule in plist:
                shape = source.layout(path).shape
                perm = rule.perm(len(shape))
                tshape = tuple(shape[p] for p in perm)
                if not 0 <= cat < len(tshape):
                    raise ValueError(
                        f"Rule {rule.pattern!r}: shard dim {cat} is out of range for torch shape {tshape}.")
                rest = tshape[:cat] + tshape[cat + 1:]
                if other is not None and rest != other:
                    raise ValueError(
                        f"fused parameter {name!r}: leaf {path!r} has torch shape {tshape}, which does not "
                        f"concatenate along dim {cat} with the other parts (other dims {other})."
                    )
                other = rest
                if shard is None:
                    local, ranges = tshape[cat], [(0, tshape[cat])] * tp
                else:
                    local, ranges = _split(tshape[cat], tp, rule.pad_to, f"leaf {path!r} -> {name!r} dim {cat}",
                                           rule.heads, rule.replicate_heads)
                for r, (lo, hi) in enumerate(ranges):
                    box = [(0, n) for n in shape]
                    box[perm[cat]] = (lo, hi)
                    offset = [0] * len(tshape)
                    offset[cat] = offsets[r]
                    if hi > lo:
                        per_rank[r].append(Region(path, tuple(box), tuple(offset), perm))
                    offsets[r] += local
            for r, rank in enumerate(group):
                tshape_local = list(other)
                tshape_local.insert(cat, offsets[r])
                targets.append(Target(name, int(rank), tuple(tshape_local), tdtype, tuple(per_rank[r])))
    return Mapping(targets)


def llama_rules(config: LlamaConfig, *, fused: bool = False, vocab_pad: int = 64) -> list[Rule]:
    """Rules from the flax model in ``jreshard.nn`` to Hugging Face Llama/Qwen3 names, vLLM-style TP.

    Column parallel: q, k, v, gate, up (``fused=True``: ``qkv_proj``, ``gate_up_proj``);
    row parallel: o, down; vocabulary parallel embedding and lm_head padded to ``vocab_pad``;
    norms replicated. Attention splits whole heads; with more TP ranks than KV heads each
    KV head is replicated on ``tp // num_key_value_heads`` consecutive ranks (as vLLM does).
    """
    L = r"layers_(\d+)"
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads, "v": config.num_key_value_heads}
    rules = [Rule("embed/embedding", "model.embed_tokens.weight", shard=0, pad_to=vocab_pad)]
    if fused:
        rules += [Rule(rf"{L}/attn/{x}_proj/kernel", "model.layers.{1}.self_attn.qkv_proj.weight",
                       transpose=True, shard=0, part=i, heads=heads[x], replicate_heads=x != "q")
                  for i, x in enumerate("qkv")]
        rules += [Rule(rf"{L}/mlp/{x}_proj/kernel", "model.layers.{1}.mlp.gate_up_proj.weight",
                       transpose=True, shard=0, part=i) for i, x in enumerate(("gate", "up"))]
    else:
        rules += [Rule(rf"{L}/attn/({x})_proj/kernel", "model.layers.{1}.self_attn.{2}_proj.weight",
                       transpose=True, shard=0, heads=heads[x], replicate_heads=x != "q") for x in "qkv"]
        rules.append(Rule(rf"{L}/mlp/(gate|up)_proj/kernel", "model.layers.{1}.mlp.{2}_proj.weight",
                          transpose=True, shard=0))
    rules += [
        Rule(rf"{L}/attn/o_proj/kernel", "model.layers.{1}.self_attn.o_proj.weight", transpose=True, shard=1,
             heads=config.num_attention_heads),
        Rule(rf"{L}/mlp/down_proj/kernel", "model.layers.{1}.mlp.down_proj.weight", transpose=True, shard=1),
        Rule(rf"{L}/attn/(q|k)_norm/scale", "model.layers.{1}.self_attn.{2}_norm.weight"),
        Rule(rf"{L}/input_norm/scale", "model.layers.{1}.input_layernorm.weight"),
        Rule(rf"{L}/post_attention_norm/scale", "model.layers.{1}.post_attention_layernorm.weight"),
        Rule("final_norm/scale", "model.norm.weight"),
        Rule("lm_head/kernel", "lm_head.weight", transpose=True, shard=0, pad_to=vocab_pad),
    ]
    return rules


def llama_mapping(config: LlamaConfig, source: Source, tp_ranks: Any, *, fused: bool = False,
                  vocab_pad: int = 64, dtype: Any = "float32") -> Mapping:
    """The ready mapping for ``jreshard.nn.Llama`` to Hugging Face names on TP ranks.

    With ``tie_word_embeddings`` the torch ``lm_head.weight`` is filled from the embedding too.

    Example:
      >>> from jreshard.nn import LlamaConfig, param_shapes, fsdp_spec
      >>> from bridge._source import trainer_mesh
      >>> cfg = LlamaConfig.load("llama-tiny", vocab_size=1000)
      >>> src = Source.build(param_shapes(cfg), trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
      >>> m = llama_mapping(cfg, src, tp_ranks=[2, 3], fused=True)
      >>> [(t.name, t.shape) for t in m.for_rank(3) if "layers.0.self" in t.name]
      [('model.layers.0.self_attn.o_proj.weight', (256, 128)), ('model.layers.0.self_attn.qkv_proj.weight', (256, 256))]
      >>> [r.box for r in m.for_rank(3) [0].regions]  # lm_head: vocab rows 512..1000 of 1024 padded
      [((0, 256), (512, 1000))]
    """
    mapping = tp_mapping(source, llama_rules(config, fused=fused, vocab_pad=vocab_pad), tp_ranks, dtype=dtype)
    if config.tie_word_embeddings:
        tied = [dataclasses.replace(t, name="lm_head.weight") for t in mapping.targets
                if t.name == "model.embed_tokens.weight"]
        mapping = mapping + Mapping(tied)
    return mapping


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


def dtensor_targets(name: str, source: Source, leaf: str, mesh_ranks: Any, placements: Sequence[Any],
                    *, transpose: bool | Sequence[int] = False, dtype: Any = "float32") -> Mapping:
    """The targets of one DTensor: every rank of its mesh gets its local shard (torch chunk rules).

    Args:
      name: the torch parameter name.
      source: the trainer leaves; ``leaf`` names the one to read.
      mesh_ranks: the DeviceMesh's ``mesh`` (an array of global ranks), or the DeviceMesh.
      placements: one ``Shard(d)``/``Replicate()`` per mesh dim.
      transpose: as in ``Rule``; the DTensor's global shape is the permuted leaf shape.

    Example:
      >>> from bridge._source import trainer_mesh
      >>> from jreshard import Layout
      >>> src = Source({"w": Layout((5, 3), trainer_mesh((2,), "x", [0], 2), ("x",), "float32")})
      >>> m = dtensor_targets("w", src, "w", [[4, 5], [6, 7]], [("shard", 1), "replicate"], transpose=True)
      >>> [(t.rank, t.shape, t.regions[0].box) for t in m.targets]  # doctest: +NORMALIZE_WHITESPACE
      [(4, (3, 3), ((0, 3), (0, 3))), (5, (3, 3), ((0, 3), (0, 3))),
       (6, (3, 2), ((3, 5), (0, 3))), (7, (3, 2), ((3, 5), (0, 3)))]
    """
    mesh_arr = getattr(mesh_ranks, "mesh", mesh_ranks)
    mesh_arr = np.asarray(mesh_arr.tolist() if hasattr(mesh_arr, "tolist") else mesh_arr, dtype=np.int64)
    if mesh_arr.ndim != len(placements):
        raise ValueError(
            f"placements {list(placements)!r} give {len(placements)} entries for a mesh of rank "
            f"{mesh_arr.ndim} (shape {mesh_arr.shape}); give one per mesh dim."
        )
    shape = source.layout(leaf).shape
    perm = Rule(leaf, name, transpose=transpose if isinstance(transpose, bool) else tuple(transpose)).perm(len(shape))
    tshape = tuple(shape[p] for p in perm)
    dims = [_placement(p) for p in placements]
    for d in dims:
        if d is not None and not 0 <= d < len(tshape):
            raise ValueError(f"placement Shard({d}) is out of range for the global shape {tshape}.")
    targets = []
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
        local = tuple(h - l for l, h in zip(lo, hi, strict=True))
        regions = (Region(leaf, tuple(box), (0,) * len(tshape), perm),) if math.prod(local) else ()
        targets.append(Target(name, int(mesh_arr[coord]), local, canonical_dtype(dtype), regions))
    return Mapping(targets)
