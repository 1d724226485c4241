"""``jreshard plan``: bytes, balance and predicted time of a whole-model weight sync."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Iterator
from typing import Any, cast

from jreshard.core.layout import canonical_dtype
from jreshard.core.planner import Plan, PlanStats, clear_cache, plan
from jreshard.core.progress import progress_bar, show_progress
from jreshard.fleet import calibration, catalog, cost
from jreshard.fleet.fp8 import AmaxSummary
from jreshard.fleet.layer import format_layer, predict_layer
from jreshard.fleet.presets import parse_degrees
from jreshard.fleet.scenario import Scenario, ScenarioError, load_scenario

__all__ = ["add_plan_parser", "run_plan", "plan_report", "format_report", "LABELS"]

# With --progress auto, models of more tensors than this show a bar on a terminal (below it
# planning takes well under a second); the policy is jreshard.core.progress's, as for transfer.
_PROGRESS_TENSORS = 5000


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="plan a whole-model weight sync and predict its time",
        description="Plan a weight sync from a scenario file (or --model/--train/--infer/--hardware) and print "
                    "bytes moved, the lower bound, per-device load, messages, predicted seconds for jreshard "
                    "and the baselines, and planning time.")
    p.add_argument("scenario", nargs="?", help="scenario JSON file or built-in scenario name")
    p.add_argument("--model", help=f"catalog model ({', '.join(catalog.models())}) or a config.json path")
    p.add_argument("--train", help="training degrees, e.g. tp=4,pp=4,dp=2 (also ep, cp, fsdp, expert_tp)")
    p.add_argument("--infer", help="inference degrees, e.g. tp=4,dp=8 (also ep, expert_tp)")
    p.add_argument("--hardware", help=f"hardware name ({', '.join(cost.hardware_names())}) or JSON path")
    p.add_argument("--dtype", help="delivered weight dtype (default: the model's); an FP8 type such as float8_e4m3fn "
                                   "quantizes at the sender: block-scaled FP8 for the linear layers, the model's "
                                   "dtype for embeddings, heads, norms and routers")
    p.add_argument("--fp8-block", metavar="BLOCK",
                   help="FP8 scale block: 128x128 (default), 128, 'tensor' or 'channel'")
    p.add_argument("--colocated", action="store_true", help="training and inference share devices")
    p.add_argument("--gpus-per-domain", type=int, help="override the hardware's NVLink domain size")
    p.add_argument("--experts", choices=("separate", "stacked"), default="separate",
                   help="routed experts as separate tensors (Hugging Face) or stacked [experts, ...]")
    p.add_argument("--hierarchical", choices=("auto", "always", "never"), default="auto",
                   help="hierarchical delivery: let the cost model decide (auto), force it, or never")
    p.add_argument("--layer", type=int, metavar="N",
                   help="predict only layer N's routed experts, next to the scenario's published per-layer figures")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on stderr (auto: for large models on a terminal)")


_FLAGS = {"model": "--model", "train": "--train", "infer": "--infer", "hardware": "--hardware", "dtype": "--dtype",
          "fp8_block": "--fp8-block"}


def _restated(exc: ScenarioError, args: argparse.Namespace, fields: tuple[str, ...]) -> ScenarioError:
    """The error with the scenario field restated as the flag that set it (when a flag did)."""
    if exc.field not in fields:
        return exc
    return ScenarioError(f"{_FLAGS[exc.field]} {getattr(args, exc.field)!r}: {exc.reason}")


def _scenario_from_args(args: argparse.Namespace) -> Scenario:
    flags = {"--model": args.model, "--train": args.train, "--infer": args.infer, "--hardware": args.hardware}
    gpd = args.gpus_per_domain
    if gpd is not None and gpd < 1:
        raise ScenarioError(f"--gpus-per-domain {gpd}: the GPUs of one NVLink domain must be a positive int; "
                            "pass for example --gpus-per-domain 8, or leave it out to use the hardware's.")
    if args.scenario:
        given = [k for k, v in flags.items() if v]
        if given:
            raise ScenarioError(f"give either a scenario file or {', '.join(flags)}, not both (got {given[0]}).")
        try:
            s = load_scenario(args.scenario, dtype=args.dtype, fp8_block=args.fp8_block)
        except ScenarioError as exc:
            overridden = tuple(f for f in ("dtype", "fp8_block") if getattr(args, f) is not None)
            raise _restated(exc, args, overridden) from None
        return s if gpd is None else dataclasses.replace(s, gpus_per_domain=gpd)
    missing = [k for k, v in flags.items() if not v]
    if missing:
        raise ScenarioError(f"without a scenario file, {missing[0]} is required (flags {', '.join(flags)}).")
    data: dict[str, Any] = {"model": args.model, "hardware": args.hardware, "colocated": bool(args.colocated)}
    for side in ("train", "infer"):
        text = getattr(args, side)
        try:
            data[side] = parse_degrees(text, side, gpus=True)
        except ValueError as exc:
            raise ScenarioError(f"--{side} {text!r}: {exc}") from None
    if args.dtype:
        data["dtype"] = args.dtype
    if args.fp8_block:
        data["fp8_block"] = args.fp8_block
    if gpd is not None:
        data["gpus_per_domain_override"] = gpd
    try:
        return load_scenario(data, name=f"{args.model} train {args.train} infer {args.infer} on {args.hardware}")
    except ScenarioError as exc:
        raise _restated(exc, args, tuple(_FLAGS)) from None


class _Steps:
    """A bar of ``total`` steps on stderr (``jreshard.core.progress.progress_bar``), or nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar = progress_bar(enabled, total, "jreshard plan", unit="step")

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        if self.bar is not None:
            self.bar.set_description(what)
        yield
        if self.bar is not None:
            self.bar.update(1)

    def wrap(self, items: Any) -> Any:
        """``items`` counted on a bar of their own while they are consumed."""
        items = list(items)
        bar = progress_bar(self.bar is not None, len(items), "hierarchical plan", unit="tensor")
        if bar is None:
            return items

        def counted() -> Iterator[Any]:
            try:
                for item in items:
                    yield item
                    bar.update(1)
            finally:
                bar.close()

        return counted()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plan_report(s: Scenario, *, experts: str = "separate", hierarchical: str = "auto",
                progress: bool = False) -> dict[str, Any]:
    """Plans scenario ``s`` and returns the report (the ``--json`` object)."""
    steps = _Steps(progress, 6)
    try:
        with steps.step("layouts"):
            src, dst = s.layouts(experts)
        with steps.step("FP8 amax exchange"):
            fp8 = s.fp8_costs(experts)
        with steps.step("plan (cold)"):
            clear_cache()
            t0 = time.perf_counter()
            p = cast(Plan, plan(src, dst))  # a dict of layouts plans to a whole-model Plan
            cold = time.perf_counter() - t0
        with steps.step("plan (warm)"):
            t0 = time.perf_counter()
            plan(src, dst)
            warm = time.perf_counter() - t0
        with steps.step("statistics"):
            st: PlanStats = p.stats()
        with steps.step("cost model"):
            cmp = cost.compare(src, dst, s.topology(), hierarchical=hierarchical, jreshard_plan=p,
                               progress=steps.wrap if progress else None, fp8=fp8[0] if fp8 else None)
    finally:
        steps.close()
    return {
        "scenario": s.name,
        "model": s.model.name,
        "tensors": len(src) - (fp8[1].quantized if fp8 else 0),  # model tensors; scale leaves not counted
        "train_gpus": s.train_gpus,
        "infer_gpus": s.infer_gpus,
        # The direct plan's statistics: bytes between distinct devices, network and NVLink together.
        "bytes_moved": st.network_bytes,
        "lower_bound_bytes": st.lower_bound_bytes,
        "naive_bytes": st.naive_bytes,
        "max_send_bytes": st.max_send_bytes,
        "mean_send_bytes": st.mean_send_bytes,
        "sender_load_bound_bytes": cost.sender_load_bound(src, st),
        "max_recv_bytes": st.max_recv_bytes,
        "mean_recv_bytes": st.mean_recv_bytes,
        "messages": st.messages,
        "plan_seconds_cold": cold,
        "plan_seconds_warm": warm,
        "predicted_seconds": cmp.seconds(),
        "delivery": cmp.delivery,
        "hierarchical_setting": hierarchical,
        "bottleneck": cmp.jreshard.bottleneck,
        "predictions": {
            "jreshard_direct": _prediction(cmp.direct, "direct"),
            "jreshard_hierarchical": _prediction(cmp.hierarchical, "hierarchical"),
            "gather_broadcast": _prediction(cmp.gather_broadcast, "gather-then-broadcast"),
            "flat_direct": _prediction(cmp.flat_direct, "flat direct"),
            "pipelined_tree": _prediction(cmp.pipelined_tree, "pipelined tree (ideal)"),
        },
        "labels": {**LABELS, "predicted_seconds": {"delivery": f"jreshard: {cmp.delivery}; baselines: their own",
                                                   "links": "network and NVLink"}},
        "published": dict(s.published),
        "calibration": _calibration(s, cmp.seconds()),
        "fp8": _fp8_report(s, fp8[1]) if fp8 else None,
    }


def _calibration(s: Scenario, predicted: dict[str, float]) -> list[dict[str, Any]]:
    """Each published full-sync figure beside its prediction; a ratio only where the dtypes agree."""
    measured_in = canonical_dtype(s.published.get("dtype", s.dtype))
    out = []
    for method, fig in calibration.published(s.published).items():
        same = measured_in == s.dtype
        out.append({"method": method, "published": fig.text, "published_dtype": measured_in,
                    "predicted": predicted[method], "ratio": calibration.ratio(predicted[method], fig) if same
                    else None})
    return out


def _fp8_report(s: Scenario, summary: AmaxSummary) -> dict[str, Any]:
    fmt = s.fp8
    assert fmt is not None  # only called under FP8 delivery
    return {"dtype": fmt.dtype, "block": list(fmt.block), "scaling": fmt.scaling, "amax_floor": fmt.amax_floor,
            "kept_dtype": s.model.get("dtype") or s.model.get("torch_dtype") or "bfloat16",
            **dataclasses.asdict(summary)}


# What each figure of the report counts: which delivery, and which links its bytes cross.
_PLAN = {"delivery": "direct", "links": "network and NVLink (bytes between distinct devices)"}
LABELS: dict[str, dict[str, str]] = {
    "bytes_moved": _PLAN, "lower_bound_bytes": {"delivery": "any", "links": "network and NVLink"},
    "naive_bytes": {"delivery": "gather-then-broadcast", "links": "network and NVLink"},
    "max_send_bytes": _PLAN, "mean_send_bytes": _PLAN, "sender_load_bound_bytes": _PLAN,
    "max_recv_bytes": _PLAN, "mean_recv_bytes": _PLAN, "messages": _PLAN,
}


def _prediction(p: cost.Prediction | None, delivery: str) -> dict[str, Any] | None:
    if p is None:
        return None
    return {"delivery": delivery, "seconds": p.seconds, "network_bytes": p.network_bytes,
            "nvlink_bytes": p.nvlink_bytes, "stage_seconds": list(p.stages or (p.seconds,)),
            "bottleneck": p.bottleneck}


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _links(p: dict[str, Any]) -> str:
    stages = p["stage_seconds"]
    staged = f"; stages {' + '.join(f'{x:.3f}' for x in stages)} s" if len(stages) > 1 else ""
    return (f"{p['seconds']:.3f} s: network {_gb(p['network_bytes'])}, NVLink {_gb(p['nvlink_bytes'])}{staged}; "
            f"bottleneck {p['bottleneck']}")


def format_report(r: dict[str, Any]) -> str:
    """The report as the table ``jreshard plan`` prints."""
    pub = {k: v for k, v in r["published"].items() if isinstance(v, (int, float))}
    pred = r["predictions"]
    imbalance = r["max_send_bytes"] / r["mean_send_bytes"] if r["mean_send_bytes"] else 1.0
    between = "between devices, network and NVLink"
    rows = [
        ("scenario", f"{r['scenario']} ({r['model']}, {r['tensors']:,} tensors, "
                     f"{r['train_gpus']} -> {r['infer_gpus']} devices)"),
        ("bytes moved (direct)", f"{_gb(r['bytes_moved'])} {between}"),
        ("lower bound", _gb(r["lower_bound_bytes"]) + ("  (met)" if r["bytes_moved"] == r["lower_bound_bytes"]
                                                       else "")),
        ("gather-then-broadcast", f"{_gb(r['naive_bytes'])} {between}"),
        ("per sender (direct)", f"max {_gb(r['max_send_bytes'])}, mean {_gb(r['mean_send_bytes'])} "
                                f"(imbalance {imbalance:.3f}; "
                                f"no plan does better than {_gb(r['sender_load_bound_bytes'])})"),
        ("per receiver (direct)", f"max {_gb(r['max_recv_bytes'])}, mean {_gb(r['mean_recv_bytes'])}"),
        ("messages (direct)", f"{r['messages']:,} sender->receiver pairs"),
        ("predicted jreshard", f"{r['predicted_seconds']['jreshard']:.3f} s with {r['delivery']} delivery"),
        ("executors' delivery", f"{r['delivery']} (fleet.hierarchical.decide): what jreshard.transfer("
                                f"hierarchical={r['hierarchical_setting']!r}, domains=topo.domains, topology=topo) "
                                "takes on this scenario's topology"),
        ("  direct delivery", _links(pred["jreshard_direct"])),
        ("  hierarchical delivery", _links(pred["jreshard_hierarchical"]) if pred["jreshard_hierarchical"]
         else "not predicted (--hierarchical never)" if r["hierarchical_setting"] == "never"
         else "does not apply (no NVLink domain holds two replicas of a tensor)"),
        ("predicted gather+bcast", _links(pred["gather_broadcast"])),
        ("predicted flat direct", _links(pred["flat_direct"])),
        ("predicted tree (ideal)", _links(pred["pipelined_tree"])),
        ("planning time", f"cold {r['plan_seconds_cold']:.3f} s, warm {r['plan_seconds_warm'] * 1e3:.2f} ms"),
    ]
    f8 = r.get("fp8")
    if f8:
        block = "x".join("all" if b is None else str(b) for b in f8["block"])
        rows[2:2] = [
            ("FP8 delivery", f"{f8['quantized']:,} tensors in {f8['dtype']} ({_gb(f8['fp8_bytes'])}) with "
                             f"{block} scales ({_gb(f8['scale_bytes'])}); {f8['kept']:,} kept in {f8['kept_dtype']} "
                             f"({_gb(f8['kept_bytes'])}); one copy each"),
            ("amax exchange", f"{f8['cut_blocks']:,} blocks cut by training shards: {f8['nbytes']:,} bytes in "
                              f"{f8['messages']:,} messages, before the sends"),
        ]
    if pub:
        rows.append(("published", ", ".join(f"{k} {v}" for k, v in pub.items())))
    for c in r.get("calibration", []):
        label = {"jreshard": "jreshard", "gather_broadcast": "gather+bcast", "flat_direct": "flat direct"}
        vs = (f"ratio {c['ratio']:.2f} (goal {calibration.BAND[0]}-{calibration.BAND[1]})" if c["ratio"] is not None
              else f"measured in {c['published_dtype']}: rerun with --dtype {c['published_dtype']} for the ratio")
        rows.append((f"  vs published {label[c['method']]}",
                     f"predicted {c['predicted']:.3f} s, published {c['published']} s; {vs}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _run_layer(s: Scenario, args: argparse.Namespace) -> str:
    p = predict_layer(s, args.layer, experts=args.experts, hierarchical=args.hierarchical)
    if not args.json:
        return format_layer(p)
    c = p.comparison
    return json.dumps({
        "scenario": p.scenario, "model": p.model, "layer": p.layer, "tensors": len(p.names), "bytes": p.nbytes,
        "predictions": {name: _prediction(getattr(c, name), delivery) for name, delivery in (
            ("jreshard", c.delivery), ("flat_direct", "direct"), ("gather_broadcast", "gather-then-broadcast"))},
        "published": p.published._asdict() if p.published else None,
    }, indent=2)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector (reference counting still frees everything).

    A frontier model's command builds about 200,000 small objects that live until it exits
    (tensors, layouts, names); the collector's passes over them find nothing to free and
    took 10-15% of ``jreshard plan`` on Kimi K3 here.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_plan(args: argparse.Namespace) -> int:
    with _collector_paused():
        return _run_plan(args)


def _run_plan(args: argparse.Namespace) -> int:
    try:
        s = _scenario_from_args(args)
        if args.layer is not None:
            print(_run_layer(s, args))
            return 0
        enabled = {"on": True, "off": False, "auto": None}[args.progress]
        tensors = len(catalog.tensors(s.model, experts=args.experts)) if enabled is None else 0
        progress = show_progress(enabled, tensors, threshold=_PROGRESS_TENSORS)
        report = plan_report(s, experts=args.experts, hierarchical=args.hierarchical, progress=progress)
    except (ScenarioError, ValueError, TypeError) as exc:
        print(f"jreshard plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
