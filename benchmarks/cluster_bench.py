"""Weight syncs on a simulated cluster: direct vs hierarchical delivery, and the cost model's prediction.

The cluster (``benchmarks/cluster.py``): 4 nodes, each a network namespace whose link to
the others is shaped with ``tc`` (``--rate-mbit`` per direction); processes of one node
talk over its loopback (the fast links), processes of different nodes over the shaped
links. Trainer nodes and inference nodes are apart (nodes 0-1 train, 2-3 serve), and
every inference node holds 2 replicas of the weights, so hierarchical delivery (each byte
into each node once, then the copies inside the node) has half the cross-node bytes of
direct delivery.

  (a) bridge: 4 JAX trainer processes (1 device each, 2 per node, FSDP over 4) -> 4 torch
      inference ranks (2 per node, each a full replica: TP1 x DP4), a Llama-shaped model
      cast to bfloat16 at the senders; ``BridgePlan(hierarchical="never" | "always")``
      with the nodes as domains.
  (b) jreshard.transfer: 4 JAX processes (one per node, 2 devices each; gloo between
      processes), float32 leaves FSDP over the 4 devices of nodes 0-1 -> replicated on
      the 4 devices of nodes 2-3 (2 replicas per process); ``hierarchical=`` when
      ``jreshard.transfer`` accepts it, else direct only.
  (c) the cost model (``jreshard.fleet.cost.compare``) for the same layouts on the links
      and local work measured at the start (``measure``), hierarchical delivery as each
      executor runs it (the bridge's two stages overlap in shared buckets, ``overlap=`` its
      ``STAGE2_LAG``, the stages in a row printed beside; ``transfer``'s run one after the
      other): the network at the shaped-link
      rate (halved per rank: two ranks share a node's link), the fast links at the
      loopback rate per stream with every inference rank streaming to its peer at once
      (a) or at the shared copy rate (b: stage 2 of ``transfer`` is a copy inside a
      process), the latency at one gloo message, and ``copy_GBps`` (packing, unpacking)
      at the memory-copy rate per process with one process per device copying at once
      (8 processes share the machine's cores as the ranks do); next to the measured
      times, with the prediction from links and messages alone beside it.

Cross-node bytes are counted by the kernel (``tx_bytes`` of every node's link, TCP/IP
headers and the timing barriers included) next to the plan's figure. Without root or
iproute2 the processes run on the machine's loopback (no shaping, no counts).

Usage: python benchmarks/cluster_bench.py [--parts abc --reps 3 --rate-mbit 400 --layers 4 --hidden 512]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

from cluster import Cluster, round_trip, stream_rate, unavailable  # noqa: E402

from tests._procs import free_ports  # noqa: E402 (the repository root is on the path)

NODES, PER_NODE = 4, 2
TRAINERS, RECEIVERS = (0, 1, 2, 3), (4, 5, 6, 7)  # bridge ranks; rank r sits in node r // PER_NODE
DOMAINS = [[2 * k, 2 * k + 1] for k in range(NODES)]
MODES = ("never", "always")
NAMES = {"never": "direct", "always": "hierarchical"}
# The steps of a bridge sync that Sender.last_stats and Receiver.last_stats time (seconds).
STEPS = ("handshake", "pack", "vote", "post", "wait", "check", "unpack")
MiB = 1 << 20
# 8 processes share the machine's cores: XLA runs each on one thread, as OMP_NUM_THREADS=1 does torch.
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _config(a):
    from jreshard.nn import LlamaConfig

    return LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                       num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                       num_key_value_heads=max(1, a.hidden // 128), head_dim=64, name="cluster-bench")


def _tx_bytes() -> int:
    """Bytes this node has sent over its link (the kernel's count), or 0 off the cluster."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return 0


def _bridge_plans(a, auto: bool = False) -> dict:
    import bridge
    from jreshard.nn import fsdp_spec, param_shapes

    cfg = _config(a)
    src = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", TRAINERS, 1), fsdp_spec)
    pm = bridge.llama_param_map(cfg, src, [[r] for r in RECEIVERS], fused=True, dtype="bfloat16")
    if "hierarchical" not in inspect.signature(bridge.BridgePlan).parameters:
        return {"never": bridge.BridgePlan(src, pm, bucket_bytes=a.bucket_mb * MiB)}
    return {m: bridge.BridgePlan(src, pm, bucket_bytes=a.bucket_mb * MiB, hierarchical=m, domains=DOMAINS)
            for m in (*MODES, *(["auto"] if auto else []))}


def bridge_worker(a) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import bridge

    rank, count = a.rank, a.count_bytes and a.rank % PER_NODE == 0
    plans = _bridge_plans(a)
    bridge.init_group(rank, len(TRAINERS) + len(RECEIVERS), port=a.port, host=a.master, timeout=600)

    def timed(fn, synced) -> tuple[float, int, int, list[float]]:
        """Seconds of the slowest rank, cross-node bytes counted by the kernel and by the executors (``synced``:
        the Sender or Receiver that ``fn`` syncs)."""
        dist.barrier()
        c0, t0 = _tx_bytes(), time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        dist.barrier()
        st = synced.last_stats
        stats = {**st.step_seconds, "cross_domain_sent": st.cross_domain_sent_bytes}
        t = torch.tensor([dt], dtype=torch.float64)
        n = torch.tensor([_tx_bytes() - c0 if count else 0, int(stats.get("cross_domain_sent", 0))],
                         dtype=torch.int64)
        steps = torch.tensor([float(stats.get(k, 0.0)) for k in STEPS], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(n)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        return float(t.item()), int(n[0]), int(n[1]), steps.tolist()

    results: dict = {m: {"times": [], "bytes": [], "counted": [], "steps": []} for m in plans}

    def record(m: str, rep: int, measured: tuple) -> None:
        if rep:  # the first repetition warms up
            for key, v in zip(("times", "bytes", "counted", "steps"), measured, strict=True):
                results[m][key].append(v)

    if rank in TRAINERS:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        from bridge.trainer.sender import Sender
        from jreshard.nn import fsdp_spec

        jax.distributed.initialize(f"{a.master}:{a.jax_port}", num_processes=len(TRAINERS), process_id=rank,
                                   initialization_timeout=300)
        mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices(), axis_types=(jax.sharding.AxisType.Auto,))
        src = next(iter(plans.values())).source
        rng = np.random.default_rng(0)
        params = {}
        for path, layout in src.items():
            host = rng.standard_normal(layout.shape, dtype=np.float32)
            sharding = NamedSharding(mesh, P(*fsdp_spec(path, host.shape)))
            params[path] = jax.make_array_from_callback(host.shape, sharding, host.__getitem__)
        senders = {m: Sender(p, rank=rank, timeout=600) for m, p in plans.items()}
        for rep in range(a.reps + 1):
            for m, s in senders.items():
                record(m, rep, timed(lambda s=s, rep=rep: s.sync(params, version=rep + 1), s))
    else:
        outs = {}
        receivers = {}
        for m, p in plans.items():
            mine = p.param_map.for_rank(rank)
            outs[m] = {q.name: torch.zeros(q.shape, dtype=getattr(torch, q.dtype)) for q in mine}
            receivers[m] = bridge.Receiver(p, outs[m], rank=rank, timeout=600)
        for rep in range(a.reps + 1):
            for m, r in receivers.items():
                record(m, rep, timed(r.sync, r))
        first = outs[MODES[0]]
        same = all(torch.equal(first[k], o[k]) for o in outs.values() for k in first)
        nonzero = all(bool(v.any()) for v in first.values())
        if rank == RECEIVERS[0]:
            plan_bytes = {m: _cross_node_bytes(p) for m, p in plans.items()}
            routes = {m: dict(r.last_stats.transport_bytes) for m, r in receivers.items()}
            print("RESULT " + json.dumps({"results": results, "same": same and nonzero, "plan_bytes": plan_bytes,
                                          "buckets": {m: p.num_buckets for m, p in plans.items()},
                                          "routes": routes}), flush=True)
    dist.barrier()
    os._exit(0)  # skip the JAX coordination shutdown barrier


def _cross_node_bytes(plan) -> int:
    """Bytes of the plan's messages whose sender and receiver sit in different nodes."""
    node = {r: r // PER_NODE for r in (*TRAINERS, *RECEIVERS)}
    return sum(m.nbytes for m in plan.messages if node[m.src] != node[m.dst])


def transfer_worker(a) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={PER_NODE} {ONE_THREAD}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.distributed.initialize(f"{a.master}:{a.jax_port}", num_processes=NODES, process_id=a.rank,
                               initialization_timeout=300)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    train = jax.sharding.Mesh(np.array(devs[:4]), ("fsdp",))
    serve = jax.sharding.Mesh(np.array(devs[4:]).reshape(2, 2), ("node", "dp"))
    shapes = _transfer_shapes(a)
    params, target = {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        host = np.random.default_rng(i).standard_normal(shape, dtype=np.float32)
        params[name] = jax.make_array_from_callback(shape, NamedSharding(train, P("fsdp")), host.__getitem__,
                                                    dtype=np.float32)
        target[name] = NamedSharding(serve, P())
    modes = MODES if "hierarchical" in inspect.signature(jreshard.transfer).parameters else ("never",)
    # What the executor counted it sent across domains (this process's senders), where it counts.
    last_stats = getattr(importlib.import_module("jreshard.jax_executor.transfer"), "last_transfer_stats", None)
    results: dict = {m: {"times": [], "bytes": [], "counted": [], "delivery": ""} for m in modes}
    outs = {}
    for rep in range(a.reps + 1):
        for m in modes:
            kw = {"hierarchical": m} if len(modes) > 1 else {}
            multihost_utils.sync_global_devices(f"start {rep} {m}")
            c0, t0 = _tx_bytes(), time.perf_counter()
            outs[m] = jax.block_until_ready(jreshard.transfer(params, target, **kw))
            dt = time.perf_counter() - t0
            multihost_utils.sync_global_devices(f"end {rep} {m}")
            if rep:
                results[m]["times"].append(dt)
                results[m]["bytes"].append(_tx_bytes() - c0 if a.count_bytes else 0)
                stats = last_stats() if last_stats else None
                if stats is not None:
                    results[m]["counted"].append(stats.cross_domain_bytes)
                    results[m]["delivery"] = stats.delivery
    auto = ""
    if len(modes) > 1 and last_stats is not None:  # what hierarchical="auto" takes here, untimed
        jax.block_until_ready(jreshard.transfer(params, target, hierarchical="auto"))
        auto = last_stats().delivery
    exact = True
    for i, (name, shape) in enumerate(shapes.items()):
        want = np.random.default_rng(i).standard_normal(shape, dtype=np.float32)
        for m in modes:
            exact &= all(np.array_equal(np.asarray(s.data), want) for s in outs[m][name].addressable_shards)
    stats = jreshard.plan(params, target).stats()
    print("RESULT " + json.dumps({"rank": a.rank, "results": results, "exact": bool(exact), "auto": auto,
                                  "network_bytes": stats.network_bytes}), flush=True)
    multihost_utils.sync_global_devices("done")
    os._exit(0)


def _transfer_shapes(a) -> dict[str, tuple[int, int]]:
    n = max(1, round(a.transfer_mb * MiB / (4 * 1024 * 1024)))
    return {f"w{i}": (1024, 1024) for i in range(n)}


# ---------------------------------------------------------------------- the driver
def _launch(cluster: Cluster | None, ranks: list[tuple[int, list[str]]], env: dict, timeout: float) -> list[str]:
    """Starts one process per (node, argv) (inside its node when there is a cluster); returns their outputs."""
    procs = []
    for node, argv in ranks:
        kw: dict[str, Any] = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        procs.append(cluster.popen(node, argv, **kw) if cluster else
                     subprocess.Popen(argv, start_new_session=True, **kw))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return outs


def _results(outs: list[str]) -> list[dict]:
    lines = [ln[len("RESULT "):] for o in outs for ln in o.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit("benchmark failed:\n" + "\n----\n".join(o[-3000:] for o in outs))
    return [json.loads(ln) for ln in lines]


def _common(a, cluster: Cluster | None) -> tuple[str, list[str], dict]:
    master = Cluster.addr(0) if cluster else "127.0.0.1"
    ports = (29500, 29501) if cluster else free_ports(2)
    args = [f"--reps={a.reps}", f"--layers={a.layers}", f"--hidden={a.hidden}", f"--vocab={a.vocab}",
            f"--bucket-mb={a.bucket_mb}", f"--transfer-mb={a.transfer_mb}", f"--master={master}",
            f"--port={ports[0]}", f"--jax-port={ports[1]}",
            *(["--count-bytes"] if cluster else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {ONE_THREAD}", PYTHONPATH=ROOT)
    return master, args, env


def run_bridge(a, cluster: Cluster | None) -> dict:
    _, args, env = _common(a, cluster)
    ranks = [(r // PER_NODE, [sys.executable, __file__, "--bridge-rank", str(r), *args])
             for r in (*TRAINERS, *RECEIVERS)]
    return _results(_launch(cluster, ranks, env, a.timeout))[0]


def run_transfer(a, cluster: Cluster | None) -> list[dict]:
    _, args, env = _common(a, cluster)
    ranks = [(k, [sys.executable, __file__, "--transfer-rank", str(k), *args]) for k in range(NODES)]
    return _results(_launch(cluster, ranks, env, a.timeout))


class Links(NamedTuple):
    """What the cost model is given of the cluster, measured at the start of a run (bytes/s, seconds)."""

    shaped: float  # one TCP stream over a node's shaped link
    loop: float  # one TCP stream over a node's loopback, alone
    loop_shared: float  # per stream, with every rank of the inference nodes streaming to its peer at once
    copy: float  # one process copying memory, alone
    copy_shared: float  # per process, with one process per device copying at once
    rtt: float  # a 1-byte TCP round trip across nodes
    message: float  # one small gloo (torch.distributed) message across nodes: half a send/recv round trip


def topology(links: Links, part: str, bucket: int, copies: bool = True) -> Any:
    """The cost model's topology of part (a) or (b) on the measured links.

    Network: the shaped link halved (the model gives each device its own NIC; two ranks share a
    node's link). Fast links: (a) the loopback per stream with every pair of ranks streaming at
    once; (b) a copy inside a process (stage 2 of ``transfer``), at the shared copy rate. Latency:
    one gloo message. Copies (packing, unpacking): the rate each device gets when every device
    copies at once, as the ranks share the machine's cores.
    """
    from jreshard.fleet.cost import Topology

    fast = links.loop_shared if part == "a" else links.copy_shared
    return Topology(gpus_per_domain=PER_NODE, nvlink_GBps=fast / 1e9, network_GBps=links.shaped / PER_NODE / 1e9,
                    latency_us=links.message * 1e6, bucket_bytes=bucket,
                    copy_GBps=links.copy_shared / 1e9 if copies else None)


def predictions(a, links: Links) -> dict[str, dict[str, float]]:
    """The cost model's seconds for (a) and (b), direct and hierarchical, on the measured links.

    Device ``d`` of the model is bridge rank ``d`` (a) or JAX device ``d`` (b), node ``d // 2``.
    ``<mode>_links``: the same prediction without the copy term (links and messages only);
    ``always_serial`` (a): hierarchical delivery predicted with its stages in a row.
    """
    import numpy as np

    from bridge.plan.bridge_plan import STAGE2_LAG
    from jreshard import Layout, Mesh
    from jreshard.fleet.cost import compare
    from jreshard.nn import fsdp_spec, param_shapes

    src_mesh, dst_mesh = Mesh(np.arange(4), "fsdp"), Mesh(np.arange(4, 8), "dp")
    cases: dict[str, tuple[dict, str, int, Any]] = {
        "a": (dict(param_shapes(_config(a))), "bfloat16", a.bucket_mb * MiB, fsdp_spec),
        "b": (_transfer_shapes(a), "float32", 256 * MiB, lambda p, s: ("fsdp",)),
    }
    out = {}
    for part, (shapes, dtype, bucket, spec) in cases.items():
        src = {p: Layout(s, src_mesh, spec(p, s), dtype) for p, s in shapes.items()}
        dst = {p: Layout(s, dst_mesh, (), dtype) for p, s in shapes.items()}
        out[part] = {}
        # How the executor runs the two stages: the bridge in shared buckets, transfer one after the other.
        lag = STAGE2_LAG if part == "a" else 0
        for copies, tag, overlap in ((True, "", lag), (False, "_links", lag), (True, "_serial", 0)):
            if tag == "_serial" and not lag:
                continue
            c = compare(src, dst, topology(links, part, bucket, copies), hierarchical="always", overlap=overlap)
            hier = c.hierarchical if c.hierarchical is not None else c.direct
            out[part].update({"never" + tag: c.direct.seconds, "always" + tag: hier.seconds})
        out[part].update(never_bytes=c.direct.network_bytes, always_bytes=hier.network_bytes)
    return out


def _copy_probe(seconds: float, start_at: float) -> None:
    """From ``start_at`` (wall clock) for ``seconds``, copies 32 MiB over and over; prints bytes per second."""
    import numpy as np

    x, y = np.ones(32 * MiB, np.uint8), np.empty(32 * MiB, np.uint8)
    np.copyto(y, x)
    time.sleep(max(0.0, start_at - time.time()))
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        np.copyto(y, x)
        n += 1
    print("RESULT " + json.dumps({"rate": n * x.nbytes / (time.perf_counter() - t0)}), flush=True)


def copy_rates(cluster: Cluster | None, procs: int, seconds: float = 1.0) -> tuple[float, float]:
    """Memory-copy rate of one process alone, and per process (median) with ``procs`` copying at once.

    The processes run in the nodes, ``PER_NODE`` per node, as the ranks do."""
    rates = []
    for n in (1, procs):
        start_at = time.time() + 1.0 + 0.4 * n  # after every process has imported numpy
        argv = [sys.executable, __file__, "--copy-probe", str(seconds), str(start_at)]
        outs = _launch(cluster, [(i // PER_NODE, argv) for i in range(n)], dict(os.environ, OMP_NUM_THREADS="1"), 120)
        rates.append(statistics.median(r["rate"] for r in _results(outs)))
    return rates[0], rates[1]


def shared_loopback(cluster: Cluster | None, nodes: tuple[int, ...] = (2, 3), seconds: float = 3.0) -> float:
    """Median rate per stream of ``PER_NODE`` loopback streams in each of ``nodes`` at once (stage 2's pairs).

    Each stream's processes start on their own (up to a second apart on a loaded machine), so the
    streams run for several seconds to overlap for most of their time."""
    # In the nodes: ports 5210.. in each node's namespace; without a cluster: one machine, every port apart.
    jobs = [(n if cluster else 0, 5210 + (i if cluster else j * PER_NODE + i))
            for j, n in enumerate(nodes) for i in range(PER_NODE)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        rates = list(pool.map(lambda job: stream_rate(cluster, job[0], job[0], seconds, port=job[1]), jobs))
    return statistics.median(rates)


def _message_probe(a) -> None:
    """Rank 0 and 1 of a gloo group ping-pong one int64 (rank 0 prints the median round trip)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=2)
    x, times = torch.zeros(1, dtype=torch.int64), []
    for _ in range(300):
        t0 = time.perf_counter()
        if a.rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append(time.perf_counter() - t0)
    if a.rank == 0:
        print("RESULT " + json.dumps({"rtt": statistics.median(times[50:])}), flush=True)
    dist.destroy_process_group()


def message_cost(cluster: Cluster | None) -> float:
    """Seconds of one small gloo message from node 0 to node 2 (half the median send/recv round trip)."""
    master = Cluster.addr(0) if cluster else "127.0.0.1"
    port = 29400 if cluster else free_ports(1)[0]
    argv = [sys.executable, __file__, f"--master={master}", f"--port={port}", "--message-rank"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return _results(_launch(cluster, [(0, [*argv, "0"]), (2, [*argv, "1"])], env, 180))[0]["rtt"] / 2


def measure(cluster: Cluster | None) -> Links:
    """The links and the local work of the cluster (or the machine), measured and printed."""
    if cluster is None:
        shaped = loop = stream_rate(None, 0, 0)
        rtt = round_trip(None, 0, 0)
    else:
        shaped, loop = stream_rate(cluster, 0, 2), stream_rate(cluster, 2, 2)
        rtt = round_trip(cluster, 0, 2)
    copy, copy_shared = copy_rates(cluster, NODES * PER_NODE)
    links = Links(shaped, loop, shared_loopback(cluster), copy, copy_shared, rtt, message_cost(cluster))
    print(f"measured: shaped link {shaped * 8 / 1e6:.0f} Mbit/s ({shaped / 1e6:.1f} MB/s); loopback in a node "
          f"{loop * 8 / 1e9:.2f} Gbit/s alone, {links.loop_shared * 8 / 1e9:.2f} Gbit/s per stream with "
          f"{2 * PER_NODE} streams at once; memory copy {copy / 1e9:.2f} GB/s alone, "
          f"{copy_shared / 1e9:.2f} GB/s per process with {NODES * PER_NODE} at once; 1-byte TCP round trip "
          f"across nodes {rtt * 1e6:.0f} us; one gloo message across nodes {links.message * 1e6:.0f} us")
    return links


def _report(title: str, res: dict, plan_bytes: dict, pred: dict | None, kernel: bool) -> None:
    print(title)
    med = {m: statistics.median(r["times"]) for m, r in res.items()}
    for m, r in res.items():
        name = NAMES[m]
        kb = statistics.median(r["bytes"])
        planned = f"plan {plan_bytes[m] / 1e6:.2f} MB" if m in plan_bytes else ""
        if r.get("counted"):
            planned += (", " if planned else "") + f"executor {statistics.median(r['counted']) / 1e6:.2f} MB"
        if r.get("delivery"):
            name += f" ({r['delivery']})" if r["delivery"] != name else ""
        line = (f"  {name:<13} median {med[m] * 1e3:8.1f} ms (runs {', '.join(f'{t * 1e3:.0f}' for t in r['times'])}); "
                "cross-node bytes: " + (f"kernel {kb / 1e6:.2f} MB, " if kernel else "") + planned)
        if pred is not None:
            line += (f"; predicted {pred[m] * 1e3:7.1f} ms ({pred[m + '_bytes'] / 1e6:.2f} MB), "
                     f"predicted / measured {pred[m] / med[m]:.2f} (links only: {pred[m + '_links'] * 1e3:.0f} ms, "
                     f"{pred[m + '_links'] / med[m]:.2f}"
                     + (f"; stages in a row: {pred[m + '_serial'] * 1e3:.0f} ms, {pred[m + '_serial'] / med[m]:.2f}"
                        if m + "_serial" in pred and m == "always" else "") + ")")
        print(line)
    for m, r in res.items():
        if r.get("steps"):
            per = [statistics.median(x[i] for x in r["steps"]) for i in range(len(STEPS))]
            print(f"  {NAMES[m]}: seconds per step, slowest rank, medians: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in zip(STEPS, per, strict=True)))
    if len(med) == 2:
        print(f"  hierarchical speed-up over direct: {med['never'] / med['always']:.2f}x (goal >= 1.5x)")
    else:
        print("  hierarchical: not run (this executor has no hierarchical= option yet)")


def _load() -> str:
    """The machine's load average: the other work the measured processes share the cores with."""
    return "load average (1, 5, 15 min): " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def _machine() -> str:
    import jax
    import numpy as np
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; python "
            f"{platform.python_version()}, jax {jax.__version__}, torch {torch.__version__}, numpy {np.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--parts", default="abc", help="a: bridge, b: jreshard.transfer, c: the cost model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate-mbit", type=float, default=400.0)
    ap.add_argument("--latency-ms", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--transfer-mb", type=int, default=32, help="model size of part (b), float32")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--no-cluster", action="store_true", help="run on the machine's loopback, as without root")
    for hidden in ("--bridge-rank", "--transfer-rank", "--rank", "--port", "--jax-port"):
        ap.add_argument(hidden, type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--count-bytes", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--copy-probe", nargs=2, type=float, help=argparse.SUPPRESS)
    ap.add_argument("--message-rank", type=int, default=-1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.copy_probe is not None:
        return _copy_probe(*a.copy_probe)
    if a.message_rank >= 0:
        a.rank = a.message_rank
        return _message_probe(a)
    if a.bridge_rank >= 0:
        a.rank = a.bridge_rank
        return bridge_worker(a)
    if a.transfer_rank >= 0:
        a.rank = a.transfer_rank
        return transfer_worker(a)

    print("jreshard on a simulated cluster")
    print("machine:", _machine())
    reason = "--no-cluster" if a.no_cluster else unavailable()
    cluster = None if reason else Cluster(NODES, rate_mbit=a.rate_mbit, latency_ms=a.latency_ms).up()
    try:
        if cluster is None:
            print(f"no simulated cluster ({reason}): every process runs on the machine's loopback, unshaped")
        else:
            print(f"cluster: {NODES} nodes x {PER_NODE} ranks, links shaped to {a.rate_mbit:g} Mbit/s per direction, "
                  f"latency {a.latency_ms:g} ms " + ("applied (netem)" if cluster.latency_shaped else
                                                    "NOT applied (this kernel has no netem qdisc)"))
        print(_load())
        links = measure(cluster)
        pred = predictions(a, links) if "c" in a.parts and cluster else None
        if "c" in a.parts and cluster is None:
            print("(c) skipped: without a cluster there is no shaped link to predict")
        if "a" in a.parts:
            t0 = time.perf_counter()
            r = run_bridge(a, cluster)
            cfg = _config(a)
            auto_plan = _bridge_plans(a, auto=True).get("auto")
            _report(f"\n(a) bridge: 4 JAX trainers (nodes 0-1) -> 4 torch ranks (nodes 2-3, a full replica each), "
                    f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, bfloat16 on "
                    f"the wire, {a.bucket_mb} MiB buckets {r['buckets']}; {a.reps} repetitions after a warm-up; all "
                    f"modes give the same weights: {r['same']} ({time.perf_counter() - t0:.0f} s)",
                    r["results"], r["plan_bytes"], pred["a"] if pred else None, cluster is not None)
            print(f"  bytes per route on inference rank {RECEIVERS[0]} (shm: from a rank of its own node; gloo: over "
                  f"the links): {r.get('routes')}")
            if auto_plan is not None:
                print(f"  BridgePlan(hierarchical='auto') with the nodes as domains takes: "
                      f"{'hierarchical' if auto_plan.two_stage else 'direct'} delivery")
        print(_load())
        if "b" in a.parts:
            t0 = time.perf_counter()
            rs = run_transfer(a, cluster)
            modes = list(rs[0]["results"])
            merged = {m: {"times": [max(r["results"][m]["times"][i] for r in rs) for i in range(a.reps)],
                          "bytes": [sum(r["results"][m]["bytes"][i] for r in rs) for i in range(a.reps)],
                          "counted": [sum(r["results"][m]["counted"][i] for r in rs)
                                      for i in range(len(rs[0]["results"][m]["counted"]))],
                          "delivery": rs[0]["results"][m]["delivery"]}
                      for m in modes}
            nb = rs[0]["network_bytes"]
            _report(f"\n(b) jreshard.transfer: 4 JAX processes x 2 devices (one per node, gloo), "
                    f"{len(_transfer_shapes(a))} float32 leaves of 1024x1024 FSDP over nodes 0-1 -> replicated on "
                    f"nodes 2-3; bit-exact: {all(r['exact'] for r in rs)} ({time.perf_counter() - t0:.0f} s)",
                    merged, {"never": nb}, pred["b"] if pred else None, cluster is not None)
            if rs[0].get("auto"):
                print(f"  jreshard.transfer(hierarchical='auto') took: {rs[0]['auto']} delivery")
        print(_load())
    finally:
        if cluster is not None:
            cluster.down()


if __name__ == "__main__":
    main()
