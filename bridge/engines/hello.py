"""What trainers and vLLM workers tell each other before a sync, as plain data (pure: no torch, no jax).

Trainer rank 0 describes its leaves (path, shape, dtype, spec, and the mesh as source
ids in the trainer's real device order) and its ``Recipe`` (the rules that turn leaves
into vLLM params); every worker describes its place in the engine (TP rank and size,
data-parallel replica, expert parallelism, dtype) and its targets: the name, per-rank
shape and dtype of every parameter its live model loads, in vLLM's logical layout.
Everything is JSON-ready; every rank receives every description, builds the same
``ParamMap`` from them and checks it against every worker's targets, so a mismatch
is refused on every rank before any byte moves.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bridge.plan.param_map import ParamMap
from bridge.plan.rules import Rule, tp_param_map
from bridge.plan.source import Source
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh

__all__ = ["Recipe", "EngineShape", "Target", "source_to_data", "source_from_data", "build_param_map", "engine_shape",
           "resolve_names", "check_targets", "bytes_per_worker", "PROTOCOL"]

PROTOCOL = 1  # bumped when the descriptions change shape


def _rule_to_data(rule: Rule) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(Rule):
        v = getattr(rule, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def _rule_from_data(data: Mapping[str, Any]) -> Rule:
    kw = dict(data)
    if isinstance(kw.get("transpose"), list):
        kw["transpose"] = tuple(kw["transpose"])
    return Rule(**kw)


@dataclasses.dataclass(frozen=True, slots=True)
class Recipe:
    """How the trainer's leaves become vLLM params: rules split over each TP group, expert rules, tying.

    Args:
      rules: rules applied over every tensor-parallel group (attention, dense MLP, norms,
        embeddings); the first rule whose pattern matches a leaf applies.
      expert_rules: rules of routed experts split over each TP group (the engine without
        expert parallelism).
      ep_expert_rules: the same experts split linearly over the engine's ranks (vLLM's
        ``enable_expert_parallel``: one row per rank, experts whole); used when the engine has
        expert parallelism.
      tie_lm_head: the engine has an ``lm_head.weight`` filled from the embedding.
    """

    rules: tuple[Rule, ...]
    expert_rules: tuple[Rule, ...] = ()
    ep_expert_rules: tuple[Rule, ...] = ()
    tie_lm_head: bool = False

    def __post_init__(self) -> None:
        for what in ("rules", "expert_rules", "ep_expert_rules"):
            value = tuple(getattr(self, what))
            for r in value:
                if not isinstance(r, Rule):
                    raise TypeError(f"Recipe {what} must hold bridge.Rule, got {type(r).__name__}.")
            object.__setattr__(self, what, value)

    @classmethod
    def llama(cls, config: Any, *, vocab_pad: int = 64) -> Recipe:
        """``jreshard.nn``'s Llama/Qwen3 model as vLLM names it (fused ``qkv_proj`` and ``gate_up_proj``)."""
        from bridge.recipes.llama import llama_rules

        return cls(tuple(llama_rules(config, fused=True, vocab_pad=vocab_pad)),
                   tie_lm_head=bool(config.tie_word_embeddings))

    @classmethod
    def qwen3_moe(cls, config: Any, *, vocab_pad: int = 64, names: dict[str, str] | None = None) -> Recipe:
        """``jreshard.nn``'s Qwen3-MoE model as vLLM names it (``FusedMoE`` ``w13_weight``/``w2_weight``).

        ``names`` overrides the expert param templates (see ``bridge.recipes.qwen3_moe.expert_rules``);
        where vLLM nests the experts one module deeper the workers find them (``resolve_names``).
        """
        from bridge.recipes.qwen3_moe import expert_rules, qwen3_moe_rules

        experts = tuple(expert_rules(target="vllm", names=names))
        dense = tuple(r for r in qwen3_moe_rules(config, names=names, vocab_pad=vocab_pad) if r not in experts)
        return cls(dense, experts, tuple(expert_rules(target="vllm", names=names, ep=True)),
                   bool(config.tie_word_embeddings))

    def to_data(self) -> dict[str, Any]:
        return {"rules": [_rule_to_data(r) for r in self.rules],
                "expert_rules": [_rule_to_data(r) for r in self.expert_rules],
                "ep_expert_rules": [_rule_to_data(r) for r in self.ep_expert_rules], "tie_lm_head": self.tie_lm_head}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Recipe:
        def rules(key: str) -> tuple[Rule, ...]:
            return tuple(_rule_from_data(r) for r in data[key])

        return cls(rules("rules"), rules("expert_rules"), rules("ep_expert_rules"), bool(data["tie_lm_head"]))


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """A parameter of one worker's live model: its name, per-rank logical shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True, slots=True)
class EngineShape:
    """The inference engine as the sync sees it: sync ranks in (replica, TP rank) order and expert placement.

    ``ranks[d][t]`` is the sync rank of TP rank ``t`` of data-parallel replica ``d``.
    """

    ranks: tuple[tuple[int, ...], ...]
    expert_parallel: bool
    dtype: str

    @property
    def tp(self) -> int:
        return len(self.ranks[0])

    def expert_grid(self) -> list[list[int]]:
        """The rank grid the expert rules split over: each TP group, or one row per rank under EP."""
        if not self.expert_parallel:
            return [list(g) for g in self.ranks]
        return [[r] for g in self.ranks for r in g]


def source_to_data(source: Source) -> dict[str, Any]:
    """Every leaf's layout as plain data; the mesh keeps the trainer's device order."""
    out = {}
    for path, lay in source.items():
        out[path] = {"shape": list(lay.shape), "dtype": lay.dtype,
                     "spec": [list(s) if isinstance(s, tuple) else s for s in lay.spec],
                     "mesh": np.asarray(lay.mesh.devices).tolist(), "axes": list(lay.mesh.axis_names)}
    return out


def source_from_data(data: Mapping[str, Any]) -> Source:
    leaves = {}
    for path, d in data.items():
        mesh = Mesh(np.asarray(d["mesh"], dtype=np.int64), tuple(d["axes"]))
        spec = tuple(tuple(s) if isinstance(s, list) else s for s in d["spec"])
        leaves[path] = Layout(tuple(d["shape"]), mesh, spec, d["dtype"])
    return Source(leaves)


def build_param_map(source: Source, recipe: Recipe, engine: EngineShape) -> ParamMap:
    """Every worker's params from the trainer's leaves, the recipe and the engine's shape.

    Raises:
      ValueError: a leaf matches no rule, or a rule does not fit the engine (an uneven split).
    """
    experts = recipe.ep_expert_rules if engine.expert_parallel else recipe.expert_rules
    if engine.expert_parallel and recipe.expert_rules and not experts:
        raise ValueError("the engine runs with expert parallelism but the recipe has no ep_expert_rules; give "
                         "the expert rules split over ranks (expert_rules(..., ep=True)).")
    unmatched = [p for p in source.paths if not any(re.fullmatch(r.pattern, p) for r in (*recipe.rules, *experts))]
    if unmatched:
        raise ValueError(f"trainer leaves {unmatched[:3]} ({len(unmatched)} in all) match no rule of the "
                         "recipe; add rules for them.")
    groups = [list(g) for g in engine.ranks]
    param_map = tp_param_map(source, recipe.rules, groups, dtype=engine.dtype, strict=False)
    if experts:
        param_map = param_map + tp_param_map(source, experts, engine.expert_grid(), dtype=engine.dtype,
                                             strict=False)
    if recipe.tie_lm_head:
        from bridge.recipes.llama import tie_lm_head

        param_map = tie_lm_head(param_map)
    return param_map


def resolve_names(param_map: ParamMap, targets: Mapping[int, Sequence[Target]]) -> ParamMap:
    """Renames params to the live model's names where the engine nests a module one level deeper.

    A recipe names vLLM's modules as the model code builds them
    (``model.layers.0.mlp.experts.w13_weight``); some vLLM versions hold the same parameter
    in a submodule (``model.layers.0.mlp.experts.routed_experts.w13_weight``). A param whose
    name is not a target of its rank takes the one target under the same parent module with
    the same parameter name and shape, if there is exactly one; every rank resolves alike.
    """
    by_rank = {rank: {t.name: t for t in live} for rank, live in targets.items()}
    out = []
    for p in param_map.params:
        live = by_rank.get(p.rank, {})
        if p.name not in live:
            parent, _, leaf = p.name.rpartition(".")
            found = [t for t in live.values() if t.name.startswith(parent + ".") and t.name.endswith("." + leaf)
                     and t.name.count(".") == p.name.count(".") + 1 and tuple(t.shape) == tuple(p.shape)]
            if len(found) == 1:
                p = dataclasses.replace(p, name=found[0].name)
        out.append(p)
    return ParamMap(out)


def check_targets(param_map: ParamMap, targets: Mapping[int, Sequence[Target]]) -> list[str]:
    """What differs between the params the sync writes and each worker's live targets (empty: nothing).

    Every param must be a target of its rank with the same shape and dtype, and every
    target must be written: a parameter the sync skipped would keep its old weights.
    """
    problems = []
    for rank, live in sorted(targets.items()):
        want = {t.name: t for t in live}
        got = {p.name: p for p in param_map.for_rank(rank)}
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        if missing:
            problems.append(f"rank {rank}: {len(missing)} parameters of the engine get no leaf, e.g. "
                            f"{missing[:3]}")
        if extra:
            problems.append(f"rank {rank}: {len(extra)} params of the recipe are not in the engine, e.g. "
                            f"{extra[:3]}")
        for name in sorted(set(want) & set(got)):
            t, p = want[name], got[name]
            if tuple(p.shape) != tuple(t.shape) or p.dtype != t.dtype:
                problems.append(f"rank {rank}: {name!r} is {tuple(t.shape)} {t.dtype} in the engine but "
                                f"{tuple(p.shape)} {p.dtype} from the trainer's leaves and recipe")
    return problems


def engine_shape(workers: Sequence[Mapping[str, Any]]) -> EngineShape:
    """The engine's shape from every worker's handshake description.

    Raises:
      ValueError: the workers disagree on TP size, replicas, expert parallelism or dtype, or a
        (replica, TP rank) is missing or doubled.
    """
    if not workers:
        raise ValueError("the sync group has no vLLM workers; give world_size = trainers + workers.")
    for key in ("tp", "replicas", "expert_parallel", "dtype"):
        values = {str(w[key]) for w in workers}
        if len(values) != 1:
            raise ValueError(f"the vLLM workers disagree on {key}: {sorted(values)}.")
    tp, replicas = int(workers[0]["tp"]), int(workers[0]["replicas"])
    slots = {(int(w["replica"]), int(w["tp_rank"])): int(w["rank"]) for w in workers}
    want = {(d, t) for d in range(replicas) for t in range(tp)}
    if set(slots) != want or len(slots) != len(workers):
        raise ValueError(f"the vLLM workers hold (replica, TP rank) {sorted(slots)}, expected {sorted(want)}; "
                         "give world_size = trainers + every worker of every replica.")
    ranks = tuple(tuple(slots[(d, t)] for t in range(tp)) for d in range(replicas))
    return EngineShape(ranks, bool(workers[0]["expert_parallel"]), str(workers[0]["dtype"]))


FUSED = ("qkv_proj.weight", "gate_up_proj.weight", "w13_weight", "w2_weight")
_ITEMSIZE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def bytes_per_worker(param_map: Any, source: Any) -> dict[str, dict[int, int]]:
    """Per method (``jreshard``, ``nccl``, ``nccl_m2n``), per worker rank, the bytes it receives per sync.

    ``jreshard``: the regions of the worker's params, the lower bound (padding rows are not
    sent). ``nccl``: vLLM's ``nccl`` backend broadcasts every checkpoint tensor, whole, to
    every worker. ``nccl_m2n``: vLLM's reshard collective sends shards for params that map one
    to one and whole tensors for every fused param (``FUSED``).

    Args:
      param_map: the workers' ``bridge.ParamMap`` (from ``build_param_map`` or a ``BridgePlan``).
      source: the trainer's ``bridge.Source``.

    Example:

      >>> from bridge import Source, trainer_mesh
      >>> from bridge.engines.hello import EngineShape, Recipe, build_param_map, bytes_per_worker
      >>> from jreshard.nn import LlamaConfig, fsdp_spec, param_shapes
      >>> cfg = LlamaConfig.load("llama-tiny")
      >>> src = Source.build(param_shapes(cfg), trainer_mesh((4,), "fsdp", [0], 4), fsdp_spec)
      >>> b = bytes_per_worker(build_param_map(src, Recipe.llama(cfg), EngineShape(((1, 2),), False, "float32")), src)
      >>> b["nccl"][1] == sum(lay.nbytes for _, lay in src.items()), b["jreshard"][1] < b["nccl_m2n"][1] < b["nccl"][1]
      (True, True)
    """
    total = sum(math.prod(lay.shape) * _ITEMSIZE_BYTES[lay.dtype] for _, lay in source.items())
    out: dict[str, dict[int, int]] = {"jreshard": {}, "nccl": {}, "nccl_m2n": {}}
    for rank in param_map.ranks:
        exact = m2n = 0
        for p in param_map.for_rank(rank):
            size = _ITEMSIZE_BYTES[p.dtype]
            region = sum(math.prod(r.shape) for r in p.regions) * size
            exact += region
            if p.name.endswith(FUSED):
                m2n += sum(math.prod(source.layout(leaf).shape) for leaf in {r.leaf for r in p.regions}) * size
            else:
                m2n += region
        out["jreshard"][rank], out["nccl"][rank], out["nccl_m2n"][rank] = exact, total, m2n
    return out
