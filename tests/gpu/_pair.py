"""A tiny Qwen3 synced from a JAX trainer process into a torch receiver process (two ranks, one host).

``run_pair`` starts two processes with the ``spawn`` method: rank 0 (``trainer``) initialises
``jreshard.nn``'s flax Decoder with a tiny Qwen3 config (q/k norms, tied embeddings) on its JAX
device and sends it with ``bridge.trainer.sender.Sender``; rank 1 (``receiver``) imports no JAX and
receives into torch tensors on its device with ``bridge.Receiver``. They meet in a gloo group over a
TCP store on 127.0.0.1 (a port the OS picked). Each writes what it saw under a temporary folder
(the trainer its leaves, the receiver its params and timings); the parent compares the received
params bit for bit with the Hugging Face state of the trainer's leaves (``tests.helpers.hf_state``,
the oracle that shares no code with the bridge). Children that outlive their timeout are killed.

The same harness serves ``run_device_checks.py``'s Qwen3 check (``transport="auto"``) and its
``cuda_ipc`` check (``transport="cuda_ipc"``, once that transport exists); with ``device="cpu"``
it runs on this machine (``auto`` picks shared memory there), so its logic is tested before a GPU.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

SYNCS = 3  # the first compiles the trainer's casts; the others are timed (the best is kept)
# Vocabularies are multiples of the recipe's vocab padding (64): no padded rows to account for.
SIZES = {
    "tiny": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},  # 0.3 MB
    "medium": {"vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128},  # 0.5 GB in float32
}


def tiny_qwen3(size: str = "tiny") -> Any:
    """A small Qwen3 (q/k norms, tied embeddings) of ``jreshard.nn``, as tests/bridge/test_llama.py builds one."""
    from jreshard.nn import LlamaConfig

    return LlamaConfig(**SIZES[size], qk_norm=True, tie_word_embeddings=True)


def make_plan(cfg: Any) -> Any:
    """The plan both ranks build from the config alone: one trainer device (rank 0) -> TP1 rank 1, float32,
    in buckets of 64 KiB for the tiny model (several buckets) and of 64 MiB for larger ones."""
    import bridge
    from jreshard.nn import param_shapes

    src = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((1,), ("x",), [0], 1), lambda path, shape: ())
    return bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [1], fused=False, dtype="float32"),
                             bucket_bytes=1 << (16 if cfg.hidden_size <= 64 else 26))


def _group(rank: int, port: int, timeout: float) -> Any:
    from bridge.wire.group import gloo_group, tcp_store

    store = tcp_store("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    return gloo_group(store, rank, 2, timeout, bind="127.0.0.1")


def _set_platform(device: str) -> None:
    """Before jax is imported: its platform, and no preallocation of most of the GPU's memory."""
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ.pop("JAX_PLATFORMS", None)


def trainer(out: str, port: int, device: str, transport: str, timeout: float, size: str) -> None:
    """Rank 0: the tiny Qwen3's flax leaves on the JAX device, sent ``SYNCS`` times."""
    _set_platform(device)
    try:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        from bridge.trainer.sender import Sender, flatten_params
        from jreshard.nn import init_params

        cfg = tiny_qwen3(size)
        dev = jax.devices("cpu" if device == "cpu" else "gpu")[0]
        sharding = NamedSharding(jax.sharding.Mesh(np.array([dev]), ("x",)), P())
        params = jax.device_put(init_params(cfg, jax.random.key(0)), sharding)
        np.savez(Path(out) / "leaves.npz", **{k: np.asarray(v) for k, v in flatten_params(params).items()})
        sender = Sender(make_plan(cfg), rank=0, timeout=timeout, ready_timeout=timeout)
        group = _group(0, port, timeout)
        seconds = []
        for version in range(1, SYNCS + 1):
            t0 = time.perf_counter()
            sender.sync(params, version, group, transport=transport)
            seconds.append(time.perf_counter() - t0)
        _write(out, 0, {"ok": True, "seconds": seconds, "jax_device": str(dev), **_stats(sender.last_stats)})
    except BaseException:  # noqa: BLE001 (reported to the parent)
        _write(out, 0, {"ok": False, "error": traceback.format_exc()})


def receiver(out: str, port: int, device: str, transport: str, timeout: float, size: str) -> None:
    """Rank 1: torch params on ``device`` (no JAX here), received ``SYNCS`` times, then saved."""
    try:
        import torch

        import bridge

        dev = torch.device("cpu" if device == "cpu" else "cuda:0")
        plan = make_plan(tiny_qwen3(size))
        params = {p.name: torch.zeros(p.shape, dtype=torch.float32, device=dev) for p in plan.param_map.for_rank(1)}
        rec = bridge.Receiver(plan, params, rank=1, timeout=timeout, ready_timeout=timeout)
        group = _group(1, port, timeout)
        seconds = []
        for _ in range(SYNCS):
            t0 = time.perf_counter()
            rec.sync(group, transport=transport)
            seconds.append(time.perf_counter() - t0)
        np.savez(Path(out) / "received.npz", **{n: t.cpu().numpy() for n, t in params.items()})
        nbytes = sum(t.numel() * t.element_size() for t in params.values())
        _write(out, 1, {"ok": True, "seconds": seconds, "version": rec.version, "nbytes": nbytes,
                        "copy_s": _copy_seconds(torch, dev, nbytes), **_stats(rec.last_stats)})
    except BaseException:  # noqa: BLE001 (reported to the parent)
        _write(out, 1, {"ok": False, "error": traceback.format_exc()})


def _copy_seconds(torch: Any, dev: Any, nbytes: int) -> float:
    """Median seconds of one device copy of ``nbytes`` bytes on ``dev`` (the baseline of a transport)."""
    from tests.gpu._checks import timer

    a, b = (torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2))
    return timer(torch, dev, 5)(lambda: b.copy_(a))


def _stats(stats: Any) -> dict[str, Any]:
    return {"transport_bytes": dict(stats.transport_bytes), "transports": list(stats.transports),
            "step_seconds": dict(stats.step_seconds)}


def _write(out: str, rank: int, result: dict[str, Any]) -> None:
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def run_pair(device: str, transport: str, *, size: str = "tiny", timeout: float = 120.0) -> dict[str, Any]:
    """Runs the two ranks (``device``: ``"cpu"`` or ``"cuda"``; ``size``: a key of ``SIZES``) and compares.

    Returns ``ok`` (both ranks finished and every param equals the oracle), ``problems`` (what
    went wrong, each a line), and each rank's result (``trainer``, ``receiver``: seconds per sync,
    bytes per transport, ...). ``timeout`` bounds each sync and the whole run (plus start-up).
    """
    import multiprocessing as mp

    from tests._procs import free_port

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="jreshard-gpu-pair-") as out:
        args = (out, free_port(), device, transport, timeout, size)
        procs = [ctx.Process(target=fn, args=args, daemon=True) for fn in (trainer, receiver)]
        for p in procs:
            p.start()
        try:
            end = time.monotonic() + timeout + 60.0  # start-up: imports, JAX's first compile
            for p in procs:
                p.join(max(0.0, end - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return _compare(Path(out), procs, tiny_qwen3(size))


def _compare(out: Path, procs: list[Any], cfg: Any) -> dict[str, Any]:
    """Both ranks' results, and the received params against ``hf_state`` of the trainer's leaves."""
    from tests.helpers import hf_state

    result: dict[str, Any] = {"problems": []}
    for rank, (role, p) in enumerate(zip(("trainer", "receiver"), procs, strict=True)):
        path = out / f"rank{rank}.json"
        got = json.loads(path.read_text()) if path.exists() else {
            "ok": False, "error": f"exited with code {p.exitcode} without a result (killed at the timeout, "
                                  "or crashed)"}
        result[role] = got
        if not got["ok"]:
            result["problems"].append(f"{role}: {got['error'].strip().splitlines()[-1]}")
    if not result["problems"]:
        with np.load(out / "leaves.npz") as leaves, np.load(out / "received.npz") as received:
            want = hf_state(dict(leaves), cfg)
            got = dict(received)
        if set(got) != set(want):
            result["problems"].append(f"names differ: {sorted(set(got) ^ set(want))[:4]}")
        differ = [n for n in want if n in got and not np.array_equal(got[n], want[n])]
        if differ:
            result["problems"].append(f"{len(differ)} params differ from the oracle, e.g. {differ[0]}")
    result["ok"] = not result["problems"]
    return result
