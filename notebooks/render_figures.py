"""Renders the README's pictures, one per notebook, into docs/images/.

Each picture is the headline figure of its notebook, computed the same way from
the library (planner, catalog, cost model), so the README never shows a figure
that the code no longer produces; 05_rl_loop's draws the numbers that a run of the
notebook recorded (docs/data/05_rl_loop.json). Runs on CPU in a few seconds; no devices needed.

Usage:
  python notebooks/render_figures.py                 # all pictures into docs/images/
  python notebooks/render_figures.py --out /tmp/img --only 01_quickstart
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure

import jreshard
import jreshard.viz as viz

ROOT = Path(__file__).resolve().parents[1]
DPI = 110


def quickstart() -> Figure:
    """01_quickstart: a (10, 12) weight from FSDP rows on devices 0-3 to TP columns x DP on 4-7."""
    train = jreshard.Mesh([0, 1, 2, 3], ("fsdp",))
    serve = jreshard.Mesh([[4, 5], [6, 7]], ("dp", "tp"))
    src = jreshard.Layout((10, 12), train, ("fsdp", None), dtype="float32")
    dst = jreshard.Layout((10, 12), serve, (None, "tp"), dtype="float32")
    return viz.draw_plan(jreshard.plan(src, dst))


def plan_a_model() -> Figure:
    """02_plan_a_model: DeepSeek-V3 sync on DGX H100, jreshard against the three baselines (cost model)."""
    from jreshard.fleet import cost, scenario

    s = scenario.load_scenario("dsv3-dgx-h100")
    src, dst = s.layouts(experts="stacked")
    c = cost.compare(src, dst, s.topology(), jreshard_plan=jreshard.plan(src, dst))
    methods = {"jreshard": c.jreshard, "flat direct sends": c.flat_direct, "gather-then-broadcast": c.gather_broadcast,
               "pipelined tree (ideal)": c.pipelined_tree}
    return viz.draw_comparison({k: p.network_bytes for k, p in methods.items()},
                               {k: p.seconds for k, p in methods.items()},
                               nvlink_bytes_by_method={k: p.nvlink_bytes for k, p in methods.items()},
                               title=f"{s.name}: predicted full weight sync")


def jax_to_torch() -> Figure:
    """03_jax_to_torch: the q part of a fused qkv_proj, from a flax FSDP kernel to two torch TP ranks."""
    import bridge
    from jreshard.nn import LlamaConfig, fsdp_spec, param_shapes

    cfg = LlamaConfig.load("llama-tiny")
    source = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", ranks=[0], devices_per_rank=4),
                                 fsdp_spec)
    plan = bridge.BridgePlan(source, bridge.llama_param_map(cfg, source, tp_ranks=[1, 2], fused=True),
                             bucket_bytes=4 << 20)
    q_job = next(name for name in plan.plan.tensors if "layers.0.self_attn.qkv_proj.weight#0" in name)
    return viz.draw_plan(plan.plan[q_job], title="flax q_proj kernel [in, out], FSDP over 4 JAX devices -> "
                                                 "q rows of qkv_proj on torch TP ranks 1 and 2 (transposed on arrival)")


def vllm_refit() -> Figure:
    """04_vllm_refit: bytes each vLLM worker receives per sync of the notebook's Qwen3 at TP2, by backend."""
    import bridge
    from bridge.engines.hello import build_param_map
    from bridge.engines.vllm import EngineShape, Recipe
    from bridge.engines.vllm.baselines import bytes_per_worker
    from jreshard.nn import LlamaConfig, fsdp_spec, param_shapes

    cfg = LlamaConfig.load("llama-tiny", qk_norm=True)
    source = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((8,), "fsdp", ranks=[0], devices_per_rank=8),
                                 fsdp_spec)
    tp2 = bytes_per_worker(build_param_map(source, Recipe.llama(cfg), EngineShape(((1, 2),), False, "float32")),
                           source)
    return viz.draw_comparison({method: max(per.values()) for method, per in tp2.items()}, baseline="nccl",
                               title=f"{cfg.name} at vLLM TP2: bytes per worker per sync")


def rl_loop() -> Figure:
    """05_rl_loop: reward and seconds per step of the loop, from the run recorded in docs/data/05_rl_loop.json.

    The loop needs a live vLLM engine (about a minute here), so the picture draws the numbers one execution of
    the notebook printed (its last cell) rather than running it again.
    """
    import json

    run = json.loads((ROOT / "docs" / "data" / "05_rl_loop.json").read_text())
    return viz.draw_rl_loop(run["reward"], {"generate": run["generate"], "waiting for the refit": run["wait"],
                                            "train": run["train"]},
                            during={"refit": run["transfer"], "pause": run["pause"]},
                            title="llama-tiny (Qwen3): policy-gradient steps, vllm serve rollouts, "
                                  "a jreshard refit in flight after each")


FIGURES: dict[str, Callable[[], Figure]] = {
    "01_quickstart": quickstart,
    "02_plan_a_model": plan_a_model,
    "03_jax_to_torch": jax_to_torch,
    "04_vllm_refit": vllm_refit,
    "05_rl_loop": rl_loop,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="folder for the PNG files")
    parser.add_argument("--only", action="append", choices=sorted(FIGURES),
                        help="render only this picture (repeatable)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or sorted(FIGURES):
        t0 = time.perf_counter()
        fig = FIGURES[name]()
        path = args.out / f"{name}.png"
        # No software/date stamps, so a re-render with the same code gives the same file.
        fig.savefig(path, dpi=DPI, metadata={"Software": None})
        print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}  ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
