"""One process of the multi-process transfer test: 2 processes x 4 CPU devices.

Usage: transfer_worker.py RANK PORT. On two devices of each process: process 0
holds the source (FSDP over its two devices), process 1 the destination (TP over
its two devices) for one tensor, and a second tensor goes the other way with a spec
change; a replicated leaf goes from both to both. Each process checks the shards it
holds against ``host[shard.index]`` bit for bit (also with a cast, in buckets, and
with compiled packing), checks that a repeated sync compiles nothing. Then
hierarchical delivery over all 8 devices into TP2 x DP2 in each process, with
``hierarchical`` never, always and auto: the shards, the bytes each (sender,
receiver) pair sent as the executors counted them, the plan's cross-process figure
and the lower bound (NumPy). Prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                               initialization_timeout=60, heartbeat_timeout_seconds=30)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard

    devs = sorted(jax.devices(), key=lambda d: d.id)
    p0 = [d for d in devs if d.process_index == 0][:2]
    p1 = [d for d in devs if d.process_index == 1][:2]
    m0 = jax.sharding.Mesh(np.array(p0), ("fsdp",))
    m1 = jax.sharding.Mesh(np.array(p1), ("tp",))
    both = jax.sharding.Mesh(np.array(p0 + p1).reshape(2, 2), ("dp", "tp"))

    full = {
        "w": np.arange(8 * 6, dtype=np.float32).reshape(8, 6) * 1.5,
        "e": (np.arange(4 * 10, dtype=np.int32).reshape(4, 10) - 7),
        "b": np.arange(12, dtype=np.float32).astype(jnp.bfloat16),
    }
    src = {"w": NamedSharding(m0, P("fsdp", None)), "e": NamedSharding(m1, P(None, "tp")),
           "b": NamedSharding(both, P(None))}
    dst = {"w": NamedSharding(m1, P(None, "tp")), "e": NamedSharding(m0, P("fsdp", None)),
           "b": NamedSharding(both, P("tp"))}

    def make(name):
        host = full[name]
        return jax.make_array_from_callback(host.shape, src[name], lambda idx: host[idx], dtype=host.dtype)

    params = {k: make(k) for k in full}
    plan = jreshard.plan(params, dst)
    results = {}

    def compile_log(fn):
        """What jax logs about tracing and compiling while ``fn`` runs with log_compiles on."""
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        logger = logging.getLogger("jax")
        logger.addHandler(handler)
        try:
            with jax.log_compiles():
                out = jax.block_until_ready(fn())
        finally:
            logger.removeHandler(handler)
        return out, [m for m in lines if "Compiling" in m or "tracing" in m]

    for attempt in range(2):  # the second run reuses the compiled programs
        out, compiled = compile_log(lambda: jreshard.transfer(params, dst, plan=plan))
        results[f"compiled{attempt}"] = len(compiled)
        ok = True
        for name, arr in out.items():
            ok &= arr.sharding == dst[name]
            for shard in arr.addressable_shards:
                want = full[name][shard.index]
                ok &= np.array_equal(np.asarray(shard.data).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))
        results[f"run{attempt}"] = bool(ok)

    def cast_is_exact(out):
        """Every shard of ``out`` is ``full[shard.index]`` cast to bfloat16, bit for bit."""
        ok = True
        for name, arr in out.items():
            for shard in arr.addressable_shards:
                want = np.asarray(full[name][shard.index]).astype(np.float32).astype(jnp.bfloat16)
                ok &= np.array_equal(np.asarray(shard.data).view(np.uint16),
                                     np.ascontiguousarray(want).view(np.uint16))
        return bool(ok)

    results["cast_buckets"] = cast_is_exact(jreshard.transfer(params, dst, dtype=jnp.bfloat16, max_bytes_in_flight=64))
    # Packing with compiled programs (what accelerators use), where devices of one process that do
    # the same work share one launch over a mesh of them.
    from jreshard.jax_executor import transfer as _transfer

    _transfer._HOST_PACKING_BACKENDS = frozenset()
    results["xla_packing"] = cast_is_exact(jreshard.transfer(params, dst, dtype=jnp.bfloat16))
    results["network_bytes"] = plan.stats().network_bytes
    _transfer._HOST_PACKING_BACKENDS = frozenset({"cpu"})
    results.update(hierarchical(devs))
    print(json.dumps({"rank": rank, **results}), flush=True)
    jax.distributed.shutdown()


def hierarchical(devs) -> dict:
    """Hierarchical delivery into TP2 x DP2 per process, against direct delivery."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard
    from jreshard.core.hierarchical import hierarchical_plan
    from jreshard.fleet.hierarchical import decide
    from jreshard.jax_executor.adapter import parse
    from jreshard.jax_executor.transfer import auto_topology, process_domains

    procs = sorted(devs, key=lambda d: (d.process_index, d.id))
    train = jax.sharding.Mesh(np.array(procs[:4]), ("fsdp",))  # process 0's devices
    everyone = jax.sharding.Mesh(np.array(procs).reshape(2, 4), ("proc", "fsdp"))
    serve = jax.sharding.Mesh(np.array(procs).reshape(2, 2, 2), ("proc", "dp", "tp"))
    full = {"hw": np.arange(32 * 24, dtype=np.float32).reshape(32, 24) / 3,
            "hb": np.arange(16 * 8, dtype=np.int32).reshape(16, 8) - 50}
    src = {"hw": NamedSharding(train, P("fsdp")), "hb": NamedSharding(everyone, P(("proc", "fsdp")))}
    dst = {"hw": NamedSharding(serve, P(None, "tp")), "hb": NamedSharding(serve, P("tp"))}
    params = {k: jax.make_array_from_callback(v.shape, src[k], lambda idx, v=v: v[idx], dtype=v.dtype)
              for k, v in full.items()}
    domains = process_domains()
    leaves = parse(params, dst)
    layouts = dict(zip(leaves.names, leaves.src, strict=True)), dict(zip(leaves.names, leaves.dst, strict=True))
    out = {"plan_cross_bytes": hierarchical_plan(*layouts, domains).cross_domain_bytes(),
           "auto_decision": decide(*layouts, auto_topology("cpu", domains)).delivery,
           "domains": [list(g) for g in domains.groups]}
    lower = 0
    for name, host in full.items():
        held, needed = {}, {}
        for sharding, into in ((src[name], held), (dst[name], needed)):
            for dev, index in sharding.devices_indices_map(host.shape).items():
                into.setdefault(dev.process_index, np.zeros(host.shape, bool))[index] = True
        none = np.zeros(host.shape, bool)
        lower += sum(int((need & ~held.get(p, none)).sum()) for p, need in needed.items()) * host.itemsize
    out["lower_bound_bytes"] = lower
    for how in ("never", "always", "auto"):
        got = jreshard.transfer(params, dst, hierarchical=how)
        stats = jreshard.last_transfer_stats()
        ok = all(arr.sharding == dst[name] and np.array_equal(np.asarray(s.data), full[name][s.index])
                 for name, arr in got.items() for s in arr.addressable_shards)
        out[how] = {"ok": bool(ok), "delivery": stats.delivery, "transports": list(stats.transports),
                    "link_bytes": [[s, d, b] for (s, d), b in sorted(stats.link_bytes.items())]}
    return out


if __name__ == "__main__":
    main()
