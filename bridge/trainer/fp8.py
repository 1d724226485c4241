"""The trainer side of an FP8 sync: quantize the weight leaves where their shards are, then send.

Import this module in trainer processes only (it imports jax). ``quantize_params``
turns the trainer's tree into the tree that ``bridge.trainer.sender.Sender.sync`` sends for
an ``Fp8ParamMap``: each quantized leaf becomes its FP8 weight (its FP8 dtype,
same sharding) plus its scale leaf ``<leaf>_scale_inv``, computed by
``jreshard.jax_executor.fp8.quantize`` (partial amax exchanged between the holders of
cut blocks, exact bit for bit); the other leaves pass through.

Example (every trainer process):

    fp8 = bridge.fp8_param_map(source, bridge.llama_param_map(cfg, source, [2, 3], fused=True), fmt)
    sender = Sender(bridge.BridgePlan(fp8.source, fp8.param_map), rank=rank)
    sender.sync(quantize_params(params, fp8), version=step)
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

from bridge.plan.fp8 import Fp8ParamMap, scale_leaf
from bridge.trainer.sender import flatten_params
from jreshard.jax_executor.adapter import check_concrete
from jreshard.jax_executor.fp8 import quantize

__all__ = ["quantize_params"]


def _placed(x: Any, want: Any) -> Any:
    """``x`` where the plan's source expects it (a no-op when the quantizer put it there already)."""
    if isinstance(x.sharding, NamedSharding) and x.sharding.spec == want.spec and x.sharding.mesh == want.mesh:
        return x
    return jax.jit(lambda a: a, out_shardings=want)(x)


def quantize_params(params: Any, fp8: Fp8ParamMap) -> dict[str, Any]:
    """The tree to send for ``fp8``: quantized weight leaves and their scale leaves, other leaves as they are.

    Args:
      params: the trainer's pytree of sharded ``jax.Array`` (the leaves of ``fp8``'s
        unquantized source); call on every trainer process.
      fp8: from ``bridge.fp8_param_map`` (the same on every rank).

    Returns:
      ``{path: jax.Array}``, flat (its paths are the plan's leaves): pass it to ``Sender.sync``.

    Raises:
      TypeError: a leaf is a tracer (call it outside ``jax.jit``).
      ValueError: a leaf that ``fp8`` quantizes is missing from ``params``, or a leaf was deleted (donated).
    """
    flat = flatten_params(params)
    formats = fp8.formats
    missing = sorted(set(formats) - set(flat))
    if missing:
        raise ValueError(f"params lacks the leaves {missing[:4]} that the FP8 param map quantizes; "
                         "pass the whole tree.")
    out = {}
    for path, x in flat.items():
        check_concrete(f"params[{path!r}]", x, "quantize_params")
        fmt = formats.get(path)
        if fmt is None:
            out[path] = x
            continue
        w, s = quantize(x, fmt)
        out[path] = w
        want = fp8.source.layout(scale_leaf(path))
        mesh = x.sharding.mesh if isinstance(x.sharding, NamedSharding) else None
        out[scale_leaf(path)] = s if mesh is None else _placed(s, NamedSharding(mesh, jax.sharding.PartitionSpec(
            *want.spec)))
    return out
