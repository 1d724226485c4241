"""Benchmark: FP8 delivery vs bfloat16 delivery vs "send bfloat16, quantize on the inference side", in one run.

Setup (as benchmarks/bridge_bench.py): 2 JAX trainer processes (2 simulated CPU devices
each, FSDP over 4; float32 weights) and 2 torch inference ranks (TP2, vLLM-style fused
qkv/gate_up, padded vocabulary), all on 127.0.0.1 over gloo. Block-scaled FP8
(e4m3fn, 128 x 128 blocks by default) for every linear layer; embeddings, lm_head and
norms in bfloat16 in every mode.

  fp8        the trainers quantize where their shards are (bridge.trainer.fp8.quantize_params:
             partial amax exchanged for the blocks FSDP cuts), then Sender.sync of FP8 weights
             and float32 scales; the receivers hold torch.float8_e4m3fn weights
  bf16       Sender.sync of the same weights cast to bfloat16 (the bridge's default delivery)
  bf16+q     the bf16 sync, then each inference rank quantizes its own bfloat16 shards to FP8
             with torch (its TP shards hold whole blocks, as vLLM requires), as inference stacks
             that quantize online at weight loading do
  quantize   the trainers' quantization alone (part of fp8)

Every time is the slowest rank's, median of --reps after one warm-up. Bytes are counted
by the receivers (what their receives posted), next to the plan's.

Usage: python benchmarks/bridge_bench_fp8.py [--layers 8 --hidden 1024 --vocab 32000 --reps 5 --block 128x128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bridge_bench import RECEIVERS, TRAINERS, WORLD, _config, _timed, run_ranks  # noqa: E402

from tests._procs import free_ports  # noqa: E402 (bridge_bench put the repository root on the path)

MODES = ("fp8", "bf16", "bf16+q", "quantize")


def _plans(args):
    import bridge
    from jreshard.core.fp8 import Fp8Format
    from jreshard.nn import fsdp_spec, param_shapes

    cfg = _config(args)
    src = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", TRAINERS, 2), fsdp_spec)
    pm = bridge.llama_param_map(cfg, src, list(RECEIVERS), fused=True, dtype="bfloat16")
    fp8 = bridge.fp8_param_map(src, pm, Fp8Format(block=args.block))
    bucket = args.bucket_mb << 20
    return cfg, fp8, bridge.BridgePlan(fp8.source, fp8.param_map, bucket_bytes=bucket), \
        bridge.BridgePlan(src, pm, bucket_bytes=bucket)


def torch_quantize(w, block: tuple[int, int]):
    """One rank's ``[out, in]`` weight to FP8 and float32 scale_inv, per block (vLLM's per_block_cast_to_fp8)."""
    import torch

    bn, bk = block
    out, inn = w.shape
    x = torch.nn.functional.pad(w.float(), (0, -inn % bk, 0, -out % bn))
    blocks = x.view(x.shape[0] // bn, bn, x.shape[1] // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    scale = amax / 448.0
    q = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn).view(x.shape)[:out, :inn]
    return q, scale.view(scale.shape[0], scale.shape[2])


def trainer(args, rank: int, fp8, fp8_plan, bf16_plan, cfg) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bridge.trainer.fp8 import quantize_params
    from bridge.trainer.sender import Sender
    from jreshard import nn as jnn
    from jreshard.nn import fsdp_spec, param_shapes

    jax.distributed.initialize(f"127.0.0.1:{args.jax_port}", num_processes=2, process_id=rank,
                               initialization_timeout=300)
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices(), axis_types=(jax.sharding.AxisType.Auto,))
    nested: dict = {}
    for p, s in param_shapes(cfg).items():
        node = nested
        *head, last = p.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = NamedSharding(mesh, P(*fsdp_spec(p, s)))
    params = jax.jit(lambda key: jnn.init_params(cfg, key), out_shardings=nested)(jax.random.key(0))
    s_fp8, s_bf16 = Sender(fp8_plan, rank=rank, timeout=600), Sender(bf16_plan, rank=rank, timeout=600)
    version = iter(range(1, 10_000))
    return {
        "fp8": lambda: s_fp8.sync(quantize_params(params, fp8), version=next(version)),
        "bf16": lambda: s_bf16.sync(params, version=next(version)),
        "bf16+q": lambda: s_bf16.sync(params, version=next(version)),
        "quantize": lambda: jax.block_until_ready(quantize_params(params, fp8)),
    }


def receiver(args, rank: int, fp8, fp8_plan, bf16_plan, counts: dict) -> dict:
    import torch

    import bridge

    held = {p.name: torch.zeros(p.shape, dtype=getattr(torch, p.dtype)) for p in fp8.param_map.for_rank(rank)}
    bf16 = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16) for p in bf16_plan.param_map.for_rank(rank)}
    r_fp8, r_bf16 = bridge.Receiver(fp8_plan, held, rank=rank, timeout=600), \
        bridge.Receiver(bf16_plan, bf16, rank=rank, timeout=600)
    online = {n: None for n in fp8.weights}

    def bf16_then_quantize():
        sync(r_bf16, "bf16+q")
        for n in online:
            online[n] = torch_quantize(bf16[n], args.block)

    def sync(rec, mode):
        rec.sync()
        counts[mode] = rec.last_stats.received_bytes  # the bytes its receives posted

    state = {"held": held, "online": online}
    return {"fp8": lambda: sync(r_fp8, "fp8"), "bf16": lambda: sync(r_bf16, "bf16"), "bf16+q": bf16_then_quantize,
            "quantize": lambda: None, "_state": lambda: state}


def worker(args) -> None:
    import numpy as np
    import torch

    import bridge

    rank = args.rank
    cfg, fp8, fp8_plan, bf16_plan = _plans(args)
    counts: dict[str, int] = {}
    if rank in TRAINERS:
        fns = trainer(args, rank, fp8, fp8_plan, bf16_plan, cfg)
        bridge.init_group(rank, WORLD, port=args.port, timeout=600)
    else:
        bridge.init_group(rank, WORLD, port=args.port, timeout=600)
        fns = receiver(args, rank, fp8, fp8_plan, bf16_plan, counts)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.reps + 1):
        for mode in MODES:
            t = _timed(fns[mode])
            if rep:
                times[mode].append(t)
    if rank == RECEIVERS[0]:
        state = fns["_state"]()
        # Where the two FP8 paths differ: the trainer quantizes float32, the online path bfloat16 roundings.
        diff = total = 0
        for n, (q, _) in state["online"].items():
            a, b = state["held"][n].view(torch.uint8), q.contiguous().view(torch.uint8)
            diff += int((a != b).sum())
            total += a.numel()
        res = {"times": times, "bytes": counts, "plan_bytes": {"fp8": fp8_plan.network_bytes,
                                                              "bf16": bf16_plan.network_bytes},
               "fp8_differs": diff / max(total, 1), "fp8_elements": total,
               "model_bytes_f32": 4 * sum(int(np.prod(lay.shape)) for path, lay in fp8.source.items()
                                          if path not in fp8.formats and not path.endswith("_scale_inv"))
               + 4 * sum(int(np.prod(fp8.source.layout(path).shape)) for path in fp8.formats),
               "buckets": (fp8_plan.num_buckets, bf16_plan.num_buckets)}
        print("RESULT " + json.dumps(res), flush=True)
    torch.distributed.barrier()
    if rank in TRAINERS:
        os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--block", default="128x128", help="FP8 block (block_n x block_k), e.g. 128x128")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--jax-port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    args.block = tuple(int(b) for b in args.block.split("x"))
    if args.rank >= 0:
        worker(args)
        return
    port, jport = free_ports(2)
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONUNBUFFERED="1")
    common = [f"--layers={args.layers}", f"--hidden={args.hidden}", f"--vocab={args.vocab}", f"--reps={args.reps}",
              f"--bucket-mb={args.bucket_mb}", f"--block={'x'.join(map(str, args.block))}", f"--port={port}",
              f"--jax-port={jport}"]
    t0 = time.perf_counter()
    _, res = run_ranks(__file__, WORLD, common, env, args.timeout)
    _report(args, res, time.perf_counter() - t0)


def _report(args, res, wall: float) -> None:
    import jax
    import numpy as np
    import torch

    med = {k: statistics.median(v) for k, v in res["times"].items()}
    cfg = _config(args)
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
          f"{platform.system()} {platform.release()}, python {platform.python_version()}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"versions: jax {jax.__version__}, torch {torch.__version__}, numpy {np.__version__}, backend gloo 127.0.0.1")
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
          f"vocab {cfg.vocab_size}: {res['model_bytes_f32'] / 1e6:.1f} MB float32 in JAX; FSDP4 over 2 trainer "
          f"processes -> TP2 (fused) on 2 inference ranks; FP8 e4m3fn, blocks {args.block[0]}x{args.block[1]}; "
          f"{args.bucket_mb} MiB buckets ({res['buckets'][0]} fp8, {res['buckets'][1]} bf16)")
    print(f"repetitions: {args.reps} (after one warm-up), medians of the slowest rank; run took {wall:.0f} s")
    b = res["bytes"]
    rows = (("fp8", "fp8 (quantized at the sender)", b["fp8"]), ("bf16", "bf16", b["bf16"]),
            ("bf16+q", "bf16, quantized at inference", b["bf16+q"]), ("quantize", "  of which quantize (trainers)", 0))
    print(f"  {'mode':<32} {'bytes received':>15} {'time':>10}   min-max")
    for k, label, nbytes in rows:
        ts = res["times"][k]
        shown = f"{nbytes / 1e6:12.1f} MB" if nbytes else f"{'':>15}"
        print(f"  {label:<32} {shown} {med[k] * 1e3:8.1f} ms   {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}")
    print(f"bytes on the wire, fp8 / bf16: {b['fp8'] / b['bf16']:.3f} (plans: {res['plan_bytes']['fp8'] / 1e6:.1f} "
          f"MB / {res['plan_bytes']['bf16'] / 1e6:.1f} MB)")
    print(f"time, fp8 / bf16: {med['fp8'] / med['bf16']:.2f}; fp8 / bf16+q: {med['fp8'] / med['bf16+q']:.2f}")
    print(f"FP8 bytes where the two paths differ (the trainer quantizes float32, bf16+q the bfloat16 rounding): "
          f"{res['fp8_differs'] * 100:.2f}% of {res['fp8_elements']:,}")


if __name__ == "__main__":
    main()
