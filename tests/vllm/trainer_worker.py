"""One JAX trainer process of the vLLM tests (2 simulated devices, FSDP over both processes' 4).

Started by tests/vllm/test_vllm_live.py, two at a time:
``trainer_worker.py --rank R --jax-port P --sync-port Q --server PORT --model DIR --out DIR --versions 1,2``.
Both start from the engine's initial weights (``initial.npz`` next to the saved model), take one training step per
version and sync it into the engine through bridge.engines.vllm.VLLMWeightSync. Rank 0 saves each version's
weights (``params_v{v}.npz``) and every rank its events (``rank{R}.json``: reports, errors, plan bytes).
Rank 0 waits for the file ``go_v{v}`` before the next version, so the test can query the engine in between.

``--mode mismatch`` syncs with a recipe that asks for bfloat16 params (the engine holds float32);
``--mode die`` makes rank 1 exit in the middle of the first sync; ``--mode retry`` sends version 2 with
``final_norm/scale`` of the wrong shape (the sync fails on every rank) and goes on with the next version
on the same ``VLLMWeightSync``. ``--client http`` drives a ``vllm serve`` server on port ``--server``
(tests/vllm/test_serve_live.py) with ``bridge.engines.vllm.http.HTTPClient``; ``--pause commit`` syncs with
``VLLMWeightSync(pause="commit")`` and an ``HTTPClient`` that pauses in vLLM's ``"keep"`` mode; with ``--gate``
every rank makes the file ``ready_v{v}_r{rank}`` and waits for ``start_v{v}`` before syncing version ``v``.
``--server-host`` and ``--host`` place the engine server and trainer rank 0 elsewhere than 127.0.0.1
(tests/vllm/test_cluster_live.py). ``--kind`` names the model
(``tests/vllm/_common.KINDS``; ``fp8``: the engine serves it as block-FP8, the sync quantizes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tests.vllm import _common as C  # noqa: E402

events: dict = {"syncs": {}}


def save(out: str, rank: int) -> None:
    name = os.path.join(out, f"rank{rank}.json")
    with open(name + ".tmp", "w") as f:
        json.dump(events, f, indent=1)
    os.replace(name + ".tmp", name)


def wait_for(path: str, seconds: float = 300.0) -> None:
    """Returns once the test made the file ``path`` (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _by_dtype(params, size: dict[str, int]) -> dict[str, int]:
    """The bytes of ``params``' regions per dtype (what one worker receives of each)."""
    out: dict[str, int] = {}
    for p in params:
        out[p.dtype] = out.get(p.dtype, 0) + sum(int(np.prod(g.shape)) for g in p.regions) * size[p.name]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--rank", "--jax-port", "--sync-port", "--server"):
        ap.add_argument(a, type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--versions", default="1")
    ap.add_argument("--timeout", type=float, default=30.0, help="the sync's deadline after its handshake (seconds)")
    ap.add_argument("--mode", default="normal", choices=["normal", "mismatch", "die", "retry"])
    ap.add_argument("--kind", default="dense", choices=sorted(C.KINDS))
    ap.add_argument("--client", default="remote", choices=["remote", "http"],
                    help="rank 0 drives the engine server (remote) or a `vllm serve` server over HTTP on --server")
    ap.add_argument("--server-host", default="127.0.0.1", help="the engine server's address")
    ap.add_argument("--host", default="127.0.0.1",
                    help="trainer rank 0's address (jax's coordinator and the sync group's store)")
    ap.add_argument("--pause", default="sync", choices=["sync", "commit"], help="VLLMWeightSync's pause")
    ap.add_argument("--gate", action="store_true", help="each rank waits for the file start_v{v} before syncing v")
    args = ap.parse_args()

    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bridge.engines.vllm import Recipe, VLLMWeightSync
    from jreshard.nn import fsdp_spec, make_optimizer, train_step

    jax.distributed.initialize(f"{args.host}:{args.jax_port}", num_processes=C.TRAINERS, process_id=args.rank,
                               initialization_timeout=120)
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices(), axis_types=(jax.sharding.AxisType.Auto,))
    cfg = C.config(args.kind)
    with np.load(os.path.join(args.model, "initial.npz")) as z:
        flat = C.hf_to_flax({k: z[k] for k in z.files}, cfg)
    params: dict = {}
    for path, a in flat.items():
        node = params
        *head, last = path.split("/")
        for k in head:
            node = node.setdefault(k, {})
        sh = NamedSharding(mesh, P(*fsdp_spec(path, a.shape)))
        node[last] = jax.make_array_from_callback(a.shape, sh, lambda idx, a=a: a[idx])
    opt = make_optimizer(3e-2)
    state = opt.init(params)
    step = jax.jit(train_step, static_argnums=(0, 1))

    recipe = Recipe.qwen3_moe(cfg) if args.kind == "moe" else Recipe.llama(cfg)
    if args.mode == "mismatch":
        recipe = Recipe(tuple(dataclasses.replace(r, dtype="bfloat16") for r in recipe.rules))
    client = None
    if args.rank == 0 and args.client == "http":
        from bridge.engines.vllm.http import HTTPClient

        client = HTTPClient(f"http://{args.server_host}:{args.server}", timeout=300.0,
                            pause_mode="keep" if args.pause == "commit" else "abort")
    elif args.rank == 0:
        client = C.RemoteClient((args.server_host, args.server))
    sync = VLLMWeightSync(recipe, workers=C.TP, client=client, rank=args.rank, trainers=C.TRAINERS,
                          host=args.host, port=args.sync_port,
                          bucket_bytes=(64 << 10) if args.mode == "die" else (16 << 20),
                          timeout=args.timeout, ready_timeout=120.0, pause=args.pause)
    if args.mode == "die" and args.rank == 1:
        from bridge.trainer.sender import Sender

        original, calls = Sender._pack, [0]

        def dying_pack(self, *a, **kw):
            calls[0] += 1
            if calls[0] == 3:  # mid-sync: two buckets were packed and posted
                os._exit(17)
            return original(self, *a, **kw)

        Sender._pack = dying_pack

    for v in [int(x) for x in args.versions.split(",")]:
        tokens = jnp.asarray(np.random.default_rng(v).integers(0, cfg.vocab_size, (4, 16)), jnp.int32)
        params, state, loss = step(cfg, opt, params, state, tokens)
        full = multihost_utils.process_allgather(params, tiled=True)
        if args.rank == 0:
            from jax.tree_util import keystr, tree_flatten_with_path

            arrays = {keystr(k, simple=True, separator="/"): np.asarray(x) for k, x in tree_flatten_with_path(full)[0]}
            np.savez(os.path.join(args.out, f"params_v{v}.npz"), **arrays)
        send = params
        if args.mode == "retry" and v == 2:  # a leaf of the wrong shape, on a connected group
            norm = NamedSharding(mesh, P(None))
            send = {**params, "final_norm": {"scale": jax.make_array_from_callback(
                (cfg.hidden_size // 2,), norm, lambda idx: np.ones(cfg.hidden_size // 2, np.float32)[idx])}}
        if args.gate:  # tells the test this rank is idle until then (its step and gather are done)
            open(os.path.join(args.out, f"ready_v{v}_r{args.rank}"), "w").close()
            wait_for(os.path.join(args.out, f"start_v{v}"))
        t0 = time.perf_counter()
        try:
            report = sync.sync(send, v)
            plan = sync.plan
            size = {p.name: jnp.dtype(p.dtype).itemsize for p in plan.param_map.params}
            events["syncs"][str(v)] = {
                "ok": True, "seconds": time.perf_counter() - t0, "loss": float(loss), "fp8": sync.fp8 is not None,
                "sync_seconds": report.sync_seconds, "pause_seconds": report.pause_seconds,
                "rank_seconds": {str(r): secs for r, secs in report.seconds.items()},
                "bytes_received": {str(r): n for r, n in report.bytes_received.items()},
                "transport_bytes": {str(r): moved for r, moved in report.transport_bytes.items()},
                "plan_recv": {str(r): n for r, n in plan.rank_bytes()["recv"].items()},
                "plan_send": {str(r): n for r, n in plan.rank_bytes()["send"].items()},
                "param_bytes": {str(r): sum(int(np.prod(p.shape)) * size[p.name] for p in plan.param_map.for_rank(r))
                                for r in plan.param_map.ranks},
                "region_bytes": {str(r): sum(int(np.prod(g.shape)) * size[p.name] for p in plan.param_map.for_rank(r)
                                             for g in p.regions) for r in plan.param_map.ranks},
                "dtype_bytes": {str(r): _by_dtype(plan.param_map.for_rank(r), size) for r in plan.param_map.ranks}}
        except Exception as e:
            events["syncs"][str(v)] = {"ok": False, "error": type(e).__name__, "message": str(e),
                                       "seconds": time.perf_counter() - t0, "trace": traceback.format_exc()[-3000:]}
            save(args.out, args.rank)
            if args.mode == "retry":
                continue
            break
        save(args.out, args.rank)
        if args.rank == 0:
            wait_for(os.path.join(args.out, f"go_v{v}"))
    sync.close()
    save(args.out, args.rank)
    if args.mode == "die":
        # A JAX job does not survive losing a process: exit without jax.distributed's shutdown
        # barrier, which would wait for the dead peer's heartbeats to time out (minutes).
        os._exit(0)


if __name__ == "__main__":
    main()
