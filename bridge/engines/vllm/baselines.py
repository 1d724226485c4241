"""What each vLLM worker receives per sync under jreshard and under vLLM's own weight-transfer backends (pure).

For benchmarks and the docs' comparisons: ``bytes_per_worker`` counts, from the plan alone,
the bytes of ``jreshard`` (the lower bound), of vLLM's ``nccl`` backend (every checkpoint
tensor broadcast whole) and of its reshard collective (``nccl_m2n``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FUSED", "bytes_per_worker"]

# The fused params vLLM's reshard collective sends whole.
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
      >>> from bridge.engines.hello import EngineShape, build_param_map
      >>> from bridge.engines.vllm.baselines import bytes_per_worker
      >>> from bridge.recipes import Recipe
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
