"""Parallelism presets: the Layout of every tensor of a model under a framework's sharding.

Vocabulary: *tp* tensor parallel, *pp* pipeline parallel (consecutive layers per
stage), *ep* expert parallel (routed experts split across ranks), *expert_tp*
tensor parallel inside an expert, *cp* context parallel (weights replicated),
*dp* data parallel (replicas), *fsdp* data-parallel ranks that shard weights on
their leading dim.

Device order follows the frameworks, tp innermost:

- training (Megatron order ``tp-cp-ep-dp-pp``): pipeline stages are the outermost
  blocks of the device list; inside a stage the dense weights live on a mesh
  ``(dp, fsdp, cp, tp)`` and the routed experts on ``(edp, ep, expert_tp)``. As
  in Megatron, ep folds into the data-parallel ranks: a stage of ``S`` devices
  replicates dense weights over ``S / (tp*cp*fsdp)`` ranks and experts over
  ``S / (ep*expert_tp)`` ranks.
- JAX-style FSDP x TP is the same mesh with ``fsdp > 1``: every tensor's leading
  dim is sharded over ``fsdp`` (major) and, for tp-split dim 0, over ``tp`` (minor).
- inference (vLLM): a mesh ``(dp, tp)``, each dp replica one engine of
  consecutive ranks; with ``ep > 1`` the experts are split over a ``(edp, ep)``
  view of the same devices. Attention projections split whole heads
  (``jreshard.core.heads``); with fewer KV heads than ``tp`` the KV projections
  live on a ``(dp, tp, tp_replica)`` view, each head on ``tp_replica``
  consecutive ranks, as vLLM replicates them.

``check_degrees`` refuses degrees the frameworks cannot lay out (a ``tp`` that cuts
a head, an ``ep`` that does not divide the experts, more stages than layers).

Column-parallel weights (``[out, in]``) are split on dim 0, row-parallel on dim 1,
embeddings and heads on the vocabulary dim; norms and routers are replicated.

Example:
  >>> from jreshard import catalog, presets
  >>> infos = catalog.tensors("llama-tiny")
  >>> dst = presets.infer_layouts(infos, presets.InferParallel(tp=2, dp=2), devices=range(4, 8))
  >>> dst["model.layers.0.self_attn.o_proj.weight"].spec_str
  "P(None, 'tp')"
  >>> dst["model.layers.0.self_attn.o_proj.weight"].mesh.shape
  (2, 2)
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jreshard.core.heads import split_heads
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh
from jreshard.fleet.catalog import TensorInfo

__all__ = ["TrainParallel", "InferParallel", "train_layouts", "infer_layouts", "stage_of_layers", "parse_parallel",
           "parse_degrees", "check_degrees"]


def _check_positive(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be a positive int, got {v!r}.")


@dataclasses.dataclass(frozen=True, slots=True)
class TrainParallel:
    """Training-side degrees (Megatron / JAX trainers)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    expert_tp: int = 1
    fsdp: int = 1

    def __post_init__(self) -> None:
        _check_positive(self)

    def world(self, gpus: int) -> tuple[int, int, int]:
        """(stage size, dense replicas, expert replicas) for ``gpus`` devices.

        Raises ValueError when the degrees do not fit ``gpus``.
        """
        if gpus % self.pp:
            raise ValueError(f"{gpus} training devices do not split into pp={self.pp} stages; "
                             "make the device count a multiple of pp.")
        stage = gpus // self.pp
        dense = self.tp * self.cp * self.fsdp * self.dp
        if stage % dense:
            raise ValueError(f"a pipeline stage of {stage} devices cannot hold tp*cp*fsdp*dp = {dense}; "
                             f"degrees {self} do not fit {gpus} devices.")
        if self.ep == 1 and self.expert_tp == 1 and stage != dense:
            raise ValueError(f"tp*cp*fsdp*dp*pp = {dense * self.pp} but there are {gpus} training devices; "
                             f"degrees {self} must multiply to the device count.")
        if stage % (self.ep * self.expert_tp):
            raise ValueError(f"a pipeline stage of {stage} devices cannot hold ep*expert_tp = "
                             f"{self.ep * self.expert_tp}; degrees {self} do not fit {gpus} devices.")
        return stage, stage // (self.tp * self.cp * self.fsdp), stage // (self.ep * self.expert_tp)


@dataclasses.dataclass(frozen=True, slots=True)
class InferParallel:
    """Inference-side degrees (vLLM-style engines: tp x dp, optional ep)."""

    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        _check_positive(self)

    def check(self, gpus: int) -> None:
        if self.tp * self.dp != gpus:
            raise ValueError(f"inference tp*dp = {self.tp * self.dp} but there are {gpus} inference devices; "
                             "make tp*dp equal the device count.")
        if gpus % self.ep:
            raise ValueError(f"inference ep={self.ep} does not divide {gpus} devices.")


_KINDS = {"train": TrainParallel, "infer": InferParallel}


def parse_degrees(text: str, kind: str, *, gpus: bool = False) -> dict[str, int]:
    """Parses ``'tp=4,pp=4,dp=2'`` into ``{'tp': 4, 'pp': 4, 'dp': 2}``, checking names and values.

    Args:
      text: comma-separated ``name=int`` pairs.
      kind: ``'train'`` (names of ``TrainParallel``) or ``'infer'`` (names of ``InferParallel``).
      gpus: also accept ``gpus=N`` (the device count of a scenario side).

    Raises:
      TypeError: ``text`` is not a string.
      ValueError: a pair is malformed, a name unknown, a value not a positive int, or a name repeated.

    Example:
      >>> from jreshard.fleet.presets import parse_degrees
      >>> parse_degrees("tp=8, dp=2", "infer")
      {'tp': 8, 'dp': 2}
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'train' or 'infer', got {kind!r}.")
    if not isinstance(text, str):
        raise TypeError(f"{kind} degrees must be a string such as 'tp=4,dp=2', got {type(text).__name__}.")
    names = [f.name for f in dataclasses.fields(_KINDS[kind])] + (["gpus"] if gpus else [])
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, val = (x.strip() for x in part.partition("="))
        if not eq or key not in names or not val.isdigit() or int(val) < 1:
            raise ValueError(f"{kind} degrees {text!r}: cannot read {part!r}; write name=int pairs with positive "
                             f"ints, such as 'tp=4,dp=2', with names from {names}.")
        if key in values:
            raise ValueError(f"{kind} degrees {text!r}: {key} is given twice; give it once.")
        values[key] = int(val)
    return values


def parse_parallel(text: str, kind: str) -> TrainParallel | InferParallel:
    """Parses ``'tp=4,pp=4,dp=2'`` into a ``TrainParallel`` (``kind='train'``) or ``InferParallel``.

    Example:
      >>> from jreshard.fleet.presets import parse_parallel
      >>> parse_parallel("tp=4,pp=2", "train")
      TrainParallel(tp=4, pp=2, dp=1, cp=1, ep=1, expert_tp=1, fsdp=1)
    """
    values = parse_degrees(text, kind)
    return _KINDS[kind](**values)


def _device_array(devices: Iterable[int], n: int, arg: str) -> np.ndarray:
    ids = np.asarray(list(devices), dtype=np.int64)
    if ids.ndim != 1 or len(ids) != n:
        raise ValueError(f"{arg} must list {n} device ids, got {len(ids)}.")
    return ids


def stage_of_layers(num_layers: int, pp: int) -> list[int]:
    """The pipeline stage of each decoder layer: consecutive, as even as possible."""
    if pp > max(num_layers, 1):
        raise ValueError(f"pp={pp} stages exceed the model's {num_layers} layers; use pp <= {num_layers}.")
    return [s for s, block in enumerate(np.array_split(np.arange(num_layers), pp)) for _ in block]


def _stage(info: TensorInfo, layer_stage: list[int], pp: int) -> int:
    if info.layer is not None:
        return layer_stage[info.layer]
    return 0 if info.role == "embed" else pp - 1


def _dense_spec(info: TensorInfo, tp: str | None, fsdp: str | None) -> tuple:
    """Spec of a non-expert tensor: tp per role, fsdp on the leading dim (major)."""
    rank = len(info.shape)
    if rank == 0:
        return ()
    lead = []
    if fsdp:
        lead.append(fsdp)
    if tp and info.role in ("column", "embed", "head"):
        lead.append(tp)
    spec: list = [tuple(lead) if lead else None] + [None] * (rank - 1)
    if tp and info.role == "row" and rank >= 2:
        spec[1] = tp
    return tuple(spec)


def _expert_owner(expert: int, num_experts: int, ep: int) -> int:
    return expert // -(-num_experts // ep)


def _num_experts(infos: Sequence[TensorInfo]) -> int:
    n = 0
    for t in infos:
        if t.stacked:
            n = max(n, t.shape[0])
        elif t.expert is not None:
            n = max(n, t.expert + 1)
    return n


def _tp_dim(info: TensorInfo) -> int | None:
    """The dim that tensor parallelism splits (expert_tp for training experts); None if none."""
    if info.role == "column":
        return 1 if info.stacked else 0
    if info.role == "row":
        return 2 if info.stacked else 1
    return None  # replicated tensors; the vocabulary, which the frameworks pad to split it


def _check_split(info: TensorInfo, arg: str, degree: int, replicate: bool) -> None:
    dim = _tp_dim(info)
    if degree == 1 or dim is None:
        return
    n = info.shape[dim]
    if info.heads is not None:
        split_heads(info.heads, n // info.heads, degree, replicate=replicate and info.replicate_heads,
                    what=f"{arg}={degree} on {info.name}")
    elif n % degree:
        raise ValueError(f"{arg}={degree} on {info.name}: dim {dim} of size {n} does not split evenly over {degree} "
                         f"ranks; make {arg} a divisor of {n}.")


def _head_replicas(info: TensorInfo, tp: int) -> int:
    """How many consecutive TP ranks hold each head of ``info`` (1 unless KV heads are replicated)."""
    dim = _tp_dim(info)
    if info.heads is None or dim is None or tp == 1:
        return 1
    return split_heads(info.heads, info.shape[dim] // info.heads, tp, replicate=info.replicate_heads).replicas


def check_degrees(infos: Sequence[TensorInfo], par: TrainParallel | InferParallel) -> None:
    """Raises ValueError when the degrees do not divide the model as the frameworks require.

    - ``tp`` splits attention heads by the vLLM head rule (``jreshard.core.heads``):
      it divides the query heads; inference replicates KV heads when ``tp`` is a
      multiple of them, training (Megatron) never does. Every other tensor-parallel
      dim except the vocabulary (which the frameworks pad) must split evenly, as
      must the expert dims under ``expert_tp`` (training) or ``tp`` (inference
      without ``ep``).
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
    if not isinstance(par, (TrainParallel, InferParallel)):
        raise TypeError(f"par must be a TrainParallel or an InferParallel, got {type(par).__name__}.")
    expert_tp = par.expert_tp if isinstance(par, TrainParallel) else None
    seen: set[tuple] = set()
    for t in infos:
        key = (t.role, t.shape, t.heads, t.replicate_heads, t.stacked, t.is_expert)
        if key in seen:
            continue
        seen.add(key)
        if t.is_expert and expert_tp is not None:
            _check_split(t, "expert_tp", expert_tp, False)
        elif not (t.is_expert and par.ep > 1):
            _check_split(t, "tp", par.tp, expert_tp is None)
    n_exp = _num_experts(infos)
    if par.ep > 1 and not n_exp:
        raise ValueError(f"ep={par.ep} but the model has no routed experts; use ep=1.")
    if n_exp % par.ep:
        raise ValueError(f"ep={par.ep} does not divide the model's {n_exp} routed experts; "
                         f"make ep a divisor of {n_exp}.")
    if isinstance(par, TrainParallel):
        n_layers = max((t.layer for t in infos if t.layer is not None), default=-1) + 1
        stage_of_layers(n_layers, par.pp)


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
    stage_size, dense_dp, edp = par.world(len(devices))
    check_degrees(infos, par)
    ids = _device_array(devices, len(devices), "devices").reshape(par.pp, stage_size)
    n_layers = max((t.layer for t in infos if t.layer is not None), default=-1) + 1
    layer_stage = stage_of_layers(n_layers, par.pp) if n_layers else []
    n_exp = _num_experts(infos)
    dense_mesh = [Mesh(ids[s].reshape(dense_dp, par.fsdp, par.cp, par.tp), ("dp", "fsdp", "cp", "tp"))
                  for s in range(par.pp)]
    expert_grid = [ids[s].reshape(edp, par.ep, par.expert_tp) for s in range(par.pp)]
    stacked_mesh = [Mesh(g, ("edp", "ep", "etp")) for g in expert_grid]
    owner_mesh = [[Mesh(g[:, r, :], ("edp", "etp")) for r in range(par.ep)] for g in expert_grid]
    fsdp = "fsdp" if par.fsdp > 1 else None
    tp = "tp" if par.tp > 1 else None
    etp = "etp" if par.expert_tp > 1 else None
    out: dict[str, Layout] = {}
    cache: dict[tuple, tuple] = {}
    for t in infos:
        s = _stage(t, layer_stage, par.pp)
        dt = dtype or t.dtype
        if t.stacked:
            rest = (etp, None) if t.role == "column" else (None, etp)
            out[t.name] = Layout(t.shape, stacked_mesh[s], ("ep",) + rest, dt)
        elif t.expert is not None:
            mesh = owner_mesh[s][_expert_owner(t.expert, n_exp, par.ep)]
            out[t.name] = Layout(t.shape, mesh, (etp, None) if t.role == "column" else (None, etp), dt)
        else:
            key = (t.role, len(t.shape))
            spec = cache.get(key)
            if spec is None:
                spec = cache[key] = _dense_spec(t, tp, fsdp)
            out[t.name] = Layout(t.shape, dense_mesh[s], spec, dt)
    return out


def infer_layouts(infos: Sequence[TensorInfo], par: InferParallel, devices: Iterable[int],
                  dtype: str | None = None) -> dict[str, Layout]:
    """The inference Layout of every tensor (vLLM-style tp x dp engines, optional ep).

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
    check_degrees(infos, par)
    ids = _device_array(devices, len(devices), "devices")
    mesh = Mesh(ids.reshape(par.dp, par.tp), ("dp", "tp"))
    # KV heads fewer than tp: each head on `replicas` consecutive tp ranks (vLLM), so the
    # tp axis splits into the head groups (still "tp") and their copies ("tp_replica").
    head_mesh: dict[int, Mesh] = {1: mesh}
    n_exp = _num_experts(infos)
    ep_grid = ids.reshape(len(ids) // par.ep, par.ep)
    ep_mesh = Mesh(ep_grid, ("edp", "ep"))
    owner_mesh = [Mesh(ep_grid[:, r], ("edp",)) for r in range(par.ep)]
    tp = "tp" if par.tp > 1 else None
    out: dict[str, Layout] = {}
    for t in infos:
        dt = dtype or t.dtype
        if t.is_expert and par.ep > 1:
            if t.expert is not None:
                out[t.name] = Layout(t.shape, owner_mesh[_expert_owner(t.expert, n_exp, par.ep)], (), dt)
            else:
                out[t.name] = Layout(t.shape, ep_mesh, ("ep",), dt)
        elif t.stacked:
            out[t.name] = Layout(t.shape, mesh, (None, tp, None) if t.role == "column" else (None, None, tp), dt)
        else:
            replicas = _head_replicas(t, par.tp)
            m = head_mesh.get(replicas)
            if m is None:
                m = head_mesh[replicas] = Mesh(ids.reshape(par.dp, par.tp // replicas, replicas),
                                               ("dp", "tp", "tp_replica"))
            out[t.name] = Layout(t.shape, m, _dense_spec(t, tp, None), dt)
    return out
