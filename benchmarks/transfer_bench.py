"""Benchmark of jreshard.transfer against the ways a weight sync is done without it.

Run: ``.venv/bin/python benchmarks/transfer_bench.py`` (about 5-7 minutes on 2 cores);
``--cases d`` runs case (d) alone, ``--cases e`` case (e).

All methods run side by side in one run on 8 simulated CPU devices, several
repetitions each; the script prints medians, ratios, the machine and versions.

Cases:
  (a) a stack of Qwen3-shaped layers (bfloat16, about 1 GiB), FSDP over devices 0-3
      to TP2 x DP2 on devices 4-7;
  (b) the same layers on the same devices 0-3, FSDP to TP2 x DP2 (a spec change);
  (c) two processes with two devices each (jax.distributed, gloo): FSDP over the
      first process's devices to TP2 over the second's, against a raw ppermute of
      the same bytes between the same devices.

  (d) first call and warm call with a cast: a few hundred float32 leaves of a few shapes
      (``--leaves``), FSDP4 x TP2 to TP2 x DP4 on the same 8 devices, cast to bfloat16:
      ``jreshard.transfer(..., dtype=bfloat16)`` against ``astype`` + ``jax.device_put``,
      each method in a fresh process (nothing compiled before its first call), the
      methods taking turns for ``--rounds`` rounds; medians of the first calls and of
      the warm calls.
  (e) hierarchical delivery: two processes with four devices each (jax.distributed,
      gloo), the layers FSDP over the first process's devices to TP2 x DP2 in each
      process (two replicas per process), ``hierarchical="always"`` against
      ``"never"`` (direct), the methods taking turns; medians, and the bytes that
      cross the process boundary as the executors counted them.

Methods (a, b): jreshard.transfer (both transports), ``jax.device_put(x, target)``,
gather-then-scatter (replicate each tensor on the destination devices, then slice),
and a plain memory copy of the same number of bytes, into fresh buffers and into kept ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

GiB = 1 << 30


def _setup(devices: int) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def qwen3_layers(target_bytes: int) -> dict[str, tuple[int, ...]]:
    """Qwen3-32B-shaped layers (flax [in, out] kernels), widths halved, enough layers for ``target_bytes`` (bf16)."""
    from importlib import resources

    cfg = json.loads(resources.files("jreshard").joinpath("data/models/qwen3-32b.json").read_text())
    h, inter = cfg["hidden_size"] // 2, cfg["intermediate_size"] // 2
    q, kv = cfg["num_attention_heads"] // 2 * cfg["head_dim"], cfg["num_key_value_heads"] // 2 * cfg["head_dim"]
    layer = {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        "input_layernorm": (h,), "post_attention_layernorm": (h,),
        "q_norm": (cfg["head_dim"],), "k_norm": (cfg["head_dim"],),
    }
    per_layer = 2 * sum(_prod(s) for s in layer.values())
    n = max(1, round(target_bytes / per_layer))
    return {f"layers/{i}/{k}": s for i in range(n) for k, s in layer.items()}


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def tp_spec(name: str, rank: int):
    from jax.sharding import PartitionSpec as P

    if rank == 1:
        return P()
    if name.endswith(("o_proj", "down_proj")):
        return P("tp", None)  # row parallel
    return P(None, "tp")  # column parallel


def _median_time(fn, reps: int) -> tuple[float, list[float]]:
    import jax

    jax.block_until_ready(fn())  # warm-up: compiles
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def machine() -> str:
    import jax
    import numpy as np

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / (1 << 20):.0f} GiB RAM"
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, {mem}; python {platform.python_version()}, jax {jax.__version__}, "
            f"jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}, numpy {np.__version__}, "
            f"backend {jax.devices()[0].platform}")


def run_single(case: str, reps: int, target_bytes: int) -> list[tuple[str, float]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard

    devs = np.array(jax.devices())
    train = jax.sharding.Mesh(devs[:4], ("fsdp",))
    serve_devs = devs[4:8] if case == "a" else devs[:4]
    serve = jax.sharding.Mesh(serve_devs.reshape(2, 2), ("dp", "tp"))
    shapes = qwen3_layers(target_bytes)
    rng = np.random.default_rng(0)
    params, target = {}, {}
    for name, shape in shapes.items():
        host = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(jnp.bfloat16)
        params[name] = jax.device_put(host, NamedSharding(train, P("fsdp") if len(shape) > 1 else P()))
        target[name] = NamedSharding(serve, tp_spec(name, len(shape)))
    total = sum(x.nbytes for x in params.values())
    plan = jreshard.plan(params, target)
    stats = plan.stats()
    out_bytes = 0
    for name, shape in shapes.items():
        for idx in target[name].addressable_devices_indices_map(shape).values():
            out_bytes += _prod(tuple(len(range(*s.indices(n))) for s, n in zip(idx, shape, strict=True))) * 2
    print(f"\ncase ({case}): {len(shapes)} tensors, {total / GiB:.2f} GiB bf16, FSDP over devices 0-3 -> "
          f"TP2 x DP2 on devices {[d.id for d in serve_devs]}")
    print(f"  plan: network {stats.network_bytes / GiB:.3f} GiB (lower bound {stats.lower_bound_bytes / GiB:.3f}), "
          f"local {stats.local_bytes / GiB:.3f} GiB, output {out_bytes / GiB:.3f} GiB, {stats.messages} messages")

    methods: dict[str, object] = {}
    for tr in ("memcpy", "device_put", "collective"):
        methods[f"jreshard.transfer ({tr})"] = lambda tr=tr: jreshard.transfer(params, target, plan=plan, transport=tr)
    methods["jax.device_put"] = lambda: jax.device_put(params, target)
    rep = {k: NamedSharding(serve, P()) for k in shapes}
    slicers = {k: jax.jit(lambda y: y, out_shardings=target[k]) for k in shapes}

    def gather_scatter():
        full = jax.device_put(params, rep)
        return {k: slicers[k](v) for k, v in full.items()}

    methods["gather then scatter"] = gather_scatter
    # The practical limit: the same bytes copied into fresh buffers of the output shards' sizes.
    chunks = [np.ones(_prod(idx_shape) * 2, np.uint8) for name, shape in shapes.items()
              for idx_shape in (tuple(len(range(*s.indices(n))) for s, n in zip(idx, shape, strict=True))
                                for idx in target[name].addressable_devices_indices_map(shape).values())]
    methods["memory copy (fresh buffer, numpy)"] = lambda: [np.array(c, copy=True) for c in chunks]
    # The limit for a method that recycles its output buffers (no page faults).
    kept = [np.empty_like(c) for c in chunks]
    methods["memory copy (kept buffer, numpy)"] = lambda: [np.copyto(k, c) for k, c in zip(kept, chunks, strict=True)]

    # Check every method once (this also compiles), then time them round-robin so that
    # the machine's state (page cache, allocator) drifts evenly over all of them.
    for name, fn in methods.items():
        out = fn()
        if isinstance(out, dict):
            for k in list(shapes)[:4]:
                ok = out[k].sharding == target[k] and np.array_equal(np.asarray(out[k]).view(np.uint16),
                                                                     np.asarray(params[k]).view(np.uint16))
                assert ok, f"{name} is wrong for {k}"
        del out
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(reps):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    results = []
    for name, ts in times.items():
        med = statistics.median(ts)
        results.append((name, med))
        print(f"  {name:<34} median {med * 1e3:8.1f} ms  ({out_bytes / med / GiB:5.2f} GiB/s of output)  "
              f"runs {', '.join(f'{t * 1e3:.0f}' for t in ts)}")
    return results


def report(case: str, results: list[tuple[str, float]]) -> None:
    t = dict(results)
    auto = t["jreshard.transfer (memcpy)"]  # what transport="auto" picks on CPU in one process
    print(f"  ratios, case ({case}), transfer = transport 'auto' (memcpy on CPU): "
          f"device_put time / transfer time = {t['jax.device_put'] / auto:.2f}x, "
          f"gather-then-scatter / transfer = {t['gather then scatter'] / auto:.2f}x, "
          f"transfer rate / memory-copy rate = {t['memory copy (fresh buffer, numpy)'] / auto:.2f} "
          f"(kept buffers {t['memory copy (kept buffer, numpy)'] / auto:.2f}); "
          f"time of transport 'device_put' / 'memcpy' = {t['jreshard.transfer (device_put)'] / auto:.2f}, "
          f"'collective' / 'memcpy' = {t['jreshard.transfer (collective)'] / auto:.2f}")


# --------------------------------------------------------------------------- case (c)


def worker(rank: int, port: int, reps: int, target_bytes: int) -> None:
    _setup(2)
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                               initialization_timeout=60)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    p0 = [d for d in devs if d.process_index == 0]
    p1 = [d for d in devs if d.process_index == 1]
    train = jax.sharding.Mesh(np.array(p0), ("fsdp",))
    serve = jax.sharding.Mesh(np.array(p1), ("tp",))
    shapes = qwen3_layers(target_bytes)
    params, target = {}, {}
    for name, shape in shapes.items():
        sh = NamedSharding(train, P("fsdp") if len(shape) > 1 else P())
        params[name] = jax.jit(lambda shape=shape: jnp.ones(shape, jnp.bfloat16), out_shardings=sh)()
        target[name] = NamedSharding(serve, tp_spec(name, len(shape)) if len(shape) > 1 else P())
    plan = jreshard.plan(params, target)
    moved = plan.stats().network_bytes

    def run():
        return jreshard.transfer(params, target, plan=plan, transport="collective")

    t_transfer, runs_t = _median_time(run, reps)
    out = run()
    ok = all(bool(jnp.all(s.data == 1)) for v in out.values() for s in v.addressable_shards)

    # Raw ppermute of the same bytes: each of process 0's devices sends half of the
    # moved bytes to one device of process 1, in one buffer.
    union = jax.sharding.Mesh(np.array(p0 + p1), ("x",))
    per = moved // 2
    perm = [(0, 2), (1, 3)]
    fn = jax.jit(jax.shard_map(lambda b: jax.lax.ppermute(b, "x", perm), mesh=union, in_specs=P("x"), out_specs=P("x")))
    buf = jax.jit(lambda: jnp.ones((4 * per,), jnp.uint8), out_shardings=NamedSharding(union, P("x")))()
    t_raw, runs_r = _median_time(lambda: fn(buf), reps)
    print(json.dumps({"moved": moved, "transfer": t_transfer, "raw": t_raw, "ok": ok,
                      "runs_transfer": runs_t, "runs_raw": runs_r, "tensors": len(shapes),
                      "total": sum(x.nbytes for x in params.values())}), flush=True)
    jax.distributed.shutdown()


# --------------------------------------------------------------------------- case (e)


def hier_worker(rank: int, port: int, reps: int, target_bytes: int) -> None:
    """One process of case (e): hierarchical against direct delivery, taking turns; prints JSON."""
    _setup(4)
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                               initialization_timeout=60)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    train = jax.sharding.Mesh(np.array(devs[:4]), ("fsdp",))
    serve = jax.sharding.Mesh(np.array(devs).reshape(2, 2, 2), ("proc", "dp", "tp"))
    shapes = qwen3_layers(target_bytes)
    params, target = {}, {}
    for k, (name, shape) in enumerate(shapes.items()):
        sh = NamedSharding(train, P("fsdp") if len(shape) > 1 else P())
        params[name] = jax.jit(lambda shape=shape, k=k: (jnp.arange(_prod(shape)) % 251 + k).astype(jnp.bfloat16)
                               .reshape(shape), out_shardings=sh)()
        target[name] = NamedSharding(serve, tp_spec(name, len(shape)) if len(shape) > 1 else P())
    from jreshard.jax_executor.transfer import process_domains

    domains = process_domains()
    times: dict[str, list[float]] = {"always": [], "never": []}
    crossing, outs = {}, {}
    for rep in range(reps + 1):  # the first round compiles and is not timed
        for how in times:
            t0 = time.perf_counter()
            out = jax.block_until_ready(jreshard.transfer(params, target, hierarchical=how))
            if rep:
                times[how].append(time.perf_counter() - t0)
            st = jreshard.last_transfer_stats()
            crossing[how] = st.cross_domain_bytes
            outs[how] = out
            del out
    import ml_dtypes

    ok = True
    for k, (name, shape) in enumerate(shapes.items()):  # both outputs against the host values, bit for bit
        host = (np.arange(_prod(shape)) % 251 + k).astype(ml_dtypes.bfloat16).reshape(shape)
        ok &= all(np.array_equal(np.asarray(s.data).view(np.uint16), host[s.index].view(np.uint16))
                  for how in outs for s in outs[how][name].addressable_shards)
    print(json.dumps({"rank": rank, "times": times, "crossing": crossing, "ok": bool(ok), "tensors": len(shapes),
                      "total": sum(x.nbytes for x in params.values()), "domains": repr(domains)}), flush=True)
    jax.distributed.shutdown()


def run_hierarchical(reps: int, target_bytes: int) -> None:
    both = _launch_two("--hier-worker", reps, target_bytes, "e")
    if both is None:
        return
    r = both[0]
    cross = {how: sum(x["crossing"][how] for x in both) for how in ("always", "never")}
    med = {how: statistics.median(max(x["times"][how][k] for x in both) for k in range(reps))
           for how in ("always", "never")}
    print(f"\ncase (e): 2 processes x 4 CPU devices (gloo), {r['tensors']} tensors, {r['total'] / GiB:.3f} GiB bf16, "
          f"FSDP on process 0 -> TP2 x DP2 in each process (2 replicas per process); domains {r['domains']}")
    for how, label in (("always", "hierarchical"), ("never", "direct")):
        runs = [max(x["times"][how][k] for x in both) for k in range(reps)]
        print(f"  jreshard.transfer ({label:<12}) median {med[how] * 1e3:8.1f} ms, cross-process "
              f"{cross[how] / GiB:.3f} GiB; runs {', '.join(f'{t * 1e3:.0f}' for t in runs)}")
    print(f"  ratio, case (e): direct time / hierarchical time = {med['never'] / med['always']:.2f}x; "
          f"cross-process bytes direct / hierarchical = {cross['never'] / cross['always']:.2f}x; "
          f"same outputs: {all(x['ok'] for x in both)}")


def _launch_two(flag: str, reps: int, target_bytes: int, case: str) -> list[dict] | None:
    """Runs ``flag``'s worker in two processes; each one's last JSON line, or None (the failure printed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, flag, str(r), "--port", str(port), "--reps", str(reps),
                               "--bytes", str(target_bytes)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        print(f"  case ({case}) failed:\n" + "\n".join(o[1][-2000:] for o in outs))
        return None
    return [json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]) for out, _ in outs]


def run_multiprocess(reps: int, target_bytes: int) -> None:
    both = _launch_two("--worker", reps, target_bytes, "c")
    if both is None:
        return
    r = both[0]
    print(f"\ncase (c): 2 processes x 2 CPU devices (gloo), {r['tensors']} tensors, {r['total'] / GiB:.3f} GiB bf16, "
          f"FSDP on process 0 -> TP2 on process 1; {r['moved'] / GiB:.3f} GiB cross the process boundary")
    for name, t, runs in (("jreshard.transfer (collective)", r["transfer"], r["runs_transfer"]),
                          ("raw ppermute, same bytes", r["raw"], r["runs_raw"])):
        print(f"  {name:<34} median {t * 1e3:8.1f} ms  ({r['moved'] / t / GiB:5.2f} GiB/s)  "
              f"runs {', '.join(f'{x * 1e3:.0f}' for x in runs)}")
    print(f"  ratio, case (c): transfer rate / raw ppermute rate = {r['raw'] / r['transfer']:.2f}; "
          f"bit-exact: {r['ok']}")


# --------------------------------------------------------------------------- case (d)

FIRST_CALL_METHODS = ("jreshard.transfer (auto)", "jreshard.transfer (collective)", "astype + jax.device_put")
FIRST_CALL_SHAPES = ((256, 256), (256, 512), (512, 256), (256,))


def first_call_worker(method: str, leaves: int, reps: int) -> None:
    """One method of case (d) in a fresh process: its first call, then its warm calls, as JSON."""
    _setup(8)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard

    devs = np.array(jax.devices())
    train = jax.sharding.Mesh(devs.reshape(4, 2), ("fsdp", "tp"))
    serve = jax.sharding.Mesh(devs.reshape(2, 4), ("tp", "dp"))
    rng = np.random.default_rng(0)
    params, target = {}, {}
    for i in range(leaves):
        shape = FIRST_CALL_SHAPES[i % len(FIRST_CALL_SHAPES)]
        two_d = len(shape) == 2
        host = rng.standard_normal(shape, np.float32)
        params[f"layers/{i}"] = jax.device_put(host, NamedSharding(train, P("fsdp", "tp") if two_d else P("fsdp")))
        target[f"layers/{i}"] = NamedSharding(serve, P(None, "tp") if two_d else P())
    jax.block_until_ready(params)
    if method == "astype + jax.device_put":
        def run():
            return jax.device_put({k: v.astype(jnp.bfloat16) for k, v in params.items()}, target)
    else:
        transport = method.split("(")[1].rstrip(")")

        def run():
            return jreshard.transfer(params, target, dtype=jnp.bfloat16, transport=transport)

    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    first = time.perf_counter() - t0
    for k in list(params)[:4]:
        want = np.asarray(params[k].astype(jnp.bfloat16)).view(np.uint16)
        assert out[k].sharding == target[k] and np.array_equal(np.asarray(out[k]).view(np.uint16), want), k
    del out
    warm = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        warm.append(time.perf_counter() - t0)
    print(json.dumps({"first": first, "warm": warm,
                      "bytes": sum(x.nbytes for x in params.values())}), flush=True)


def run_first_call(leaves: int, reps: int, rounds: int) -> None:
    """Case (d): every method in a fresh process, the methods taking turns for ``rounds`` rounds
    (so that a machine whose load drifts weighs on all of them alike)."""
    first: dict[str, list[float]] = {m: [] for m in FIRST_CALL_METHODS}
    warm: dict[str, list[float]] = {m: [] for m in FIRST_CALL_METHODS}
    nbytes = 0
    for _ in range(rounds):
        for method in FIRST_CALL_METHODS:
            proc = subprocess.run([sys.executable, __file__, "--first-call-worker", method, "--leaves", str(leaves),
                                   "--reps", str(reps)], capture_output=True, text=True, timeout=900,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
            if proc.returncode:
                print(f"  case (d), {method} failed:\n{proc.stderr[-2000:]}")
                return
            r = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
            first[method].append(r["first"])
            warm[method].extend(r["warm"])
            nbytes = r["bytes"]
    print(f"\ncase (d): {leaves} float32 leaves of shapes {list(FIRST_CALL_SHAPES)}, {nbytes / GiB:.3f} GiB, "
          f"FSDP4 x TP2 -> TP2 x DP4 on the same 8 devices, cast to bfloat16; each method in a fresh process, "
          f"{rounds} rounds, {reps} warm calls each")
    med = {m: (statistics.median(first[m]), statistics.median(warm[m])) for m in FIRST_CALL_METHODS}
    for m in FIRST_CALL_METHODS:
        print(f"  {m:<34} first median {med[m][0] * 1e3:8.1f} ms (runs {', '.join(f'{t * 1e3:.0f}' for t in first[m])})"
              f"  warm median {med[m][1] * 1e3:7.1f} ms")
    base = "astype + jax.device_put"
    for m in FIRST_CALL_METHODS[:2]:
        print(f"  ratio, case (d), {m} / {base}: first call {med[m][0] / med[base][0]:.2f}x, "
              f"warm {med[m][1] / med[base][1]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bytes", type=int, default=GiB, help="model size for cases a and b")
    ap.add_argument("--mp-bytes", type=int, default=GiB // 4, help="model size for case c")
    ap.add_argument("--cases", default="abcde")
    ap.add_argument("--leaves", type=int, default=256, help="leaves for case d")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per method for case d")
    ap.add_argument("--first-call-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hier-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.first_call_worker is not None:
        first_call_worker(args.first_call_worker, args.leaves, args.reps)
        return
    if args.worker is not None:
        worker(args.worker, args.port, args.reps, args.bytes)
        return
    if args.hier_worker is not None:
        hier_worker(args.hier_worker, args.port, args.reps, args.bytes)
        return
    _setup(8)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("jreshard transfer benchmark")
    print("machine:", machine())
    for case in "ab":
        if case in args.cases:
            report(case, run_single(case, args.reps, args.bytes))
    if "c" in args.cases:
        run_multiprocess(args.reps, args.mp_bytes)
    if "d" in args.cases:
        run_first_call(args.leaves, args.reps, args.rounds)
    if "e" in args.cases:
        run_hierarchical(args.reps, args.mp_bytes)


if __name__ == "__main__":
    main()
