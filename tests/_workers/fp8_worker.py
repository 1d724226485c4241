"""One process of the multi-process FP8 test: 2 processes x 2 CPU devices; also the tests' reference quantizer.

Usage: fp8_worker.py RANK PORT. A bfloat16 leaf is FSDP over all four devices with 3
rows a shard, so the holders of its block row 1 (rows 4-7, blocks of 4 rows) sit in
different processes and exchange partial amax across them; ``jreshard.transfer(...,
block=)`` delivers it to TP2 on process 1. Each process checks the shards it holds, at
the source after ``quantize`` and at the destination, against ``ref_quantize`` bit for
bit, and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn


def ref_quantize(x: np.ndarray, block: tuple[int | None, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Block-scaled FP8 as vLLM computes it, in NumPy: blocks over the trailing dims (None: whole dim).

    Each block: amax = max |x| in float32, floored at 1e-4; scale = amax / 448 (float32);
    q = x * (1 / scale) in float32, rounded to nearest even by ml_dtypes.
    """
    x = np.asarray(x).astype(np.float32)
    lead = x.ndim - len(block)
    bs = [1] * lead + [max(n, 1) if b is None else b for n, b in zip(x.shape[lead:], block, strict=True)]
    grid = [-(-n // b) for n, b in zip(x.shape, bs, strict=True)]
    padded = np.zeros([g * b for g, b in zip(grid, bs, strict=True)], np.float32)
    padded[tuple(slice(0, n) for n in x.shape)] = np.abs(x)
    split = [v for g, b in zip(grid, bs, strict=True) for v in (g, b)]
    amax = padded.reshape(split).max(axis=tuple(range(1, 2 * x.ndim, 2)))
    scale = np.maximum(amax, np.float32(1e-4)) / np.float32(448)
    factor = np.float32(1) / scale
    for d, b in enumerate(bs):
        factor = np.repeat(factor, b, axis=d)
    factor = factor[tuple(slice(0, n) for n in x.shape)]
    return (x * factor).astype(E4M3), scale.astype(np.float32)


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                               initialization_timeout=60, heartbeat_timeout_seconds=30)
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard
    from jreshard.core.fp8 import Fp8Format
    from jreshard.jax_executor.fp8 import quantize

    devs = sorted(jax.devices(), key=lambda d: d.id)
    p1 = [d for d in devs if d.process_index == 1]
    block = (4, 8)
    rng = np.random.default_rng(7)
    a = rng.standard_normal((12, 16)) * 3
    a[0, :8] = 0  # an all-zero block
    full = {"a": a.astype(ml_dtypes.bfloat16)}
    src = {"a": NamedSharding(jax.sharding.Mesh(np.array(devs), ("fsdp",)), P("fsdp"))}
    dst = {"a": NamedSharding(jax.sharding.Mesh(np.array(p1), ("tp",)), P(None, "tp"))}
    params = {k: jax.make_array_from_callback(v.shape, src[k], lambda idx, v=v: v[idx], dtype=v.dtype)
              for k, v in full.items()}
    ref = {k: ref_quantize(v, block) for k, v in full.items()}

    def same(arr: jax.Array, want: np.ndarray) -> bool:
        return all(np.array_equal(np.asarray(s.data).view(np.uint8), np.ascontiguousarray(want[s.index]).view(np.uint8))
                   for s in arr.addressable_shards)

    out: dict[str, object] = {"rank": rank}
    for k in full:
        w, s = quantize(params[k], Fp8Format(block=block))
        out[f"quantize_{k}"] = same(w, ref[k][0]) and same(s, ref[k][1]) and w.sharding == src[k]
    weights, scales = jreshard.transfer(params, dst, dtype="float8_e4m3fn", block=block, transport="collective")
    for k in full:
        out[f"transfer_{k}"] = (same(weights[k], ref[k][0]) and same(scales[k], ref[k][1])
                                and weights[k].sharding == dst[k])
        out[f"held_{k}"] = len(weights[k].addressable_shards)
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
