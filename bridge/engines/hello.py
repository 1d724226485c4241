"""What trainers and an engine's workers tell each other before a sync: their hellos, as plain data (pure).

Trainer rank 0's hello describes its leaves (path, shape, dtype, spec, and the mesh as
source ids in the trainer's real device order) and its ``bridge.recipes.Recipe``; every
worker's hello describes its place in the engine (TP rank and size, data-parallel
replica, expert parallelism, dtype) and its engine params (``EngineParam``: the name,
per-rank shape and dtype of every parameter its live model loads, in the engine's
logical layout). Everything is JSON-ready; every rank receives every hello, builds the
same ``ParamMap`` from them and checks it against every worker's engine params
(``bridge.engines.agree``), so a mismatch is refused on every rank before any byte moves.
No torch, no jax, no engine: an engine's folder only says what goes into its workers' hellos.

Example:
  >>> from bridge.engines.hello import EngineParam, engine_params_of, worker_hello
  >>> hello = worker_hello(rank=2, replica=0, tp_rank=0, tp=1, replicas=1, expert_parallel=False,
  ...                      dtype="float32", params=[EngineParam("model.norm.weight", (64,), "float32")])
  >>> hello["role"], hello["params"]
  ('worker', [['model.norm.weight', [64], 'float32']])
  >>> engine_params_of(hello)
  [EngineParam(name='model.norm.weight', shape=(64,), dtype='float32')]
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bridge.plan.param_map import ParamMap
from bridge.plan.rules import tp_param_map
from bridge.plan.source import SOURCE_BASE, Source
from bridge.recipes.recipe import Recipe
from jreshard.core.args import check_flag, check_int
from jreshard.core.degrees import InferParallel, rank_grid
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh

__all__ = ["EngineParam", "EngineShape", "PROTOCOL", "build_param_map", "check_engine_params", "engine_params_of",
           "engine_shape", "resolve_names", "source_from_data", "source_to_data", "trainer_hello", "worker_hello",
           "worker_rank"]

PROTOCOL = 2  # bumped when the hellos change shape (2: a worker's engine params under "params")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineParam:
    """A parameter of one worker's live model, as its engine loads it: name, per-rank logical shape, dtype.

    What a sync must fill on that worker; the plan's ``bridge.Param`` of the same name must match it.
    """

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

    def __post_init__(self) -> None:
        grid = rank_grid(self.ranks, "EngineShape ranks", below=SOURCE_BASE)
        object.__setattr__(self, "ranks", tuple(tuple(g) for g in grid.tolist()))
        object.__setattr__(self, "expert_parallel", check_flag("EngineShape expert_parallel", self.expert_parallel))

    @property
    def degrees(self) -> InferParallel:
        """The engine's degrees (``jreshard.core.degrees``): ``dp`` replicas of ``tp`` ranks, and under
        expert parallelism one block of experts per rank (vLLM's ``enable_expert_parallel``)."""
        return InferParallel.of_grid(self.ranks, expert_parallel=self.expert_parallel)

    @property
    def tp(self) -> int:
        return self.degrees.tp

    def expert_grid(self) -> list[list[int]]:
        """The rank grid the expert rules split over: each TP group, or one row per rank under EP."""
        return self.degrees.expert_groups(np.ravel(self.ranks)).tolist()


def source_to_data(source: Source) -> dict[str, Any]:
    """Every leaf's layout as plain data; the mesh keeps the trainer's device order."""
    out = {}
    for path, lay in source.items():
        out[path] = {"shape": list(lay.shape), "dtype": lay.dtype,
                     "spec": [list(s) if isinstance(s, tuple) else s for s in lay.spec],
                     "mesh": np.asarray(lay.mesh.devices).tolist(), "axes": list(lay.mesh.axis_names)}
    return out


def source_from_data(data: Mapping[str, Any]) -> Source:
    """The ``Source`` of ``source_to_data``'s plain data."""
    leaves = {}
    for path, d in data.items():
        mesh = Mesh(np.asarray(d["mesh"], dtype=np.int64), tuple(d["axes"]))
        spec = tuple(tuple(s) if isinstance(s, list) else s for s in d["spec"])
        leaves[path] = Layout(tuple(d["shape"]), mesh, spec, d["dtype"])
    return Source(leaves)


def trainer_hello(rank: int, *, source: Source | None = None, recipe: Recipe | None = None,
                  bucket_bytes: int | None = None) -> dict[str, Any]:
    """A trainer rank's hello: trainer rank 0 also gives the leaves, the recipe and the bucket size."""
    hello: dict[str, Any] = {"role": "trainer", "protocol": PROTOCOL, "rank": check_int("rank", rank)}
    if rank == 0:
        if source is None or recipe is None or bucket_bytes is None:
            raise ValueError("trainer rank 0's hello needs source, recipe and bucket_bytes; give all three.")
        hello.update(leaves=source_to_data(source), recipe=recipe.to_data(),
                     bucket_bytes=check_int("bucket_bytes", bucket_bytes, minimum=1))
    return hello


def worker_rank(trainers: int, replica: int, tp_rank: int, tp: int) -> int:
    """A worker's rank in the sync group: trainers first, then the workers in (replica, TP rank) order."""
    tp = check_int("tp", tp, minimum=1)
    replica, tp_rank = check_int("replica", replica), check_int("tp_rank", tp_rank, maximum=tp - 1)
    return check_int("trainers", trainers) + replica * tp + tp_rank


def worker_hello(*, rank: int, replica: int, tp_rank: int, tp: int, replicas: int, expert_parallel: bool,
                 dtype: str, params: Sequence[EngineParam], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A worker's hello: its place in the engine and its engine params (``extra``: engine-specific entries).

    ``extra`` carries what only some engines send, e.g. the FP8 format (``bridge.engines.fp8.fp8_hello``).
    """
    hello = {"role": "worker", "protocol": PROTOCOL, "rank": check_int("rank", rank),
             "replica": check_int("replica", replica), "tp_rank": check_int("tp_rank", tp_rank),
             "tp": check_int("tp", tp, minimum=1), "replicas": check_int("replicas", replicas, minimum=1),
             "expert_parallel": bool(expert_parallel), "dtype": str(dtype),
             "params": [[p.name, list(p.shape), p.dtype] for p in params]}
    hello.update(extra or {})
    return hello


def engine_params_of(hello: Mapping[str, Any]) -> list[EngineParam]:
    """The engine params of a worker's hello (after the JSON round trip)."""
    return [EngineParam(n, tuple(s), d) for n, s, d in hello["params"]]


def build_param_map(source: Source, recipe: Recipe, engine: EngineShape) -> ParamMap:
    """Every worker's params from the trainer's leaves, the recipe and the engine's shape.

    The params the recipe ties (``Recipe.tied``: the ``lm_head`` of a model with tied embeddings)
    are not among them: their bytes would cross the wire twice.

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
    doubled = sorted(set(recipe.tied) & {p.name for p in param_map.params})
    if doubled:
        raise ValueError(f"the recipe ties {doubled} to {[recipe.tied[n] for n in doubled]}, but trainer leaves fill "
                         "them too; drop those leaves (a tied model has none) or give a recipe with "
                         "tie_lm_head=False.")
    return param_map  # a tied param (``recipe.tied``) is not sent: each worker fills it from its source


def resolve_names(param_map: ParamMap, engine_params: Mapping[int, Sequence[EngineParam]]) -> ParamMap:
    """Renames params to the live model's names where the engine nests a module one level deeper.

    A recipe names an engine's modules as the model code builds them
    (``model.layers.0.mlp.experts.w13_weight``); some vLLM versions hold the same parameter
    in a submodule (``model.layers.0.mlp.experts.routed_experts.w13_weight``). A param whose
    name is not an engine param of its rank takes the one engine param one module deeper under
    the same parent with the same parameter name (of those, the one with its shape where several
    are), so that a param of the wrong shape is reported as a shape mismatch
    (``check_engine_params``), not as a missing and an extra name; every rank resolves alike.
    """
    by_rank = {rank: {t.name: t for t in live} for rank, live in engine_params.items()}
    out = []
    for p in param_map.params:
        live = by_rank.get(p.rank, {})
        if p.name not in live:
            parent, _, leaf = p.name.rpartition(".")
            found = [t for t in live.values() if t.name.startswith(parent + ".") and t.name.endswith("." + leaf)
                     and t.name.count(".") == p.name.count(".") + 1]
            same = [t for t in found if tuple(t.shape) == tuple(p.shape)]
            if len(same) == 1 or len(found) == 1:
                p = dataclasses.replace(p, name=(same if len(same) == 1 else found)[0].name)
        out.append(p)
    return ParamMap(out)


def check_engine_params(param_map: ParamMap, engine_params: Mapping[int, Sequence[EngineParam]],
                        source: Source | None = None, tied: Mapping[str, str] | None = None) -> list[str]:
    """What differs between the params the sync writes and each worker's engine params (empty: nothing).

    Every param must be an engine param of its rank with the same shape and dtype, and every
    engine param must be written: a parameter the sync skipped would keep its old weights.
    With ``source`` (the trainer's leaves), a param of another shape or dtype names the leaves
    it comes from and their shapes. An engine param tied to a param (``tied``: ``{name: source}``,
    ``Recipe.tied``) is filled from its source's tensor, so it must have the source's shape and dtype.
    """
    problems = []
    for rank, live in sorted(engine_params.items()):
        want = {t.name: t for t in live}
        got = {p.name: p for p in param_map.for_rank(rank)}
        got.update({name: got[src] for name, src in (tied or {}).items() if src in got and name in want})
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
                leaves = sorted({r.leaf for r in p.regions})
                given = "" if source is None else " " + ", ".join(
                    f"{leaf!r} {source.layout(leaf).shape}" for leaf in leaves if leaf in source.paths)
                problems.append(f"rank {rank}: {name!r} is {tuple(t.shape)} {t.dtype} in the engine but "
                                f"{tuple(p.shape)} {p.dtype} from the trainer's leaves{given} and recipe")
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
