"""One process of the bridge's multi-process test: a JAX trainer (ranks 0, 1) or a torch receiver (2, 3).

Run by tests/bridge/test_bridge_multiprocess.py; every phase writes its results under --out
(``rank{r}_{phase}.npz`` with the received local tensors, ``rank{r}.json`` with events), and the
test checks them against NumPy references. Phases, in order:

  fused_f32   FSDP over 4 JAX devices -> TP2 with fused qkv/gate_up and a padded vocabulary
  fused_bf16  the same, cast to bfloat16 at the sender
  dtensor     DTensor params (Shard/Replicate over a DeviceMesh of the two receivers)
  mismatch    receivers plan with another vocabulary padding: every rank must raise PlanMismatchError
  rejected    receiver rank 3's Receiver refuses its parameters and it calls bridge.reject_sync: every
              other rank must fail at once (not after ready_timeout), receiver 2's weights untouched
  e2e         flax Llama (llama-tiny) takes a training step; synced into Hugging Face names, TP2
  pre_kill    a first sync into the receivers that the kill phase must leave untouched
  kill        trainer rank 1 kills itself mid-sync; everyone else must fail within the timeout
  restart     the trainers are relaunched (--restart) on a new group (--port2); the sync succeeds
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import _common as C  # noqa: E402

import bridge  # noqa: E402
from jreshard.nn import fsdp_spec, param_shapes  # noqa: E402

source_for = C.source_for

TIMEOUT = 60.0  # a trainer's first sync of a phase compiles its casts: seconds on a loaded machine
KILL_TIMEOUT = 10.0
RESTART_TIMEOUT = 60.0  # the restarted trainers' first sync compiles their packing: slow on a loaded machine

def save(out: str, rank: int) -> None:
    """``C.save``, to ``rank{r}_restart.json`` in a restarted trainer."""
    C.save(out, rank, "_restart" if C.events.get("restarted") else "")


def plans(config, **kw) -> dict[str, bridge.BridgePlan]:
    """Every phase's plan, built from the config alone (what a torch-only process can do)."""
    small, tiny = C.small_config(), C.tiny_config()
    s_small, s_tiny = source_for(small), source_for(tiny)
    fused = bridge.llama_param_map(small, s_small, C.RECEIVERS, fused=True, vocab_pad=64)
    out = {
        "fused_f32": bridge.BridgePlan(s_small, fused, bucket_bytes=1 << 20),
        "fused_bf16": bridge.BridgePlan(
            s_small, bridge.llama_param_map(small, s_small, C.RECEIVERS, fused=True, dtype="bfloat16"),
            bucket_bytes=1 << 20),
        "e2e": bridge.BridgePlan(
            s_tiny, bridge.llama_param_map(tiny, s_tiny, C.RECEIVERS, fused=False, vocab_pad=C.E2E_VOCAB_PAD)),
        "kill": bridge.BridgePlan(s_small, fused, bucket_bytes=64 << 10),
    }
    out["pre_kill"] = out["restart"] = out["kill"]
    out["mismatch"] = out["fused_f32"]  # the receivers plan this one with another padding
    out["rejected"] = out["fused_f32"]
    dt = (bridge.dtensor_params("q.weight", s_small, "layers_0/attn/q_proj/kernel", [2, 3], [("shard", 0)],
                                 transpose=True)
          + bridge.dtensor_params("down.weight", s_small, "layers_1/mlp/down_proj/kernel", [2, 3], [("shard", 1)],
                                   transpose=True)
          + bridge.dtensor_params("embed.weight", s_small, "embed/embedding", [2, 3], ["replicate"])
          + bridge.dtensor_params("norm.weight", s_small, "final_norm/scale", [2, 3], [("shard", 0)]))
    out["dtensor"] = bridge.BridgePlan(s_small, dt, bucket_bytes=1 << 20)
    return out


# --------------------------------------------------------------------------- trainers
def trainer(rank: int, args) -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bridge.trainer.sender import Sender, describe
    from jreshard import nn as jnn

    jax.distributed.initialize(f"127.0.0.1:{args.jax_port}", num_processes=2, process_id=rank,
                               initialization_timeout=120)
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices(), axis_types=(jax.sharding.AxisType.Auto,))

    def put(tree: dict[str, np.ndarray]) -> dict:
        nested: dict = {}
        for path, a in tree.items():
            sh = NamedSharding(mesh, P(*fsdp_spec(path, a.shape)))
            node = nested
            *head, last = path.split("/")
            for k in head:
                node = node.setdefault(k, {})
            node[last] = jax.make_array_from_callback(a.shape, sh, lambda idx, a=a: a[idx])
        return nested

    bridge.init_group(rank, C.WORLD, port=args.port2 if args.restart else args.port, timeout=120)
    all_plans = plans(None)
    small = put(C.make_arrays(C.small_config(), seed=1))
    # The trainer describes its live arrays; receivers build the Source from the config.
    C.events["describe_matches_config"] = describe(small, C.TRAINERS) == source_for(C.small_config())

    def run(phase: str, params, version: int, transport=None) -> None:
        t0 = time.perf_counter()
        try:
            timeout = {"kill": KILL_TIMEOUT, "restart": RESTART_TIMEOUT}.get(phase, TIMEOUT)
            Sender(all_plans[phase], rank=rank, timeout=timeout).sync(params, version=version, transport=transport)
            C.events[phase] = {"ok": True, "seconds": time.perf_counter() - t0}
        except Exception as e:  # recorded for the test to check
            C.events[phase] = {"ok": False, "error": type(e).__name__, "message": str(e),
                             "seconds": time.perf_counter() - t0}
        save(args.out, rank)

    if args.restart:
        run("restart", put(C.make_arrays(C.small_config(), seed=3)), version=8)
        import torch.distributed as dist

        dist.destroy_process_group()
        jax.distributed.shutdown()
        return
    run("fused_f32", small, 1)
    run("fused_bf16", small, 2)
    run("dtensor", small, 3)
    run("mismatch", small, 4)
    run("rejected", small, 4)

    cfg = C.tiny_config()
    shardings = {p: NamedSharding(mesh, P(*fsdp_spec(p, s))) for p, s in param_shapes(cfg).items()}
    init = jax.jit(lambda key: jnn.init_params(cfg, key), out_shardings=C.nest(shardings))
    params = init(jax.random.key(0))
    opt = jnn.make_optimizer(1e-2)
    tok = jax.make_array_from_callback((2, 16), NamedSharding(mesh, P()), lambda idx: C.tokens(cfg)[idx])

    def step(p, t):
        new, _, loss = jnn.train_step(cfg, opt, p, opt.init(p), t)
        return new, loss

    params, loss = jax.jit(step, out_shardings=(C.nest(shardings), NamedSharding(mesh, P())))(params, tok)
    logits = jax.jit(lambda p, t: jnn.logits(cfg, p, t), out_shardings=NamedSharding(mesh, P()))(params, tok)
    if rank == 0:
        np.save(os.path.join(args.out, "jax_logits.npy"), np.asarray(logits.addressable_data(0)))
    C.events["e2e_loss"] = float(np.asarray(loss.addressable_data(0)))
    run("e2e", params, 5)

    run("pre_kill", small, 6)
    run("kill", put(C.make_arrays(C.small_config(), seed=2)), 7, transport=_Dying() if rank == 1 else None)
    C.events["done"] = True
    save(args.out, rank)
    # A JAX job does not survive losing a process: the trainers restart (the test relaunches them).
    os._exit(0)


class _Dying:
    """The gloo transport of a trainer that dies (SIGKILL) posting its third bucket: two are on their way."""

    def __init__(self) -> None:
        from bridge.wire.gloo import GlooTransport

        self.inner, self.posts, self.name = GlooTransport(), 0, "gloo"
        self.wait, self.abort, self.close = self.inner.wait, self.inner.abort, self.inner.close

    def post(self, ops):
        self.posts += 1
        if self.posts == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.post(ops)


# --------------------------------------------------------------------------- receivers
def receiver(rank: int, args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    bridge.init_group(rank, C.WORLD, port=args.port, timeout=120)
    all_plans = plans(None)

    def zeros(plan) -> dict[str, torch.Tensor]:
        return {p.name: torch.zeros(p.shape, dtype=getattr(torch, p.dtype)) for p in plan.param_map.for_rank(rank)}

    def dump(phase: str, params: dict) -> None:
        np.savez(os.path.join(args.out, f"rank{rank}_{phase}.npz"),
                 **{k: v.float().numpy() for k, v in params.items()})

    def run(phase: str, receiver, params) -> None:
        t0 = time.perf_counter()
        try:
            version = receiver.sync()
            C.events[phase] = {"ok": True, "version": version, "seconds": time.perf_counter() - t0}
            dump(phase, params)
        except Exception as e:
            C.events[phase] = {"ok": False, "error": type(e).__name__, "message": str(e),
                             "seconds": time.perf_counter() - t0, "version": receiver.version}
        save(args.out, rank)

    for phase in ("fused_f32", "fused_bf16"):
        params = zeros(all_plans[phase])
        run(phase, bridge.Receiver(all_plans[phase], params, rank=rank, timeout=TIMEOUT), params)

    # DTensors over a DeviceMesh of the two receivers; the DeviceMesh needs no process group here.
    mesh = DeviceMesh("cpu", torch.tensor(list(C.RECEIVERS)), _init_backend=False, _rank=rank)
    locals_ = zeros(all_plans["dtensor"])
    place = {"q.weight": [Shard(0)], "down.weight": [Shard(1)], "embed.weight": [Replicate()],
             "norm.weight": [Shard(0)]}
    dts = {n: DTensor.from_local(locals_[n], mesh, place[n], run_check=False) for n in locals_}
    s_small = source_for(C.small_config())
    leaves = {"q.weight": ("layers_0/attn/q_proj/kernel", True), "down.weight": ("layers_1/mlp/down_proj/kernel", True),
              "embed.weight": ("embed/embedding", False), "norm.weight": ("final_norm/scale", False)}
    param_map = bridge.dtensor_param_map(s_small, {n: (dts[n], *leaves[n]) for n in dts})
    C.events["dtensor_param_map_matches"] = param_map == all_plans["dtensor"].param_map
    plan = bridge.BridgePlan(s_small, param_map, bucket_bytes=1 << 20)
    run("dtensor", bridge.Receiver(plan, dts, rank=rank, timeout=TIMEOUT), {n: d.to_local() for n, d in dts.items()})

    small = C.small_config()
    # Another vocabulary padding (1000 rows to 1056, not 1024): same names, other shapes and plan.
    wrong = bridge.BridgePlan(s_small, bridge.llama_param_map(small, s_small, C.RECEIVERS, fused=True, vocab_pad=96),
                              bucket_bytes=all_plans["mismatch"].bucket_bytes)
    params = zeros(wrong)
    run("mismatch", bridge.Receiver(wrong, params, rank=rank, timeout=TIMEOUT), params)

    params = zeros(all_plans["rejected"])
    if rank == C.RECEIVERS[1]:
        t0 = time.perf_counter()
        try:
            bridge.Receiver(all_plans["rejected"], {k: v.double() for k, v in params.items()}, rank=rank)
            C.events["rejected"] = {"ok": True}
        except ValueError as e:
            bridge.reject_sync(all_plans["rejected"], rank=rank)
            C.events["rejected"] = {"ok": False, "error": "ValueError", "message": str(e),
                                  "seconds": time.perf_counter() - t0}
        save(args.out, rank)
    else:
        rec = bridge.Receiver(all_plans["rejected"], params, rank=rank, timeout=TIMEOUT, ready_timeout=300)
        run("rejected", rec, params)
        C.events["rejected"]["unchanged"] = all(bool((v == 0).all()) for v in params.values())
        save(args.out, rank)

    params = zeros(all_plans["e2e"])
    run("e2e", bridge.Receiver(all_plans["e2e"], params, rank=rank, timeout=TIMEOUT), params)

    params = zeros(all_plans["kill"])
    rec = bridge.Receiver(all_plans["kill"], params, rank=rank, timeout=KILL_TIMEOUT)
    run("pre_kill", rec, params)
    before = {k: v.clone() for k, v in params.items()}
    run("kill", rec, params)
    C.events["kill"]["unchanged"] = all(torch.equal(before[k], params[k]) for k in params)
    C.events["kill"]["version_after"] = rec.version
    save(args.out, rank)
    # The trainers restart; this process keeps its weights, recreates the group and syncs again.
    dist.destroy_process_group()
    bridge.init_group(rank, C.WORLD, port=args.port2, timeout=120)
    rec.timeout = RESTART_TIMEOUT
    run("restart", rec, params)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--port2", type=int, default=0)
    ap.add_argument("--jax-port", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--restart", action="store_true")
    args = ap.parse_args()
    if args.restart:
        C.events["restarted"] = True
    C.run_worker(args, trainer, receiver, suffix="_restart" if args.restart else "", exit_trainers=False)


if __name__ == "__main__":
    main()
