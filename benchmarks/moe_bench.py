"""Benchmark of one MoE feed-forward layer moved from expert-parallel training to tensor-parallel inference.

Run: ``.venv/bin/python benchmarks/moe_bench.py`` (2-4 minutes on 2 busy cores), or with
``--small`` for a quick check (a few seconds).

The expert weights of one DeepSeek-V3-style layer, stacked as JAX trainers keep them
(router ``[H, E]``, ``w_gate`` and ``w_up`` ``[E, H, I]``, ``w_down`` ``[E, I, H]``), on 8
simulated CPU devices. Experts are split over ``ep`` and replicated over ``dp`` in
training, as when EP is smaller than the data-parallel world; inference splits every
expert's intermediate dim over ``tp`` and replicates experts over ``dp``.

Cases:
  (a) colocated: EP4 x DP2 on devices 0-7 -> TP2 x DP4 on devices 0-7;
  (b) disjoint: EP2 x DP2 on devices 0-3 -> TP2 x DP2 on devices 4-7.

Methods, side by side in one run, each checked bit for bit once, then timed round-robin
(medians of ``--reps`` after a warm-up):
  - jreshard: ``jreshard.transfer`` with its plan (senders balanced over replicas);
  - flat direct sends: the same pieces, each from its first holder (``jreshard.plan(...,
    balance=False)``: a local copy where the receiver holds the piece, else the lowest
    device id holding it), executed by the same ``jreshard.transfer``;
  - gather-then-broadcast: each full tensor gathered on device 0, put replicated on every
    inference device, then sliced to the target sharding there.

Bytes are per plan: what crosses between devices in all, and the most any one device
sends or receives (on hardware where each device has its own link, that device's time
bounds the sync). On simulated CPU devices every "link" is the same memory bus, so times
follow the total bytes copied rather than the largest sender.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

from transfer_bench import _setup, machine  # a sibling script: run as benchmarks/moe_bench.py

GiB = 1 << 30
MiB = 1 << 20


class Sizes(NamedTuple):
    experts: int
    hidden: int
    inter: int
    dtype: str

    def shapes(self) -> dict[str, tuple[int, ...]]:
        e, h, i = self.experts, self.hidden, self.inter
        return {"router": (h, e), "w_gate": (e, h, i), "w_up": (e, h, i), "w_down": (e, i, h)}


class Case(NamedTuple):
    name: str
    train: str  # description
    serve: str
    train_devices: tuple[int, ...]
    serve_devices: tuple[int, ...]


CASES = {
    "a": Case("a", "EP4 x DP2 on devices 0-7", "TP2 x DP4 on devices 0-7", tuple(range(8)), tuple(range(8))),
    "b": Case("b", "EP2 x DP2 on devices 0-3", "TP2 x DP2 on devices 4-7", (0, 1, 2, 3), (4, 5, 6, 7)),
}


class Traffic(NamedTuple):
    """Bytes of one method: in all across devices, and the most one device sends or receives."""

    network: int
    max_send: int
    max_recv: int

    @classmethod
    def of(cls, send: dict[int, int], recv: dict[int, int]) -> Traffic:
        return cls(sum(send.values()), max(send.values(), default=0), max(recv.values(), default=0))


def shardings(case: Case, sizes: Sizes):
    """Training and inference NamedShardings per tensor."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    devs = np.array(jax.devices())
    n_train, n_serve = len(case.train_devices), len(case.serve_devices)
    train = jax.sharding.Mesh(devs[list(case.train_devices)].reshape(2, n_train // 2), ("dp", "ep"))
    serve = jax.sharding.Mesh(devs[list(case.serve_devices)].reshape(n_serve // 2, 2), ("dp", "tp"))
    src = {k: NamedSharding(train, P() if k == "router" else P("ep")) for k in sizes.shapes()}
    dst = {"router": NamedSharding(serve, P()), "w_gate": NamedSharding(serve, P(None, None, "tp")),
           "w_up": NamedSharding(serve, P(None, None, "tp")), "w_down": NamedSharding(serve, P(None, "tp", None))}
    return src, dst, serve


def gather_broadcast_traffic(params, serve_devices: tuple[int, ...], root: int) -> Traffic:
    """Every tensor gathered on ``root`` from its first holders, then sent whole to each inference device."""
    send: dict[int, int] = {}
    recv: dict[int, int] = {}
    for x in params.values():
        seen: set = set()
        for shard in x.addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index)
            if key in seen:
                continue
            seen.add(key)
            dev = shard.device.id
            if dev != root:
                send[dev] = send.get(dev, 0) + shard.data.nbytes
                recv[root] = recv.get(root, 0) + shard.data.nbytes
        for dev in serve_devices:
            if dev != root:
                send[root] = send.get(root, 0) + x.nbytes
                recv[dev] = recv.get(dev, 0) + x.nbytes
    return Traffic.of(send, recv)


def run_case(case: Case, sizes: Sizes, reps: int, transports: list[str]) -> None:
    import jax
    import ml_dtypes
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    import jreshard

    src, dst, serve = shardings(case, sizes)
    rng = np.random.default_rng(0)
    dt = np.dtype(ml_dtypes.bfloat16) if sizes.dtype == "bfloat16" else np.dtype(sizes.dtype)
    hosts = {k: rng.integers(0, 256, size=int(np.prod(s)) * dt.itemsize, dtype=np.uint8).view(dt).reshape(s)
             for k, s in sizes.shapes().items()}
    params = {k: jax.device_put(h, src[k]) for k, h in hosts.items()}
    total = sum(x.nbytes for x in params.values())
    balanced = jreshard.plan(params, dst)
    flat = jreshard.plan(params, dst, balance=False)
    traffic = {}
    for label, plan in (("jreshard", balanced), ("flat direct sends", flat)):
        plan.check()
        s = plan.stats()
        traffic[label] = Traffic(s.network_bytes, s.max_send_bytes, s.max_recv_bytes)
    root = case.train_devices[0]
    traffic["gather-then-broadcast"] = gather_broadcast_traffic(params, case.serve_devices, root)
    lower = balanced.stats().lower_bound_bytes

    print(f"\ncase ({case.name}): {case.train} -> {case.serve}; {len(params)} tensors, {total / MiB:.0f} MiB "
          f"{sizes.dtype} (E={sizes.experts}, H={sizes.hidden}, I={sizes.inter}); lower bound {lower / MiB:.0f} MiB")

    methods = {}
    for tr in transports:
        suffix = "" if tr == "auto" else f" ({tr})"
        methods[f"jreshard{suffix}"] = (
            "jreshard", lambda tr=tr: jreshard.transfer(params, dst, plan=balanced, transport=tr))
        methods[f"flat direct sends{suffix}"] = (
            "flat direct sends", lambda tr=tr: jreshard.transfer(params, dst, plan=flat, transport=tr))
    gather_to = SingleDeviceSharding(jax.devices()[root])
    replicated = jax.sharding.NamedSharding(serve, jax.sharding.PartitionSpec())
    slicers = {k: jax.jit(lambda y: y, out_shardings=dst[k]) for k in params}

    def gather_broadcast():
        out = {}
        for k, x in params.items():
            full = jax.device_put(jax.device_put(x, gather_to), replicated)
            out[k] = slicers[k](full)
        return out

    methods["gather-then-broadcast"] = ("gather-then-broadcast", gather_broadcast)

    for name, (_, fn) in methods.items():  # checks once; this also compiles
        out = fn()
        for k, x in out.items():
            assert x.sharding == dst[k], f"{name}: {k} has sharding {x.sharding}"
            for shard in x.addressable_shards:
                same = np.array_equal(np.asarray(shard.data).view(np.uint8), hosts[k][shard.index].view(np.uint8))
                assert same, f"{name}: {k} differs on {shard.device}"
        del out
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(reps):
        for name, (_, fn) in methods.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)

    ref_time = statistics.median(times["jreshard"])
    ref = traffic["jreshard"]
    print(f"  {'method':<32} {'median ms':>9} {'x time':>7} {'network MiB':>11} {'max send MiB':>12} "
          f"{'x max send':>10} {'max recv MiB':>12}   runs (ms)")
    for name, (kind, _) in methods.items():
        med, t = statistics.median(times[name]), traffic[kind]
        print(f"  {name:<32} {med * 1e3:9.1f} {med / ref_time:7.2f} {t.network / MiB:11.1f} "
              f"{t.max_send / MiB:12.1f} {t.max_send / ref.max_send:10.2f} {t.max_recv / MiB:12.1f}   "
              f"{', '.join(f'{x * 1e3:.0f}' for x in times[name])}")
    fl, gb = traffic["flat direct sends"], traffic["gather-then-broadcast"]
    print(f"  ratios to jreshard, case ({case.name}): network bytes: flat {fl.network / ref.network:.2f}x, "
          f"gather-then-broadcast {gb.network / ref.network:.2f}x; largest sender: flat "
          f"{fl.max_send / ref.max_send:.2f}x, gather-then-broadcast {gb.max_send / ref.max_send:.2f}x; "
          f"time: flat {statistics.median(times['flat direct sends']) / ref_time:.2f}x, "
          f"gather-then-broadcast {statistics.median(times['gather-then-broadcast']) / ref_time:.2f}x")
    jreshard.release_transfer_buffers()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a quick run: E=16, H=256, I=128")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default="ab")
    ap.add_argument("--transports", default="auto,collective",
                    help="comma-separated transports for jreshard and flat direct sends")
    args = ap.parse_args()
    if args.small:
        args.experts, args.hidden, args.inter, args.reps = 16, 256, 128, 3
    _setup(8)
    sizes = Sizes(args.experts, args.hidden, args.inter, args.dtype)
    print("jreshard MoE layer benchmark")
    print("machine:", machine())
    for key in args.cases:
        run_case(CASES[key], sizes, args.reps, args.transports.split(","))


if __name__ == "__main__":
    main()
