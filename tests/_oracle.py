"""Shared helpers for planner tests: the NumPy oracle and invariant checks."""

from __future__ import annotations

import numpy as np

import jreshard
from jreshard import Layout, reference


def global_array(shape: tuple[int, ...], dtype: str = "int64") -> np.ndarray:
    """A global array whose every element is distinct (its flat index)."""
    return np.arange(int(np.prod(shape, dtype=np.int64)), dtype=dtype).reshape(shape)


def expected_lower_bound(src: Layout, dst: Layout, itemsize: int) -> int:
    """Per destination device: elements of its shard that its own source shard lacks."""
    src_boxes = src.shards()
    total = 0
    for d, box in dst.shards().items():
        vol = int(np.prod([s.stop - s.start for s in box], dtype=np.int64))
        if d in src_boxes:
            own = src_boxes[d]
            vol -= int(np.prod([max(0, min(a.stop, b.stop) - max(a.start, b.start)) for a, b in zip(own, box)], dtype=np.int64))
        total += vol
    return total * itemsize


def assert_exact(tp: jreshard.TensorPlan) -> None:
    """Runs the plan on the oracle and compares every destination shard bit for bit."""
    full = global_array(tp.shape)
    out = reference.execute(tp, reference.shard(full, tp.src))
    for device, box in tp.dst.shards().items():
        np.testing.assert_array_equal(out[device], full[box], err_msg=f"device {device}")


def assert_plan_ok(tp: jreshard.TensorPlan) -> None:
    """Invariants, lower bound and bit-exact execution."""
    tp.check()
    s = tp.stats()
    assert s.network_bytes == s.lower_bound_bytes == expected_lower_bound(tp.src, tp.dst, tp.itemsize)
    for m in tp.moves:
        if m.src == m.dst:
            assert m.dst in tp.src.mesh
    assert_exact(tp)
