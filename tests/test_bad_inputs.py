"""Bad inputs across the public API: each row names a call, the exact exception type and a message
pattern that names the argument (and so tells the user what to fix).

Rows here cover the bridge's argument checks (``jreshard.core.args``), ``init_group``, ``reject_sync``,
``Receiver``, ``BridgePlan``, ``Source``, ``Rule``, ``tp_param_map``, ``trainer_mesh``,
``source_id``, the planner's ``Mesh``, ``Layout``, ``plan``, ``plan_layouts`` and ``Box`` (sizes
beyond int64 included), the fleet's degrees, catalog and scenarios, and the ``jreshard plan``
command line. More rows: tests/test_bad_inputs_bridge.py (bridge constructors, ``Sender``,
sync-time inputs), tests/test_bad_inputs_transfer.py (``jreshard.transfer``) and
tests/test_bad_inputs_fleet.py (FP8 helpers; config, hardware and scenario files). No row reaches a process group:
every check runs before one is needed.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re

import numpy as np
import pytest

import bridge
from jreshard import Box, Layout, Mesh, plan, plan_layouts
from jreshard.core.args import check_flag, check_int, check_seconds
from jreshard.core.degrees import InferParallel, TrainParallel, parse_degrees
from jreshard.fleet import catalog
from jreshard.fleet.presets import stage_of_layers
from jreshard.fleet.scenario import ScenarioError, load_scenario

M = Mesh(np.arange(4).reshape(2, 2), ("x", "y"))
L = Layout((8, 8), M, ("x", "y"), "float32")
TM = bridge.trainer_mesh((2,), "fsdp", [0], 2)
SRC = bridge.Source({"w": Layout((8, 6), TM, ("fsdp",), "float32")})
PM = bridge.tp_param_map(SRC, [bridge.Rule("w", "lin.weight", transpose=True, dim=0)], [1, 2])
BP = bridge.BridgePlan(SRC, PM)


def recv(**kw):
    import torch

    from bridge.wire.receiver import Receiver

    params = kw.pop("params", None)
    if params is None:
        params = {p.name: torch.zeros(p.shape, dtype=torch.float32) for p in PM.for_rank(1)}
    return Receiver(BP, params, rank=kw.pop("rank", 1), **kw)


def recv_params(make):
    import torch

    return lambda: recv(params=make(torch))


ROWS = []


def row(name, fn, exc, pat):
    ROWS.append((name, fn, exc, pat))


# --- jreshard.core.args
for v, e in [
    (-1, ValueError),
    (True, TypeError),
    (1.5, TypeError),
    ("3", TypeError),
    (None, TypeError),
    (1 << 63, ValueError),
    (np.float32(2), TypeError),
    (np.bool_(True), TypeError),
]:
    row(f"check_int {v!r}", lambda v=v: check_int("rank", v), e, "rank")
for v, e in [
    (0, ValueError),
    (-1, ValueError),
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    ("10", TypeError),
    (True, TypeError),
    (None, TypeError),
    (-0.0, ValueError),
    (np.float64("nan"), ValueError),
    ([1], TypeError),
]:
    row(f"check_seconds {v!r}", lambda v=v: check_seconds("timeout", v), e, "timeout")
for v in ("yes", 1, 0, None, 1.0):
    row(f"check_flag {v!r}", lambda v=v: check_flag("atomic", v), TypeError, "atomic")

# --- init_group
for kw, e, arg in [
    ({"rank": -1}, ValueError, "rank"),
    ({"rank": 1.0}, TypeError, "rank"),
    ({"rank": "0"}, TypeError, "rank"),
    ({"world_size": 0}, ValueError, "world_size"),
    ({"world_size": "2"}, TypeError, "world_size"),
    ({"port": 0}, ValueError, "port"),
    ({"port": 70000}, ValueError, "port"),
    ({"port": "1"}, TypeError, "port"),
    ({"timeout": -1}, ValueError, "timeout"),
    ({"timeout": float("nan")}, ValueError, "timeout"),
    ({"timeout": "60"}, TypeError, "timeout"),
    ({"host": ""}, TypeError, "host"),
    ({"host": 5}, TypeError, "host"),
    ({"backend": "mpi"}, ValueError, "backend"),
    ({"rank": 2, "world_size": 2}, ValueError, "world_size"),
]:
    args = {"rank": 0, "world_size": 2, "port": 29999, **kw}
    row(f"init_group {kw}", lambda a=args: bridge.init_group(a.pop("rank"), a.pop("world_size"), **a), e, arg)

# --- reject_sync / Receiver
row("reject_sync plan", lambda: bridge.reject_sync("plan", rank=1), TypeError, "plan")
row("reject_sync rank", lambda: bridge.reject_sync(BP, rank=-2), ValueError, "rank")
row("reject_sync ready_timeout", lambda: bridge.reject_sync(BP, rank=1, ready_timeout=0), ValueError, "ready_timeout")
row(
    "reject_sync ready_timeout str",
    lambda: bridge.reject_sync(BP, rank=1, ready_timeout="1"),
    TypeError,
    "ready_timeout",
)
for kw, e, arg in [
    ({"timeout": -5}, ValueError, "timeout"),
    ({"timeout": float("nan")}, ValueError, "timeout"),
    ({"timeout": "5"}, TypeError, "timeout"),
    ({"timeout": None}, TypeError, "timeout"),
    ({"ready_timeout": 0}, ValueError, "ready_timeout"),
    ({"ready_timeout": float("inf")}, ValueError, "ready_timeout"),
    ({"ready_timeout": "x"}, TypeError, "ready_timeout"),
    ({"atomic": "yes"}, TypeError, "atomic"),
    ({"atomic": None}, TypeError, "atomic"),
    ({"swap": 1}, TypeError, "swap"),
    ({"progress": "on"}, TypeError, "progress"),
    ({"rank": -1}, ValueError, "rank"),
    ({"rank": 1.0}, TypeError, "rank"),
    ({"rank": "1"}, TypeError, "rank"),
    ({"rank": 0}, ValueError, "rank 0"),
    ({"rank": 7}, ValueError, "rank 7"),
]:
    row(f"Receiver {kw}", lambda kw=kw: recv(**dict(kw)), e, arg)
row("Receiver plan", lambda: importlib.import_module("bridge.wire.receiver").Receiver("p", {}, rank=1), TypeError,
    "plan")
row("Receiver params list", lambda: recv(params=[1, 2]), TypeError, "params")
row("Receiver params missing", lambda: recv(params={}), ValueError, "params lacks 'lin.weight'")
row(
    "Receiver params not tensor",
    lambda: recv(params={"lin.weight": np.zeros((3, 8), np.float32)}),
    TypeError,
    r"params\['lin.weight'\]",
)
row(
    "Receiver params wrong shape",
    recv_params(lambda t: {"lin.weight": t.zeros(4, 8)}),
    ValueError,
    r"params\['lin.weight'\]",
)
row(
    "Receiver params wrong dtype",
    recv_params(lambda t: {"lin.weight": t.zeros(3, 8, dtype=t.float64)}),
    ValueError,
    r"params\['lin.weight'\]",
)
row(
    "Receiver params complex",
    recv_params(lambda t: {"lin.weight": t.zeros(3, 8, dtype=t.complex64)}),
    ValueError,
    r"params\['lin.weight'\]",
)
row(
    "Receiver params int",
    recv_params(lambda t: {"lin.weight": t.zeros(3, 8, dtype=t.int32)}),
    ValueError,
    r"params\['lin.weight'\]",
)
row(
    "Receiver params meta",
    recv_params(lambda t: {"lin.weight": t.zeros(3, 8, device="meta")}),
    ValueError,
    "meta device",
)
row(
    "Receiver params non-contiguous",
    recv_params(lambda t: {"lin.weight": t.zeros(8, 3).T}),
    ValueError,
    r"params\['lin.weight'\]",
)

# --- BridgePlan / Source / Rule / tp_param_map / trainer_mesh
row("BridgePlan source", lambda: bridge.BridgePlan({"w": 1}, PM), TypeError, "source")
row("BridgePlan param_map", lambda: bridge.BridgePlan(SRC, {"w": 1}), TypeError, "param_map")
row("BridgePlan balance", lambda: bridge.BridgePlan(SRC, PM, balance="yes"), TypeError, "balance")
for v, e in [
    (0, ValueError),
    (63, ValueError),
    (-64, ValueError),
    (1.5e6, (TypeError, ValueError)),
    ("16", (TypeError, ValueError)),
    (True, (TypeError, ValueError)),
    (None, (TypeError, ValueError)),
]:
    row(f"BridgePlan bucket_bytes {v!r}", lambda v=v: bridge.BridgePlan(SRC, PM, bucket_bytes=v), e, "bucket_bytes")
row(
    "BridgePlan bucket_bytes np",
    lambda: bridge.BridgePlan(SRC, PM, bucket_bytes=np.int64(32)),
    ValueError,
    "bucket_bytes",
)
row("Source not mapping", lambda: bridge.Source([1]), TypeError, "leaves")
row("Source leaf not layout", lambda: bridge.Source({"w": 1}), TypeError, "w")
row("Source key not str", lambda: bridge.Source({1: L}), TypeError, "1")
row("Rule pattern", lambda: bridge.Rule(1, "x"), TypeError, "pattern")
row("Rule pad_to", lambda: bridge.Rule("w", "x", pad_to=0), ValueError, "pad_to")
row("Rule heads", lambda: bridge.Rule("w", "x", heads=0), ValueError, "heads")
row("tp_param_map tp_ranks empty", lambda: bridge.tp_param_map(SRC, [bridge.Rule("w", "x")], []), TypeError, "tp_ranks")
row(
    "tp_param_map tp_ranks neg", lambda: bridge.tp_param_map(SRC, [bridge.Rule("w", "x")], [-1]), ValueError, "tp_ranks"
)
row(
    "tp_param_map dtype object",
    lambda: bridge.tp_param_map(SRC, [bridge.Rule("w", "x")], [1], dtype="object"),
    TypeError,
    "dtype",
)
row(
    "tp_param_map no match",
    lambda: bridge.tp_param_map(SRC, [bridge.Rule("nope", "x")], [1]),
    ValueError,
    "leaf 'w' matches no rule",
)
row("trainer_mesh shape", lambda: bridge.trainer_mesh((3,), "fsdp", [0], 2), ValueError, "shape")
row("trainer_mesh devices_per_rank", lambda: bridge.trainer_mesh((2,), "fsdp", [0], 0), ValueError, "devices_per_rank")
row("trainer_mesh ranks", lambda: bridge.trainer_mesh((2,), "fsdp", [-1], 2), ValueError, "rank")
row("source_id rank", lambda: bridge.source_id(-1, 0), ValueError, "rank")
row("source_id local", lambda: bridge.source_id(0, -1), ValueError, "local")

# --- planner
row("Mesh devices str", lambda: Mesh("abc", ("x",)), (TypeError, ValueError), "devices")
row("Mesh axis count", lambda: Mesh(np.arange(4).reshape(2, 2), ("x",)), ValueError, "axis_names")
row("Mesh axis dup", lambda: Mesh(np.arange(4).reshape(2, 2), ("x", "x")), ValueError, "axis")
row("Mesh dup devices", lambda: Mesh(np.array([0, 0]), ("x",)), ValueError, "devices")
row("Mesh negative ids", lambda: Mesh(np.array([-1, 0]), ("x",)), ValueError, "devices")
row("Mesh float ids", lambda: Mesh(np.array([0.5, 1.0]), ("x",)), (TypeError, ValueError), "devices")
row("Mesh axis int", lambda: Mesh(np.arange(2), (1,)), TypeError, "axis")
row("Mesh empty", lambda: Mesh(np.array([], dtype=np.int64), ("x",)), ValueError, "devices")
row("Layout mesh", lambda: Layout((4,), "mesh", ("x",)), TypeError, "mesh")
row("Layout shape neg", lambda: Layout((-4,), M, ()), ValueError, "shape")
row("Layout shape float", lambda: Layout((4.5,), M, ()), TypeError, "shape")
row("Layout shape str", lambda: Layout("44", M, ()), TypeError, "shape")
row("Layout spec unknown axis", lambda: Layout((4,), M, ("z",)), ValueError, "z")
row("Layout spec too long", lambda: Layout((4,), M, ("x", "y")), ValueError, "spec")
row("Layout spec axis twice", lambda: Layout((4, 4), M, ("x", "x")), ValueError, "x")
row("Layout dtype nonsense", lambda: Layout((4,), M, (), "floaty"), (TypeError, ValueError), "dtype")
row("Layout dtype object", lambda: Layout((4,), M, (), object), (TypeError, ValueError), "dtype")
row("Layout huge", lambda: Layout((1 << 62, 1 << 62), M, ()), ValueError, "shape")
row("Layout spec int", lambda: Layout((4,), M, (1,)), TypeError, "spec")
row("plan src", lambda: plan("a", L), TypeError, "src")
row("plan dst", lambda: plan(L, "b"), TypeError, "dst")
row("plan shapes", lambda: plan(L, Layout((8, 4), M, ())), ValueError, "shape")
row("plan kwarg", lambda: plan(L, L, bogus=1), TypeError, "bogus")
row("plan dict mismatch", lambda: plan({"a": L}, {"b": L}), ValueError, "a")
row("Box bad", lambda: Box([(0, -1)]), ValueError, "box dim 0")
row("Box str", lambda: Box("ab"), TypeError, "box must be")
row("Box float", lambda: Box([(0.5, 2)]), TypeError, "box dim 0 lower bound")
row("Mesh id above int64", lambda: Mesh([1 << 63], "x"), ValueError, "devices must be ids that fit in int64")
row("Mesh id above uint64", lambda: Mesh([1 << 64], "x"), ValueError, "devices must be ids that fit in int64")
row("Mesh bool ids", lambda: Mesh([True, False], "x"), TypeError, "devices")
row("Mesh axis name empty", lambda: Mesh([0, 1], ""), TypeError, "axis_names")
row("Mesh axis_names int", lambda: Mesh([0, 1], 5), TypeError, "axis_names")
row("Mesh ragged devices", lambda: Mesh([[0, 1], [2]], ("x", "y")), (TypeError, ValueError), "devices")
row("Layout dim above int64", lambda: Layout((1 << 64, 0), M, ()), ValueError, "shape dims must fit in int64")
row("Layout dtype str", lambda: Layout((4,), M, (), "U8"), TypeError, "dtype must be a numeric dtype")
row("Layout dtype datetime", lambda: Layout((4,), M, (), "datetime64[s]"), TypeError, "dtype must be a numeric")
row("Layout dtype void", lambda: Layout((4,), M, (), "V8"), TypeError, "dtype must be a numeric dtype")
row("Layout dtype bytes", lambda: Layout((4,), M, (), "S4"), TypeError, "dtype must be a numeric dtype")
row("Layout dtype int", lambda: Layout((4,), M, (), 5), TypeError, "dtype")
row("Layout dtype structured", lambda: Layout((4,), M, (), [("a", "f4")]), TypeError, "dtype")
row("Layout with_dtype", lambda: L.with_dtype("U2"), TypeError, "dtype")
row("Layout spec str", lambda: Layout((4,), M, "x"), TypeError, "spec")
row("Layout spec entry int in tuple", lambda: Layout((4,), M, (("x", 1),)), TypeError, "spec entry")
row("Layout shape 2-d array", lambda: Layout(np.ones((2, 2), dtype=int), M, ()), TypeError, "shape")
row("Layout shard_box missing device", lambda: L.shard_box(99), ValueError, "device 99 is not in the mesh")
row("Layout holders not a box", lambda: L.holders("ab"), ValueError, "box must be")
row("Layout holders strided", lambda: L.holders((slice(0, 8, 2), slice(0, 8))), TypeError, "box must hold slice")
row("plan balance str", lambda: plan(L, L, balance="yes"), TypeError, "balance must be True or False")
row("plan balance None", lambda: plan(L, L, balance=None), TypeError, "balance must be True or False")
row("plan balance int", lambda: plan({"a": L}, {"a": L}, balance=1), TypeError, "balance")
row("plan nested mismatch", lambda: plan({"a": [L]}, {"a": L}), ValueError, "same structure")
row("plan leaf not layout", lambda: plan({"a": L}, {"a": 3}), TypeError, "dst at 'a'")
row("plan_layouts pair int", lambda: plan_layouts([1]), TypeError, r"pairs\[0\]")
row("plan_layouts pair short", lambda: plan_layouts([("a", L)]), TypeError, r"pairs\[0\]")
row("plan_layouts name int", lambda: plan_layouts([(1, L, L)]), TypeError, r"pairs\[0\] name")
row("plan_layouts name twice", lambda: plan_layouts([("a", L, L), ("a", L, L)]), ValueError, "'a' appears twice")
row("plan_layouts balance", lambda: plan_layouts([("a", L, L)], balance="x"), TypeError, "balance")
row("plan_layouts dst", lambda: plan_layouts([("a", L, None)]), TypeError, "dst at 'a'")
# sizes near 2**63: every count the planner makes must fit in int64
BIG = 1 << 61  # elements; int16 tensors of 2**62 bytes
row("Layout shard end beyond int64", lambda: Layout((2**63 - 1,), Mesh([0, 1], "x"), ("x",)), ValueError,
    r"shape \(9223372036854775807,\): dim 0 .* split 2 ways gives chunks of 4611686018427387904")
row("Layout shard end beyond int64, 3 ways", lambda: Layout((1, 2**63 - 1), Mesh([0, 1, 2], "x"), (None, "x")),
    ValueError, "shape .*: dim 1 of 9223372036854775807 split 3 ways")
row("Layout bytes beyond int64", lambda: Layout((BIG,), M, (), "float64"), ValueError,
    "shape .* holds 18446744073709551616")
row("plan bytes received beyond int64", lambda: plan(Layout((BIG,), M, (), "int16"), Layout((BIG,), M, (), "int16")),
    ValueError, "src and dst are too large to plan in one call: .* sum to 18446744073709551616")
row("plan tree bytes beyond int64", lambda: plan(*[{k: Layout((BIG,), Mesh([i], "x"), (), "int16") for k in "abc"}
                                                  for i in (0, 1)]), ValueError, "sum to .* by tensor 'b'")
row("plan_layouts bytes beyond int64", lambda: plan_layouts([(k, Layout((BIG // 2,), Mesh([0], "x"), (), "int32"),
                                                              Layout((BIG // 2,), Mesh([1], "y"), (), "int32"))
                                                             for k in ("a", "b")]), ValueError, "by tensor 'b'")

# --- fleet: degrees, catalog, scenarios
row("TrainParallel tp 0", lambda: TrainParallel(tp=0), ValueError, "TrainParallel.tp")
row("TrainParallel pp str", lambda: TrainParallel(pp="2"), TypeError, "TrainParallel.pp")
row("TrainParallel dp bool", lambda: TrainParallel(dp=True), TypeError, "TrainParallel.dp")
row("InferParallel ep float", lambda: InferParallel(ep=2.0), TypeError, "InferParallel.ep")
row("InferParallel dp -1", lambda: InferParallel(dp=-1), ValueError, "InferParallel.dp")
row("InferParallel tp 2**63", lambda: InferParallel(tp=2**63), ValueError, "InferParallel.tp")
row("stage_of_layers pp 0", lambda: stage_of_layers(4, 0), ValueError, "pp")
row("stage_of_layers layers float", lambda: stage_of_layers(4.0, 2), TypeError, "num_layers")
row("TrainParallel fsdp beyond int64", lambda: TrainParallel(fsdp=1 << 70), ValueError, "TrainParallel.fsdp")
row("parse_degrees value", lambda: parse_degrees("tp=x", "train"), ValueError, "train degrees 'tp=x'")
row("parse_degrees name", lambda: parse_degrees("zz=2", "infer"), ValueError, "infer degrees 'zz=2'")
row("parse_degrees None", lambda: parse_degrees(None, "train"), TypeError, "train degrees")
row("catalog unknown model", lambda: catalog.get_model("nope"), ValueError, "model 'nope'")
row("catalog model int", lambda: catalog.get_model(5), TypeError, "model must be")
row("catalog experts", lambda: catalog.tensors("llama-tiny", experts="x"), ValueError, "experts")
row("catalog config no type", lambda: catalog.load_config({"a": 1}), ValueError, "model_type")
SIDES = {"model": "llama-tiny", "hardware": "dgx-h100", "train": {"gpus": 4, "fsdp": 4}, "infer": {"gpus": 4, "tp": 4}}
for field, value, pattern in [
    ("hardware", "nope", "field 'hardware'"),
    ("model", "nope", "field 'model'"),
    ("train", {"gpus": 4, "tp": 0}, "field 'train.tp'"),
    ("train", {"gpus": "4", "fsdp": 4}, "field 'train.gpus'"),
    ("infer", {"gpus": 4}, "infer"),
    ("bogus", 1, "field 'bogus'"),
    ("dtype", "floaty", "field 'dtype'"),
]:
    row(f"scenario {field}={value!r}", lambda f=field, v=value: load_scenario({**SIDES, f: v}), ScenarioError, pattern)
row("scenario missing train", lambda: load_scenario({"model": "llama-tiny"}), ScenarioError, "field 'train'")
row("scenario int", lambda: load_scenario(5), TypeError, "scenario must be")
row("scenario unknown name", lambda: load_scenario("no-such"), ScenarioError, "scenario 'no-such'")


def cli(*argv: str) -> None:
    """Runs ``jreshard plan ...``; a refusal (exit status 2) is raised as SystemExit with its stderr."""
    from jreshard.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["plan", *argv])
        except SystemExit as e:  # argparse
            code = e.code
    if code:
        raise SystemExit(f"exit status {code}: {err.getvalue()}")


FLAGS = {"--model": "llama-tiny", "--hardware": "dgx-h100", "--train": "fsdp=4", "--infer": "tp=4"}
for flag, value, pattern in [
    ("--train", "tp=x", "--train 'tp=x'"),
    ("--infer", "tp=0", "--infer 'tp=0'"),
    ("--hardware", "nope", "--hardware 'nope'"),
    ("--model", "nope", "--model 'nope'"),
    ("--dtype", "floaty", "--dtype 'floaty'"),
    ("--experts", "bogus", "--experts"),
    ("--gpus-per-domain", "x", "--gpus-per-domain"),
    ("--hierarchical", "sometimes", "--hierarchical"),
    ("--gpus-per-domain", "0", "--gpus-per-domain 0: the GPUs of one NVLink domain must be a positive int"),
    ("--gpus-per-domain", "-8", "--gpus-per-domain -8"),
]:
    argv = tuple(x for k, v in {**FLAGS, flag: value}.items() for x in (k, v))
    row(f"cli {flag} {value}", lambda a=argv: cli(*a), SystemExit, re.escape(pattern))
row("cli scenario and flags", lambda: cli("qwen3-32b-fsdp8-to-tp4dp2", "--model", "llama-tiny"), SystemExit,
    "not both")
row("cli scenario --gpus-per-domain 0", lambda: cli("qwen3-32b-fsdp8-to-tp4dp2", "--gpus-per-domain", "0"), SystemExit,
    "--gpus-per-domain 0")
row("cli missing --train", lambda: cli("--model", "llama-tiny", "--hardware", "dgx-h100"), SystemExit, "--train")


def test_counts_up_to_int64_and_gpus_per_domain_still_work():
    top = Layout((2**63 - 1,), Mesh([0], "x"), ("x",))
    assert top.shard_box(0)[0].stop == 2**63 - 1
    even = Layout((1 << 62,), Mesh([0, 1], "x"), ("x",), "int8")
    assert plan(even, Layout((1 << 62,), Mesh([2], "y"), (), "int8")).stats().network_bytes == 1 << 62
    import argparse

    from jreshard.cli.plan import _scenario_from_args, add_plan_parser

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "qwen3-32b-fsdp8-to-tp4dp2", "--gpus-per-domain", "4"])
    assert _scenario_from_args(args).topology().gpus_per_domain == 4  # a scenario file takes the flag too


def check_row(name, fn, exc, pattern):
    """One row: ``fn()`` raises exactly ``exc`` (or one of them) with a message matching ``pattern``."""
    with pytest.raises(exc) as info:
        fn()
    assert re.search(pattern, str(info.value)), (name, str(info.value))


def test_rows_are_many_and_distinct():
    from tests import test_bad_inputs_bridge, test_bad_inputs_fleet, test_bad_inputs_transfer

    tables = (ROWS, test_bad_inputs_bridge.ROWS, test_bad_inputs_transfer.ROWS, test_bad_inputs_fleet.ROWS)
    names = [r[0] for rows in tables for r in rows]
    assert len(names) == len(set(names)) and len(names) >= 200, len(names)


@pytest.mark.parametrize(("name", "fn", "exc", "pattern"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(name, fn, exc, pattern):
    check_row(name, fn, exc, pattern)
