"""One process of the FP8 end-to-end test: a JAX trainer (ranks 0, 1) or a torch receiver (2, 3).

Run by tests/bridge/test_fp8_e2e.py. For each model of ``MODELS`` in turn (the dense flax
Llama, then the flax MoE model), the trainers (2 CPU devices each, FSDP over 4) build it,
quantize its linear layers (and stacked experts) where their shards are
(``bridge.trainer.fp8.quantize_params``) and sync them, then sync the same weights in
bfloat16. The receivers (TP2, vLLM's names: fused ``qkv_proj``/``gate_up_proj``, FusedMoE's
``w13_weight``/``w2_weight``) hold the FP8 weights as ``torch.float8_e4m3fn`` and record the
bytes they received (``Receiver.last_stats``). Results go under --out, per model ``m``:
``{m}_params.npz`` (the trainer's float32 leaves), ``{m}_jax_logits.npy``,
``rank{r}_{m}_fp8.npz`` (FP8 weights as their raw bytes, scales, the rest as float32); and
``rank{r}.json`` (events, per model under ``events[m]``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import _common as C  # noqa: E402

import bridge  # noqa: E402
from jreshard.core.fp8 import Fp8Format  # noqa: E402
from jreshard.nn import LlamaConfig, MoeConfig, fsdp_spec, param_shapes  # noqa: E402

TIMEOUT = 30.0
# Blocks of 64 output rows x 128 input columns: TP2 shards and the fused parts hold whole blocks,
# while the trainer's FSDP shards (64 rows of each [in, out] kernel) cut the 128-wide input blocks.
FMT = Fp8Format(block=(64, 128))


def config() -> LlamaConfig:
    # One layer, intermediate 256: every linear kernel is [256, 256] or [256, 128], so the trainers compile
    # two quantizers; vocabulary 128: TP2 holds 64 rows a rank.
    return LlamaConfig.load("llama-tiny", vocab_size=128, intermediate_size=256, num_hidden_layers=1)


def moe_config() -> MoeConfig:
    # One sparse layer of 4 experts (top 2), hidden 256, expert MLP 256: TP2 gives each rank 128 gate
    # and 128 up rows of w13 (two 64-row blocks each) and 128 input columns of w2 (one 128-wide block);
    # heads of 64: q 128, k and v 64 rows a rank. The trainers' FSDP puts one expert on each device.
    return MoeConfig.load("qwen3-moe-tiny", vocab_size=128, hidden_size=256, head_dim=64, intermediate_size=256,
                          moe_intermediate_size=256, num_experts=4, num_hidden_layers=1)


def _dense_map(cfg, source):
    return bridge.llama_param_map(cfg, source, C.RECEIVERS, fused=True, vocab_pad=64, dtype="bfloat16")


def _moe_map(cfg, source):
    return bridge.qwen3_moe_param_map(cfg, source, C.RECEIVERS, vocab_pad=64, dtype="bfloat16")


MODELS = {"dense": (config, _dense_map), "moe": (moe_config, _moe_map)}  # synced in this order


def plans(model: str = "dense") -> tuple[bridge.Fp8ParamMap, bridge.BridgePlan, bridge.BridgePlan]:
    """The FP8 sync and the bfloat16 sync of one model of ``MODELS``, from the config alone (both sides)."""
    make_config, make_map = MODELS[model]
    cfg = make_config()
    source = C.source_for(cfg)
    pm = make_map(cfg, source)
    fp8 = bridge.fp8_param_map(source, pm, FMT)
    return fp8, bridge.BridgePlan(fp8.source, fp8.param_map), bridge.BridgePlan(source, pm)


def trainer(rank: int, args) -> None:
    t0 = time.perf_counter()
    import jax

    jax.distributed.initialize(f"127.0.0.1:{args.jax_port}", num_processes=2, process_id=rank,
                               initialization_timeout=120)
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices(), axis_types=(jax.sharding.AxisType.Auto,))
    bridge.init_group(rank, C.WORLD, port=args.port, timeout=120)
    C.events["start_seconds"] = time.perf_counter() - t0  # imports, jax.distributed, the sync group
    for version, model in enumerate(MODELS):
        _train_side(rank, args, mesh, model, version=2 * version + 1)


def _train_side(rank: int, args, mesh, model: str, version: int) -> None:
    """One model: build it, its logits and full leaves, then the FP8 sync (``version``) and the bfloat16 one."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bridge.trainer.fp8 import quantize_params
    from bridge.trainer.sender import Sender, flatten_params
    from jreshard import nn as jnn

    ev = C.events[model] = {}
    fp8, fp8_plan, bf16_plan = plans(model)
    cfg = MODELS[model][0]()
    t0 = time.perf_counter()
    shardings = {p: NamedSharding(mesh, P(*fsdp_spec(p, s))) for p, s in param_shapes(cfg).items()}
    params = jax.jit(lambda key: jnn.init_params(cfg, key), out_shardings=C.nest(shardings))(jax.random.key(0))
    tok = jax.make_array_from_callback((2, 16), NamedSharding(mesh, P()), lambda idx: C.tokens(cfg)[idx])
    logits = jax.jit(lambda p, t: jnn.logits(cfg, p, t), out_shardings=NamedSharding(mesh, P()))(params, tok)
    # Every leaf replicated in one program (one compile), then read from a local device.
    whole = jax.jit(lambda p: p, out_shardings=NamedSharding(mesh, P()))(flatten_params(params))
    full = {k: np.asarray(v.addressable_data(0)) for k, v in whole.items()}
    ev["model_seconds"] = time.perf_counter() - t0  # params, logits, the full leaves
    if rank == 0:
        np.save(os.path.join(args.out, f"{model}_jax_logits.npy"), np.asarray(logits.addressable_data(0)))
        np.savez(os.path.join(args.out, f"{model}_params.npz"), **full)
    ev["describe_matches_config"] = bridge.trainer.sender.describe(params, C.TRAINERS) == C.source_for(cfg)
    t0 = time.perf_counter()
    sent = quantize_params(params, fp8)
    jax.block_until_ready(sent)
    ev["quantize_seconds"] = time.perf_counter() - t0
    ev["quantized_matches_plan"] = bridge.trainer.sender.describe(sent, C.TRAINERS) == fp8.source
    for phase, plan, tree, v in (("fp8", fp8_plan, sent, version), ("bf16", bf16_plan, params, version + 1)):
        t0 = time.perf_counter()
        Sender(plan, rank=rank, timeout=TIMEOUT).sync(tree, version=v)
        ev[phase] = {"ok": True, "seconds": time.perf_counter() - t0}
        C.save(args.out, rank)


def receiver(rank: int, args) -> None:
    bridge.init_group(rank, C.WORLD, port=args.port, timeout=120)
    for model in MODELS:
        _receive_side(rank, args, model)


def _receive_side(rank: int, args, model: str) -> None:
    import torch

    ev = C.events[model] = {}
    fp8, fp8_plan, bf16_plan = plans(model)
    held = {p.name: torch.zeros(p.shape, dtype=getattr(torch, p.dtype)) for p in fp8.param_map.for_rank(rank)}
    bf16 = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16) for p in bf16_plan.param_map.for_rank(rank)}
    for phase, plan, tensors in (("fp8", fp8_plan, held), ("bf16", bf16_plan, bf16)):
        rec = bridge.Receiver(plan, tensors, rank=rank, timeout=TIMEOUT)
        t0 = time.perf_counter()
        version = rec.sync()
        ev[phase] = {"ok": True, "version": version, "seconds": time.perf_counter() - t0,
                     "bytes": rec.last_stats.received_bytes}
        if phase == "fp8":
            ev["fp8_dtypes"] = sorted({str(t.dtype) for t in held.values()})
            np.savez(os.path.join(args.out, f"rank{rank}_{model}_fp8.npz"),
                     **{n: t.view(torch.uint8).numpy() if t.dtype == torch.float8_e4m3fn else t.float().numpy()
                        for n, t in held.items()})
        C.save(args.out, rank)


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--rank", "--port", "--jax-port"):
        ap.add_argument(flag, type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    C.run_worker(args, trainer, receiver)


if __name__ == "__main__":
    main()
