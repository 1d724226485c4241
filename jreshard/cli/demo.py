"""The README's demo: a real ``jreshard.transfer`` of tiny-Llama tensors from FSDP to TP x DP.

It runs on 8 simulated CPU devices (set up here, before jax is imported), plans the
reshard, moves the weights with ``jreshard.transfer`` and checks every destination
shard bit for bit against the NumPy reference executor.
"""

from __future__ import annotations

import json
import os
import time
from importlib import resources
from typing import cast

import numpy as np


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


def _simulate_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` CPU devices; must run before jax is first imported."""
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> int:
    _simulate_cpu_devices(8)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard
    from jreshard.core import reference

    if len(jax.devices()) < 8:
        print(f"the demo needs 8 devices; jax has {len(jax.devices())} "
              "(was jax imported before the demo set XLA_FLAGS?)")
        return 1
    devices = np.array(jax.devices()[:8])
    train = jax.sharding.Mesh(devices[:4], ("fsdp",))
    serve = jax.sharding.Mesh(devices[4:].reshape(2, 2), ("dp", "tp"))
    shapes = tiny_llama_shapes()
    rng = np.random.default_rng(0)
    hosts = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    params = {n: jax.device_put(h, NamedSharding(train, P("fsdp") if h.ndim else P())) for n, h in hosts.items()}
    target = {n: NamedSharding(serve, P(*_tp_spec(n, len(s)))) for n, s in shapes.items()}
    print(f"jreshard demo: tiny-Llama tensors, FSDP over devices 0-3 -> TP2 x DP2 on devices 4-7 "
          f"(jreshard.transfer on {len(jax.devices())} simulated {jax.devices()[0].platform.upper()} devices)\n")

    t0 = time.perf_counter()
    p = cast(jreshard.Plan, jreshard.plan(params, target))  # a dict of arrays plans to a pytree Plan
    t1 = time.perf_counter()
    print(p)
    print(f"\nplanned {len(p)} tensors in {1e3 * (t1 - t0):.1f} ms\n")
    print(p["layer0/attn/k"].table(limit=8))

    out = jax.block_until_ready(jreshard.transfer(params, target, plan=p))  # first call: builds the schedule
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = jax.block_until_ready(jreshard.transfer(params, target, plan=p))
        times.append(time.perf_counter() - t0)
    total = sum(h.nbytes for h in hosts.values())

    exact = True
    for name, tp in p.items():
        want = reference.execute(tp, reference.shard(hosts[name], tp.src))
        exact &= out[name].sharding == target[name]
        for shard in out[name].addressable_shards:
            exact &= np.array_equal(np.asarray(shard.data).view(np.uint32), want[shard.device.id].view(np.uint32))
    s = p.stats()
    print(f"\ntransferred {total / 2**20:.1f} MiB of weights in {1e3 * min(times):.1f} ms "
          f"(best of {len(times)}; the first call took longer: it builds the schedule)")
    print(f"network bytes {s.network_bytes:,} = lower bound {s.lower_bound_bytes:,}: "
          f"{s.network_bytes == s.lower_bound_bytes}")
    print(f"gather-then-broadcast would move {s.naive_bytes:,} bytes ({s.naive_bytes / max(s.network_bytes, 1):.1f}x)")
    print("every destination shard has its target sharding and equals the NumPy reference executor's; "
          f"bit-exact: {exact}")
    return 0 if exact else 1
