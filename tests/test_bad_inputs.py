"""Bad inputs across the public API: each row names a call, the exact exception type and a message
pattern that names the argument (and so tells the user what to fix).

Rows cover the bridge's argument checks (``bridge._args``), ``init_group``, ``reject_sync``,
``Receiver``, ``BridgePlan``, ``Source``, ``Rule``, ``tp_param_map``, ``trainer_mesh``,
``source_id`` and the planner's ``Mesh``, ``Layout``, ``plan`` and ``Box``. No row reaches a
process group: every check runs before one is needed.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import bridge
from bridge._args import check_flag, check_int, check_seconds
from jreshard import Box, Layout, Mesh, plan

M = Mesh(np.arange(4).reshape(2, 2), ("x", "y"))
L = Layout((8, 8), M, ("x", "y"), "float32")
TM = bridge.trainer_mesh((2,), "fsdp", [0], 2)
SRC = bridge.Source({"w": Layout((8, 6), TM, ("fsdp",), "float32")})
PM = bridge.tp_param_map(SRC, [bridge.Rule("w", "lin.weight", transpose=True, shard=0)], [1, 2])
BP = bridge.BridgePlan(SRC, PM)


def recv(**kw):
    import torch

    from bridge.receiver import Receiver

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


# --- bridge._args
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
row("Receiver plan", lambda: __import__("bridge.receiver").receiver.Receiver("p", {}, rank=1), TypeError, "plan")
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
row("BridgePlan both", lambda: bridge.BridgePlan(SRC, PM, mapping=PM), TypeError, "param_map")
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


def test_rows_are_many_and_distinct():
    names = [r[0] for r in ROWS]
    assert len(names) == len(set(names)) and len(names) >= 100, len(names)


@pytest.mark.parametrize(("name", "fn", "exc", "pattern"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(name, fn, exc, pattern):
    with pytest.raises(exc) as info:
        fn()
    assert re.search(pattern, str(info.value)), (name, str(info.value))
