"""The ``jreshard plan`` command: table, JSON keys, flags, and errors that name the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from jreshard.__main__ import main

KEYS = {"bytes_moved", "lower_bound_bytes", "naive_bytes", "max_send_bytes", "mean_send_bytes", "messages",
        "plan_seconds_cold", "plan_seconds_warm", "predicted_seconds"}
SCENARIO = {"model": "llama-tiny", "train": {"gpus": 8, "tp": 2, "pp": 2, "dp": 2},
            "infer": {"gpus": 8, "tp": 4, "dp": 2}, "hardware": "dgx-h100", "dtype": "float32"}


def run(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_keys_and_values(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCENARIO))
    rc, out, err = run(capsys, str(path), "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert set(r) >= KEYS
    assert set(r["predicted_seconds"]) == {"jreshard", "gather_broadcast", "flat_direct", "pipelined_tree"}
    # llama-tiny in float32: tp-split tensors reach both engines, norms all 8 devices.
    assert r["bytes_moved"] == r["lower_bound_bytes"] == 2 * 13706240 + 6 * 9 * 256 * 4
    assert r["naive_bytes"] == 8 * 13706240
    assert 0 < r["messages"] <= 8 * 8
    assert r["plan_seconds_cold"] > 0 and r["plan_seconds_warm"] >= 0
    assert all(v > 0 for v in r["predicted_seconds"].values())


def test_table_from_builtin_scenario(capsys):
    rc, out, _ = run(capsys, "qwen3-32b-fsdp8-to-tp4dp2")
    assert rc == 0
    for label in ("bytes moved (direct)", "lower bound", "(met)", "gather-then-broadcast", "per sender (direct)",
                  "per receiver (direct)", "messages (direct)", "predicted jreshard", "  direct delivery",
                  "  hierarchical delivery", "predicted gather+bcast", "predicted flat direct", "planning time"):
        assert label in out, label
    assert "707 tensors" in out
    lines = {re.split(r"\s{2,}", line.strip())[0]: line for line in out.splitlines()}
    # Which delivery each prediction is for, and which links its bytes cross.
    assert "with hierarchical delivery" in lines["predicted jreshard"]
    for key in ("direct delivery", "hierarchical delivery", "predicted gather+bcast", "predicted flat direct"):
        assert "network" in lines[key] and "NVLink" in lines[key], key
    assert "between devices, network and NVLink" in lines["bytes moved (direct)"]


def test_json_labels_delivery_and_links(tmp_path, capsys):
    rc, out, err = run(capsys, "qwen3-32b-fsdp8-to-tp4dp2", "--json")
    assert rc == 0, err
    r = json.loads(out)
    pred = r["predictions"]
    assert r["delivery"] == "hierarchical" and r["hierarchical_setting"] == "auto"
    assert [pred[k]["delivery"] for k in ("jreshard_direct", "jreshard_hierarchical", "gather_broadcast",
                                          "flat_direct")] == ["direct", "hierarchical", "gather-then-broadcast",
                                                              "flat direct"]
    # Direct delivery: training and inference sit in different domains, every byte crosses the network.
    assert pred["jreshard_direct"]["network_bytes"] == r["bytes_moved"] and pred["jreshard_direct"]["nvlink_bytes"] == 0
    # Hierarchical: each byte enters the inference domain once (two TP4 engines share it), then NVLink.
    hier = pred["jreshard_hierarchical"]
    assert hier["network_bytes"] + hier["nvlink_bytes"] == r["bytes_moved"]
    assert hier["network_bytes"] < r["bytes_moved"] and len(hier["stage_seconds"]) == 2
    assert r["predicted_seconds"]["jreshard"] == hier["seconds"]
    assert r["labels"]["bytes_moved"] == {"delivery": "direct",
                                          "links": "network and NVLink (bytes between distinct devices)"}
    assert set(r["labels"]) >= {"bytes_moved", "naive_bytes", "messages", "predicted_seconds"}
    _, never, _ = run(capsys, "qwen3-32b-fsdp8-to-tp4dp2", "--hierarchical", "never")
    assert "not predicted (--hierarchical never)" in never and "with direct delivery" in never


def test_flags_match_the_scenario_file(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCENARIO))
    _, from_file, _ = run(capsys, str(path), "--json")
    rc, from_flags, err = run(capsys, "--model", "llama-tiny", "--train", "tp=2,pp=2,dp=2", "--infer", "tp=4,dp=2",
                              "--hardware", "dgx-h100", "--dtype", "float32", "--json")
    assert rc == 0, err
    a, b = json.loads(from_file), json.loads(from_flags)
    for k in ("bytes_moved", "naive_bytes", "max_send_bytes", "messages", "predicted_seconds"):
        assert a[k] == b[k], k


def flags(train, infer, *, model="llama-tiny", hardware="dgx-h100", extra=()):
    return ["--model", model, "--train", train, "--infer", infer, "--hardware", hardware, *extra]


@pytest.mark.parametrize("argv, match", [
    (["--model", "llama-tiny", "--train", "tp=2"], "--infer is required"),
    (flags("tp=x", "tp=1"), "'tp=x'"),
    (flags("tp=2,pp=2,gpus=6", "tp=1"), "--train 'tp=2,pp=2,gpus=6': a pipeline stage of 3 devices cannot hold"),
    (flags("tp=2,tp=4", "tp=1"), "given twice"),
    (flags("tp=2", "tp=0"), "--infer 'tp=0': .*positive ints"),
    (flags("tp=2", "tp=2", model="nope"), "--model 'nope': model 'nope' is not in the catalog"),
    (flags("pp=5", "tp=1"), "--train 'pp=5': pp=5 stages exceed the model's 4 layers; use pp <= 4"),
    # llama-tiny: 8 query heads, 4 KV heads, 4 layers, intermediate size 688, no experts.
    (flags("tp=2", "tp=16"),
     "--infer 'tp=16': tp=16 on model.layers.0.self_attn.q_proj.weight: 16 tensor-parallel ranks for 8 heads"),
    (flags("tp=8", "tp=8"),
     "--train 'tp=8': tp=8 on model.layers.0.self_attn.k_proj.weight: .*use a TP degree dividing 4"),
    (flags("tp=2", "tp=2,ep=2"), "--infer 'tp=2,ep=2': ep=2 but the model has no routed experts; use ep=1"),
    (flags("tp=2", "tp=2", hardware="tpu"), "--hardware 'tpu'"),
    (flags("tp=2", "tp=2", extra=["--dtype", "f7"]), "--dtype 'f7'"),
    (["qwen3-32b-fsdp8-to-tp4dp2", "--model", "qwen3-32b"], "not both"),
    (["/no/such/file.json"], "neither a built-in name"),
])
def test_errors(capsys, argv, match):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and not out
    assert err.startswith("jreshard plan: error:") and re.search(match, err), err


def test_bad_scenario_file_names_field(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**SCENARIO, "infer": {"gpus": 8, "tp": "four"}}))
    rc, _, err = run(capsys, str(path))
    assert rc == 2 and "field 'infer.tp'" in err


def test_module_entry_point_and_demo_still_listed():
    out = subprocess.run([sys.executable, "-m", "jreshard", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "plan" in out.stdout and "demo" in out.stdout


def test_moe_scenario_at_full_size():
    # Qwen3-235B-A22B, ~37,000 tensors, TP2 CP2 EP16 PP4 -> TP8 DP8 on GB200.
    from jreshard.cli.plan import plan_report
    from jreshard.fleet.scenario import load_scenario

    r = plan_report(load_scenario("qwen3-235b-tp2cp2ep16pp4-to-tp8dp8"))
    assert r["tensors"] == 36945
    assert r["bytes_moved"] == r["lower_bound_bytes"]
    # Disjoint device ranges: each of the 8 TP8 engines receives every tp-split tensor once
    # (bfloat16); replicated tensors (norms, routers) go to all 64 devices.
    from jreshard.fleet import catalog

    # The model's 4 KV heads at TP8: vLLM puts each on 2 ranks, so an engine receives the
    # KV projections twice.
    infos = catalog.tensors("qwen3-235b-a22b")
    replicated = sum(t.size for t in infos if t.role == "replicated")
    kv = sum(t.size for t in infos if t.name.endswith(("k_proj.weight", "v_proj.weight")))
    assert kv == 94 * 2 * (4 * 128) * 4096
    sharded = catalog.num_params(infos) - replicated - kv
    assert r["bytes_moved"] == 2 * (8 * sharded + 16 * kv + 64 * replicated)
    p = r["predicted_seconds"]
    assert p["jreshard"] < p["flat_direct"] and p["jreshard"] < p["gather_broadcast"]
    assert r["delivery"] == "hierarchical"


@pytest.mark.parametrize("experts", ["separate", "stacked"])
def test_model_from_config_file(tmp_path, capsys, experts):
    cfg = {"model_type": "qwen3_moe", "name": "cli-moe", "vocab_size": 64, "hidden_size": 16,
           "moe_intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 4, "num_experts": 4, "dtype": "float32"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, err = run(capsys, "--model", str(path), "--train", "tp=2,ep=2,pp=2", "--infer", "tp=2,dp=2",
                       "--hardware", "dgx-h100", "--experts", experts, "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["tensors"] == 3 + 4 * (9 + (12 if experts == "separate" else 3))
    assert r["bytes_moved"] == r["lower_bound_bytes"] > 0


def test_progress_bar_on_stderr(capsys):
    rc, out, err = run(capsys, "qwen3-32b-fsdp8-to-tp4dp2", "--progress", "on", "--json")
    assert rc == 0 and json.loads(out)["tensors"] == 707
    assert "plan (cold)" in err and "cost model" in err


def _config(tmp_path, folder, **extra):
    """A Qwen3 config.json without a name, in a folder named like a Hugging Face repo."""
    cfg = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 4,
           "torch_dtype": "float32", **extra}
    path = tmp_path / folder / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return path


def report(capsys, *argv):
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_config_without_name_takes_the_folder_name(tmp_path, capsys):
    r = report(capsys, *flags("tp=2", "tp=4", model=str(_config(tmp_path, "Org-Qwen3-Mini"))))
    assert r["model"] == "org-qwen3-mini" and r["tensors"] == 1 + 2 * 11 + 2


def test_kv_heads_at_tp16_are_replicated_whole(tmp_path, capsys):
    # 16 query heads, 8 KV heads of 4 rows at TP16: vLLM gives each rank one whole KV head, two
    # ranks per head, so one engine receives each KV projection twice (not 8 half-heads once).
    r = report(capsys, *flags("tp=2", "tp=16", model=str(_config(tmp_path, "kv8"))))
    h, layers = 16, 2
    kv = layers * 2 * (8 * 4) * h  # k_proj and v_proj: [32, 16] each
    q_o = layers * 2 * (16 * 4) * h
    mlp = layers * 3 * 32 * h
    vocab = 2 * 64 * h  # embedding and lm_head
    norms = layers * (2 * h + 2 * 4) + h  # input/post norms, q/k norms, final norm
    assert r["bytes_moved"] == r["lower_bound_bytes"] == 4 * (q_o + mlp + vocab + 2 * kv + 16 * norms)


def test_moe_config_without_name(tmp_path, capsys):
    path = str(_config(tmp_path, "mini-moe", model_type="qwen3_moe", num_experts=4, moe_intermediate_size=8,
                       num_experts_per_tok=2))
    assert report(capsys, *flags("tp=2,ep=2", "tp=2,dp=2", model=path))["model"] == "mini-moe"
    rc, _, err = run(capsys, *flags("tp=2,ep=3", "tp=2,dp=2", model=path))
    assert rc == 2 and "--train 'tp=2,ep=3': ep=3 does not divide the model's 4 routed experts" in err


def test_layer_prints_one_moe_layer_next_to_the_published_figures(capsys):
    rc, out, err = run(capsys, "dsv3-ep16pp8-to-tp8dp16", "--layer", "3")
    assert rc == 0, err
    assert out.startswith("deepseek-v3 layer 3, routed experts on dsv3-ep16pp8-to-tp8dp16: 768 tensors")
    assert re.search(r"jreshard \(\w+\)\s+[\d.,]+ ms\s+9\.8 ms", out)
    assert re.search(r"flat direct sends\s+[\d.,]+ ms\s+77\.3 ms", out)
    rc, out, err = run(capsys, "dsv3-ep16pp8-to-tp8dp16", "--layer", "3", "--json")
    r = json.loads(out)
    assert (r["layer"], r["tensors"]) == (3, 768)
    assert r["predictions"]["jreshard"]["seconds"] < r["predictions"]["flat_direct"]["seconds"]
    assert r["published"] == {"jreshard_s": 0.0098, "flat_direct_s": 0.0773}


def test_layer_without_experts_is_refused(capsys):
    rc, out, err = run(capsys, "dsv3-ep16pp8-to-tp8dp16", "--layer", "0")
    assert rc == 2 and out == ""
    assert "layer 0 of deepseek-v3 holds no routed experts; layers 3 to 61 do" in err


FP8 = ["--model", "llama-tiny", "--train", "fsdp=4", "--infer", "tp=2,dp=2", "--hardware", "dgx-h100",
       "--dtype", "float8_e4m3fn", "--fp8-block", "8"]


def test_fp8_delivery_json(capsys):
    rc, out, err = run(capsys, *FP8, "--json")
    assert rc == 0, err
    r = json.loads(out)
    f8 = r["fp8"]
    assert (f8["dtype"], f8["block"], f8["scaling"], f8["kept_dtype"]) == ("float8_e4m3fn", [8, 8], "reciprocal",
                                                                           "float32")
    assert (f8["quantized"], f8["kept"], r["tensors"]) == (28, 11, 39)
    # llama-tiny: 4 layers of q, k, v, o (256x256, 128x256, 128x256, 256x256) and gate, up, down (688x256 / 256x688)
    elems = 4 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 688 * 256)
    scales = 4 * (2 * 32 * 32 + 2 * 16 * 32 + 2 * 86 * 32 + 32 * 86)
    assert f8["fp8_bytes"] == elems and f8["scale_bytes"] == 4 * scales
    # FSDP4 cuts the 688 rows of gate and up at 172 and 516: 2 x 32 blocks each, 8 tensors, both ways.
    assert (f8["cut_blocks"], f8["nbytes"], f8["messages"]) == (512, 512 * 2 * 4, 4)
    # Each engine (dp=2) receives every tensor once (FP8 weights, their scales, the rest in float32),
    # and its second TP rank the 9 norms again.
    norms = 9 * 256 * 4
    assert r["bytes_moved"] == r["lower_bound_bytes"] == 2 * (elems + 4 * scales + f8["kept_bytes"] + norms)
    stages = r["predictions"]["jreshard_direct"]["stage_seconds"]
    assert len(stages) == 2 and stages[0] > 0  # the amax exchange, then the sends


def test_fp8_delivery_table_and_scenario_override(capsys):
    rc, out, err = run(capsys, *FP8)
    assert rc == 0, err
    lines = {re.split(r"\s{2,}", line.strip())[0]: line for line in out.splitlines()}
    assert "28 tensors in float8_e4m3fn" in lines["FP8 delivery"] and "11 kept in float32" in lines["FP8 delivery"]
    assert "512 blocks cut by training shards: 4,096 bytes in 4 messages" in lines["amax exchange"]
    rc, out, err = run(capsys, "qwen3-32b-fsdp8-to-tp4dp2", "--json")
    bf16 = json.loads(out)
    rc, out, err = run(capsys, "qwen3-32b-fsdp8-to-tp4dp2", "--dtype", "float8_e4m3fn", "--json")
    assert rc == 0, err
    fp8 = json.loads(out)
    assert fp8["tensors"] == bf16["tensors"] == 707 and fp8["fp8"]["block"] == [128, 128]
    assert 0.5 < fp8["bytes_moved"] / bf16["bytes_moved"] < 0.55  # norms and embeddings stay in bfloat16


@pytest.mark.parametrize("argv, match", [
    (FP8[:-2] + ["--fp8-block", "3x"], r"--fp8-block '3x': fp8_block must be two positive block sizes"),
    (FP8[:-4] + ["--fp8-block", "8"], r"--fp8-block '8': needs an FP8 dtype"),
    (FP8[:-2], r"--infer 'tp=2,dp=2': FP8 delivery of model.layers.0.self_attn.k_proj.weight \(float8_e4m3fn with "
               r"128x128 blocks\): layout splits dim 0 \(size 128\) into shards of 64"),
    (["qwen3-32b-fsdp8-to-tp4dp2", "--dtype", "float8_e4m3fn", "--fp8-block", "96"],
     r"field 'infer': FP8 delivery of model.layers.0.self_attn.q_proj.weight \(float8_e4m3fn with 96x96 blocks\): "
     r"layout splits dim 0 \(size 8192\) into shards of 2048"),
])
def test_fp8_errors_name_the_flag(capsys, argv, match):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and not out and re.search(match, err), err
