"""One process of the multi-process transfer test: 2 processes x 2 CPU devices.

Usage: transfer_worker.py RANK PORT. Process 0 holds the source (FSDP over its two
devices), process 1 the destination (TP over its two devices) for one tensor, and a
second tensor goes the other way with a spec change; a replicated leaf goes from
both to both. Each process checks the shards it holds against ``host[shard.index]``
bit for bit (also with a cast, in buckets, and with compiled packing), checks that a
repeated sync compiles nothing, and prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
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
    p0 = [d for d in devs if d.process_index == 0]
    p1 = [d for d in devs if d.process_index == 1]
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
    print(json.dumps({"rank": rank, **results}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
