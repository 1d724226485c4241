"""The ``jreshard plan`` command: table, JSON keys, flags, and errors that name the field."""

from __future__ import annotations

import json
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
    assert KEYS <= set(r)
    assert set(r["predicted_seconds"]) == {"jreshard", "gather_broadcast", "flat_direct"}
    # llama-tiny in float32: tp-split tensors reach both engines, norms all 8 devices.
    assert r["bytes_moved"] == r["lower_bound_bytes"] == 2 * 13706240 + 6 * 9 * 256 * 4
    assert r["naive_bytes"] == 8 * 13706240
    assert 0 < r["messages"] <= 8 * 8
    assert r["plan_seconds_cold"] > 0 and r["plan_seconds_warm"] >= 0
    assert all(v > 0 for v in r["predicted_seconds"].values())


def test_table_from_builtin_scenario(capsys):
    rc, out, _ = run(capsys, "qwen3-32b-fsdp8-to-tp4dp2")
    assert rc == 0
    for label in ("network bytes", "lower bound", "(met)", "gather-then-broadcast", "per sender", "per receiver",
                  "messages", "predicted jreshard", "predicted gather+bcast", "predicted flat direct",
                  "planning time"):
        assert label in out, label
    assert "707 tensors" in out


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


@pytest.mark.parametrize("argv, match", [
    (["--model", "llama-tiny", "--train", "tp=2"], "--infer is required"),
    (["--model", "llama-tiny", "--train", "tp=x", "--infer", "tp=1", "--hardware", "dgx-h100"], "'tp=x'"),
    (["--model", "llama-tiny", "--train", "tp=2,pp=2,gpus=6", "--infer", "tp=1", "--hardware", "dgx-h100"], "field 'train'"),
    (["--model", "nope", "--train", "tp=2", "--infer", "tp=2", "--hardware", "dgx-h100"], "field 'model'"),
    (["--model", "llama-tiny", "--train", "pp=5", "--infer", "tp=1", "--hardware", "dgx-h100"], "pp=5"),
    (["qwen3-32b-fsdp8-to-tp4dp2", "--model", "qwen3-32b"], "not both"),
    (["/no/such/file.json"], "neither a built-in name"),
])
def test_errors(capsys, argv, match):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and not out
    assert err.startswith("jreshard plan: error:") and __import__("re").search(match, err), err


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
    from jreshard import catalog

    infos = catalog.tensors("qwen3-235b-a22b")
    replicated = sum(t.size for t in infos if t.role == "replicated")
    assert r["bytes_moved"] == 2 * (8 * (catalog.num_params(infos) - replicated) + 64 * replicated)
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
