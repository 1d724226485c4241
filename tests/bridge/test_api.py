"""The bridge's names, its refusals at plan time, what a plan mismatch reports, and the docs' snippet."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import bridge
from bridge.plan.key import decode, describe_difference, encode, plan_key
from jreshard import Box, Layout
from tests.bridge import _common as C

DOCS = Path(__file__).resolve().parents[2] / "docs" / "bridge.md"

def _plan(**kw) -> bridge.BridgePlan:
    cfg = C.small_config()
    src = C.source_for(cfg)
    bucket = kw.pop("bucket_bytes", 1 << 20)
    return bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, list(C.RECEIVERS), fused=True, **kw),
                             bucket_bytes=bucket)


def test_public_names_and_no_old_aliases():
    for name in bridge.__all__:
        if name not in ("Receiver", "init_group", "reject_sync", "rebuild_group", "dtensor_param_map"):  # torch
            assert getattr(bridge, name) is not None, name
    for old in ("Target", "Mapping", "Transfer", "tp_mapping", "llama_mapping", "dtensor_targets", "dtensor_mapping"):
        assert not hasattr(bridge, old), old  # removed in 0.2.0 (docs/changelog.md)
    p = _plan()
    assert p.param(p.moves[0].param, p.moves[0].dst).name == p.moves[0].param


def test_region_box_is_a_box_whichever_way_it_is_given():
    a = bridge.Region("w", ((0, 4), (2, 6)), (0, 0), (1, 0))
    b = bridge.Region("w", (slice(0, 4), slice(2, 6)), (0, 0), (1, 0))
    assert isinstance(a.box, Box) and a == b and a.shape == (4, 4) and str(a.box) == "[0:4, 2:6]"


def test_plan_refuses_a_dtype_the_wire_cannot_carry():
    src = bridge.Source({"w": Layout((4, 6), bridge.trainer_mesh((2,), "fsdp", [0], 2), ("fsdp",), "float32")})
    rules = [bridge.Rule("w", "linear.weight", transpose=True, dim=0)]
    with pytest.raises(ValueError, match=r"'linear.weight' on rank 1 has dtype float8_e5m2, which the wire cannot"):
        bridge.BridgePlan(src, bridge.tp_param_map(src, rules, [1, 2], dtype="float8_e5m2"))
    with pytest.raises(TypeError, match="param_map must be a bridge.ParamMap"):
        bridge.BridgePlan(src, {"w": rules})


def test_plan_key_survives_json_and_names_what_differs():
    base = _plan()
    key = plan_key(base)
    assert decode(encode(key)) == key
    assert describe_difference(key, plan_key(_plan())) == (
        "the same inputs planned into different moves; run one jreshard version everywhere")
    # The trainer plans bfloat16 params, the receivers float32: the error names both dtypes.
    assert describe_difference(plan_key(_plan(dtype="bfloat16")), key) == "param dtypes bfloat16 vs float32"
    # Another vocabulary padding: the first differing shape is named, with both values.
    padded = describe_difference(plan_key(_plan(vocab_pad=96)), key)
    assert re.search(r"params differ in shape, e\.g\. 'lm_head\.weight on rank 2': \[528, 256\] vs \[512, 256\]",
                     padded), padded
    assert describe_difference(plan_key(_plan(bucket_bytes=1 << 19)), key) == "bucket_bytes 524288 vs 1048576"
    fewer = bridge.BridgePlan(base.source, bridge.ParamMap(base.param_map.for_rank(2)), bucket_bytes=1 << 20)
    assert describe_difference(plan_key(fewer), key) == (
        "params only on one side: 0 vs 15 (e.g. 'lm_head.weight on rank 3')")


def test_docs_own_model_snippet_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    (snippet,) = [b for b in blocks if "tp_param_map(source, rules" in b]
    scope: dict = {}
    exec(compile(snippet, str(DOCS), "exec"), scope)
    assert capsys.readouterr().out.strip() == "(384, 256)"
    plan = scope["plan"]
    assert plan.param_map.ranks == (2, 3) and plan.source.ranks == (0, 1)
    assert plan.plan.stats().network_bytes == plan.plan.stats().lower_bound_bytes == plan.network_bytes


@pytest.mark.parametrize("marker", ["ep_dim=\"e\", at=", "maxtext_param_map(cfg, source"])
def test_docs_moe_and_real_tree_snippets_run(marker, capsys):
    blocks = DOCS.read_text().split("```python\n")[1:]
    (snippet,) = [b.split("```")[0] for b in blocks if marker in b.split("```")[0]]
    exec(compile(snippet, str(DOCS), "exec"), {})
    if "maxtext" in marker:
        assert capsys.readouterr().out == "lm_head.weight (512, 256)\n"
