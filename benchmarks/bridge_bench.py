"""Benchmark: the bridge vs gather-then-broadcast vs raw point-to-point gloo, side by side in one run.

Setup: 2 JAX trainer processes (2 simulated CPU devices each, FSDP over 4) and 2 torch
inference ranks (TP2, vLLM-style fused qkv/gate_up, padded vocabulary), all on 127.0.0.1
over gloo. The weights are float32 in JAX and bfloat16 on the inference ranks.

  bridge     over gloo (transport="gloo"): bridge.trainer.sender.Sender -> bridge.Receiver (DLPack
             export, XLA cast/transpose, contiguous pieces sent and received in place, the rest
             packed; lengths checked (sender, votes, the transport's framing), no digests; atomic
             commit by copy on the receivers). The rows below but shm run over gloo too
  shm        the defaults (transport="auto", which picks shared memory here: every rank is on
             this host): the same, with the trainers copying each piece straight into the
             receivers' held bytes (bridge.wire.shm), only credits and headers over gloo
  memcopy    one memory copy of the bytes the receivers need: each receiver copies as many bytes
             as it receives, once, between two preallocated buffers (the trainers do nothing)
  swap       the same with Receiver(swap=True): the atomic commit swaps storage (no copy), so
             what is left over the floor is the protocol itself (votes, buckets, staging)
  atomic=False the same with Receiver(atomic=False): received in place, no shadow, no commit
             (a failed sync leaves mixed weights): the atomic commit's cost, beside swap's
  checksum   the bridge over gloo with Sender(checksum=True): an xxh3 digest of every piece, sent
             after each message and checked by the receivers; its cost is this row's time over
             the bridge over gloo
  shm, checksum the defaults (shm) with Sender(checksum=True): the digests travel over gloo
             after each message; its cost is this row's time over the defaults'
  gather     what RL stacks do today: per tensor, gather the full tensor on trainer 0
             (a jitted all-gather to a replicated sharding), cast to bfloat16, broadcast it to
             every inference rank, each rank slicing its TP part
  raw p2p    gloo batch_isend_irecv of preallocated contiguous buffers with exactly the
             bridge's bytes per (sender, receiver) pair: the transport's ceiling (the buffers
             are written once before, so a send reads real pages, not the kernel's zero page)
  raw, buckets the same bytes in the bridge's buckets: one batch per bucket, one bucket at
             a time (what bounding the staging memory costs the transport)
  floor      the work the layout forces on any sync into these targets, without the bridge:
             each trainer casts and transposes with XLA the shards the bridge does, and copies
             as many bytes as the bridge must pack (pieces not contiguous in its shards), then
             the raw p2p, then each receiver copies as many bytes as the bridge must unpack
             (pieces not contiguous in its targets). Contiguous copies, in sequence, no
             protocol, no staging: what the layout costs on this machine, whoever does it
  floor with the layout's copies
             the floor with the real copies instead of contiguous ones of as many bytes: the
             same pieces the bridge packs and unpacks, addressed as it addresses them
             (BridgePlan.segments / segment_pieces, src_region, param_box, view_of), copied
             strided from and to preallocated tensors of the real shapes (the shards as the
             bridge reads them: transposed by XLA in the param dtype, or as they are, the copy
             casting; the params), views built beforehand; in sequence, no protocol, no
             staging. Each rank prints the bytes it copies beside those of the floor's copy
  floor with an atomic commit
             the floor where each receiver copies every byte it received once (one contiguous
             copy of as many bytes), not only those not contiguous in its params: the least an
             atomic commit by copy (the default Receiver's) adds to the floor, whoever does it
  pipeline without the protocol
             the default Sender's own packing (DLPack, XLA, copies) and the default Receiver's own
             held bytes and commit, in the bridge's buckets (two staging buffers per trainer, every
             receive posted at once), each bucket's segments posted straight to the gloo process
             group once the bucket before was sent: no handshake, votes, alarm, waiting thread,
             counts or checks. The bridge's time over it is what its protocol costs; its time over
             the floor with an atomic commit, what the bridge's own copies and pipelining cost

With ``--hierarchical`` it runs instead 2 trainer processes and 2 "nodes" of 2 inference ranks
(ranks 2, 3 and 4, 5; TP1, four replicas, two per node) and times the bridge with
``hierarchical="never"`` (every rank fed by the trainers) and ``"always"`` (each node receives every
byte once, then its two ranks exchange halves), side by side, with the bytes that crossed into
nodes as the executors counted them and the plans' figures. Here every link is the same loopback,
so the time shows the cost of the second stage, not a network's saving
(benchmarks/cluster_bench.py runs the same on shaped links).

Every run also prints where each rank's bridge time goes (``Sender.last_stats`` / ``Receiver.last_stats`` of
the last repetition: packing, votes, posting, waiting, checksums, unpacking, the commit) and, but
with ``--hierarchical``, where the two floors' time goes (medians over the repetitions per rank:
the trainers' relayout, pack copies and raw p2p; the receivers' raw p2p, which includes waiting for
the trainers, and unpack copies) and the CPU time each row takes per rank (``time.process_time``:
every thread of the process; ``time.thread_time``: the thread that calls it), in all beside the wall
time times the cores, and the share of the cores' time the hypervisor gave to other machines
meanwhile (steal: on a virtual machine it stretches every row's time, not their CPU time).

Usage: python benchmarks/bridge_bench.py [--layers 8 --hidden 1024 --reps 5 --bucket-mb 16 --plain --profile
                                          --hierarchical]
Prints medians, ratios (the bridge's to the floor and to the floor with the layout's copies), the
machine and the versions. Goals: bridge >= 2x gather, >= 70% of raw, <= 1.25x the floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import bridge_report  # noqa: E402 (beside this script)

from tests._procs import free_ports  # noqa: E402 (the repository root is on the path)

TRAINERS, RECEIVERS, WORLD = (0, 1), (2, 3), 4
NODES = ((2, 3), (4, 5))  # --hierarchical: two nodes of two inference ranks, one replica each


def _config(args):
    from jreshard.nn import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       num_key_value_heads=max(1, args.hidden // 128), head_dim=64, name="bench")


def _plans(args):
    """The plans a run times: {"bridge": plan}, or with --hierarchical {"never": plan, "always": plan}."""
    import bridge
    from jreshard.nn import fsdp_spec, param_shapes

    cfg = _config(args)
    src = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", TRAINERS, 2), fsdp_spec)
    if args.hierarchical:
        replicas = [[r] for node in NODES for r in node]
        pm = bridge.llama_param_map(cfg, src, replicas, fused=True, dtype="bfloat16")
        return cfg, src, {m: bridge.BridgePlan(src, pm, bucket_bytes=args.bucket_mb << 20, hierarchical=m,
                                               domains=NODES) for m in ("never", "always")}
    if args.plain:
        # Same bytes per rank, no layout transform: float32 kept, kernels not transposed (the torch
        # side then holds [in, out] slices). Isolates the bridge's transport and pipeline overhead.
        rules = [dataclasses.replace(r, transpose=False, dim=1 - r.dim if r.transpose and r.dim is not None
                                     else r.dim) for r in bridge.llama_rules(cfg, fused=True)]
        param_map = bridge.tp_param_map(src, rules, list(RECEIVERS), dtype="float32")
    else:
        param_map = bridge.llama_param_map(cfg, src, list(RECEIVERS), fused=True, dtype="bfloat16")
    return cfg, src, {"bridge": bridge.BridgePlan(src, param_map, bucket_bytes=args.bucket_mb << 20)}


def _timed(fn, profile: bool = False) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(fn)
        print(f"PROFILE rank {dist.get_rank()}", flush=True)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    else:
        fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _layout_copies(plan, rank: int) -> list[tuple[Any, Any]]:
    """The copies the layout forces on ``rank``, addressed as the bridge addresses them: (dst, src) views.

    A trainer packs every piece of its segments that are not contiguous in its (cast,
    transposed) shards (``Segment.src_direct``) from a tensor of the shard's real shape, in
    torch dim order, into a buffer at the piece's offset in its message (a transposed shard is
    XLA's output, in the param dtype; any other is read as it is and cast by the copy, as
    ``bridge.trainer.sender`` does). A receiver unpacks every piece of its segments that are not
    contiguous in its params (``Segment.dst_direct``) from such a buffer into its block of a
    tensor of the param's shape (``BridgePlan.param_box`` of the param seen as
    ``BridgePlan.view_of``), as ``bridge.wire.receiver`` does. Every tensor is preallocated here and
    every view built here, so a timed run is the strided ``copy_`` calls alone.
    """
    import torch

    send = rank in plan.source.ranks
    msgs = [m for m in plan.messages if rank == (m.src if send else m.dst)]
    buf = torch.zeros(sum(m.nbytes for m in msgs), dtype=torch.uint8)
    tensors: dict[Any, Any] = {}  # trainer: shards by (leaf, source id, perm, dtype); receiver: params by name
    pairs, base = [], 0
    for m in msgs:
        for seg, members in zip(plan.segments(m), plan.segment_pieces(m), strict=True):
            if seg.src_direct if send else seg.dst_direct:
                continue  # sent from its shard or received into its param as it is: no copy
            for i, off in members:
                t = plan.moves[i]
                wire = getattr(torch, plan.param(t.param, t.dst).dtype)
                if send:
                    perm = plan.dst_region(t)[1]
                    cast = perm != tuple(range(len(perm)))  # XLA casts and transposes it; else copy_ casts
                    layout = plan.source.layout(t.leaf)
                    shard = layout.shard_box(t.src)
                    key = (t.leaf, t.src, perm, cast)
                    if key not in tensors:
                        tensors[key] = torch.zeros([shard[p].stop - shard[p].start for p in perm],
                                                   dtype=wire if cast else getattr(torch, layout.dtype))
                    region = plan.src_region(t)
                    src = tensors[key][tuple(region[p] for p in perm)]
                    pairs.append((buf[base + off:base + off + t.nbytes].view(wire).view(src.shape), src))
                else:
                    if t.param not in tensors:
                        p = plan.param(t.param, rank)
                        tensors[t.param] = torch.zeros(p.shape, dtype=wire)
                    dst = tensors[t.param].view(plan.view_of(t, rank))[plan.param_box(t, rank)]
                    pairs.append((dst, buf[base + off:base + off + t.nbytes].view(wire).view(dst.shape)))
        base += m.nbytes
    return pairs


def _copy_all(pairs: list[tuple[Any, Any]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def worker(args) -> None:
    import itertools

    import numpy as np
    import torch
    import torch.distributed as dist

    import bridge

    rank = args.rank
    cfg, src, plans = _plans(args)
    if args.hierarchical:
        hierarchical_worker(args, src, plans)
        return
    plan = plans["bridge"]
    bridge.init_group(rank, WORLD, port=args.port, timeout=300)
    bcast = dist.new_group([0, *RECEIVERS])
    group = dist.group.WORLD  # the pipeline row posts to it straight
    pairs = sorted({(t.src_rank, t.dst) for t in plan.moves})
    pair_bytes = {p: sum(t.nbytes for t in plan.moves if (t.src_rank, t.dst) == p) for p in pairs}
    # Written once here: a buffer never written would be sent from the kernel's shared zero page (one
    # page, always in cache), a read no real send gets.
    raw = {p: torch.ones(n, dtype=torch.uint8) for p, n in pair_bytes.items() if rank in p}
    # The copies the layout forces, as contiguous copies of as many bytes: the sender packs the
    # pieces not contiguous in its (cast, transposed) shards, the receiver unpacks those not
    # contiguous in its params (BridgePlan.segments tells which).
    segs = [(m, seg) for m in plan.messages if rank in (m.src, m.dst) for seg in plan.segments(m)]
    pack_bytes = sum(seg.stop - seg.start for m, seg in segs if m.src == rank and not seg.src_direct)
    unpack_bytes = sum(seg.stop - seg.start for m, seg in segs if m.dst == rank and not seg.dst_direct)
    forced = [torch.ones(n, dtype=torch.uint8) for n in (pack_bytes or unpack_bytes,) * 2]
    # An atomic commit by copy (the default Receiver) lands every received byte in memory of its own and
    # copies it into the params after the final ack, so it copies all of them, not only the unpacked ones.
    received = sum(m.nbytes for m in plan.messages if m.dst == rank)
    held = [torch.ones(received, dtype=torch.uint8) for _ in range(2)] if received else forced
    # The same copies as the bridge addresses them (strided, from and to tensors of the real shapes).
    real = _layout_copies(plan, rank)
    copies = {"floor": lambda: forced[1].copy_(forced[0]), "copies": lambda: _copy_all(real),
              "afloor": lambda: held[1].copy_(held[0])}
    phases: dict[str, dict[str, list[float]]] = {"floor": {}, "copies": {}, "afloor": {}}  # seconds per phase

    def phase(ref: str, name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        phases[ref].setdefault(name, []).append(time.perf_counter() - t0)

    by_bucket: dict[int, list] = {}  # this rank's messages per bucket
    for m in plan.messages:
        if rank in (m.src, m.dst):
            by_bucket.setdefault(m.bucket, []).append(m)

    def raw_bucketed():
        """The raw p2p in the bridge's buckets: one batch per bucket, one bucket at a time."""
        offs = dict.fromkeys(raw, 0)
        for b in sorted(by_bucket):
            ops = []
            for m in by_bucket[b]:
                p = (m.src, m.dst)
                ops.append(dist.P2POp(dist.isend if m.src == rank else dist.irecv, raw[p][offs[p]:offs[p] + m.nbytes],
                                      m.dst if m.src == rank else m.src))
                offs[p] += m.nbytes
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def raw_p2p():
        ops = [dist.P2POp(dist.isend if s == rank else dist.irecv, buf, d if s == rank else s)
               for (s, d), buf in raw.items()]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()

    if rank in TRAINERS:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        from bridge.trainer.sender import Sender

        mesh, params = _jax_params(args, src)
        sender = Sender(plan, rank=rank, timeout=300)  # the defaults: no digests
        checked = Sender(plan, rank=rank, timeout=300, checksum=True)
        wire = getattr(torch, plan.param_map.params[0].dtype)
        replicate = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))

        def gather():
            for path in src.paths:  # one tensor at a time, as RL stacks do
                full = replicate(params[path])
                if rank == 0:
                    t = torch.from_dlpack(full.addressable_data(0)).to(wire)
                    dist.broadcast(t, src=0, group=bcast)
                else:
                    full.block_until_ready()  # trainer 1 takes part in the all-gather, then idles

        import jax.numpy as jnp

        # The cast+transposes the bridge's sender runs: one per (leaf, source device, permutation).
        layout_work = sorted({(t.leaf, t.src, perm, dtype) for t in plan.moves if t.src_rank == rank
                              for perm, dtype in [(plan.dst_region(t)[1], plan.param(t.param, t.dst).dtype)]
                              if perm != tuple(range(len(perm))) or dtype != src.layout(t.leaf).dtype})
        relayout = jax.jit(lambda x, perm, dtype: jnp.transpose(x.astype(dtype), perm), static_argnums=(1, 2))

        def floor(ref: str = "floor"):
            shards = sender._shards(params)  # this process's single-device shards by (leaf, source id)
            phase(ref, "relayout", lambda: jax.block_until_ready([relayout(shards[(leaf, dev)], perm, dtype)
                                                                   for leaf, dev, perm, dtype in layout_work]))
            phase(ref, "pack", copies[ref])
            phase(ref, "p2p", raw_p2p)

        most = max((sum(m.nbytes for m in plan.sends(rank, b)) for b in range(plan.num_buckets)), default=0)
        staging = [torch.empty(max(most, 1), dtype=torch.uint8) for _ in range(2)]

        def pipeline():
            """The default Sender's own packing, bucket by bucket into two buffers, each bucket posted straight
            to gloo once the one before it was sent: the bridge's pipeline with none of its protocol."""
            shards, cache, done, works = sender._shards(params), {}, set(), []
            for b in range(plan.num_buckets):
                buf, off, sends = staging[b % 2], 0, []
                for m in plan.sends(rank, b):
                    sends += [(m.dst, x) for x in sender._pack(shards, cache, done, m, buf[off:off + m.nbytes])]
                    off += m.nbytes
                for w in works:
                    w.wait()
                works = [group.send([x], dst, 0) for dst, x in sends]
            for w in works:
                w.wait()

        version = itertools.count(1)
        bridges = {"bridge": sender, "shm": sender, "swap": sender, "inplace": sender, "checksum": checked,
                   "shm_checksum": checked}
        runs = {k: (lambda s=s, k=k: s.sync(params, version=next(version), transport=ROUTE.get(k, "gloo")))
                for k, s in bridges.items()}
        runs["memcopy"] = lambda: None
    else:
        mine = plan.param_map.for_rank(rank)
        wire = getattr(torch, mine[0].dtype)

        def zeros() -> dict[str, torch.Tensor]:
            return {p.name: torch.zeros(p.shape, dtype=wire) for p in mine}

        local, swapped, inplace, sliced, piped, shared = zeros(), zeros(), zeros(), zeros(), zeros(), zeros()
        receiver = bridge.Receiver(plan, local, rank=rank, timeout=300)
        # The default Receiver's own held bytes and commit, into params of their own (checked like the others).
        holder = bridge.Receiver(plan, piped, rank=rank, timeout=300)

        def pipeline():
            """Every receive posted at once into the default Receiver's held bytes, then its commit: the bridge's
            pipeline with none of its protocol."""
            side = holder.strategy.begin(torch.device("cpu"))  # a HeldCommit: receives into its held bytes
            works = [group.recv([x], m.src, 0) for m in plan.messages if m.dst == rank
                     for x in side.recv(m, torch.empty(0, dtype=torch.uint8))]
            for w in works:
                w.wait()
            with torch.no_grad():
                holder.strategy.commit()
        # checksum, shm_checksum: the same receivers; the senders send digests, the receivers check them
        held_shm = bridge.Receiver(plan, shared, rank=rank, timeout=300)
        bridges = {"bridge": receiver, "shm": held_shm,
                   "swap": bridge.Receiver(plan, swapped, rank=rank, timeout=300, swap=True),
                   "inplace": bridge.Receiver(plan, inplace, rank=rank, timeout=300, atomic=False),
                   "checksum": receiver, "shm_checksum": held_shm}
        runs = {k: (lambda r=r, k=k: r.sync(transport=ROUTE.get(k, "gloo"))) for k, r in bridges.items()}
        need = sum(m.nbytes for m in plan.messages if m.dst == rank)
        held, into = torch.ones(max(need, 1), dtype=torch.uint8), torch.ones(max(need, 1), dtype=torch.uint8)
        runs["memcopy"] = lambda: into.copy_(held)
        by_leaf: dict[str, list] = {}
        for p in mine:
            for r in p.regions:
                by_leaf.setdefault(r.leaf, []).append((p.name, r))

        def gather():
            for path, layout in src.items():
                full = torch.empty(layout.shape, dtype=wire)
                dist.broadcast(full, src=0, group=bcast)
                for name, r in by_leaf.get(path, []):
                    dst = tuple(slice(o, o + n) for o, n in zip(r.offset, r.shape, strict=True))
                    sliced[name][dst].copy_(full[r.box.slices()].permute(r.transpose))

        def floor(ref: str = "floor"):
            phase(ref, "p2p", raw_p2p)
            phase(ref, "unpack", copies[ref])

    runs.update(gather=gather, raw=raw_p2p, floor=floor, copies=lambda: floor("copies"), rawb=raw_bucketed,
                afloor=lambda: floor("afloor"), pipeline=pipeline)
    call: dict[str, float] = {}  # per row, this rank's seconds in its last call
    cpu: dict[str, list[float]] = {k: [] for k in runs}  # per row, this process's CPU seconds (all its threads)
    main_cpu: dict[str, list[float]] = {k: [] for k in runs}  # per row, the CPU seconds of the calling thread

    def clocked(k: str, fn):
        def run():
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            fn()
            call[k] = time.perf_counter() - t0
            cpu[k].append(time.process_time() - c0)
            main_cpu[k].append(time.thread_time() - m0)
        return run

    runs = {k: clocked(k, fn) for k, fn in runs.items()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    stats: dict[str, dict] = {}
    for rep in range(args.reps + 1):
        for k, fn in runs.items():
            t = _timed(fn, args.profile and rep == args.reps and k == "bridge")
            if k in bridges:
                stats[k] = dict(bridge_report.stats_row(bridges[k].last_stats), call=call[k])
            if rep:  # the first repetition warms up (jit compilation, buffers)
                times[k].append(t)
    _print_stats(rank, stats)
    copied = sum(dst.numel() * dst.element_size() for dst, _ in real)
    print("FLOOR " + json.dumps({"rank": rank, "copied": copied, "floor_copied": forced[0].numel(), "copy_runs":
                                 len(real), "phases": {ref: {k: v[1:] for k, v in ph.items()}
                                                       for ref, ph in phases.items()},
                                 "cpu": {k: v[1:] for k, v in cpu.items()},
                                 "main_cpu": {k: v[1:] for k, v in main_cpu.items()}}), flush=True)
    if rank == RECEIVERS[0]:
        same = all(torch.equal(t[n], sliced[n]) for t in (local, shared, swapped, inplace, piped) for n in local)
        shm_bytes = dict(bridges["shm"].last_stats.transport_bytes)
        out = {"times": times, "bridge_equals_gather": same, "network_bytes": plan.network_bytes,
               "recv_bytes": plan.rank_bytes()["recv"], "buckets": plan.num_buckets,
               "model_bytes_f32": sum(4 * int(np.prod(lay.shape)) for _, lay in src.items()),
               "moves": len(plan.moves), "messages": len(plan.messages), "shm_transport_bytes": shm_bytes}
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    if rank in TRAINERS:
        os._exit(0)  # skip the JAX coordination shutdown barrier


ROUTE = {"shm": "auto", "shm_checksum": "auto"}  # the transport of each bridge row (else "gloo")


def _jax_params(args, src):
    """This trainer process's JAX mesh (FSDP over 2 processes x 2 devices) and random float32 params."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jreshard.nn import fsdp_spec

    jax.distributed.initialize(f"127.0.0.1:{args.jax_port}", num_processes=2, process_id=args.rank,
                               initialization_timeout=120)
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices(), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    params = {}
    for path, layout in src.items():
        a = rng.standard_normal(layout.shape, dtype=np.float32)
        params[path] = jax.make_array_from_callback(
            a.shape, NamedSharding(mesh, P(*fsdp_spec(path, a.shape))), lambda idx, a=a: a[idx])
    return mesh, params


def _print_stats(rank: int, stats: dict) -> None:
    print(f"STATS {json.dumps({'rank': rank, 'stats': stats})}", flush=True)


def hierarchical_worker(args, src, plans) -> None:
    """One rank of --hierarchical: the bridge with direct and with two-stage delivery, alternated."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import bridge

    rank, world = args.rank, len(TRAINERS) + sum(len(n) for n in NODES)
    bridge.init_group(rank, world, port=args.port, timeout=300)
    times: dict[str, list[float]] = {m: [] for m in plans}
    if rank in TRAINERS:
        from bridge.trainer.sender import Sender

        _, params = _jax_params(args, src)
        senders = {m: Sender(p, rank=rank, timeout=300) for m, p in plans.items()}
        run = {m: (lambda s=s: s.sync(params, version=1)) for m, s in senders.items()}
        synced: dict = senders
    else:
        mine = plans["never"].param_map.for_rank(rank)
        local = {p.name: torch.zeros(p.shape, dtype=getattr(torch, p.dtype)) for p in mine}
        receivers = {m: bridge.Receiver(p, local, rank=rank, timeout=300) for m, p in plans.items()}
        run = {m: r.sync for m, r in receivers.items()}
        synced = receivers
    same = True
    for rep in range(args.reps + 1):
        for m in plans:
            t = _timed(run[m])
            if rep:
                times[m].append(t)
            if rank not in TRAINERS:
                if m == "never":
                    direct = {k: v.clone() for k, v in local.items()}
                else:
                    same = same and all(torch.equal(direct[k], local[k]) for k in local)
    _print_stats(rank, {m: bridge_report.stats_row(x.last_stats) for m, x in synced.items()})
    if rank == NODES[0][0]:
        out = {"times": times, "same": same, "network_bytes": {m: p.network_bytes for m, p in plans.items()},
               "cross_plan": {m: p.cross_domain_bytes for m, p in plans.items()},
               "buckets": {m: p.num_buckets for m, p in plans.items()},
               "model_bytes_f32": sum(4 * int(np.prod(lay.shape)) for _, lay in src.items())}
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    if rank in TRAINERS:
        os._exit(0)



def run_ranks(script: str, world: int, argv: list[str], env: dict[str, str],
              timeout: float) -> tuple[list[str], dict[str, Any]]:
    """Runs ``script --rank=r *argv`` for every rank, each in its own session (killed if it outlives
    ``timeout``); returns every rank's output and the first ``RESULT {json}`` line any rank printed."""
    procs = [subprocess.Popen([sys.executable, script, f"--rank={r}", *argv], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(world)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    lines = [line for o in outputs for line in o.splitlines() if line.startswith("RESULT ")]
    if not lines:
        print("\n".join(o[-3000:] for o in outputs))
        raise SystemExit("benchmark failed: no result")
    return outputs, json.loads(lines[0][len("RESULT "):])


def main() -> None:
    if "--fp8" in sys.argv[1:]:
        # FP8 has a benchmark of its own (FP8, bfloat16 and "bfloat16, then quantize" side by side);
        # --fp8 runs it with the other arguments (--layers, --hidden, --vocab, --reps, --bucket-mb, --block).
        fp8_bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bridge_bench_fp8.py")
        argv = [a for a in sys.argv[1:] if a != "--fp8"]
        sys.exit(subprocess.run([sys.executable, fp8_bench, *argv], check=False).returncode)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp8", action="store_true",
                    help="run benchmarks/bridge_bench_fp8.py instead: FP8 vs bfloat16 delivery vs quantizing on the "
                         "inference side")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--plain", action="store_true",
                    help="float32 without transposes: the same boxes with no cast or transpose")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--jax-port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the last bridge sync per rank")
    ap.add_argument("--hierarchical", action="store_true",
                    help="2 nodes x 2 inference ranks (TP1 replicas): direct vs two-stage delivery")
    args = ap.parse_args()
    if args.rank >= 0:
        worker(args)
        return
    port, jport = free_ports(2)
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONUNBUFFERED="1")
    common = [f"--layers={args.layers}", f"--hidden={args.hidden}", f"--vocab={args.vocab}",
              f"--reps={args.reps}", f"--bucket-mb={args.bucket_mb}", *(["--profile"] if args.profile else []),
              *(["--plain"] if args.plain else []), *(["--hierarchical"] if args.hierarchical else []),
              f"--port={port}", f"--jax-port={jport}"]
    world = len(TRAINERS) + (sum(len(n) for n in NODES) if args.hierarchical else len(RECEIVERS))
    import psutil

    cpu0 = psutil.cpu_times()
    outputs, res = run_ranks(__file__, world, common, env, args.timeout)
    cpu1 = psutil.cpu_times()
    if args.profile:
        for o in outputs:
            i = o.find("PROFILE")
            if i >= 0:
                print(o[i:o.find("RESULT") if "RESULT" in o[i:] else None][:4000])
    stats = bridge_report.tagged(outputs, "STATS")
    bridge_report.header()
    print(bridge_report.steal(cpu0, cpu1))
    if args.hierarchical:
        bridge_report.report_hierarchical(args, _config(args), NODES, res, stats)
    else:
        bridge_report.report(args, _config(args), res)
    bridge_report.breakdown(stats)
    if not args.hierarchical:
        bridge_report.floor_breakdown(bridge_report.tagged(outputs, "FLOOR"))
        bridge_report.cpu(bridge_report.tagged(outputs, "FLOOR"), res)


if __name__ == "__main__":
    main()
