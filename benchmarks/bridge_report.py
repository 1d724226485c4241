"""What benchmarks/bridge_bench.py prints: the machine, every row's medians and ratios, where each rank's
time went (the bridge's steps, the floors' phases) and the CPU time of every row."""

from __future__ import annotations

import json
import os
import platform
import statistics

__all__ = ["steal", "tagged", "header", "stats_row", "breakdown", "report_hierarchical", "report", "floor_breakdown",
           "cpu"]


def steal(before, after) -> str:
    """How much of the cores' time the hypervisor gave to other machines between two ``psutil.cpu_times()``
    (a virtual machine's 'steal': the runs' times stretch by it, their CPU times do not)."""
    if not hasattr(before, "steal"):
        return "steal time unknown (not reported on this system)"
    d = {f: getattr(after, f) - getattr(before, f) for f in before._fields}
    total = sum(d.values()) - d.get("guest", 0) - d.get("guest_nice", 0)  # guest time is counted in user too
    return f"steal time during the run: {100 * d['steal'] / max(total, 1e-9):.0f}% of the cores' time"


def tagged(outputs: list[str], tag: str) -> list[dict]:
    """The JSON of every ``TAG {json}`` line the ranks printed."""
    return [json.loads(line[len(tag) + 1:]) for o in outputs for line in o.splitlines() if line.startswith(tag + " ")]


def header() -> None:
    import jax
    import numpy as np
    import torch

    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
          f"{platform.system()} {platform.release()}, python {platform.python_version()}")
    print(f"versions: jax {jax.__version__}, torch {torch.__version__}, numpy {np.__version__}, backend gloo 127.0.0.1")


STEPS = ("handshake", "pack", "vote", "post", "wait", "check", "unpack", "commit")


def stats_row(s) -> dict:
    """A Sender's or Receiver's ``last_stats`` (``ExecutionStats``) as the JSON a rank prints: seconds per step,
    the sync's seconds and its byte counts."""
    return {**s.step_seconds, "seconds": s.seconds, "sent": s.sent_bytes, "received": s.received_bytes,
            "cross_domain_sent": s.cross_domain_sent_bytes, "cross_domain_received": s.cross_domain_received_bytes}


def breakdown(stats: list[dict]) -> None:
    """Where each rank's time went in its last bridge sync (``stats_row`` of Sender/Receiver ``last_stats``)."""
    print("where the time goes, last repetition, ms per rank (pack: casting, packing and receive set-up; "
          "vote: all_gathers incl. digests of sent pieces; post: posting sends and receives; wait: waiting for the "
          "wire; check: digests of received pieces; commit: shadow -> params; total: the protocol, without the "
          "commit; outside: the rest of the sync call, e.g. the sender's shard look-up, the receiver's staging):")
    for row in sorted(stats, key=lambda r: r["rank"]):
        for what, st in sorted(row["stats"].items()):
            cells = "  ".join(f"{k} {st.get(k, 0.0) * 1e3:7.1f}" for k in STEPS)
            if "call" in st:
                cells += f"  outside {(st['call'] - st['seconds'] - st.get('commit', 0.0)) * 1e3:7.1f}"
            print(f"  rank {row['rank']} {what:<8} total {st['seconds'] * 1e3:7.1f}  {cells}  "
                  f"(cross-node sent {st['cross_domain_sent'] / 1e6:.1f} MB, received "
                  f"{st['cross_domain_received'] / 1e6:.1f} MB)")


def report_hierarchical(args, cfg, nodes, res, stats: list[dict]) -> None:
    """The --hierarchical run: direct against two-stage delivery, time and bytes into nodes."""
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}: "
          f"{res['model_bytes_f32'] / 1e6:.1f} MB float32 in JAX")
    print(f"sync: FSDP4 over 2 trainer processes -> 4 TP1 replicas (bfloat16, fused) on nodes {list(nodes)}; "
          f"two-stage result == direct result: {res['same']}")
    print(f"repetitions: {args.reps} (after one warm-up), medians:")
    for m, label in (("never", "direct (hierarchical='never')"), ("always", "two stages ('always')")):
        ts = res["times"][m]
        counted = sum(row["stats"][m]["cross_domain_sent"] for row in stats)
        print(f"  {label:<32} {med[m] * 1e3:9.1f} ms  (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f}); "
              f"{res['network_bytes'][m] / 1e6:.1f} MB sent in all, into nodes {counted / 1e6:.1f} MB as the "
              f"executors counted, {res['cross_plan'][m] / 1e6:.1f} MB in the plan; {res['buckets'][m]} buckets")
    print(f"two stages / direct: time {med['always'] / med['never']:.2f}, bytes into nodes "
          f"{res['cross_plan']['always'] / res['cross_plan']['never']:.2f}")


def report(args, cfg, res) -> None:
    """Every row's median time and the ratios the goals are about."""
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    nbytes = res["network_bytes"]
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
          f"vocab {cfg.vocab_size}: {res['model_bytes_f32'] / 1e6:.1f} MB float32 in JAX")
    kind = ("float32, kernels not transposed (--plain)" if args.plain
            else "bfloat16, kernels transposed to torch [out, in]")
    print(f"sync: FSDP4 over 2 trainer processes -> TP2 (fused, padded vocab) on 2 inference ranks, {kind}; "
          f"{nbytes / 1e6:.1f} MB on the wire, {res['buckets']} buckets of {args.bucket_mb} MiB, "
          f"{res['moves']} boxes in {res['messages']} messages; bridge result == gather result: "
          f"{res['bridge_equals_gather']}")
    print(f"repetitions: {args.reps} (after one warm-up), medians:")
    for k, label in (("bridge", "bridge over gloo"), ("shm", "bridge over shm (defaults)"),
                     ("memcopy", "one copy of the received bytes"), ("swap", "bridge, swap=True"),
                     ("inplace", "bridge, atomic=False"), ("checksum", "bridge over gloo, checksum=True"),
                     ("shm_checksum", "bridge over shm, checksum=True"),
                     ("gather", "gather-then-broadcast"),
                     ("raw", "raw p2p, same bytes"), ("floor", "floor: layout work + raw"),
                     ("copies", "floor with the layout's copies"), ("afloor", "floor with an atomic commit"),
                     ("pipeline", "pipeline without the protocol"), ("rawb", "raw p2p in the bridge's buckets")):
        ts = res["times"][k]
        print(f"  {label:<32} {med[k] * 1e3:9.1f} ms   {nbytes / med[k] / 1e9:6.2f} GB/s of bridge bytes   "
              f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})")
    print(f"shared memory (transport='auto', bytes per route on a receiver: {res['shm_transport_bytes']}): "
          f"shm time / gloo time = {med['shm'] / med['bridge']:.2f} (goal <= 0.6); shm time / one memory copy of "
          f"the bytes the receivers need = {med['shm'] / med['memcopy']:.2f} (goal <= 1.3)")
    print(f"speed-up over gather-then-broadcast: {med['gather'] / med['bridge']:.2f}x over gloo, "
          f"{med['gather'] / med['shm']:.2f}x over shm (goal >= 2x)")
    print(f"fraction of raw p2p bandwidth:       {med['raw'] / med['bridge'] * 100:.0f}% (goal >= 70%); "
          f"with swap=True {med['raw'] / med['swap'] * 100:.0f}%")
    print(f"raw p2p in the bridge's buckets: {med['raw'] / med['rawb'] * 100:.0f}% of raw p2p in one batch")
    print(f"floor (the layout work, then raw p2p, in sequence): {med['raw'] / med['floor'] * 100:.0f}% of raw p2p; "
          f"bridge time / floor time = {med['bridge'] / med['floor']:.2f} (swap=True {med['swap'] / med['floor']:.2f}, "
          f"checksum=True {med['checksum'] / med['floor']:.2f}; goal <= 1.25)")
    print(f"checksums cost {(med['shm_checksum'] / med['shm'] - 1) * 100:+.1f}% of the sync over shm (the defaults) "
          f"and {(med['checksum'] / med['bridge'] - 1) * 100:+.1f}% over gloo (checksum=True against the same "
          "transport without, medians; goal <= 5%, on by default only at <= 10%)")
    print(f"floor with the layout's copies (the bridge's strided packing and unpacking copies instead of contiguous "
          f"ones): {med['copies'] / med['floor']:.2f}x the floor; bridge time / its time = "
          f"{med['bridge'] / med['copies']:.2f} (swap=True {med['swap'] / med['copies']:.2f}, "
          f"atomic=False {med['inplace'] / med['copies']:.2f})")
    print(f"floor with an atomic commit (each receiver copies every byte it received once, as the default "
          f"Receiver's commit must; the floor copies only those not contiguous in the params): "
          f"{med['afloor'] / med['floor']:.2f}x the floor; bridge (defaults) time / its time = "
          f"{med['bridge'] / med['afloor']:.2f}")
    print(f"pipeline without the protocol (the default Sender's packing and Receiver's held commit, in the bridge's "
          f"buckets, posted straight to gloo: no handshake, votes, alarm or checks): "
          f"{med['pipeline'] / med['floor']:.2f}x the floor, {med['pipeline'] / med['afloor']:.2f}x the floor with an "
          f"atomic commit; bridge (defaults) time / its time = {med['bridge'] / med['pipeline']:.2f}")


def floor_breakdown(rows: list[dict]) -> None:
    """Where each rank's time went in the floor and in the floor with the layout's copies (medians)."""
    print("where the floors' time goes, medians over the repetitions, ms per rank (relayout: XLA's cast+transposes; "
          "pack / unpack: the copies the layout forces; p2p: the raw point-to-point, on the receivers incl. "
          "waiting for the trainers):")
    for row in sorted(rows, key=lambda r: r["rank"]):
        for ref, label in (("floor", "floor"), ("copies", "copies"), ("afloor", "atomic")):
            cells = "  ".join(f"{k} {statistics.median(v) * 1e3:7.1f}" for k, v in row["phases"][ref].items())
            print(f"  rank {row['rank']} {label:<7} {cells}")
        print(f"  rank {row['rank']} copies: {row['copied'] / 1e6:.1f} MB in {row['copy_runs']} strided copies, the "
              f"floor's contiguous copy {row['floor_copied'] / 1e6:.1f} MB: same bytes "
              f"{row['copied'] == row['floor_copied']}")


def cpu(rows: list[dict], res: dict) -> None:
    """CPU time per call of every row, per rank and in all, beside the CPU time the cores could give."""
    rows = sorted(rows, key=lambda r: r["rank"])
    cores = os.cpu_count() or 1
    print(f"CPU time per call (every thread of each process, and in brackets the calling thread's; medians over "
          f"the repetitions), ms: per rank, in all, and the wall time x {cores} cores:")
    for k in rows[0]["cpu"]:
        per = [statistics.median(r["cpu"][k]) * 1e3 for r in rows]
        main = [statistics.median(r["main_cpu"][k]) * 1e3 for r in rows]
        wall = statistics.median(res["times"][k]) * 1e3
        print(f"  {k:<9} " + "  ".join(f"rank {r['rank']} {c:7.1f} ({m:6.1f})" for r, c, m in zip(rows, per, main,
                                                                                                 strict=True))
              + f"   all {sum(per):7.1f}  of {wall * cores:7.1f}")
