"""The GPU check: every device check of the bridge and the executor in one run (docs/gpu.md).

Run it once when a session is lent a GPU machine, from the repository root or anywhere:

    python tests/gpu/run_device_checks.py            # on GPU 0; about 2-3 minutes on one H200
    python tests/gpu/run_device_checks.py --device cpu   # the same logic on the CPU, small sizes

It needs no install: the repository root is put on ``sys.path`` here. It prints one line per check
(name, PASS / FAIL / SKIP, figures or the reason) and a summary, and exits 1 if any check failed.
Without a CUDA device (torch) or a GPU backend (jax) every check that needs one is skipped, saying
why; a missing Python package the project needs (``requirements.lock``) skips the checks that import
it, naming it. ``--device cpu`` runs every check that has a CPU form on the CPU at small sizes, with
the performance goals reported but not applied, so the code has run before the first GPU session.
A watchdog ends the run (with every thread's traceback) past ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# What each check imports beyond the standard library (the project's runtime needs, requirements.lock).
NEEDS = {
    "dlpack": ("numpy", "torch", "jax"),
    "pack_unpack": ("numpy", "ml_dtypes", "xxhash", "torch", "jax"),
    "transfer": ("numpy", "ml_dtypes", "jax"),
    "ipc_smoke": ("numpy", "torch"),
    "cuda_ipc": ("numpy", "ml_dtypes", "xxhash", "torch", "jax"),
    "digest": ("numpy", "xxhash", "torch"),
    "qwen3_receiver": ("numpy", "ml_dtypes", "xxhash", "torch", "jax", "flax"),
    "nccl": ("torch",),
}
GOALS = {"pack_unpack": 0.7, "cuda_ipc": 0.5}  # throughput against a plain device copy of the same bytes


class Outcome(NamedTuple):
    """One check's verdict: ``PASS``, ``FAIL`` or ``SKIP``, and its figures or the reason."""

    status: str
    text: str


class Context:
    """What the checks run on: ``device`` (``"gpu"`` or ``"cpu"``), the modules and devices found."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cpu = device == "cpu"
        self.missing = [m for m in dict.fromkeys(m for ms in NEEDS.values() for m in ms)
                        if importlib.util.find_spec(m) is None]
        self.torch: Any = None
        self.jax: Any = None
        self.jax_device: Any = None
        self.gpus = 0
        self.no_cuda = self.no_jax_gpu = ""
        if "torch" not in self.missing:
            import torch

            self.torch = torch
            self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if not self.cpu and not self.gpus:
                build = "a CPU-only build" if torch.version.cuda is None else "CUDA " + torch.version.cuda
                self.no_cuda = f"no CUDA device visible to torch {torch.__version__} ({build})"
        if "jax" not in self.missing:
            self._find_jax()

    def _find_jax(self) -> None:
        import jax

        self.jax = jax
        try:
            self.jax_device = jax.devices("cpu" if self.cpu else "gpu")[0]
        except RuntimeError as e:
            first = str(e).strip().split(",")[0].split(". ")[0] if str(e).strip() else type(e).__name__
            self.no_jax_gpu = f"jax {jax.__version__} has no GPU backend ({first[:80]})"

    def torch_device(self) -> str:
        """The torch device type of the checks: ``"cuda"`` or ``"cpu"``."""
        return "cpu" if self.cpu else "cuda"

    def reason(self, name: str) -> str:
        """Why check ``name`` cannot run here (``""``: it can)."""
        missing = [m for m in NEEDS[name] if m in self.missing]
        if missing:
            return "missing Python package " + ", ".join(f"{m} ({_pin(m)})" for m in missing)
        why = [self.no_cuda if "torch" in NEEDS[name] else "", self.no_jax_gpu if "jax" in NEEDS[name] else ""]
        return "; ".join(w for w in why if w)


def _pin(module: str) -> str:
    """The version requirements.lock pins for ``module``'s distribution, as a hint of what to bring."""
    dist = {"ml_dtypes": "ml_dtypes"}.get(module, module)
    lock = REPO / "requirements.lock"
    for line in lock.read_text().splitlines() if lock.exists() else ():
        if line.lower().startswith(dist.lower() + "=="):
            return f"requirements.lock pins {line.strip()}"
    return "not in requirements.lock"


def _ratio(name: str, ctx: Context, ratio: float) -> tuple[bool, str]:
    """Whether ``ratio`` meets check ``name``'s goal (always, on the CPU), and how to say so."""
    goal = GOALS[name]
    if ctx.cpu:
        return True, f"goal >= {goal} not applied on the CPU"
    return ratio >= goal, f"goal >= {goal} {'met' if ratio >= goal else 'MISSED'}"


def check_dlpack(ctx: Context) -> Outcome:
    """JAX arrays (float32, bfloat16) exported with DLPack are the torch tensors' memory (same pointer)."""
    from tests.gpu._checks import dlpack_zero_copy

    seen = [dlpack_zero_copy(ctx.jax, ctx.torch, ctx.jax_device, dt) for dt in ("float32", "bfloat16")]
    return Outcome("PASS" if all(ok for ok, _ in seen) else "FAIL", "; ".join(text for _, text in seen))


def check_pack_unpack(ctx: Context) -> Outcome:
    """The Sender's pack and the receiver's unpack against a device copy of the same bytes, bit-exact."""
    from tests.gpu._checks import measure

    sizes = {"layers": 1, "hidden": 256, "vocab": 1024, "reps": 3} if ctx.cpu else {}
    r = measure(ctx.jax, ctx.torch, ctx.jax_device, **sizes)
    pack, unpack = r["copy_s"] / r["pack_s"], r["copy_s"] / r["unpack_s"]
    met, goal = _ratio("pack_unpack", ctx, min(pack, unpack))
    gb = r["bytes"] / 1e9
    text = (f"{r['bytes'] / 1e6:.0f} MB bf16: pack {gb / r['pack_s']:.1f} GB/s ({pack:.2f}x copy), unpack "
            f"{gb / r['unpack_s']:.1f} GB/s ({unpack:.2f}x copy), copy {gb / r['copy_s']:.1f} GB/s; {goal}; "
            f"bit-exact {r['exact']}")
    return Outcome("PASS" if met and r["exact"] else "FAIL", text)


def check_transfer(ctx: Context) -> Outcome:
    """``jreshard.transfer`` on one device against ``jax.device_put`` (same dtype, and cast to bf16)."""
    from tests.gpu._checks import transfer_vs_device_put

    r = transfer_vs_device_put(ctx.jax, ctx.jax_device, **({"nbytes": 8 << 20, "reps": 3} if ctx.cpu else {}))
    ok = r["exact"] and r["cast_exact"] and r["shardings_ok"]
    text = (f"{r['bytes'] / 1e6:.0f} MB f32: transfer {r['transfer_s'] * 1e3:.2f} ms vs device_put "
            f"{r['device_put_s'] * 1e3:.2f} ms ({r['transfer_s'] / r['device_put_s']:.2f}x time, source memory "
            f"{'reused' if r['reused'] else 'copied'}); cast to bf16 {r['cast_transfer_s'] * 1e3:.2f} ms vs "
            f"{r['cast_device_put_s'] * 1e3:.2f} ms ({r['cast_transfer_s'] / r['cast_device_put_s']:.2f}x); "
            f"bit-exact {r['exact']} / {r['cast_exact']}")
    return Outcome("PASS" if ok else "FAIL", text)


def check_ipc_smoke(ctx: Context) -> Outcome:
    """Raw torch IPC on one device: a spawned child writes into this process's tensor, bit-exact."""
    from tests.gpu._ipc import ipc_smoke

    nbytes = (8 if ctx.cpu else 256) << 20
    r = ipc_smoke(ctx.torch_device(), nbytes, timeout=120.0)
    if not r.get("exact"):
        return Outcome("FAIL", r.get("error", "the bytes this process reads are not the child's"))
    gb = nbytes / 1e9
    return Outcome("PASS", f"{nbytes >> 20} MiB written by a spawned child on {r['device']}: bit-exact; child's write "
                           f"{gb / r['ipc_s']:.1f} GB/s through the shared mapping vs {gb / r['local_s']:.1f} GB/s "
                           "into its own memory")


def check_cuda_ipc(ctx: Context) -> Outcome:
    """The bridge's ``cuda_ipc`` transport: a JAX trainer process into a torch receiver process on GPU 0."""
    try:
        built = importlib.util.find_spec("bridge.wire.cuda_ipc") is not None
    except ImportError as e:  # e.g. a package bridge.wire imports is missing
        return Outcome("SKIP", f"cannot look for bridge.wire.cuda_ipc: {type(e).__name__}: {e}")
    if not built:
        return Outcome("SKIP", "not built yet (no bridge.wire.cuda_ipc)")
    if ctx.cpu:
        return Outcome("SKIP", "CUDA IPC has no CPU form (the shm transport is its CPU analogue: qwen3_receiver)")
    if ctx.reason("cuda_ipc"):
        return Outcome("SKIP", ctx.reason("cuda_ipc"))
    from tests.gpu._pair import run_pair

    r = run_pair("cuda", "cuda_ipc", size="medium", timeout=120.0)
    if not r["ok"]:
        return Outcome("FAIL", "; ".join(r["problems"]))
    rec = r["receiver"]
    ratio = rec["copy_s"] / min(rec["seconds"][1:])
    met, goal = _ratio("cuda_ipc", ctx, ratio)
    host = sum(b for t, b in rec["transport_bytes"].items() if t != "cuda_ipc")
    text = (f"{rec['nbytes'] / 1e6:.0f} MB f32 bit-exact; sync {min(rec['seconds'][1:]) * 1e3:.1f} ms vs device copy "
            f"{rec['copy_s'] * 1e3:.1f} ms ({ratio:.2f}x copy; {goal}); bytes by transport {rec['transport_bytes']} "
            f"({host} through host memory, 0 expected)")
    return Outcome("PASS" if met and host == 0 else "FAIL", text)


def check_digest(ctx: Context) -> Outcome:
    """The device digest equals the host formula, catches damage, and its throughput."""
    from tests.gpu._checks import digest_problems, digest_speed

    dev = ctx.torch_device()
    problems = digest_problems(ctx.torch, dev)
    r = digest_speed(ctx.torch, dev, **({"nbytes": 16 << 20, "reps": 3} if ctx.cpu else {}))
    gib = r["bytes"] / (1 << 30)
    text = (f"{'; '.join(problems) or 'agrees with the host formula, flips and truncation caught'}; "
            f"{int(r['bytes']) >> 20} MiB: digest {gib / r['digest_s']:.1f} GiB/s, to-host copy "
            f"{gib / r['copy_s']:.1f} GiB/s, xxh3 on the host {gib / r['host_s']:.1f} GiB/s")
    return Outcome("FAIL" if problems else "PASS", text)


def check_qwen3_receiver(ctx: Context) -> Outcome:
    """A tiny Qwen3 from a JAX trainer process through ``bridge.Receiver`` into torch tensors, bit-exact."""
    from tests.gpu._pair import run_pair

    r = run_pair(ctx.torch_device(), "auto", size="tiny", timeout=120.0)
    if not r["ok"]:
        return Outcome("FAIL", "; ".join(r["problems"]))
    rec = r["receiver"]
    return Outcome("PASS", f"{rec['nbytes'] / 1e6:.2f} MB f32, {len(rec['seconds'])} syncs bit-exact against "
                           f"hf_state; trainer on {r['trainer']['jax_device']}; last sync "
                           f"{rec['seconds'][-1] * 1e3:.1f} ms; bytes by transport {rec['transport_bytes']}")


def check_nccl(ctx: Context) -> Outcome:
    """NCCL between ranks: two GPUs at least, and the bridge's transport."""
    if ctx.cpu:
        return Outcome("SKIP", "NCCL needs two GPUs (--device cpu)")
    if ctx.gpus < 2:
        return Outcome("SKIP", f"NCCL between ranks needs two GPUs; torch sees {ctx.gpus}")
    return Outcome("SKIP", f"{ctx.gpus} GPUs, but the bridge's nccl transport is not built yet")


CHECKS: dict[str, Callable[[Context], Outcome]] = {
    "dlpack": check_dlpack, "pack_unpack": check_pack_unpack, "transfer": check_transfer,
    "ipc_smoke": check_ipc_smoke, "cuda_ipc": check_cuda_ipc, "digest": check_digest,
    "qwen3_receiver": check_qwen3_receiver, "nccl": check_nccl,
}
SAYS_WHY = {"nccl", "cuda_ipc"}  # say themselves why they skip (the device count; a transport not built yet)


def run_one(name: str, ctx: Context) -> Outcome:
    """Check ``name``, or why it is skipped; an exception is a FAIL naming it."""
    why = ctx.reason(name)
    if why and name not in SAYS_WHY:
        return Outcome("SKIP", why)
    try:
        return CHECKS[name](ctx)
    except Exception as e:  # noqa: BLE001 (one check's failure must not hide the others)
        return Outcome("FAIL", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")


def header(ctx: Context) -> str:
    """The versions and the device the run saw, as one ``#`` line."""
    torch, jax = ctx.torch, ctx.jax
    parts = [f"python {platform.python_version()}", f"--device {ctx.device}"]
    if torch is not None:
        gpu = torch.cuda.get_device_name(0) if ctx.gpus else "no CUDA device"
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        parts.append(f"torch {torch.__version__} ({build}; {gpu}; {ctx.gpus} GPUs)")
    if jax is not None:
        parts.append(f"jax {jax.__version__} ({ctx.jax_device or 'no GPU backend'})")
    if ctx.missing:
        parts.append("missing: " + ", ".join(ctx.missing))
    return "# " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Runs the checks (all, or ``--only``), prints a line each and a summary; 1 if any failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="gpu (default) or cpu (debugging)")
    ap.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks only")
    ap.add_argument("--budget", type=float, default=470.0, help="seconds before the watchdog ends the run")
    args = ap.parse_args(argv)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # leave GPU memory to torch and the children
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ.pop("JAX_PLATFORMS", None)  # the test suite pins the CPU; this run wants the GPU
    faulthandler.enable()
    faulthandler.dump_traceback_later(args.budget, exit=True)
    start = time.monotonic()
    ctx = Context(args.device)
    print(header(ctx), flush=True)
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for name in args.only or CHECKS:
        t0 = time.monotonic()
        out = run_one(name, ctx)
        counts[out.status] += 1
        print(f"{name:<15} {out.status:<4} {time.monotonic() - t0:6.1f}s  {out.text}", flush=True)
    faulthandler.cancel_dump_traceback_later()
    print(f"summary: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in "
          f"{time.monotonic() - start:.1f} s", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
