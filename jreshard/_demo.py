"""The README's demo: reshard a few tiny-Llama tensors from FSDP to TP x DP."""

from __future__ import annotations

import json
import time
from importlib import resources

import numpy as np

from jreshard import reference
from jreshard._layout import Layout
from jreshard._mesh import Mesh
from jreshard._planner import plan


def tiny_llama_shapes() -> dict[str, tuple[int, ...]]:
    """A few tensors of the tiny Llama, in flax convention (kernels are [in, out])."""
    cfg = json.loads(resources.files("jreshard").joinpath("data/models/llama-tiny.json").read_text())
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return {
        "embed": (v, h),
        "layer0/attn/q": (h, q),
        "layer0/attn/k": (h, kv),
        "layer0/attn/o": (q, h),
        "layer0/mlp/gate": (h, i),
        "layer0/mlp/down": (i, h),
        "layer0/norm": (h,),
        "lm_head": (h, v),
    }


def _tp_spec(name: str, rank: int) -> tuple:
    """Megatron-style tensor parallelism for flax kernels ([in, out])."""
    if rank == 1:
        return ()
    if name.endswith(("/o", "/down")):
        return ("tp", None)  # row parallel: shard the input dim
    if name == "embed":
        return ("tp", None)  # vocabulary parallel
    return (None, "tp")  # column parallel


def main() -> int:
    shapes = tiny_llama_shapes()
    train = Mesh([0, 1, 2, 3], ("fsdp",))
    serve = Mesh([[4, 5], [6, 7]], ("dp", "tp"))
    src = {n: Layout(s, train, ("fsdp",) if len(s) else (), dtype="float32") for n, s in shapes.items()}
    dst = {n: Layout(s, serve, _tp_spec(n, len(s)), dtype="float32") for n, s in shapes.items()}
    print("jreshard demo: tiny-Llama tensors, FSDP over devices 0-3 -> TP2 x DP2 on devices 4-7 (NumPy reference executor)\n")
    t0 = time.perf_counter()
    p = plan(src, dst)
    t1 = time.perf_counter()
    print(p)
    print(f"\nplanned {len(p)} tensors in {1e3 * (t1 - t0):.1f} ms\n")
    print(p["layer0/attn/k"].table(limit=8))
    rng = np.random.default_rng(0)
    exact = True
    for name, tp in p.items():
        full = rng.standard_normal(shapes[name]).astype(np.float32)
        out = reference.execute(tp, reference.shard(full, tp.src))
        for device, box in tp.dst.shards().items():
            exact &= np.array_equal(out[device], full[box])
    s = p.stats()
    print(f"\nnetwork bytes {s.network_bytes:,} = lower bound {s.lower_bound_bytes:,}: {s.network_bytes == s.lower_bound_bytes}")
    print(f"gather-then-broadcast would move {s.naive_bytes:,} bytes ({s.naive_bytes / max(s.network_bytes, 1):.1f}x)")
    print(f"every destination shard bit-exact: {exact}")
    return 0 if exact else 1
