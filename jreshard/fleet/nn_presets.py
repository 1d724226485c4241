"""JAX-style FSDP x TP x EP layouts for the parameter tree of a ``jreshard.nn`` model.

The rules are those of ``jreshard.fleet.presets`` for JAX trainers, on the flax tree
(kernels ``[in, out]``, leaf paths such as ``layers_0/attn/q_proj/kernel``):

- ``fsdp`` shards the leading dim of every matrix (vectors stay whole, as
  ``jreshard.nn.fsdp_spec``);
- ``tp`` splits whole attention heads and the MLP's intermediate dim: the output
  dim of column-parallel kernels (q, k, v, gate, up; the vocabulary of
  ``lm_head``), the input dim of row-parallel ones (o, down), the vocabulary of the
  embedding; when it lands on the leading dim too it is the minor factor after
  ``fsdp``; routers and norms are not split by it;
- stacked experts ``[E, H, I]`` (gate, up) and ``[E, I, H]`` (down) split their
  expert dim over ``('ep', 'fsdp')`` and their intermediate dim over ``tp``:
  ``P(('ep', 'fsdp'), None, 'tp')`` and ``P(('ep', 'fsdp'), 'tp', None)``.

Mesh axes the rules do not name (``dp``) hold replicas; a rule whose axis the mesh
lacks is dropped. JAX holds only even shards, so every split must be even.

Example:
  >>> import numpy as np
  >>> from jreshard import Mesh
  >>> from jreshard.fleet.nn_presets import nn_layouts
  >>> from jreshard.nn import MoeConfig
  >>> mesh = Mesh(np.arange(8).reshape(2, 2, 2), ("ep", "fsdp", "tp"))
  >>> lay = nn_layouts(MoeConfig.load("qwen3-moe-tiny"), mesh)
  >>> lay["layers_0/mlp/experts/gate_proj"].spec_str, lay["layers_0/attn/o_proj/kernel"].spec_str
  ("P(('ep', 'fsdp'), None, 'tp')", "P(('fsdp', 'tp'))")
"""

from __future__ import annotations

import math
from typing import Any

from jreshard.core.heads import split_heads
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh
from jreshard.nn.config import LlamaConfig, param_shapes

__all__ = ["nn_layouts"]

# Leaf-path suffix -> the dim tensor parallelism splits (flax kernels are [in, out]).
_TP_DIM = {
    "attn/q_proj/kernel": 1, "attn/k_proj/kernel": 1, "attn/v_proj/kernel": 1, "attn/o_proj/kernel": 0,
    "gate_proj/kernel": 1, "up_proj/kernel": 1, "down_proj/kernel": 0,
    "experts/gate_proj": 2, "experts/up_proj": 2, "experts/down_proj": 1,
    "embed/embedding": 0, "lm_head/kernel": 1,
}
_STACKED = ("experts/gate_proj", "experts/up_proj", "experts/down_proj")


def _heads(config: LlamaConfig, suffix: str) -> int | None:
    """The attention heads in the tp-split dim of a leaf, None for leaves without heads."""
    if suffix in ("attn/q_proj/kernel", "attn/o_proj/kernel"):
        return config.num_attention_heads
    if suffix in ("attn/k_proj/kernel", "attn/v_proj/kernel"):
        return config.num_key_value_heads
    return None


def _leaf_axes(path: str, shape: tuple[int, ...], config: LlamaConfig, axes: dict[str, str | None],
               sizes: dict[str, int]) -> list[list[str]]:
    """The mesh axes of each dim of one leaf (major to minor)."""
    dims: list[list[str]] = [[] for _ in shape]
    suffix = next((s for s in _TP_DIM if path.endswith(s)), None)
    fsdp, tp, ep = axes["fsdp"], axes["tp"], axes["ep"]
    if suffix in _STACKED and ep:
        dims[0].append(ep)
    if len(shape) >= 2 and fsdp:
        dims[0].append(fsdp)
    if suffix is not None and tp:
        dims[_TP_DIM[suffix]].append(tp)
        heads = _heads(config, suffix)
        if heads is not None:
            split_heads(heads, config.head_dim, sizes[tp], what=f"nn_layouts: mesh axis {tp!r} on leaf {path!r}")
    for d, names in enumerate(dims):
        ways = math.prod(sizes[a] for a in names)
        if shape[d] % ways:
            raise ValueError(f"nn_layouts: leaf {path!r} dim {d} of size {shape[d]} does not split evenly over "
                             f"mesh axes {tuple(names)} ({ways} ways), and JAX holds only even shards; "
                             f"choose axis sizes whose product divides {shape[d]}.")
    return dims


def nn_layouts(config: LlamaConfig, mesh: Mesh | Any, *, fsdp: str = "fsdp", tp: str = "tp", ep: str = "ep",
               dtype: str = "float32") -> dict[str, Layout]:
    """The training Layout of every leaf of a ``jreshard.nn`` model (dense or MoE), keyed by leaf path.

    Args:
      config: the model's ``LlamaConfig`` or ``MoeConfig``.
      mesh: a ``jreshard.Mesh`` or a ``jax.sharding.Mesh``.
      fsdp, tp, ep: the names of the mesh axes that play those parts; an axis the mesh
        lacks is not used.
      dtype: the parameters' element type.

    Raises:
      TypeError: ``config`` is not a ``LlamaConfig``.
      ValueError: a split would cut an attention head or leave uneven shards.

    ``Layout.spec`` of each leaf is its ``PartitionSpec``: ``jax.sharding.PartitionSpec(*layout.spec)``.
    """
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be a jreshard.nn LlamaConfig or MoeConfig, got {type(config).__name__}.")
    mesh = mesh if isinstance(mesh, Mesh) else Mesh.from_jax(mesh)
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    axes = {"fsdp": fsdp if fsdp in sizes else None, "tp": tp if tp in sizes else None,
            "ep": ep if ep in sizes else None}
    out: dict[str, Layout] = {}
    for path, shape in param_shapes(config).items():
        dims = _leaf_axes(path, shape, config, axes, sizes)
        spec = tuple(None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims)
        out[path] = Layout(shape, mesh, spec, dtype)
    return out
