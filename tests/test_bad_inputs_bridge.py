"""Bad inputs of the bridge's constructors and sync-time inputs (rows as in tests/test_bad_inputs.py).

``Rule``, ``tp_param_map``, ``llama_param_map``, ``Param``, ``Region``, ``ParamMap``, ``BridgePlan``,
``Receiver``, ``Sender`` and what ``Sender.sync`` and ``quantize_params`` are given (tracers and
deleted arrays included). No row needs a process group: a
``Sender.sync`` whose own checks fail tries to announce it (``reject_sync``), finds no group,
and raises the cause.
"""

from __future__ import annotations

import numpy as np
import pytest

import bridge
from bridge.recipes import Recipe
from jreshard import Layout
from jreshard.core.fp8 import Fp8Format
from jreshard.nn import LlamaConfig
from tests.test_bad_inputs import BP, PM, SRC, TM, check_row, recv

R = bridge.Rule
ROWS = []


def row(name, fn, exc, pat):
    ROWS.append((name, fn, exc, pat))


def region(**kw):
    return bridge.Region(**{"leaf": "w", "box": [(0, 4), (0, 2)], "offset": (0, 0), "transpose": (0, 1), **kw})


def param(**kw):
    return bridge.Param(**{"name": "a", "rank": 1, "shape": (4, 2), "dtype": "float32", "regions": (region(),),
                           **kw})


def plan_of(*params):
    return bridge.BridgePlan(SRC, bridge.ParamMap(params))


# --- Rule
for kw, exc, pat in [
    ({"pattern": None}, TypeError, "Rule pattern"),
    ({"pattern": ""}, TypeError, "Rule pattern"),
    ({"name": 5}, TypeError, "Rule 'w' name"),
    ({"name": None}, TypeError, "Rule 'w' name"),
    ({"transpose": "yes"}, TypeError, "Rule 'w' transpose"),
    ({"transpose": (0, 0)}, ValueError, "Rule 'w' transpose .* permutation"),
    ({"transpose": (0, 2)}, ValueError, "Rule 'w' transpose .* permutation"),
    ({"transpose": (0.0, 1)}, TypeError, r"Rule 'w' transpose\[0\]"),
    ({"dim": -1}, ValueError, "Rule 'w' dim"),
    ({"dim": 1.5}, TypeError, "Rule 'w' dim"),
    ({"dim": True}, TypeError, "Rule 'w' dim"),
    ({"dim": ""}, ValueError, "Rule 'w' dim"),
    ({"ep_dim": -1}, ValueError, "Rule 'w' ep_dim"),
    ({"ep_dim": 0.5}, TypeError, "Rule 'w' ep_dim"),
    ({"part": -1}, ValueError, "Rule 'w' part"),
    ({"part": "a"}, TypeError, "Rule 'w' part"),
    ({"pad_to": True}, TypeError, "Rule 'w' pad_to"),
    ({"pad_to": 2.0}, TypeError, "Rule 'w' pad_to"),
    ({"pad_to": 1 << 64}, ValueError, "Rule 'w' pad_to .* int64"),
    ({"pad_to": np.int64(0)}, ValueError, "Rule 'w' pad_to"),
    ({"dtype": "floaty"}, TypeError, "Rule 'w' dtype"),
    ({"dtype": object}, TypeError, "Rule 'w' dtype must be a numeric dtype"),
    ({"dtype": "U4"}, TypeError, "Rule 'w' dtype must be a numeric dtype"),
    ({"dim": 0, "heads": True}, TypeError, "Rule 'w' heads"),
    ({"dim": 0, "heads": -2}, ValueError, "Rule 'w' heads"),
    ({"dim": 0, "heads": 2, "replicate_heads": "yes"}, TypeError, "Rule 'w' replicate_heads"),
    ({"replicate_heads": None}, TypeError, "Rule 'w' replicate_heads"),
    ({"dims": 5}, TypeError, "Rule 'w' dims"),
    ({"dims": "a b -> c"}, ValueError, "dims"),
    ({"at": 1.5}, TypeError, "Rule 'w' at"),
    ({"at": -1}, ValueError, "Rule 'w' at"),
    ({"name": "x{"}, ValueError, r"Rule 'w' name 'x\{' is not a valid template"),
    ({"name": "x}"}, ValueError, r"Rule 'w' name 'x\}' is not a valid template"),
    ({"name": "w.{0:d}"}, ValueError, r"Rule 'w' name 'w.\{0:d\}' has the field \{0:d\}"),
    ({"name": "w.{0.real}"}, ValueError, r"Rule 'w' name .* has the field \{0.real\}"),
    ({"name": "w.{1[0]}"}, ValueError, r"Rule 'w' name .* has the field \{1\[0\]\}"),
    ({"name": "w.{!r}"}, ValueError, r"Rule 'w' name .* has the field \{!r\}"),
    ({"name": "w.{layer!z}"}, ValueError, r"Rule 'w' name .* has the field \{layer!z\}"),
    ({"dims": "i o -> e i o", "at": "{0:x}"}, ValueError, r"Rule 'w' at '\{0:x\}' has the field"),
]:
    row(f"Rule {kw}", lambda kw=kw: R(**{"pattern": "w", "name": "x", **kw}), exc, pat)

# --- tp_param_map / llama_param_map
RULES = [R("w", "x")]
for kw, exc, pat in [
    ({"source": "src"}, TypeError, "source must be a bridge.Source"),
    ({"source": {"w": 1}}, TypeError, "source must be a bridge.Source"),
    ({"rules": "w"}, TypeError, "rules must be a list"),
    ({"rules": R("w", "x")}, TypeError, "rules must be a list"),
    ({"rules": ["w"]}, TypeError, r"rules\[0\]"),
    ({"rules": None}, TypeError, "rules must be a list"),
    ({"tp_ranks": [[1, 2], [3]]}, TypeError, "tp_ranks"),
    ({"tp_ranks": [1.0]}, TypeError, "tp_ranks"),
    ({"tp_ranks": [True, False]}, TypeError, "tp_ranks"),
    ({"tp_ranks": [1 << 63]}, ValueError, "tp_ranks"),
    ({"tp_ranks": [1_000_000]}, ValueError, "tp_ranks must hold distinct torch ranks in"),
    ({"tp_ranks": [1, 1]}, ValueError, "tp_ranks"),
    ({"tp_ranks": [[[1]]]}, TypeError, "tp_ranks"),
    ({"dtype": "U4"}, TypeError, "dtype must be a numeric dtype"),
    ({"dtype": None}, TypeError, "dtype"),
    ({"strict": "no"}, TypeError, "strict"),
    ({"strict": None}, TypeError, "strict"),
    ({"rules": [R("nope", "x")], "strict": False}, ValueError,
     r"no trainer leaf matches any of the 1 rules .*\['nope'\].*strict=False skips"),
    ({"rules": [], "strict": False}, ValueError, "no trainer leaf matches any of the 0 rules"),
    ({"rules": [R("w.", "x"), R("v", "y")], "strict": False}, ValueError, "no trainer leaf matches any of the 2"),
]:
    args = {"source": SRC, "rules": RULES, "tp_ranks": [1], **kw}
    row(f"tp_param_map {kw}", lambda a=args: bridge.tp_param_map(a.pop("source"), a.pop("rules"), **a), exc, pat)


def llama(**kw):
    from jreshard.nn import LlamaConfig, fsdp_spec, param_shapes

    cfg = LlamaConfig.load("llama-tiny", vocab_size=1000)
    src = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    return bridge.llama_param_map(kw.pop("config", cfg), src, [2, 3], **kw)


row("llama_param_map config", lambda: llama(config={"a": 1}), TypeError, "config must be")
row("llama_param_map fused", lambda: llama(fused="yes"), TypeError, "fused")
row("llama_param_map vocab_pad 0", lambda: llama(vocab_pad=0), ValueError, "vocab_pad")
row("llama_param_map vocab_pad float", lambda: llama(vocab_pad=2.5), TypeError, "vocab_pad")
row("llama_param_map dtype", lambda: llama(dtype="U2"), TypeError, "dtype")
GOOD = Recipe.llama(LlamaConfig.load("llama-tiny")).to_data()
for name, data, exc, pat in [
    ("list", [], TypeError, "data must be a mapping"),
    ("missing key", {k: v for k, v in GOOD.items() if k != "expert_rules"}, ValueError,
     r"data lacks \['expert_rules'\]"),
    ("rules not a list", {**GOOD, "rules": "w"}, TypeError, r"data\['rules'\] must be a list"),
    ("rule not a mapping", {**GOOD, "rules": [1]}, TypeError, r"data\['rules'\]\[0\] must be a mapping"),
    ("rule unknown field", {**GOOD, "rules": [{**GOOD["rules"][0], "bogus": 1}]}, ValueError,
     r"data\['rules'\]\[0\] has fields \['bogus'\]"),
    ("tie_lm_head str", {**GOOD, "tie_lm_head": "no"}, TypeError, r"data\['tie_lm_head'\] must be True or False"),
]:
    row(f"Recipe.from_data {name}", lambda d=data: Recipe.from_data(d), exc, pat)
for v, exc in [("yes", TypeError), (2.0, TypeError), (None, TypeError), (0, ValueError), (-2, ValueError)]:
    row(f"expert_rules ep {v!r}", lambda v=v: bridge.recipes.qwen3_moe.expert_rules(ep=v), exc, "ep must be")

# --- Region / Param / ParamMap
for kw, exc, pat in [
    ({"leaf": 1}, TypeError, "Region leaf"),
    ({"leaf": ""}, TypeError, "Region leaf"),
    ({"box": [(2, 0), (0, 2)]}, ValueError, "box dim 0"),
    ({"offset": (-1, 0)}, ValueError, r"Region offset\[0\]"),
    ({"offset": "00"}, TypeError, "Region offset"),
    ({"offset": (0,)}, ValueError, "offset"),
    ({"transpose": (1, 1)}, ValueError, "transpose"),
    ({"transpose": "ab"}, TypeError, "Region transpose"),
    ({"view": (-2, 2)}, ValueError, r"Region view\[0\]"),
    ({"view": "ab"}, TypeError, "Region view"),
    ({"view": (8,)}, ValueError, "view"),
]:
    row(f"Region {kw}", lambda kw=kw: region(**kw), exc, pat)
for kw, exc, pat in [
    ({"name": 1}, TypeError, "Param name"),
    ({"name": ""}, TypeError, "Param name"),
    ({"rank": -1}, ValueError, "param 'a': rank"),
    ({"rank": "1"}, TypeError, "param 'a': rank"),
    ({"rank": 1.0}, TypeError, "param 'a': rank"),
    ({"rank": 1_000_000}, ValueError, "param 'a': rank"),
    ({"shape": (-4, 2)}, ValueError, r"param 'a': shape\[0\]"),
    ({"shape": "42"}, TypeError, "param 'a': shape"),
    ({"shape": (4.0, 2)}, TypeError, r"param 'a': shape\[0\]"),
    ({"dtype": "floaty"}, TypeError, "param 'a': dtype"),
    ({"dtype": None}, TypeError, "param 'a': dtype"),
    ({"dtype": "U4"}, TypeError, "param 'a': dtype must be a numeric dtype"),
    ({"regions": 5}, TypeError, "param 'a': regions"),
    ({"regions": (1,)}, TypeError, r"param 'a': regions\[0\]"),
    ({"shape": (2, 2)}, ValueError, "param 'a' on rank 1: region from 'w'"),
    ({"regions": (region(), region(box=[(4, 8), (0, 2)]))}, ValueError, "param 'a' on rank 1: regions .* overlap"),
]:
    row(f"Param {kw}", lambda kw=kw: param(**kw), exc, pat)
row("ParamMap not iterable", lambda: bridge.ParamMap(5), TypeError, "params must be an iterable")
row("ParamMap of str", lambda: bridge.ParamMap(["a"]), TypeError, "params must hold bridge.Param")
row("ParamMap same param twice", lambda: bridge.ParamMap([param(), param()]), ValueError, "'a' appears twice")

# --- BridgePlan
row("BridgePlan complex param", lambda: plan_of(param(dtype="complex64")), ValueError,
    "'a' on rank 1 has dtype complex64, which the wire cannot carry")
row("BridgePlan missing leaf", lambda: plan_of(param(regions=(region(leaf="nope"),))), ValueError,
    "no trainer leaf 'nope'")
row("BridgePlan region outside leaf", lambda: plan_of(param(shape=(40, 2), regions=(region(box=[(0, 40), (0, 2)]),))),
    ValueError, "param 'a' on rank 1 reads box")
row("BridgePlan rank both sides", lambda: plan_of(param(rank=0)), ValueError, r"ranks \[0\] are both")
row("BridgePlan bucket_bytes int64", lambda: bridge.BridgePlan(SRC, PM, bucket_bytes=1 << 63), ValueError,
    "bucket_bytes .* int64")
row("BridgePlan balance None", lambda: bridge.BridgePlan(SRC, PM, balance=None), TypeError, "balance")

def _overlapping():
    """A receiver of two params whose storage partly overlaps."""
    import torch

    from bridge.wire.receiver import Receiver

    src = bridge.Source({"w": Layout((8, 6), TM, ("fsdp",), "float32"), "v": Layout((6,), TM, (), "float32")})
    pm = bridge.tp_param_map(src, [R("w", "lin.weight", transpose=True), R("v", "norm.weight")], [1])
    buf = torch.zeros(60)
    return Receiver(bridge.BridgePlan(src, pm), {"lin.weight": buf[:48].view(6, 8), "norm.weight": buf[40:46]},
                    rank=1)


def _meta_parameter():
    import torch

    return {"lin.weight": torch.nn.Parameter(torch.empty(3, 8, device="meta"))}


# --- Receiver: storage and devices
row("Receiver params overlap", _overlapping, ValueError, r"params\['lin.weight'\] and params\['norm.weight'\] share")
row("Receiver params meta Parameter", lambda: recv(params=_meta_parameter()), ValueError, "meta device")
row("Receiver params not a tensor", lambda: recv(params={"lin.weight": [[0.0] * 8] * 3}), TypeError,
    r"params\['lin.weight'\]")


# --- trainer_mesh, split_source_id, Source
for args, exc, pat in [
    (((2,), "fsdp", [0], 2.0), TypeError, "devices_per_rank must be an int, got float"),
    (((2,), "fsdp", [0], "2"), TypeError, "devices_per_rank must be an int"),
    (((2,), "fsdp", [0], 1001), ValueError, "devices_per_rank must be an int <= 1000"),
    (("2", "fsdp", [0], 2), TypeError, "shape must be a tuple of ints, got str"),
    (((2.0,), "fsdp", [0], 2), TypeError, r"shape\[0\] must be an int"),
    (((0, 2), ("a", "b"), [0], 2), ValueError, r"shape\[0\] must be a positive int"),
    (((2,), "fsdp", 0, 2), TypeError, "ranks must be a tuple of ints"),
    (((2,), "fsdp", [0.0], 2), TypeError, r"ranks\[0\] must be an int"),
]:
    row(f"trainer_mesh {args}", lambda args=args: bridge.trainer_mesh(*args), exc, pat)
for device, exc, pat in [
    ("x", TypeError, "device must be an int, got str"),
    (1.5e6, TypeError, "device must be an int, got float"),
    (True, TypeError, "device must be an int, got bool"),
    (-1, ValueError, "device must be an int >= 0"),
]:
    row(f"split_source_id {device!r}", lambda d=device: bridge.split_source_id(d), exc, pat)
row("Source empty", lambda: bridge.Source({}), ValueError, "leaves must hold at least one")


# --- Sender and what Sender.sync is given
def sender(**kw):
    from bridge.trainer.sender import Sender

    return Sender(kw.pop("plan", BP), **{"rank": 0, **kw})


def jax_params(shape=(8, 6), dtype=np.float32):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    return {"w": jax.device_put(np.zeros(shape, dtype), NamedSharding(mesh, P("fsdp")))}


for kw, exc, pat in [
    ({"plan": "p"}, TypeError, "plan must be a bridge.BridgePlan"),
    ({"rank": -1}, ValueError, "rank"),
    ({"rank": "0"}, TypeError, "rank"),
    ({"rank": 1}, ValueError, "rank 1 holds no trainer shards"),
    ({"timeout": -1}, ValueError, "timeout"),
    ({"timeout": "5"}, TypeError, "timeout"),
    ({"ready_timeout": float("nan")}, ValueError, "ready_timeout"),
    ({"checksum": "yes"}, TypeError, "checksum"),
    ({"checksum": None}, TypeError, "checksum"),
    ({"progress": "on"}, TypeError, "progress"),
]:
    row(f"Sender {kw}", lambda kw=kw: sender(**kw), exc, pat)
for name, version, exc, pat in [
    ("negative", -1, ValueError, "version"),
    ("str", "1", TypeError, "version"),
    ("float", 1.0, TypeError, "version"),
    ("above int64", 1 << 63, ValueError, "version .* int64"),
]:
    row(f"Sender.sync version {name}", lambda v=version: sender().sync(jax_params(), version=v), exc, pat)
row("Sender.sync params missing a leaf", lambda: sender().sync({}, version=1), ValueError,
    r"params lacks trainer leaves \['w'\]")
row("Sender.sync params wrong shape", lambda: sender().sync(jax_params((8, 4)), version=1), ValueError,
    r"params\['w'\] is \(8, 4\)")
row("Sender.sync params numpy", lambda: sender().sync({"w": np.zeros((8, 6), np.float32)}, version=1), TypeError,
    r"params\['w'\] must be a jax.Array.*numpy.ndarray")
row("Sender.sync inside jit", lambda: jax_jit(lambda x: sender().sync({"w": x}, version=1))(jax_params()["w"]),
    TypeError, r"params\['w'\] is a tracer: Sender.sync must be called outside jax.jit")
row("Sender.sync deleted array", lambda: sender().sync(deleted(jax_params()), version=1), ValueError,
    r"params\['w'\] has been deleted")
row("quantize_params deleted array", lambda: quantize_params(deleted(jax_params((8, 4))), fp8_map()), ValueError,
    r"params\['w'\] has been deleted")
row("quantize_params inside jit", lambda: jax_jit(lambda x: quantize_params({"w": x}, fp8_map()))(
    jax_params((8, 4))["w"]), TypeError, r"params\['w'\] is a tracer: quantize_params must be called outside jax.jit")
row("Sender.sync params wrong dtype", lambda: sender().sync(jax_params(dtype=np.int32), version=1), ValueError,
    r"params\['w'\] is \(8, 6\) int32")

def jax_jit(fn):
    import jax

    return jax.jit(fn)


def deleted(params):
    """``params`` with every array deleted (as a donating jitted step leaves them)."""
    for x in params.values():
        x.delete()
    return params


def fp8_map():
    """An FP8 param map of one (8, 4) leaf in 2 x 2 blocks on one TP rank."""
    src = bridge.Source({"w": Layout((8, 4), TM, ("fsdp",), "float32")})
    pm = bridge.tp_param_map(src, [R("w", "lin.weight", transpose=True)], [1])
    return bridge.fp8_param_map(src, pm, Fp8Format(block=(2, 2)), quantize="lin.weight")


def quantize_params(params, fp8):
    from bridge.trainer.fp8 import quantize_params

    return quantize_params(params, fp8)


for who, call in [("Sender.sync", lambda g: sender().sync(jax_params(), version=1, group=g)),
                  ("Receiver.sync", lambda g: recv().sync(group=g)),
                  ("reject_sync", lambda g: bridge.reject_sync(BP, rank=1, group=g))]:
    row(f"{who} group not registered", lambda call=call: call("x"), ValueError, "group 'x' is not registered")


# --- the job's secret (TrainerSync, GroupInfo, open_group): its value is never shown
def trainer_sync(**kw):
    from bridge.engines.trainer import TrainerSync
    from bridge.recipes import Recipe
    from jreshard.nn import LlamaConfig

    return TrainerSync(Recipe.llama(LlamaConfig.load("llama-tiny")), **{
        "workers": 1, "control": object(), "rank": 0, "trainers": 1, "port": 29999, **kw})


def group_info(secret):
    from bridge.engines.worker import GroupInfo

    return GroupInfo("127.0.0.1", 29999, 1, 2, secret=secret)


def open_group(secret):
    from bridge.engines.group import open_group

    return open_group("127.0.0.1", 29999, 1, 2, secret=secret, timeout=1)


for what, call in [("TrainerSync", lambda s: trainer_sync(secret=s)), ("GroupInfo", group_info),
                   ("open_group", open_group)]:
    for name, secret, exc, pat in [
        ("int", 1234, TypeError, "secret must be bytes or str .*got int; make one with secrets.token_bytes"),
        ("list", [1, 2], TypeError, "secret must be bytes or str .*got list"),
        ("empty", b"", ValueError, "secret must hold at least 16 bytes .* got 0 bytes"),
        ("short str", "hunter2", ValueError, r"secret must hold at least 16 bytes .* got 7 bytes \(its value is not"),
    ]:
        row(f"{what} secret {name}", lambda call=call, secret=secret: call(secret), exc, pat)


def without_env_secret(fn):
    from unittest import mock

    from bridge.engines.membership import SECRET_ENV

    with mock.patch.dict("os.environ", {SECRET_ENV: ""}):
        return fn()


row("TrainerSync secret None on two trainers without jax.distributed",
    lambda: without_env_secret(lambda: trainer_sync(trainers=2)), ValueError,
    "trainers=2 need one secret between them: pass secret=")


def test_numpy_ints_and_bools_pass_where_ints_and_bools_do():
    rule = R("w", "x", dim=np.int64(0), pad_to=np.int32(2), part=np.int8(1))
    heads = R("w", "x", dim=0, heads=np.int64(2), transpose=(np.int64(1), 0))
    assert (rule.dim, rule.pad_to, rule.part, heads.heads, heads.transpose) == (0, 2, 1, 2, (1, 0))
    assert all(type(v) is int for v in (rule.dim, rule.pad_to, rule.part, heads.heads))
    pm = bridge.tp_param_map(SRC, [R("w", "x", transpose=True, dim=0)], np.array([1, 2]), strict=np.True_)
    assert pm == bridge.tp_param_map(SRC, [R("w", "x", transpose=True, dim=0)], [1, 2])
    p = param(rank=np.int64(1), shape=np.array([4, 2]))
    assert p.rank == 1 and p.shape == (4, 2) and type(p.rank) is int
    assert bridge.BridgePlan(SRC, PM, bucket_bytes=np.int64(1 << 20), balance=np.False_).balance is False
    assert bridge.trainer_mesh((np.int64(2),), "fsdp", [np.int64(0)], np.int64(2)) == TM
    assert bridge.trainer_mesh(np.array([2]), "fsdp", range(1), 2) == TM
    assert bridge.split_source_id(np.int64(1001001)) == (1, 1)
    assert Layout((np.int64(8), np.int32(6)), TM, ("fsdp",)).shape == (8, 6)
    assert region(offset=np.array([0, 0]), view=(np.int64(4), 2)).view == (4, 2)


def test_numpy_ints_pass_as_ep_and_strict_false_maps_a_partial_tree():
    from bridge.recipes.qwen3_moe import expert_rules, qwen3_moe_param_map
    from jreshard.nn import MoeConfig, fsdp_spec, param_shapes

    assert expert_rules(ep=np.int64(2)) == expert_rules(ep=True) == expert_rules(ep=np.True_)
    assert expert_rules(ep=1) == expert_rules(ep=False)
    cfg = MoeConfig.load("qwen3-moe-tiny")
    src = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    assert qwen3_moe_param_map(cfg, src, [[2, 3], [4, 5]], ep=np.int64(2)) == qwen3_moe_param_map(
        cfg, src, [[2, 3], [4, 5]], ep=2)
    two = bridge.Source({"w": Layout((8, 6), TM, ("fsdp",), "float32"), "v": Layout((6,), TM, (), "float32")})
    pm = bridge.tp_param_map(two, [R("w", "lin.{0}", transpose=True), R("nope", "x")], [1], strict=False)
    assert [p.name for p in pm.for_rank(1)] == ["lin.w"]  # v matches no rule: skipped, w mapped


@pytest.mark.parametrize(("name", "fn", "exc", "pattern"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(name, fn, exc, pattern):
    check_row(name, fn, exc, pattern)
