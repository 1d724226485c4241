"""Shared by the bridge tests and their worker processes: configs, data, references, process helpers.

Importable without jax and torch (the worker processes import it before choosing a side).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jreshard.nn import LlamaConfig, fsdp_spec, param_shapes
from tests._procs import free_port, free_ports, kill_all, wait_all  # noqa: F401  (the tests call them as C.*)
from tests.helpers import hf_state

TRAINERS = (0, 1)  # torch ranks of the JAX processes (2 simulated devices each, FSDP over 4)
RECEIVERS = (2, 3)  # torch ranks of the inference processes (TP2)
WORLD = 4
VOCAB = 1000  # padded to 1024 by vocab_pad=64: TP rank 1 holds 488 real rows and 24 padding rows
E2E_VOCAB_PAD = 384  # llama-tiny's 1024 rows padded to 1152: TP rank 1 holds 448 real rows + 128 padding


# Generous bounds for "failed at once" checks: far below the waits they rule out (ready_timeout,
# minutes), far above what a loaded machine needs to notice a failure.
SLACK = 10.0


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker process: one thread, unbuffered output, every thread's traceback on a fatal
    signal (faulthandler), plus ``extra``."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **extra)


def read_logs(out: Path, pattern: str = "*.log", tail: int = 2000) -> str:
    """The last ``tail`` characters of every worker log under ``out``, for assertion messages."""
    return "\n".join(f"--- {f.name}\n{f.read_text()[-tail:]}" for f in sorted(out.glob(pattern)))


def cross_node_lower_bound(plan, nodes, itemsize: int) -> int:
    """Bytes into nodes if each leaf element needed on a node crosses into it once (from the param
    map's regions, not from the plan's moves): the lower bound of hierarchical delivery."""
    total = 0
    for node in nodes:
        for path, layout in plan.source.items():
            need = np.zeros(layout.shape, dtype=bool)
            for q in plan.param_map.params:
                if q.rank in node:
                    for r in q.regions:
                        if r.leaf == path:
                            need[r.box.slices()] = True
            total += int(need.sum()) * itemsize
    return total


def source_for(config: LlamaConfig, mesh_shape=(4,), axes=("fsdp",), ranks=TRAINERS, per: int = 2, spec=fsdp_spec):
    """The trainer Source of ``config``'s flax leaves (default: FSDP over 2 processes x 2 devices)."""
    import bridge

    return bridge.Source.build(param_shapes(config), bridge.trainer_mesh(mesh_shape, axes, ranks, per), spec)


def small_config() -> LlamaConfig:
    return LlamaConfig.load("llama-tiny", vocab_size=VOCAB, num_hidden_layers=2)


def tiny_config() -> LlamaConfig:
    return LlamaConfig.load("llama-tiny")


def make_arrays(config: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    """Deterministic global float32 leaves (the same on every process)."""
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(s, dtype=np.float32) for p, s in sorted(param_shapes(config).items())}


def tokens(config: LlamaConfig, batch: int = 2, seq: int = 16) -> np.ndarray:
    return np.random.default_rng(123).integers(0, config.vocab_size, (batch, seq)).astype(np.int32)


def vllm_shards(arrays: dict[str, np.ndarray], config: LlamaConfig, tp: int, *, fused: bool,
                vocab_pad: int) -> list[dict[str, np.ndarray]]:
    """Every TP rank's Hugging Face-named local tensors, sliced the way vLLM shards Llama (the oracle).

    Written independently of bridge's mapping code: full Hugging Face weights first (``tests.helpers.hf_state``,
    without the Qwen3 q/k norms), then slices.
    """
    c = config
    full = {k: v for k, v in hf_state(arrays, c).items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    ranks: list[dict[str, np.ndarray]] = [{} for _ in range(tp)]
    padded = -(-c.vocab_size // vocab_pad) * vocab_pad
    for name, w in full.items():
        for r in range(tp):
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                s = padded // tp
                local = np.zeros((s, w.shape[1]), np.float32)
                rows = w[r * s:(r + 1) * s]
                local[: len(rows)] = rows
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                local = np.split(w, tp, axis=1)[r]
            elif name.endswith(("k_proj.weight", "v_proj.weight")) and tp > c.num_key_value_heads:
                # vLLM replicates KV heads when TP exceeds them: rank r holds head r // (tp // kv_heads).
                local = np.split(w, c.num_key_value_heads, axis=0)[r // (tp // c.num_key_value_heads)]
            elif w.ndim == 2:
                local = np.split(w, tp, axis=0)[r]
            else:
                local = w
            ranks[r][name] = local
    if fused:
        for r in range(tp):
            d = ranks[r]
            for i in range(c.num_hidden_layers):
                h = f"model.layers.{i}."
                d[h + "self_attn.qkv_proj.weight"] = np.concatenate(
                    [d.pop(h + f"self_attn.{n}_proj.weight") for n in "qkv"])
                d[h + "mlp.gate_up_proj.weight"] = np.concatenate(
                    [d.pop(h + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    return ranks


# ------------------------------------------------------------------ worker processes
# What a worker process records (``events``) and writes to ``rank{r}.json`` for its test to read.
events: dict = {}


def save(out: str, rank: int, suffix: str = "") -> None:
    """Writes ``events`` to ``out/rank{rank}{suffix}.json`` atomically (a test may read it any time)."""
    name = os.path.join(out, f"rank{rank}{suffix}.json")
    with open(name + ".tmp", "w") as f:
        json.dump(events, f, indent=1)
    os.replace(name + ".tmp", name)


def nest(flat: dict[str, Any]) -> dict:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``: a trainer's leaves by path as the pytree they came from."""
    nested: dict = {}
    for path, v in flat.items():
        node = nested
        *head, last = path.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = v
    return nested


def run_worker(args: Any, trainer: Callable[[int, Any], None], receiver: Callable[[int, Any], None], *,
               suffix: str = "", exit_trainers: bool = True) -> None:
    """Runs this worker's side (``args.rank`` in ``TRAINERS``: ``trainer``), recording a crash, whether jax
    was imported and completion in ``events``, saved whatever happens. A trainer exits at once after
    (``exit_trainers``): jax.distributed's shutdown barrier would wait for a trainer already gone."""
    side = trainer if args.rank in TRAINERS else receiver
    try:
        side(args.rank, args)
        events.update(jax_imported="jax" in sys.modules, done=True)
    except Exception:
        events["crash"] = traceback.format_exc()
        raise
    finally:
        save(args.out, args.rank, suffix)
    if side is trainer and exit_trainers:
        os._exit(0)
