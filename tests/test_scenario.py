"""Scenario files: every built-in one loads; errors name the field."""

from __future__ import annotations

import doctest
import json

import pytest

from jreshard.fleet import scenario
from jreshard.fleet.scenario import ScenarioError, load_scenario


@pytest.mark.parametrize("name", scenario.scenario_names())
def test_builtin_scenarios_load(name):
    s = load_scenario(name)
    assert len(s.train_devices()) == s.train_gpus and len(s.infer_devices()) == s.infer_gpus
    assert s.infer_devices().start == s.train_gpus  # separate ranges unless colocated
    topo = s.topology()
    assert topo.gpus_per_domain == (4 if name == "qwen3-32b-tp2pp4dp2-to-tp1dp16" else s.hardware.gpus_per_domain)


def test_kimi_and_qwen_moe_degrees():
    kimi = load_scenario("kimi-k2-256-to-128")
    assert (kimi.train_gpus, kimi.infer_gpus, kimi.train.ep, kimi.infer.tp) == (256, 128, 32, 16)
    assert kimi.published["reshard_s"] == 1.3
    q = load_scenario("qwen3-235b-tp2cp2ep16pp4-to-tp8dp8")
    assert q.train.world(q.train_gpus) == (16, 4, 1)  # stage 16, dense replicas 4, expert replicas 1


def test_expert_degrees_in_scenario_files():
    s = load_scenario({"model": "qwen3-moe-tiny", "train": {"ep": 4, "fsdp": 2, "tp": 2},
                       "infer": {"tp": 2, "dp": 4, "ep": 4, "expert_tp": 2}, "hardware": "dgx-h100"})
    # Experts take ep*fsdp*expert_tp = 8 devices, dense weights fsdp*tp = 4: a stage of lcm = 8.
    assert (s.train_gpus, s.infer_gpus, s.train.world(8)) == (8, 8, (8, 2, 1))
    src, dst = s.layouts(experts="stacked")
    gate = "model.layers.0.mlp.experts.gate_proj.weight"
    assert src[gate].spec == (("ep", "fsdp"), None, None) and dst[gate].spec == ("ep", "etp", None)
    dsv3 = load_scenario("dsv3-ep16pp8-to-tp8dp16")
    assert (dsv3.published["moe_layer_reshard_s"], dsv3.published["moe_layer_flat_direct_sends_s"]) == (0.0098, 0.0773)


BASE = {"model": "llama-tiny", "train": {"gpus": 8, "tp": 2, "pp": 2, "dp": 2},
        "infer": {"gpus": 8, "tp": 4, "dp": 2}, "hardware": "dgx-h100", "dtype": "float32"}


def test_colocated_and_file(tmp_path):
    s = load_scenario({**BASE, "colocated": True})
    assert s.infer_devices() == range(0, 8)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(BASE))
    s = load_scenario(str(path))
    assert s.name == "mine"
    src, dst = s.layouts()
    assert src.keys() == dst.keys() and len(src) == 39


def _without(key):
    return {k: v for k, v in BASE.items() if k != key}


ERRORS = [
    ("missing model", _without("model"), "field 'model' is missing"),
    ("unknown model", {**BASE, "model": "gpt-17"}, "field 'model'.*gpt-17"),
    ("unknown field", {**BASE, "hardwre": "x"}, "field 'hardwre' is not known"),
    ("missing train", _without("train"), "field 'train' is missing"),
    ("train not an object", {**BASE, "train": 8}, "field 'train' must be an object"),
    ("unknown degree", {**BASE, "train": {"gpus": 8, "tpp": 2}}, "field 'train.tpp' is not known"),
    ("bad degree", {**BASE, "train": {"gpus": 8, "tp": "2"}}, "field 'train.tp' must be an int, got str"),
    ("zero gpus", {**BASE, "infer": {"gpus": 0, "tp": 1}}, "field 'infer.gpus'"),
    ("degrees do not fit", {**BASE, "train": {"gpus": 8, "tp": 2, "pp": 2}}, "field 'train'.*multiply"),
    ("infer does not fit", {**BASE, "infer": {"gpus": 8, "tp": 4}}, "field 'infer'.*tp\\*dp"),
    ("unknown hardware", {**BASE, "hardware": "tpu-v9"}, "field 'hardware'.*tpu-v9"),
    ("missing hardware", _without("hardware"), "field 'hardware' is missing"),
    ("bad dtype", {**BASE, "dtype": "float7"}, "field 'dtype'"),
    ("bad colocated", {**BASE, "colocated": "yes"}, "field 'colocated'"),
    ("colocated sizes", {**BASE, "colocated": True, "infer": {"gpus": 4, "tp": 4}}, "field 'colocated'"),
    ("bad override", {**BASE, "gpus_per_domain_override": -1}, "field 'gpus_per_domain_override'"),
    ("bad published", {**BASE, "published": 3}, "field 'published'"),
    ("tp cuts a head", {**BASE, "infer": {"gpus": 16, "tp": 16}},
     "field 'infer': tp=16 on model.layers.0.self_attn.q_proj.weight: .*use a TP degree dividing 8"),
    ("training tp above the KV heads", {**BASE, "train": {"gpus": 8, "tp": 8}},
     "field 'train': tp=8 on model.layers.0.self_attn.k_proj.weight"),
    ("ep without experts", {**BASE, "infer": {"gpus": 8, "tp": 4, "dp": 2, "ep": 2}}, "field 'infer': ep=2 .*use ep=1"),
    ("expert_tp does not fit", {**BASE, "infer": {"gpus": 6, "tp": 2, "dp": 3, "expert_tp": 4}},
     "field 'infer': inference ep\\*expert_tp = 4 does not divide 6 devices"),
]


@pytest.mark.parametrize("case, data, match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_field(case, data, match):
    with pytest.raises(ScenarioError, match=match):
        load_scenario(data)


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ScenarioError, match="not valid JSON"):
        load_scenario(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ScenarioError, match="JSON object"):
        load_scenario(str(bad))
    with pytest.raises(ScenarioError, match="neither a built-in name"):
        load_scenario(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="scenario"):
        load_scenario(3)


def test_hardware_file_errors(tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"gpus_per_domain": 8, "nvlink_GBps_per_direction": 450, "latency_us": 5}))
    with pytest.raises(ScenarioError, match="network_GBps_per_gpu_per_direction"):
        load_scenario({**BASE, "hardware": str(hw)})


def test_error_carries_field_and_reason():
    with pytest.raises(ScenarioError) as info:
        load_scenario({**BASE, "infer": {"gpus": 16, "tp": 16}}, name="wide")
    assert info.value.field == "infer"
    assert info.value.reason.startswith("tp=16 on model.layers.0.self_attn.q_proj.weight: 16 tensor-parallel ranks")
    assert str(info.value) == f"scenario wide: field 'infer': {info.value.reason}"


def test_kv_heads_replicated_at_tp8():
    s = load_scenario({**BASE, "infer": {"gpus": 16, "tp": 8, "dp": 2}})  # llama-tiny has 4 KV heads
    _, dst = s.layouts()
    assert dst["model.layers.0.self_attn.v_proj.weight"].replication == 4  # 2 ranks per head, 2 engines


def test_docstring_examples():
    result = doctest.testmod(scenario)
    assert result.attempted > 0 and result.failed == 0
