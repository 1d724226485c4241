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
  view of the same devices.

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

from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh
from jreshard.fleet.catalog import TensorInfo

__all__ = ["TrainParallel", "InferParallel", "train_layouts", "infer_layouts", "stage_of_layers", "parse_parallel"]


def _check_degrees(obj: Any) -> None:
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
        _check_degrees(self)

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
        _check_degrees(self)

    def check(self, gpus: int) -> None:
        if self.tp * self.dp != gpus:
            raise ValueError(f"inference tp*dp = {self.tp * self.dp} but there are {gpus} inference devices; "
                             "make tp*dp equal the device count.")
        if gpus % self.ep:
            raise ValueError(f"inference ep={self.ep} does not divide {gpus} devices.")


def parse_parallel(text: str, kind: str) -> TrainParallel | InferParallel:
    """Parses ``'tp=4,pp=4,dp=2'`` into a ``TrainParallel`` (``kind='train'``) or ``InferParallel``."""
    cls = TrainParallel if kind == "train" else InferParallel
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or key not in names or not val.strip().isdigit():
            raise ValueError(f"--{kind} {text!r}: cannot read {part!r}; write name=int pairs such as "
                             f"'tp=4,dp=2' with names from {names}.")
        values[key] = int(val)
    return cls(**values)


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
    ids = _device_array(devices, len(devices), "devices").reshape(par.pp, stage_size)
    n_layers = max((t.layer for t in infos if t.layer is not None), default=-1) + 1
    layer_stage = stage_of_layers(n_layers, par.pp) if n_layers else []
    n_exp = _num_experts(infos)
    if n_exp and n_exp % par.ep:
        raise ValueError(f"ep={par.ep} does not divide the model's {n_exp} routed experts.")
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
    ids = _device_array(devices, len(devices), "devices")
    mesh = Mesh(ids.reshape(par.dp, par.tp), ("dp", "tp"))
    n_exp = _num_experts(infos)
    ep_grid = ids.reshape(len(ids) // par.ep, par.ep)
    ep_mesh = Mesh(ep_grid, ("edp", "ep"))
    owner_mesh = [Mesh(ep_grid[:, r], ("edp",)) for r in range(par.ep)]
    tp = "tp" if par.tp > 1 else None
    out: dict[str, Layout] = {}
    for t in infos:
        dt = dtype or t.dtype
        if t.is_expert and par.ep > 1:
            if t.stacked:
                out[t.name] = Layout(t.shape, ep_mesh, ("ep",), dt)
            else:
                out[t.name] = Layout(t.shape, owner_mesh[_expert_owner(t.expert, n_exp, par.ep)], (), dt)
        elif t.stacked:
            out[t.name] = Layout(t.shape, mesh, (None, tp, None) if t.role == "column" else (None, None, tp), dt)
        else:
            out[t.name] = Layout(t.shape, mesh, _dense_spec(t, tp, None), dt)
    return out
