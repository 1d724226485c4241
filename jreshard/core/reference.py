"""The NumPy reference executor: the oracle for every real executor.

It runs a plan on per-device NumPy arrays, exactly as an executor would on
devices: each destination shard is assembled from the boxes the plan moves into
it, read from the source shards that the plan names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jreshard.core.box import Box
from jreshard.core.dtypes import numpy_dtype
from jreshard.core.layout import Layout
from jreshard.core.planner import Plan, TensorPlan

__all__ = ["shard", "execute", "execute_plan", "local_region"]


def local_region(box: Box, shard: Box) -> tuple[slice, ...]:
    """``box`` (global coordinates) in the coordinates of the ``shard`` that holds it."""
    return Box(box).relative_to(shard).slices()


def shard(array: np.ndarray, layout: Layout) -> dict[int, np.ndarray]:
    """Slices a global array into each device's shard (copies), keyed by device."""
    array = np.asarray(array)
    if tuple(array.shape) != layout.shape:
        raise ValueError(f"array has shape {array.shape} but the layout has shape {layout.shape}.")
    return {d: np.array(array[box], copy=True) for d, box in layout.shards().items()}


def execute(tplan: TensorPlan, src_shards: dict[int, np.ndarray], dtype: Any = None) -> dict[int, np.ndarray]:
    """Runs one TensorPlan on NumPy source shards; returns the destination shards.

    Args:
      tplan: the plan.
      src_shards: every source device's shard, keyed by device id.
      dtype: optional destination dtype (cast at the sender, as executors do).
        Defaults to the destination layout's dtype, else the source arrays'.
    """
    src, dst = tplan.src, tplan.dst
    src_boxes, dst_boxes = src.shards(), dst.shards()
    missing = [d for d in src_boxes if d not in src_shards]
    if missing:
        raise ValueError(f"src_shards lacks the shards of source devices {missing}; pass one array per device.")
    for d, box in src_boxes.items():
        want = tuple(s.stop - s.start for s in box)
        if tuple(src_shards[d].shape) != want:
            raise ValueError(f"src_shards[{d}] has shape {src_shards[d].shape}, but the layout gives it {want}.")
    any_shard = next(iter(src_shards.values()))
    out_dtype = numpy_dtype(dtype) if dtype is not None else (numpy_dtype(dst.dtype) or any_shard.dtype)
    out = {d: np.zeros(tuple(s.stop - s.start for s in box), dtype=out_dtype) for d, box in dst_boxes.items()}
    for m in tplan.moves:
        piece = src_shards[m.src][local_region(m.box, src_boxes[m.src])]
        out[m.dst][local_region(m.box, dst_boxes[m.dst])] = piece.astype(out_dtype, copy=False)
    return out


def execute_plan(p: Plan, src_shards: dict[str, dict[int, np.ndarray]]) -> dict[str, dict[int, np.ndarray]]:
    """Runs every TensorPlan of a Plan; shards are keyed by leaf path, then device."""
    return {path: execute(tp, src_shards[path]) for path, tp in p.items()}

