"""Planner speed: synthetic 10,000-tensor pytrees (256 -> 128 devices) cold and cached, and
single tensors on growing meshes up to 1,024 -> 512 devices.

Run: ``.venv/bin/python benchmarks/plan_bench.py [--before DIR] [--reps N]`` (one core:
``OMP_NUM_THREADS=1``). Cold means after ``jreshard.clear_cache()``; the first cold run of a
process also pays for fresh memory, so both the first and the best of three are printed.

``--before DIR`` (a git worktree of an earlier commit) times the two pytrees in fresh
interpreters, ``--reps`` times each, alternating between this tree and DIR (each first on
``PYTHONPATH``), and prints the medians side by side: first cold plan in the process, best
of three, and peak RSS. On a virtual machine the first plan's fresh memory costs vary from
run to run (the host may back the guest's pages lazily), which is why it is a median.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402

import jreshard  # noqa: E402
from jreshard import Layout, Mesh  # noqa: E402


def banner(title: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{title}\nmachine: {cpu}, {os.cpu_count()} cores visible, one thread (OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')})\nversions: python {sys.version.split()[0]}, "
            f"numpy {np.__version__}, jreshard {jreshard.__version__}")


def timed(fn: Callable[[], object], repeat: int = 1) -> tuple[float, object]:
    """Best wall time of ``repeat`` calls, and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out

SHAPES = {"wq": (4096, 4096), "wk": (1024, 4096), "wv": (1024, 4096), "wo": (4096, 4096),
          "gate": (11008, 4096), "up": (11008, 4096), "down": (4096, 11008), "norm1": (4096,), "norm2": (4096,),
          "bias": (11008,)}
COLUMN = {"wq", "wk", "wv", "gate", "up", "bias"}


def synthetic_tree(kind: str, n_tensors: int = 10_000) -> tuple[dict, dict]:
    """A Llama-like pytree {layers: [{name: Layout}]} from 256 devices (0..255) onto a
    TP(8) x DP(16) fleet on devices 256..383.

    ``kind='megatron'``: training TP(8) x DP(32), so every piece has 32 replicas to
    balance over; ``kind='fsdp'``: JAX-style FSDP(32) x TP(8), every destination
    shard cut from 32 source shards (no replicas, many pieces).
    """
    axes = ("dp", "tp") if kind == "megatron" else ("fsdp", "tp")
    src_mesh = Mesh(np.arange(256).reshape(32, 8), axes)
    dst_mesh = Mesh(np.arange(256, 384).reshape(16, 8), ("dp", "tp"))
    src, dst = {"layers": []}, {"layers": []}
    for _ in range(n_tensors // len(SHAPES)):
        s_layer, d_layer = {}, {}
        for name, shape in SHAPES.items():
            if len(shape) == 1:
                d_spec = ("tp",) if name in COLUMN else ()
                s_spec = d_spec if kind == "megatron" else ("fsdp",)
            elif name in COLUMN:
                d_spec = ("tp", None)
                s_spec = d_spec if kind == "megatron" else ("tp", "fsdp")
            else:
                d_spec = (None, "tp")
                s_spec = d_spec if kind == "megatron" else ("fsdp", "tp")
            s_layer[name] = Layout(shape, src_mesh, s_spec, "bfloat16")
            d_layer[name] = Layout(shape, dst_mesh, d_spec, "bfloat16")
        src["layers"].append(s_layer)
        dst["layers"].append(d_layer)
    return src, dst


def cold(src, dst):
    jreshard.clear_cache()
    return jreshard.plan(src, dst)


def big_tensor(n_src: int) -> tuple[Layout, Layout]:
    """(65536, 8192) from FSDP(n/8) x TP(8) onto TP(8) x DP(n/16) on the next n/2 devices."""
    src_mesh = Mesh(np.arange(n_src).reshape(n_src // 8, 8), ("fsdp", "tp"))
    src = Layout((65536, 8192), src_mesh, ("fsdp", "tp"), "bfloat16")
    n_dst = n_src // 2
    dst = Layout((65536, 8192), Mesh(np.arange(n_src, n_src + n_dst).reshape(n_dst // 8, 8), ("dp", "tp")),
                 (None, "tp"), "bfloat16")
    return src, dst


KINDS = (("megatron", "Megatron TP8 x DP32 -> TP8 x DP16 (replica balancing)"),
         ("fsdp", "FSDP32 x TP8 -> TP8 x DP16 (32 pieces per shard)"))


def child(kind: str) -> None:
    """One fresh interpreter's figures for the ``kind`` pytree, as a JSON line: first cold, best of 3, RSS."""
    src, dst = synthetic_tree(kind)
    first, _ = timed(lambda: cold(src, dst))
    best, _ = timed(lambda: cold(src, dst), repeat=3)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"first": first, "best": best, "rss_mb": rss, "jreshard": os.path.dirname(jreshard.__file__)}))


def side_by_side(before: str, reps: int) -> None:
    """Medians of ``reps`` fresh interpreters per pytree, this tree and ``before`` alternating."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"now": here, "before": os.path.abspath(before)}
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(reps):
        for kind, _label in KINDS:
            for name, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": tree}
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind], env=env,
                                      cwd=tree, capture_output=True, text=True, timeout=600, check=True)
                runs.setdefault((name, kind), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\nside by side: medians of {reps} fresh interpreters each, alternating; "
          + ", ".join(f"{n}: {runs[(n, KINDS[0][0])][0]['jreshard']}" for n in trees))
    print(f"  {'pytree':<56} {'first ms':>9} {'before':>9} {'best ms':>8} {'before':>8} {'RSS MB':>7} {'before':>7}")
    def med(rs: list[dict], k: str) -> float:
        return statistics.median(r[k] for r in rs)

    for kind, label in KINDS:
        now, old = runs[("now", kind)], runs[("before", kind)]
        print(f"  {label:<56} {med(now, 'first') * 1e3:>9.1f} {med(old, 'first') * 1e3:>9.1f} "
              f"{med(now, 'best') * 1e3:>8.1f} {med(old, 'best') * 1e3:>8.1f} {med(now, 'rss_mb'):>7.0f} "
              f"{med(old, 'rss_mb'):>7.0f}")
    print("goal: the FSDP32 x TP8 pytree <= 1 s cold")


def main(before: str | None = None, reps: int = 5) -> None:
    print(banner("jreshard planner benchmark"))
    for kind, label in KINDS:
        src, dst = synthetic_tree(kind)
        first, p = timed(lambda src=src, dst=dst: cold(src, dst))
        best, p = timed(lambda src=src, dst=dst: cold(src, dst), repeat=3)
        warm, _ = timed(lambda src=src, dst=dst: jreshard.plan(src, dst), repeat=5)
        s = p.stats()
        print(f"\n10,000-tensor pytree, 256 -> 128 devices, {label}: {s.moves:,} network moves")
        print(f"  cold (first in process)  {first * 1e3:9.1f} ms")
        print(f"  cold (best of 3)         {best * 1e3:9.1f} ms")
        print(f"  cached                   {warm * 1e3:9.3f} ms   (cold / cached = {best / warm:,.0f}x)")
        print(f"  bytes moved = lower bound: {s.network_bytes == s.lower_bound_bytes}; "
              f"sender imbalance {s.send_imbalance:.3f}")
    print("\nOne (65536, 8192) tensor, FSDP x TP -> TP x DP, growing meshes. Each destination shard is cut")
    print("from more source shards as the mesh grows, so moves grow ~4x per doubling; time per move stays flat:")
    print(f"  {'src -> dst':>12}  {'moves':>9}  {'cold ms':>9}  {'us per device':>13}  {'ns per move':>11}")
    for n in (128, 256, 512, 1024):
        a, b = big_tensor(n)
        t, tp = timed(lambda a=a, b=b: cold(a, b), repeat=3)
        st = tp.stats()
        assert st.network_bytes == st.lower_bound_bytes
        print(f"  {n:>5} -> {n // 2:<4}  {st.moves:>9,}  {t * 1e3:>9.1f}  {t * 1e6 / (n + n // 2):>13.1f}  "
              f"{t * 1e9 / st.moves:>11.0f}")
    if before:
        side_by_side(before, reps)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="a tree of an earlier commit (git worktree) to time the pytrees beside")
    ap.add_argument("--reps", type=int, default=5, help="fresh interpreters per pytree and tree (with --before)")
    ap.add_argument("--child", choices=[k for k, _ in KINDS], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
    else:
        main(args.before, args.reps)
