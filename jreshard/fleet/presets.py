"""Parallelism presets: the Layout of every tensor of a model under a framework's sharding.

Vocabulary: *tp* tensor parallel, *pp* pipeline parallel (consecutive layers per
stage), *ep* expert parallel (routed experts split across ranks), *expert_tp*
tensor parallel inside an expert, *cp* context parallel (weights replicated),
*dp* data parallel (replicas), *fsdp* data-parallel ranks that shard weights on
their leading dim. The degrees are ``TrainParallel`` and ``InferParallel``
(``jreshard.core.degrees``).

Device order follows the frameworks, tp innermost:

- training (Megatron order ``tp-cp-ep-dp-pp``): pipeline stages are the outermost
  blocks of the device list; inside a stage the dense weights live on a mesh
  ``(dp, fsdp, cp, tp)`` and the routed experts on ``(edp, ep, fsdp, etp)``
  (``etp`` is ``expert_tp``). As in Megatron, ep folds into the data-parallel
  ranks: a stage of ``S`` devices replicates dense weights over
  ``S / (tp*cp*fsdp)`` ranks and experts over ``S / (ep*fsdp*expert_tp)`` ranks.
- JAX-style FSDP x TP is the same mesh with ``fsdp > 1``: every tensor's leading
  dim is sharded over ``fsdp`` (major) and, for tp-split dim 0, over ``tp``
  (minor). A stacked expert tensor ``[E, ...]`` splits its expert dim over
  ``('ep', 'fsdp')`` and its intermediate dim over ``etp``; one leaf per expert
  lives on the devices of its ep rank, its leading dim over ``fsdp``.
  ``nn_layouts`` gives the same rules for the parameter tree of ``jreshard.nn``
  (flax kernels ``[in, out]``, experts stacked ``[E, H, I]``).
- inference (vLLM): a mesh ``(dp, tp)``, each dp replica one engine of
  consecutive ranks. Routed experts follow ``tp`` (their intermediate dim split:
  rank ``r`` holds gate rows then up rows ``[r*I/tp, (r+1)*I/tp)``, vLLM's fused
  ``w13``); with ``ep > 1`` or ``expert_tp > 1`` they live on an
  ``(edp, ep, etp)`` view of the same devices, linear placement (rank ``r`` of
  ep holds experts ``[r*E/ep, (r+1)*E/ep)``) and ``etp`` inside each expert.
  Attention projections split whole heads (``jreshard.core.heads``); with fewer
  KV heads than ``tp`` the KV projections live on a ``(dp, tp, tp_replica)``
  view, each head on ``tp_replica`` consecutive ranks, as vLLM replicates them.

``check_degrees`` refuses degrees the frameworks cannot lay out (a ``tp`` that cuts
a head, an ``ep`` that does not divide the experts, more stages than layers).

Column-parallel weights (``[out, in]``) are split on dim 0, row-parallel on dim 1,
embeddings and heads on the vocabulary dim; norms and routers are replicated.

Example:
  >>> from jreshard.fleet import catalog, presets
  >>> infos = catalog.tensors("llama-tiny")
  >>> dst = presets.infer_layouts(infos, presets.InferParallel(tp=2, dp=2), devices=range(4, 8))
  >>> dst["model.layers.0.self_attn.o_proj.weight"].spec_str
  "P(None, 'tp')"
  >>> dst["model.layers.0.self_attn.o_proj.weight"].mesh.shape
  (2, 2)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jreshard.core.args import check_int
from jreshard.core.degrees import InferParallel, TrainParallel, parse_degrees, parse_parallel
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh
from jreshard.core.tp_split import VOCAB_ROLES, tp_dim, tp_split
from jreshard.fleet.catalog import TensorInfo
from jreshard.fleet.nn_presets import nn_layouts

__all__ = ["TrainParallel", "InferParallel", "train_layouts", "infer_layouts", "stage_of_layers", "parse_parallel",
           "parse_degrees", "check_degrees", "nn_layouts"]


def _device_array(devices: Iterable[int], n: int, arg: str) -> np.ndarray:
    ids = np.asarray(list(devices), dtype=np.int64)
    if ids.ndim != 1 or len(ids) != n:
        raise ValueError(f"{arg} must list {n} device ids, got {len(ids)}.")
    return ids


class _Layouts:
    """Makes Layouts, one object per distinct (shape, mesh, spec, dtype).

    A model's tensors share a few layouts; sharing the objects spares building one per
    tensor, and lets the planner and the cost model group tensors by identity.
    """

    def __init__(self) -> None:
        self._made: dict[tuple, Layout] = {}
        self._meshes: list[Mesh] = []  # keeps every mesh keyed by id alive while self lives

    def __call__(self, shape: tuple[int, ...], mesh: Mesh, spec: Any, dtype: str | None) -> Layout:
        key = (shape, id(mesh), spec, dtype)
        lay = self._made.get(key)
        if lay is None:
            lay = self._made[key] = Layout(shape, mesh, spec, dtype)
            self._meshes.append(mesh)
        return lay


def stage_of_layers(num_layers: int, pp: int) -> list[int]:
    """The pipeline stage of each decoder layer: consecutive, as even as possible."""
    num_layers, pp = check_int("num_layers", num_layers), check_int("pp", pp, minimum=1)
    if pp > max(num_layers, 1):
        raise ValueError(f"pp={pp} stages exceed the model's {num_layers} layers; use pp <= {num_layers}.")
    return [s for s, block in enumerate(np.array_split(np.arange(num_layers), pp)) for _ in block]


def _dense_spec(info: TensorInfo, tp: str | None, fsdp: str | None) -> tuple:
    """Spec of a non-expert tensor: tp on its role's dim (``jreshard.core.tp_split``), fsdp on the leading dim."""
    rank = len(info.shape)
    if rank == 0:
        return ()
    dim = tp_dim(info.role) if tp else None
    lead = [a for a in (fsdp, tp if dim == 0 else None) if a]
    spec: list = [tuple(lead) if lead else None] + [None] * (rank - 1)
    if dim is not None and 0 < dim < rank:
        spec[dim] = tp
    return tuple(spec)


class _ExpertMeshes(NamedTuple):
    """The meshes routed experts live on: all of them (stacked) and each ep rank's (one leaf per expert)."""

    stacked: Mesh
    owners: tuple[Mesh, ...]
    fsdp: str | None
    etp: str | None
    per_owner: int  # routed experts per ep rank

    @classmethod
    def build(cls, ids: np.ndarray, ep: int, fsdp: int, etp: int, num_experts: int) -> _ExpertMeshes:
        """Devices ``ids`` as ``(edp, ep[, fsdp], etp)``, etp innermost (fsdp only where it shards)."""
        sizes = {"ep": ep, "fsdp": fsdp, "etp": etp} if fsdp > 1 else {"ep": ep, "etp": etp}
        grid = ids.reshape((-1, *sizes.values()))
        names = ("edp", *sizes)
        owners = tuple(Mesh(grid[:, r], names[:1] + names[2:]) for r in range(ep))
        return cls(Mesh(grid, names), owners, "fsdp" if fsdp > 1 else None, "etp" if etp > 1 else None,
                   max(1, -(-num_experts // ep)))

    def key(self, info: TensorInfo, dtype: str) -> tuple:
        """What ``layout`` depends on: tensors with equal keys have equal layouts (the ep rank: linear placement)."""
        return (info.shape, info.role == "column", info.stacked,
                None if info.stacked else (info.expert or 0) // self.per_owner, dtype)

    def layout(self, info: TensorInfo, dtype: str, make: Any = Layout) -> Layout:
        """``info``'s layout: stacked ``[E, ...]`` over all ep ranks, else on its expert's ep rank."""
        inner: tuple = (self.etp, None) if info.role == "column" else (None, self.etp)
        if info.stacked:
            lead = ("ep", self.fsdp) if self.fsdp else "ep"
            return make(info.shape, self.stacked, (lead, *inner), dtype)
        mesh = self.owners[(info.expert or 0) // self.per_owner]
        if self.fsdp:  # the leading dim over fsdp (major), as for dense tensors
            first = tuple(a for a in (self.fsdp, inner[0]) if a)
            inner = (first if len(first) > 1 else first[0], inner[1])
        return make(info.shape, mesh, inner, dtype)


class _Facts(NamedTuple):
    """What the degrees are checked against, read in one pass over a model's tensors."""

    n_experts: int  # routed experts (0 without)
    n_layers: int  # decoder layers
    distinct: list[TensorInfo]  # one tensor per way of splitting (role, shape, heads, stacked, is_expert)

    @classmethod
    def of(cls, infos: Sequence[TensorInfo]) -> _Facts:
        seen: dict[tuple, TensorInfo] = {}
        n_exp, last_layer = 0, -1
        for t in infos:  # a frontier model has 200,000 tensors: one lean pass
            key = (t.role, t.shape, t.heads, t.replicate_heads, t.stacked, t.expert is None)
            if key not in seen:
                seen[key] = t
            if t.stacked:
                n_exp = max(n_exp, t.shape[0])
            elif t.expert is not None and t.expert >= n_exp:
                n_exp = t.expert + 1
            if t.layer is not None and t.layer > last_layer:
                last_layer = t.layer
        return cls(n_exp, last_layer + 1, list(seen.values()))


def _tp_dim(info: TensorInfo) -> int | None:
    """The dim that tensor parallelism splits and must split evenly (expert_tp for training experts); None if none.

    The vocabulary is left out: the frameworks pad it to split it.
    """
    return None if info.role in VOCAB_ROLES else tp_dim(info.role, stacked=info.stacked)


def _check_split(info: TensorInfo, arg: str, degree: int, replicate: bool) -> None:
    dim = _tp_dim(info)
    if degree == 1 or dim is None:
        return
    tp_split(info.shape[dim], degree, heads=info.heads, replicate_heads=replicate and info.replicate_heads,
             what=f"{arg}={degree} on {info.name}", dim=dim, degree=arg)


def _head_replicas(info: TensorInfo, tp: int) -> int:
    """How many consecutive TP ranks hold each head of ``info`` (1 unless KV heads are replicated)."""
    dim = _tp_dim(info)
    if info.heads is None or dim is None or tp == 1:
        return 1
    return tp_split(info.shape[dim], tp, heads=info.heads, replicate_heads=info.replicate_heads,
                    what=info.name).replicas


def check_degrees(infos: Sequence[TensorInfo], par: TrainParallel | InferParallel) -> None:
    """Raises ValueError when the degrees do not divide the model as the frameworks require.

    - ``tp`` splits attention heads by the vLLM head rule (``jreshard.core.heads``):
      it divides the query heads; inference replicates KV heads when ``tp`` is a
      multiple of them, training (Megatron) never does. Every other tensor-parallel
      dim except the vocabulary (which the frameworks pad) must split evenly, as
      must the expert dims under ``expert_tp`` (training, and inference with
      ``ep`` or ``expert_tp``) or ``tp`` (inference without them).
    - ``ep`` divides the routed experts, and is 1 for a model without them.
    - ``pp`` does not exceed the decoder layers (stages may differ by one layer).

    Example:
      >>> from jreshard.fleet import catalog, presets
      >>> infos = catalog.tensors("llama-tiny")  # 8 query heads, 4 KV heads
      >>> presets.check_degrees(infos, presets.InferParallel(tp=8))  # KV heads replicated twice
      >>> presets.check_degrees(infos, presets.TrainParallel(tp=8))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: tp=8 on model.layers.0.self_attn.k_proj.weight: 8 tensor-parallel ranks for 4 heads, which ...
    """
    _check(_Facts.of(infos), par)


def _check(facts: _Facts, par: TrainParallel | InferParallel) -> None:
    """``check_degrees`` on the facts of a model."""
    if not isinstance(par, (TrainParallel, InferParallel)):
        raise TypeError(f"par must be a TrainParallel or an InferParallel, got {type(par).__name__}.")
    infer = isinstance(par, InferParallel)
    # Experts follow tp only at inference without ep and expert_tp; else expert_tp cuts them.
    follow_tp = isinstance(par, InferParallel) and not par.splits_experts
    expert_arg, expert_degree = ("tp", par.tp) if follow_tp else ("expert_tp", par.expert_tp)
    for t in facts.distinct:
        if t.is_expert:
            _check_split(t, expert_arg, expert_degree, False)
        else:
            _check_split(t, "tp", par.tp, infer)
    n_exp = facts.n_experts
    if par.ep > 1 and not n_exp:
        raise ValueError(f"ep={par.ep} but the model has no routed experts; use ep=1.")
    if n_exp % par.ep:
        raise ValueError(f"ep={par.ep} does not divide the model's {n_exp} routed experts; "
                         f"make ep a divisor of {n_exp}.")
    if isinstance(par, TrainParallel):
        stage_of_layers(facts.n_layers, par.pp)


def train_layouts(infos: Sequence[TensorInfo], par: TrainParallel, devices: Iterable[int],
                  dtype: str | None = None) -> dict[str, Layout]:
    """The training Layout of every tensor, on explicit device ids (Megatron / JAX order).

    Args:
      infos: the model's tensors (``catalog.tensors``).
      par: the degrees.
      devices: the training device ids, in rank order.
      dtype: element type of the weights; defaults to each tensor's dtype.
    """
    if not isinstance(par, TrainParallel):
        raise TypeError(f"par must be a TrainParallel, got {type(par).__name__}.")
    devices = list(devices)
    stage_size, dense_dp, _ = par.world(len(devices))
    facts = _Facts.of(infos)
    _check(facts, par)
    ids = _device_array(devices, len(devices), "devices").reshape(par.pp, stage_size)
    layer_stage = stage_of_layers(facts.n_layers, par.pp) if facts.n_layers else []
    n_exp = facts.n_experts
    dense_mesh = [Mesh(ids[s].reshape(dense_dp, par.fsdp, par.cp, par.tp), ("dp", "fsdp", "cp", "tp"))
                  for s in range(par.pp)]
    experts = [_ExpertMeshes.build(ids[s], par.ep, par.fsdp, par.expert_tp, n_exp) for s in range(par.pp)]
    fsdp = "fsdp" if par.fsdp > 1 else None
    tp = "tp" if par.tp > 1 else None
    out: dict[str, Layout] = {}
    cache: dict[tuple, tuple] = {}
    make = _Layouts()
    by_key: dict[tuple, Layout] = {}  # expert layouts by (stage, _ExpertMeshes.key)
    for t in infos:  # a frontier model has 200,000 tensors: this loop stays lean
        s = layer_stage[t.layer] if t.layer is not None else 0 if t.role == "embed" else par.pp - 1
        dt = dtype or t.dtype
        if t.expert is not None or t.stacked:
            ekey = (s, experts[s].key(t, dt))
            lay = by_key.get(ekey)
            out[t.name] = lay if lay is not None else by_key.setdefault(ekey, experts[s].layout(t, dt, make))
        else:
            key = (t.role, len(t.shape))
            spec = cache.get(key)
            if spec is None:
                spec = cache[key] = _dense_spec(t, tp, fsdp)
            out[t.name] = make(t.shape, dense_mesh[s], spec, dt)
    return out


def infer_layouts(infos: Sequence[TensorInfo], par: InferParallel, devices: Iterable[int],
                  dtype: str | None = None) -> dict[str, Layout]:
    """The inference Layout of every tensor (vLLM-style tp x dp engines, optional ep x expert_tp).

    Args:
      infos: the model's tensors (``catalog.tensors``).
      par: the degrees.
      devices: the inference device ids, in rank order (engine 0's tp ranks first).
      dtype: element type of the weights; defaults to each tensor's dtype.
    """
    if not isinstance(par, InferParallel):
        raise TypeError(f"par must be an InferParallel, got {type(par).__name__}.")
    devices = list(devices)
    par.check(len(devices))
    facts = _Facts.of(infos)
    _check(facts, par)
    ids = _device_array(devices, len(devices), "devices")
    mesh = Mesh(par.engines(ids), ("dp", "tp"))
    # KV heads fewer than tp: each head on `replicas` consecutive tp ranks (vLLM), so the
    # tp axis splits into the head groups (still "tp") and their copies ("tp_replica").
    head_mesh: dict[int, Mesh] = {1: mesh}
    experts = _ExpertMeshes.build(ids, par.ep, 1, par.expert_tp, facts.n_experts) if par.splits_experts else None
    tp = "tp" if par.tp > 1 else None
    out: dict[str, Layout] = {}
    make = _Layouts()
    by_key: dict[tuple, Layout] = {}  # by _ExpertMeshes.key, or a dense tensor's kind
    for t in infos:
        dt = dtype or t.dtype
        if experts is not None and (t.expert is not None or t.stacked):
            key = experts.key(t, dt)
            lay = by_key.get(key)
            out[t.name] = lay if lay is not None else by_key.setdefault(key, experts.layout(t, dt, make))
        elif t.stacked:
            out[t.name] = make(t.shape, mesh, (None, tp, None) if t.role == "column" else (None, None, tp), dt)
        elif (t.shape, t.role, t.heads, t.replicate_heads, dt) in by_key:
            out[t.name] = by_key[t.shape, t.role, t.heads, t.replicate_heads, dt]
        else:
            replicas = _head_replicas(t, par.tp)
            m = head_mesh.get(replicas)
            if m is None:
                m = head_mesh[replicas] = Mesh(ids.reshape(par.dp, par.tp // replicas, replicas),
                                               ("dp", "tp", "tp_replica"))
            out[t.name] = by_key[t.shape, t.role, t.heads, t.replicate_heads, dt] = make(
                t.shape, m, _dense_spec(t, tp, None), dt)
    return out
