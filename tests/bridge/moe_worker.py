"""One process of the MoE end-to-end test: a JAX trainer (ranks 0, 1) or a torch receiver (ranks 2, 3).

Run by tests/bridge/test_moe_multiprocess.py. The trainers hold jreshard.nn's flax MoE model
(qwen3-moe-tiny) with its experts split over an ``ep`` axis of 4 JAX devices (2 per process),
take one training step and sync the weights into transformers' Qwen3MoeForCausalLM names on
two torch ranks, TP2 (experts split inside, as vLLM's FusedMoE splits them). Each rank writes
``rank{r}.json`` (events) and the receivers ``rank{r}_moe.npz`` (their local tensors).
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
from jreshard.nn import MoeConfig, fsdp_spec, param_shapes  # noqa: E402

VOCAB_PAD = 384  # 512 rows padded to 768: TP rank 1 holds rows 384..512 and 256 padding rows


def config() -> MoeConfig:
    return MoeConfig.load("qwen3-moe-tiny")


def spec(path: str, shape: tuple[int, ...]) -> tuple:
    """Experts split over ``ep`` on their expert dim; everything else FSDP over the same devices."""
    return ("ep", None, None) if "/experts/" in path else fsdp_spec(path, shape, "ep")


def plan() -> bridge.BridgePlan:
    """The sync plan, from the config alone (what a torch-only process can do)."""
    cfg = config()
    source = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "ep", C.TRAINERS, 2), spec)
    return bridge.BridgePlan(source, bridge.qwen3_moe_param_map(cfg, source, C.RECEIVERS, target="hf",
                                                                vocab_pad=VOCAB_PAD), bucket_bytes=256 << 10)


def trainer(rank: int, args) -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bridge.trainer.sender import Sender, describe
    from jreshard import nn as jnn

    jax.distributed.initialize(f"127.0.0.1:{args.jax_port}", num_processes=2, process_id=rank,
                               initialization_timeout=120)
    mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices(), axis_types=(jax.sharding.AxisType.Auto,))
    bridge.init_group(rank, C.WORLD, port=args.port, timeout=120)
    sync_plan = plan()
    cfg = config()
    shardings = {p: NamedSharding(mesh, P(*spec(p, s))) for p, s in param_shapes(cfg).items()}
    nested = C.nest(shardings)
    params = jax.jit(lambda key: jnn.init_params(cfg, key), out_shardings=nested)(jax.random.key(0))
    opt = jnn.make_optimizer(1e-2)
    tokens = C.tokens(cfg)
    tok = jax.make_array_from_callback(tokens.shape, NamedSharding(mesh, P()), lambda idx: tokens[idx])

    def step(p, t):
        new, _, loss = jnn.train_step(cfg, opt, p, opt.init(p), t)
        return new, loss

    params, loss = jax.jit(step, out_shardings=(nested, NamedSharding(mesh, P())))(params, tok)
    logits = jax.jit(lambda p, t: jnn.logits(cfg, p, t), out_shardings=NamedSharding(mesh, P()))(params, tok)
    if rank == 0:
        np.save(os.path.join(args.out, "jax_logits.npy"), np.asarray(logits.addressable_data(0)))
    C.events["loss"] = float(np.asarray(loss.addressable_data(0)))
    C.events["describe_matches_config"] = describe(params, C.TRAINERS) == sync_plan.source
    t0 = time.perf_counter()
    Sender(sync_plan, rank=rank, timeout=30).sync(params, version=1)
    C.events["moe"] = {"ok": True, "seconds": time.perf_counter() - t0}


def receiver(rank: int, args) -> None:
    import torch

    bridge.init_group(rank, C.WORLD, port=args.port, timeout=120)
    sync_plan = plan()
    params = {p.name: torch.zeros(p.shape, dtype=getattr(torch, p.dtype)) for p in sync_plan.param_map.for_rank(rank)}
    version = bridge.Receiver(sync_plan, params, rank=rank, timeout=30).sync()
    C.events["moe"] = {"ok": True, "version": version}
    np.savez(os.path.join(args.out, f"rank{rank}_moe.npz"), **{k: v.numpy() for k, v in params.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--jax-port", type=int, default=0)
    ap.add_argument("--out", required=True)
    C.run_worker(ap.parse_args(), trainer, receiver)


if __name__ == "__main__":
    main()
