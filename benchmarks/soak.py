"""Soak: many consecutive bridge syncs and ``jreshard.transfer`` calls; memory, failures, times, checksum cost.

Part 1, the bridge: 2 JAX trainer processes (2 simulated CPU devices each, FSDP over 4) send a
small Llama (``jreshard.nn``, float32 in JAX) to 2 torch inference ranks (TP2, fused qkv and
gate_up, bfloat16) over gloo on 127.0.0.1. Each round runs two syncs, in alternating order: one
from a ``Sender(checksum=True)`` and one from a ``Sender(checksum=False)`` (the default), so
the checksum's cost is measured side by side, on the same plan, params and receivers. Each sync
is timed from a barrier to the slowest rank's end. A failed sync (``SyncError``) is counted and
the soak goes on. The receivers' params are compared bit for bit with the plan's NumPy oracle at
the middle and at the end.

Part 2, ``jreshard.transfer``: one process with 8 simulated CPU devices moves the same model's
leaves from FSDP over 4 devices to TP2 x DP2 on the other 4 (float32 -> bfloat16), N times; each
output is checked against the input once in a while, and dropped.

Resident memory (RSS, from /proc) is read on every process at the start (after the first sync
or call, which allocates buffers and compiles), the middle and the end.

Usage: python benchmarks/soak.py [--rounds 200 --transfers 500 --layers 4 --hidden 512 --vocab 8000]
Prints the machine, versions, sizes and, per part, RSS, failures, p50/p99 times; the checksum's
share of sync time is (p50 on - p50 off) / p50 on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from tests._procs import free_ports  # noqa: E402 (the repository root is on the path)

TRAINERS, RECEIVERS, WORLD = (0, 1), (2, 3), 4


def rss_mib() -> float:
    """This process's resident memory in MiB (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _config(args):
    from jreshard.nn import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       num_key_value_heads=max(1, args.hidden // 128), head_dim=64, name="soak")


def _arrays(src) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {path: rng.standard_normal(layout.shape, dtype=np.float32) for path, layout in src.items()}


def bridge_worker(args) -> None:
    import torch
    import torch.distributed as dist

    import bridge
    from jreshard.nn import fsdp_spec, param_shapes

    rank = args.rank
    cfg = _config(args)
    src = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", TRAINERS, 2), fsdp_spec)
    plan = bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, list(RECEIVERS), fused=True, dtype="bfloat16"),
                             bucket_bytes=args.bucket_mb << 20)
    arrays = _arrays(src)
    bridge.init_group(rank, WORLD, port=args.port, timeout=300)
    if rank in TRAINERS:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        from bridge.trainer.sender import Sender

        jax.distributed.initialize(f"127.0.0.1:{args.jax_port}", num_processes=2, process_id=rank,
                                   initialization_timeout=120)
        mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices(), axis_types=(jax.sharding.AxisType.Auto,))
        params = {path: jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(*fsdp_spec(path, a.shape))),
                                                     lambda idx, a=a: a[idx]) for path, a in arrays.items()}
        senders = {"on": Sender(plan, rank=rank, timeout=120, checksum=True),
                   "off": Sender(plan, rank=rank, timeout=120, checksum=False)}
        version = iter(range(1, 1 << 62))

        def sync(kind: str) -> None:
            senders[kind].sync(params, version=next(version))
    else:
        mine = plan.param_map.for_rank(rank)
        local = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16) for p in mine}
        receiver = bridge.Receiver(plan, local, rank=rank, timeout=120)
        want = plan.reference(arrays)[rank]

        def sync(kind: str) -> None:
            receiver.sync()

    def exact() -> bool:
        if rank in TRAINERS:
            return True
        return all(np.array_equal(local[n].float().numpy(), want[n].astype(np.float32)) for n in local)

    times: dict[str, list[float]] = {"on": [], "off": []}
    failures = {"on": 0, "off": 0}
    errors: list[str] = []
    rss: dict[str, float] = {}
    checks: list[bool] = []
    for r in range(args.rounds + 1):
        for kind in ("on", "off") if r % 2 else ("off", "on"):
            dist.barrier()
            t0 = time.perf_counter()
            ok = 1.0
            try:
                sync(kind)
            except bridge.SyncError as e:
                ok = 0.0
                errors.append(str(e)[:300])
            t = torch.tensor([time.perf_counter() - t0, ok], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r:  # the first round warms up (jit compilation, buffers)
                times[kind].append(float(t[0]))
                failures[kind] += ok == 0.0
        if r == 1:
            rss["start"] = rss_mib()
        if r == args.rounds // 2:
            rss["middle"] = rss_mib()
            checks.append(exact())
    rss["end"] = rss_mib()
    checks.append(exact())
    out = {"rank": rank, "times": times, "failures": failures, "errors": errors[:3], "rss": rss,
           "exact": all(checks), "network_bytes": plan.network_bytes, "buckets": plan.num_buckets,
           "model_bytes_f32": sum(a.nbytes for a in arrays.values())}
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    if rank in TRAINERS:
        os._exit(0)  # skip the JAX coordination shutdown barrier


def transfer_worker(args) -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard
    from jreshard.nn import fsdp_spec, param_shapes

    devs = np.array(jax.devices()[:8])
    train = jax.sharding.Mesh(devs[:4], ("fsdp",))
    serve = jax.sharding.Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
    shapes = param_shapes(_config(args))
    host = {path: np.random.default_rng(0).standard_normal(shape, dtype=np.float32) for path, shape in shapes.items()}
    params = {path: jax.device_put(a, NamedSharding(train, P(*fsdp_spec(path, a.shape)))) for path, a in host.items()}
    target = {path: NamedSharding(serve, P(None, "tp") if a.ndim == 2 else P()) for path, a in host.items()}
    times, failures, errors, rss, checks = [], 0, [], {}, []
    for i in range(args.transfers + 1):
        t0 = time.perf_counter()
        try:
            out = jreshard.transfer(params, target, dtype="bfloat16")
            jax.block_until_ready(out)
        except Exception as e:  # counted: a soak reports failures instead of stopping at the first
            failures += 1
            errors.append(f"{type(e).__name__}: {e}"[:300])
            out = None
        if i:
            times.append(time.perf_counter() - t0)
        if out is not None and i % max(1, args.transfers // 10) == 0:
            checks.append(all(np.array_equal(np.asarray(out[p]), host[p].astype(out[p].dtype)) for p in host))
        del out
        if i == 1:
            rss["start"] = rss_mib()
        if i == args.transfers // 2:
            rss["middle"] = rss_mib()
    rss["end"] = rss_mib()
    res = {"times": times, "failures": failures, "errors": errors[:3], "rss": rss, "exact": all(checks),
           "checks": len(checks), "model_bytes_f32": sum(a.nbytes for a in host.values())}
    print("RESULT " + json.dumps(res), flush=True)



def _run(cmds: list[list[str]], env: dict, timeout: float) -> list[dict]:
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in cmds]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = [json.loads(line[len("RESULT "):]) for o in outputs for line in o.splitlines()
               if line.startswith("RESULT ")]
    if len(results) != len(cmds):
        print("\n".join(o[-3000:] for o in outputs))
        raise SystemExit("soak failed: a process gave no result")
    return results


def _ms(ts: list[float]) -> str:
    return (f"p50 {np.percentile(ts, 50) * 1e3:8.2f} ms, p99 {np.percentile(ts, 99) * 1e3:8.2f} ms, "
            f"max {max(ts) * 1e3:8.2f} ms")


def _rss(rss: dict) -> str:
    points = " / ".join(f"{rss[k]:.0f}" for k in ("start", "middle", "end"))
    return f"{points} MiB (end - start {rss['end'] - rss['start']:+.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="bridge rounds (two syncs each: checksums on, off)")
    ap.add_argument("--transfers", type=int, default=500, help="jreshard.transfer calls")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--jax-port", type=int, default=0)
    ap.add_argument("--part", choices=("bridge", "transfer"), default="bridge")
    args = ap.parse_args()
    if args.rank >= 0:
        (bridge_worker if args.part == "bridge" else transfer_worker)(args)
        return
    common = [f"--rounds={args.rounds}", f"--transfers={args.transfers}", f"--layers={args.layers}",
              f"--hidden={args.hidden}", f"--vocab={args.vocab}", f"--bucket-mb={args.bucket_mb}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    port, jport = free_ports(2)
    t0 = time.perf_counter()
    ranks = _run([[sys.executable, __file__, f"--rank={r}", f"--port={port}", f"--jax-port={jport}", *common]
                  for r in range(WORLD)], dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                 args.timeout)
    t_bridge = time.perf_counter() - t0
    (tr,) = _run([[sys.executable, __file__, "--rank=0", "--part=transfer", *common]],
                 dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8"), args.timeout)
    t_transfer = time.perf_counter() - t0 - t_bridge
    _report(args, sorted(ranks, key=lambda r: r["rank"]), tr, t_bridge, t_transfer)


def hash_speed() -> float:
    """xxh3-64 throughput on this machine now, GiB/s (the median of 5 passes over 64 MiB), for context."""
    import xxhash

    data = np.random.default_rng(0).integers(0, 256, size=64 << 20, dtype=np.uint8)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(data.data)
        times.append(time.perf_counter() - t0)
    return 1 / 16 / float(np.median(times))


def _report(args, ranks: list[dict], tr: dict, t_bridge: float, t_transfer: float) -> None:
    import jax
    import torch

    cfg = _config(args)
    r0 = ranks[0]
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
          f"{platform.system()} {platform.release()}, python {platform.python_version()}; load average "
          f"{os.getloadavg()[0]:.1f} at the end; xxh3-64 {hash_speed():.2f} GiB/s on one core now")
    print(f"versions: jax {jax.__version__}, torch {torch.__version__}, numpy {np.__version__}, gloo 127.0.0.1")
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
          f"vocab {cfg.vocab_size}: {r0['model_bytes_f32'] / 1e6:.1f} MB float32 in JAX")
    n = len(r0["times"]["on"])
    print(f"\nbridge: FSDP4 over 2 trainer processes -> TP2 bfloat16 on 2 inference ranks, "
          f"{r0['network_bytes'] / 1e6:.1f} MB per sync in {r0['buckets']} buckets of {args.bucket_mb} MiB; "
          f"{n} rounds of 2 syncs after 1 warm-up round ({t_bridge:.0f} s in all)")
    on, off = r0["times"]["on"], r0["times"]["off"]
    print(f"  checksums on             {_ms(on)}   failures {r0['failures']['on']}")
    print(f"  checksums off (default)  {_ms(off)}   failures {r0['failures']['off']}")
    p_on, p_off = float(np.percentile(on, 50)), float(np.percentile(off, 50))
    print(f"  checksum cost: {(p_on - p_off) / p_on * 100:+.1f}% of the sync time (p50), "
          f"{(np.mean(on) - np.mean(off)) / np.mean(on) * 100:+.1f}% (mean); budget 5%")
    for r in ranks:
        role = "trainer " if r["rank"] in TRAINERS else "receiver"
        print(f"  rank {r['rank']} ({role}) RSS start / middle / end: {_rss(r['rss'])}; "
              f"params exact: {r['exact']}" + (f"; errors {r['errors']}" if r["errors"] else ""))
    print(f"\ntransfer: FSDP4 -> TP2 x DP2 on 8 simulated CPU devices of one process, float32 -> bfloat16, "
          f"{len(tr['times'])} calls after 1 warm-up ({t_transfer:.0f} s in all)")
    print(f"  {_ms(tr['times'])}   failures {tr['failures']}; outputs exact in {tr['checks']} checks: {tr['exact']}")
    print(f"  RSS start / middle / end: {_rss(tr['rss'])}" + (f"; errors {tr['errors']}" if tr["errors"] else ""))


if __name__ == "__main__":
    main()
