"""FP8 delivery with jreshard.transfer: bytes moved and time, three ways side by side.

Run: ``.venv/bin/python benchmarks/fp8_transfer_bench.py`` (``--layers``, ``--hidden``,
``--inter``, ``--rounds``; about a minute on 2 cores with the defaults).

Llama-shaped layers (attention ``[hidden, hidden]`` x 4, MLP ``[inter, hidden]`` x 2
and ``[hidden, inter]``, two norms) in bfloat16, FSDP over devices 0-3 (with the
default ``hidden=1280`` a shard of a ``[hidden, *]`` weight holds 320 rows, so shard boundaries cut 128-row
blocks and the holders exchange partial amax), delivered to TP2 x DP2 on devices
4-7 of 8 simulated CPU devices:

- ``bf16``: ``jreshard.transfer(params, target)``, bfloat16 on the wire;
- ``fp8 at source``: ``jreshard.transfer(params, target, dtype="float8_e4m3fn",
  block=(128, 128))``: quantized where the shards are, FP8 weights and float32
  scales on the wire, norms kept in bfloat16;
- ``bf16 + quantize at destination``: the bf16 transfer, then
  ``jax_executor.fp8.quantize_tree`` on the inference shardings (no exchange there:
  TP splits hold whole blocks).

Bytes are the plans' bytes between devices (``PlanStats.network_bytes``) plus, for
quantizing at the source, the float32 each device puts into the partial-amax
all-reduce. Times are medians of ``--rounds`` warm calls; the first call of each
method is reported apart (the source-side quantize programs are already compiled
then, by the byte count; the destination-side ones are not). The script checks that
both FP8 methods give the same bits.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jreshard  # noqa: E402
from jreshard.core.fp8 import Fp8Format  # noqa: E402
from jreshard.jax_executor.fp8 import amax_reduce, quantize_tree, scale_sharding  # noqa: E402


def layers(n: int, hidden: int, inter: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Leaf name -> (shape, column-parallel 'col' / row-parallel 'row' / 'norm')."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(n):
        for w in ("wq", "wk", "wv"):
            out[f"l{i}/{w}"] = ((hidden, hidden), "col")
        out[f"l{i}/wo"] = ((hidden, hidden), "row")
        out[f"l{i}/w1"] = ((inter, hidden), "col")
        out[f"l{i}/w3"] = ((inter, hidden), "col")
        out[f"l{i}/w2"] = ((hidden, inter), "row")
        out[f"l{i}/attn_norm"] = ((hidden,), "norm")
        out[f"l{i}/mlp_norm"] = ((hidden,), "norm")
    return out


def timed(fn, rounds: int) -> tuple[float, float, object]:
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - t
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return first, statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1280)
    ap.add_argument("--inter", type=int, default=3584)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    devs = np.array(jax.devices())
    train = jax.sharding.Mesh(devs[:4], ("fsdp",))
    serve = jax.sharding.Mesh(devs[4:8].reshape(2, 2), ("dp", "tp"))
    spec = {"col": P("tp"), "row": P(None, "tp"), "norm": P()}
    shapes = layers(args.layers, args.hidden, args.inter)
    rng = np.random.default_rng(0)
    params, target = {}, {}
    for name, (shape, kind) in shapes.items():
        x = (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16)
        params[name] = jax.device_put(x, NamedSharding(train, P("fsdp")))
        target[name] = NamedSharding(serve, spec[kind])
    fmt = Fp8Format(block=(128, 128))

    def fp8_rule(path, leaf):
        return fmt if leaf.ndim == 2 else None

    bf16_bytes = jreshard.plan(params, target).stats().network_bytes
    q_src, s_src = quantize_tree(params, fp8_rule)
    fp8_leaves = {**q_src, **{f"{k}_scale_inv": v for k, v in s_src.items() if v is not None}}
    fp8_shardings = {**target, **{f"{k}_scale_inv": scale_sharding(target[k], params[k].shape, fmt)
                                  for k, v in s_src.items() if v is not None}}
    fp8_wire = jreshard.plan(fp8_leaves, fp8_shardings).stats().network_bytes
    reduces = [(amax_reduce(params[k].sharding, params[k].shape, fmt), len(params[k].sharding.device_set))
               for k, v in s_src.items() if v is not None]
    amax_bytes = sum(r.nbytes * n for r, n in reduces if r is not None)
    cut_tensors = sum(1 for r, _ in reduces if r is not None and r.floats)

    def bf16() -> object:
        return jreshard.transfer(params, target)

    def fp8_source() -> object:
        return jreshard.transfer(params, target, dtype="float8_e4m3fn", block=(128, 128))

    def fp8_dest() -> object:
        return quantize_tree(jreshard.transfer(params, target), fp8_rule)

    res = {name: timed(fn, args.rounds) for name, fn in
           (("bf16", bf16), ("fp8 at source", fp8_source), ("bf16 + quantize at destination", fp8_dest))}
    (w1, s1), (w2, s2) = res["fp8 at source"][2], res["bf16 + quantize at destination"][2]
    same = all(np.array_equal(np.asarray(w1[k]).view(np.uint8), np.asarray(w2[k]).view(np.uint8))
               for k in w1 if s1[k] is not None)
    same &= all(np.array_equal(np.asarray(s1[k]), np.asarray(s2[k])) for k in s1 if s1[k] is not None)

    total = sum(int(np.prod(s)) for s, _ in shapes.values()) * 2
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"jax {jax.__version__}, numpy {np.__version__}; 8 simulated CPU devices")
    print(f"{args.layers} layers, hidden {args.hidden}, inter {args.inter}: {len(shapes)} tensors, "
          f"{total / 2**20:.1f} MiB in bfloat16; FSDP4 on devices 0-3 -> TP2 x DP2 on devices 4-7; "
          f"{cut_tensors} tensors with blocks cut by FSDP shards")
    print(f"{'method':<32} {'bytes between devices':>22} {'vs bf16':>8} {'first call s':>13} {'warm s':>8}")
    rows = [("bf16", bf16_bytes), ("fp8 at source", fp8_wire + amax_bytes),
            ("bf16 + quantize at destination", bf16_bytes)]
    for name, nbytes in rows:
        first, warm, _ = res[name]
        print(f"{name:<32} {nbytes:>22,} {nbytes / bf16_bytes:>8.3f} {first:>13.3f} {warm:>8.3f}")
    print(f"fp8 at source: {fp8_wire:,} bytes of FP8 weights, scales and kept norms, plus {amax_bytes:,} bytes "
          f"of partial amax (the float32 each device puts into its all-reduce, summed over devices)")
    print(f"both FP8 methods give the same bits: {same}")


if __name__ == "__main__":
    main()
