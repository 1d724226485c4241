"""Benchmark: syncing a live vLLM engine (CPU, TP2) with jreshard vs what vLLM's nccl backend does.

Setup: one JAX trainer process with 4 simulated CPU devices (FSDP) holds a dense Qwen3 of a
few hundred MB (float32); a vLLM engine (TP2, backend "jreshard") serves the same model in
two worker processes. Side by side on the same engine:

  jreshard   bridge.engines.vllm.VLLMWeightSync: every worker receives exactly its slices (lower bound),
             straight from the trainer's shards, then vLLM's post-load processing per layer; by
             default through shared memory (the workers share the trainer's host), and over gloo
             (transport="gloo") in turn
  nccl-like  what vLLM's "nccl" backend does, over gloo here: the trainer gathers every full
             tensor, broadcasts every checkpoint-format tensor to every worker, and each worker
             runs vLLM's layerwise reload (model.load_weights slices and fuses, then processes)
  nccl_m2n   bytes only, from the plan: direct shards for one-to-one params, full tensors for
             every fused param (qkv_proj, gate_up_proj, w13_weight, w2_weight)

With ``--serve``, then the same syncs into a ``vllm serve`` server (``python -m
bridge.engines.vllm.serve``, TP2 on 127.0.0.1) driven over HTTP (``bridge.engines.vllm.HTTPClient``),
after the in-process engine has shut down: the sync's time and what its control calls cost (the
phases that move no weights: ``/pause``, ``/start_weight_update``, ``/finish_weight_update``,
``/resume``) beside the same calls on the in-process engine; then refit while serving
(``benchmarks/refit_serving.py``): tokens/s during syncs against idle, and the pause over the sync,
with ``pause="sync"`` and ``pause="commit"``.

Then, from the planner alone, bytes per worker for Qwen3-32B and Qwen3-235B-A22B at vLLM TP8.
Goals: bytes per worker equal the lower bound; jreshard at least 3x faster than nccl-like over shared
memory (2x over gloo).

Usage: python benchmarks/vllm_bench.py [--small] [--reps 3] [--serve] [--planner-only]
(in an environment with vLLM; the nccl-like baseline runs a function on the workers, so it sets
VLLM_ALLOW_INSECURE_SERIALIZATION=1 for the engine it starts).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import refit_serving  # noqa: E402 (beside this script)

from tests._procs import free_ports  # noqa: E402 (the repository root is on the path)
from tests.helpers import hf_state  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ bytes from plans (pure)
def planner_only() -> None:
    from bridge import Source, trainer_mesh
    from bridge.engines.hello import EngineShape, build_param_map
    from bridge.engines.vllm.baselines import bytes_per_worker
    from bridge.recipes import Recipe
    from jreshard.nn import LlamaConfig, MoeConfig, fsdp_spec, param_shapes

    models = [("Qwen3-32B", LlamaConfig.load("qwen3-32b"), Recipe.llama),
              ("Qwen3-235B-A22B", MoeConfig.load("qwen3-235b-a22b", intermediate_size=12288), Recipe.qwen3_moe)]
    print("\nPlanner only: bytes each vLLM worker receives at TP8 (bfloat16; trainer FSDP over 64 devices)")
    print(f"{'model':<18}{'jreshard (lower bound)':>24}{'nccl':>12}{'nccl_m2n':>12}{'nccl / jreshard':>17}"
          f"{'m2n / jreshard':>16}")
    for name, cfg, recipe in models:
        t0 = time.perf_counter()
        src = Source.build(param_shapes(cfg), trainer_mesh((64,), "fsdp", list(range(8)), 8), fsdp_spec,
                           dtype="bfloat16")
        engine = EngineShape((tuple(range(8, 16)),), False, "bfloat16")
        b = bytes_per_worker(build_param_map(src, recipe(cfg), engine), src)
        rank = 8
        j, n, m = b["jreshard"][rank], b["nccl"][rank], b["nccl_m2n"][rank]
        print(f"{name:<18}{j / 2**30:>20.2f} GiB{n / 2**30:>8.1f} GiB{m / 2**30:>8.1f} GiB{n / j:>16.1f}x"
              f"{m / j:>15.1f}x   ({time.perf_counter() - t0:.1f} s to plan)")


# ------------------------------------------------------------------ the nccl-like baseline, worker side
def receive_full(worker: Any, host: str, port: int, world: int,
                 specs: list[tuple[str, list[int], str]], secret: str) -> dict[str, float]:
    """On each vLLM worker: receive every full checkpoint tensor by broadcast, load it as vLLM's nccl backend does.

    Returns this worker's seconds: ``receive`` (waiting in broadcasts), ``load`` (the rest of
    ``load_weights`` and the reload's finalisation), of which ``process`` (post-load processing).
    """
    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from bridge.engines.group import close_group, open_group

    model = worker.model_runner.get_model()
    pg = open_group(host, port, 1 + get_tensor_model_parallel_rank(), world, secret=bytes.fromhex(secret),
                    timeout=300.0, name="baseline")
    clock = {"receive": 0.0, "process": 0.0}

    def tensors():
        for name, shape, dtype in specs:
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            t0 = time.perf_counter()
            dist.broadcast(t, src=0, group=pg)
            clock["receive"] += time.perf_counter() - t0
            yield name, t

    with set_current_vllm_config(worker.vllm_config), torch.no_grad(), timed_processing(model, clock):
        t0 = time.perf_counter()
        initialize_layerwise_reload(model)
        model.load_weights(tensors())
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        clock["load"] = time.perf_counter() - t0 - clock["receive"]
    close_group(pg)
    return clock


@contextlib.contextmanager
def timed_processing(model: Any, clock: dict[str, float]):
    """Adds the seconds of every layer's ``quant_method.process_weights_after_loading`` to ``clock["process"]``."""
    methods = {id(m.quant_method): m.quant_method for m in model.modules()
               if getattr(m, "quant_method", None) is not None}

    def wrap(f):
        def timed(layer):
            t0 = time.perf_counter()
            try:
                return f(layer)
            finally:
                clock["process"] += time.perf_counter() - t0
        return timed

    for q in methods.values():
        q.process_weights_after_loading = wrap(q.process_weights_after_loading)  # this instance only
    try:
        yield
    finally:
        for q in methods.values():
            del q.process_weights_after_loading


# ------------------------------------------------------------------ vllm serve over HTTP
CONTROL = ("pause_generation", "start_weight_update", "finish_weight_update", "resume_generation")


class TimedClient:
    """Forwards to a weight-sync client and adds each call's seconds to ``seconds[method]``."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.seconds: dict[str, float] = defaultdict(float)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)  # AttributeError where the client lacks it (no pausing)

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(*args, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed


PHASES = ("total", "control", "send", "commit", "rest")


def phases(total: float, report: Any, control: float, run: dict[str, Any] | None = None) -> dict[str, float]:
    """One sync's seconds: in all, in control calls, trainer rank 0's send, the slower worker's commit, the rest.

    From a ``SyncReport`` or from a run the in-process loop recorded (its ``send`` and ``workers``)."""
    if run is None:
        run = {"send": report.seconds[0]["send"],
               "workers": [report.seconds[r] for r in sorted(report.bytes_received)]}
    commit = max(w["commit"] for w in run["workers"])
    return {"total": total, "control": control, "send": run["send"], "commit": commit,
            "rest": total - run["send"] - commit}


def start_server(model_dir: str, log_path: str) -> Any:
    """``python -m bridge.engines.vllm.serve`` (TP2, 127.0.0.1), returned once it answers /health."""
    from bridge.engines.vllm.server import Server
    from tests.vllm._live import serve_arguments

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "VLLM_ALLOW_INSECURE_SERIALIZATION")}
    # with /inference/v1/generate (refit_serving)
    args = serve_arguments(model_dir, "127.0.0.1", free_ports(1)[0], "bench")
    return Server(args, env=env, log=log_path, cwd=os.path.dirname(HERE)).wait()


def served(args: argparse.Namespace, cfg: Any, model_dir: str, params: Any, want: list[list[int]],
           in_process: dict[str, float]) -> None:
    """The in-process run's syncs again, into ``vllm serve`` over HTTP; prints both rows."""
    import requests

    from bridge.engines.vllm import HTTPClient, Recipe, VLLMWeightSync
    from tests.vllm._live import completions

    log_path = os.path.join(model_dir, "serve.log")
    t0 = time.perf_counter()
    server = start_server(model_dir, log_path)
    url = server.url
    try:
        print(f"\nvllm serve up in {time.perf_counter() - t0:.0f} s ({url})", flush=True)
        timed = TimedClient(HTTPClient(url))
        sync = VLLMWeightSync(Recipe.llama(cfg), workers=2, client=timed, rank=0, trainers=1,
                              port=free_ports(1)[0], timeout=300.0, ready_timeout=300.0)
        t0 = time.perf_counter()
        sync.connect(params)
        sync.sync(params, 1)
        first = time.perf_counter() - t0
        runs: list[dict[str, float]] = []
        for v in range(2, 2 + args.reps):
            timed.seconds.clear()
            t0 = time.perf_counter()
            report = sync.sync(params, v)
            runs.append(phases(time.perf_counter() - t0, report, sum(timed.seconds[m] for m in CONTROL)))
        sync.close()
        version = requests.get(f"{url}/weight_info", timeout=60).json()["weight_version"]
        trips = []
        for _ in range(20):
            t0 = time.perf_counter()
            requests.get(f"{url}/weight_info", timeout=60)
            trips.append(time.perf_counter() - t0)
        got = [c["tokens"] for c in completions(url, "bench", [[1, 2, 3, 4]], 8)]

        def make_sync(pause: str) -> VLLMWeightSync:
            return VLLMWeightSync(Recipe.llama(cfg), workers=2, client=HTTPClient(url, pause_mode="keep"), rank=0,
                                  trainers=1, port=free_ports(1)[0], timeout=300.0, ready_timeout=300.0, pause=pause)

        serving = refit_serving.measure(url, make_sync, params, args.reps)
    except BaseException:
        with open(log_path) as f:
            print(f"--- vllm serve log\n{f.read()[-4000:]}")
        raise
    finally:
        server.close()
    http = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"\n{'seconds, medians of ' + str(args.reps):<34}{'sync':>6}{'control calls':>15}{'trainer send':>14}"
          f"{'workers commit':>16}{'the rest':>10}")
    for name, row in (("in process (LLMClient)", in_process), ("vllm serve (HTTPClient)", http)):
        print(f"{'jreshard, ' + name:<34}" + "".join(f"{row[k]:>{w}.3f}" for k, w in
                                                     (("total", 6), ("control", 15), ("send", 14),
                                                      ("commit", 16), ("rest", 10))))
    print(f"(vllm serve: first sync {first:.2f} s with group, hellos and plan; the rest: the phase calls and "
          "reports beside the send and the commit)")
    print(f"control calls: {', '.join(CONTROL)}; one HTTP round trip (GET /weight_info, median of 20): "
          f"{statistics.median(trips) * 1e3:.1f} ms; the server reports version {version!r} "
          f"(synced {1 + args.reps}); its greedy tokens equal the in-process engine's: {got == want}")
    refit_serving.show(serving, args.reps)


# ------------------------------------------------------------------ the live run
def live(args: argparse.Namespace) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = [HERE, os.path.dirname(HERE)]
    import jax
    import torch
    import torch.distributed as dist
    import transformers
    import vllm_bench as me  # importable by reference on the workers (PYTHONPATH)
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax.tree_util import keystr, tree_flatten_with_path
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    from bridge.engines.group import close_group, open_group
    from bridge.engines.vllm import LLMClient, Recipe, VLLMWeightSync
    from bridge.engines.vllm.baselines import bytes_per_worker
    from jreshard.nn import LlamaConfig, fsdp_spec, init_params

    cfg = (LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, qk_norm=True)
           if args.small else
           LlamaConfig(vocab_size=16384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=128, qk_norm=True))
    tmp = tempfile.mkdtemp(prefix="vllm_bench_")
    conf = transformers.Qwen3Config(**cfg.hf_kwargs(), max_position_embeddings=256)
    transformers.Qwen3ForCausalLM(conf).save_pretrained(tmp)
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,))
    params = init_params(cfg, jax.random.key(1))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.device_put(x, NamedSharding(mesh, P(*fsdp_spec(keystr(p, simple=True, separator="/"),
                                                                          x.shape)))), params)
    nbytes = sum(x.size * 4 for x in jax.tree_util.tree_leaves(params))
    print(f"model: {nbytes / 2**20:.0f} MiB float32, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}; "
          f"trainer FSDP over 4 JAX devices -> vLLM TP2 (CPU, gloo)", flush=True)
    t0 = time.perf_counter()
    llm = LLM(model=tmp, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              distributed_executor_backend="mp", max_model_len=256, tensor_parallel_size=2,
              weight_transfer_config=WeightTransferConfig(backend="jreshard"))
    print(f"engine up in {time.perf_counter() - t0:.0f} s", flush=True)

    def greedy() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=8, temperature=0.0),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    timed = TimedClient(LLMClient(llm))
    sync = VLLMWeightSync(Recipe.llama(cfg), workers=2, client=timed, rank=0, trainers=1,
                          port=free_ports(1)[0], timeout=300.0, ready_timeout=300.0)
    t0 = time.perf_counter()
    sync.connect(params)  # the group, the hellos and the plan (every rank plans it once)
    connect = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = sync.sync(params, 1)  # the first send compiles XLA's casts and transposes (once per shard shape)
    first, first_send = time.perf_counter() - t0, report.seconds[0]
    assert sync.plan is not None
    plan_bytes = bytes_per_worker(sync.plan.param_map, sync.plan.source)
    flat = {keystr(k, simple=True, separator="/"): x for k, x in tree_flatten_with_path(params)[0]}
    specs = [(n, list(a.shape), "float32") for n, a in hf_state(flat, cfg).items()]

    def baseline() -> dict[str, Any]:
        port, replies, secret = free_ports(1)[0], [], os.urandom(32).hex()
        t0 = time.perf_counter()
        worker_call = threading.Thread(target=lambda: replies.extend(llm.collective_rpc(
            me.receive_full, args=("127.0.0.1", port, 3, specs, secret))))
        worker_call.start()
        pg = open_group("127.0.0.1", port, 0, 3, secret=bytes.fromhex(secret), timeout=300.0, name="baseline")
        t1 = time.perf_counter()
        full = {k: np.asarray(jax.device_get(x)) for k, x in flat.items()}  # the gather: every full tensor
        t2 = time.perf_counter()
        for a in hf_state(full, cfg).values():
            dist.broadcast(torch.from_numpy(np.require(a, requirements=["C", "W"])), src=0, group=pg)
        t3 = time.perf_counter()
        worker_call.join()
        total = time.perf_counter() - t0
        close_group(pg)
        return {"total": total, "gather": t2 - t1, "send": t3 - t2, "workers": replies}

    # The two methods take turns on the same engine, so that both see the same machine load.
    # jreshard's default ("auto": the engine's workers share this host, so shared memory) and over gloo.
    runs: dict[str, list[dict[str, Any]]] = {"jreshard": [], "jreshard-gloo": [], "nccl-like": []}
    routes: dict[str, Any] = {}
    for v in range(2, 2 + args.reps):
        for method, transport in (("jreshard", "auto"), ("jreshard-gloo", "gloo")):
            timed.seconds.clear()
            sync.transport = transport
            t0 = time.perf_counter()
            report = sync.sync(params, v)
            total, workers = time.perf_counter() - t0, [report.seconds[r] for r in sorted(report.bytes_received)]
            runs[method].append({"total": total, **report.seconds[0], "workers": workers,
                                 "control": sum(timed.seconds[m] for m in CONTROL),
                                 "rest": total - report.seconds[0]["send"] - max(w["commit"] for w in workers)})
            routes[method] = report.transport_bytes
        sync.transport = "auto"
        runs["nccl-like"].append(baseline())
    after_baseline = greedy()
    sync.sync(params, 2 + args.reps)
    after_jreshard = greedy()

    def med(method: str, key: str, worker: bool = False) -> float:
        """Median over runs; for worker phases, the slowest worker of each run."""
        return statistics.median(max(w.get(key, 0.0) for w in run["workers"]) if worker else run[key]
                                 for run in runs[method])

    j, b = med("jreshard", "total"), med("nccl-like", "total")
    print(f"\n{'':<12}{'bytes per worker (ranks 1, 2)':>34}{'sync time (median of ' + str(args.reps) + ')':>26}")
    recv = [report.bytes_received[r] for r in sorted(report.bytes_received)]
    print(f"{'jreshard':<12}{', '.join(f'{x / 2**20:.1f} MiB' for x in recv):>34}{j:>22.3f} s"
          f"   (first sync {connect + first:.2f} s: group, hellos and plan {connect:.2f} s, first send "
          f"{first_send['send']:.2f} s, of which pack {first_send['pack']:.2f} s)")
    g = med("jreshard-gloo", "total")
    print(f"{'  over gloo':<12}{'(the same bytes)':>34}{g:>22.3f} s   (bytes per route, per worker: over shm "
          f"{routes['jreshard']}, over gloo {routes['jreshard-gloo']})")
    full_bytes = list(plan_bytes["nccl"].values())
    print(f"{'nccl-like':<12}{', '.join(f'{x / 2**20:.1f} MiB' for x in full_bytes):>34}{b:>22.3f} s")
    m2n = [plan_bytes["nccl_m2n"][r] for r in sorted(plan_bytes["nccl_m2n"])]
    print(f"{'nccl_m2n':<12}{', '.join(f'{x / 2**20:.1f} MiB' for x in m2n):>34}{'(bytes only)':>24}")

    jp, bp = med("jreshard", "process", True), med("nccl-like", "process", True)
    print("\nWhere the time goes (seconds, medians; worker phases: the slowest worker):")
    steps = ("handshake", "pack", "vote", "post", "wait")
    print(f"  jreshard   trainer send {med('jreshard', 'send'):.3f} (wire: "
          + ", ".join(f"{k} {med('jreshard', k):.3f}" for k in steps) + "; pack includes XLA's transposes)")
    print(f"             workers: receive {med('jreshard', 'receive', True):.3f} (wire: "
          + ", ".join(f"{k} {med('jreshard', k, True):.3f}" for k in steps if k != "pack")
          + f"; staging copies {med('jreshard', 'unpack', True):.3f}), commit {med('jreshard', 'commit', True):.3f} "
          f"(of which vLLM post-load processing {jp:.3f}); the rest (phase calls, reports) "
          f"{med('jreshard', 'rest'):.3f}")
    print(f"  nccl-like  trainer gather {med('nccl-like', 'gather'):.3f}, broadcasts {med('nccl-like', 'send'):.3f}; "
          f"workers: waiting in broadcasts {med('nccl-like', 'receive', True):.3f}, load_weights and reload "
          f"{med('nccl-like', 'load', True):.3f} (of which vLLM post-load processing {bp:.3f})")
    lower = [plan_bytes["jreshard"][r] for r in sorted(plan_bytes["jreshard"])]
    print(f"\nbytes per worker = lower bound: {recv == lower}; nccl-like / jreshard time: {b / j:.2f}x over shm "
          f"(goal >= 3x), {b / g:.2f}x over gloo; "
          f"excluding each one's post-load processing: {(b - bp) / (j - jp):.2f}x "
          f"({b - bp:.3f} s vs {j - jp:.3f} s); the two leave the same greedy tokens: "
          f"{after_jreshard == after_baseline}")
    if args.serve:  # one engine at a time: this one goes first
        sync.close()
        llm.llm_engine.engine_core.shutdown()
        del llm
        served(args, cfg, tmp, params, after_jreshard, {k: statistics.median(
            phases(r["total"], None, r["control"], r)[k] for r in runs["jreshard"]) for k in PHASES})
    shutil.rmtree(tmp, ignore_errors=True)  # the saved model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a ~10 MB model (a quick check)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help="then the same syncs into vllm serve over HTTP")
    ap.add_argument("--planner-only", action="store_true")
    args = ap.parse_args()
    if not args.planner_only:
        live(args)
    planner_only()
    print(f"\nPython {sys.version.split()[0]}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
