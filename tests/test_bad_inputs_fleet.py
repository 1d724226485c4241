"""Bad inputs of the FP8 helpers and of the files the fleet reads (rows as in tests/test_bad_inputs.py).

The pure FP8 helpers (``jreshard.core.fp8``, ``fp8_split``, ``fp8_blocks``): formats of the wrong
kind, blocks beyond int64, offsets and shapes that do not fit the box. Model configs, hardware and
scenario files (``catalog.load_config``, ``LlamaConfig.load``, ``load_hardware``, ``load_scenario``,
``jreshard plan --model/--hardware``): a JSON list, a missing file, malformed JSON, a folder, an
unknown ``model_type``. Each refusal names the argument; a refused ``register_model`` registers nothing.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest

from jreshard import Layout, Mesh
from jreshard.core.fp8 import BlockAmax, Fp8Format, block_amax, dequantize, quantize, quantize_local
from jreshard.core.fp8_blocks import quant_plan
from jreshard.core.fp8_split import fp8_split, fp8_tp_split, scale_layout
from jreshard.fleet import catalog
from jreshard.fleet.fp8 import parse_block
from jreshard.fleet.hardware import load_hardware
from jreshard.fleet.scenario import ScenarioError, load_scenario
from jreshard.nn import LlamaConfig, MoeConfig
from tests.test_bad_inputs import FLAGS, check_row, cli

ROWS = []
_DIR = tempfile.TemporaryDirectory(prefix="jreshard-bad-inputs-")  # removed when the session ends


def row(name, fn, exc, pat):
    ROWS.append((name, fn, exc, pat))


# --- FP8 helpers
X = np.arange(16, dtype=np.float32).reshape(4, 4)
F = Fp8Format(block=(2, 2))
L2 = Layout((4, 4), Mesh([0, 1], "x"), ("x",))
for name, fn, exc, pat in [
    ("quantize fmt str", lambda: quantize(X, "e4m3"), TypeError, "fmt must be an Fp8Format"),
    ("quantize fmt tuple", lambda: quantize(X, (2, 2)), TypeError, "fmt must be an Fp8Format"),
    ("dequantize fmt str", lambda: dequantize(X, np.ones((2, 2)), "e4m3"), TypeError, "fmt must be an Fp8Format"),
    ("block_amax fmt str", lambda: block_amax(X, "e4m3"), TypeError, "fmt must be an Fp8Format"),
    ("quantize_local fmt str", lambda: quantize_local(X, block_amax(X, F), "x"), TypeError, "fmt must be"),
    ("quantize_local amax tuple", lambda: quantize_local(X, ((0, 0), np.ones((2, 2))), F), TypeError,
     "amax must be a BlockAmax"),
    ("scale_layout fmt str", lambda: scale_layout(L2, "x"), TypeError, "fmt must be an Fp8Format"),
    ("scale_layout layout str", lambda: scale_layout("l", F), TypeError, "layout must be a jreshard.Layout"),
    ("fp8_split fmt dict", lambda: fp8_split(L2, {"block": (2, 2)}), TypeError, "fmt must be an Fp8Format"),
    ("fp8_tp_split fmt str", lambda: fp8_tp_split((4, 4), 2, 0, "x"), TypeError, "fmt must be an Fp8Format"),
    ("quant_plan fmt str", lambda: quant_plan(L2, "x"), TypeError, "fmt must be an Fp8Format"),
    ("Fp8Format block beyond int64", lambda: Fp8Format(block=(1 << 64, 2)), ValueError, "block sizes .* int64"),
    ("Fp8Format block 2**63", lambda: Fp8Format(block=(1 << 63,)), ValueError, "block sizes .* int64"),
    ("Fp8Format block numpy uint64", lambda: Fp8Format(block=(np.uint64(2**64 - 1), 2)), ValueError, "block sizes"),
    ("block_amax offset fractional", lambda: block_amax(X, F, (8, 8), (0.5, 0)), TypeError,
     r"offset\[0\] must be an int, got float 0.5"),
    ("quantize_local offset fractional", lambda: quantize_local(X, block_amax(X, F, (8, 8)), F, (8, 8), (1.5, 0)),
     TypeError, r"offset\[0\] must be an int"),
    ("block_amax offset str", lambda: block_amax(X, F, (8, 8), "00"), TypeError, "offset must be a tuple of ints"),
    ("block_amax offset short", lambda: block_amax(X, F, (8, 8), (0,)), ValueError, r"offset \(0,\) must give one"),
    ("block_amax offset past the tensor", lambda: block_amax(X, F, (8, 8), (6, 0)), ValueError,
     r"at offset \(6, 0\) reaches beyond shape \(8, 8\)"),
    ("block_amax shape short", lambda: block_amax(X, F, (8,)), ValueError, r"shape \(8,\) must give one entry"),
    ("block_amax shape long", lambda: block_amax(X, F, (8, 8, 8)), ValueError, r"shape \(8, 8, 8\) must give one"),
    ("block_amax shape smaller than x", lambda: block_amax(X, F, (2, 2)), ValueError, r"beyond shape \(2, 2\)"),
    ("block_amax shape str", lambda: block_amax(X, F, "88"), TypeError, "shape must be a tuple of ints"),
    ("quantize x shorter than block", lambda: quantize(np.ones(4, np.float32), F), ValueError,
     r"needs a tensor of at least as many dims, got shape \(4,\)"),
    ("scale_shape shape str", lambda: F.scale_shape("44"), TypeError, "shape must be a tuple of ints"),
    ("scale_shape shape float", lambda: F.scale_shape((4.5, 4)), TypeError, r"shape\[0\] must be an int"),
    ("parse_block text beyond int64", lambda: parse_block("99999999999999999999999x2"), ValueError,
     r"fp8_block\[0\] must be an int <= 9223372036854775807"),
    ("cli --fp8-block beyond int64", lambda: cli(*_argv("--dtype", "float8_e4m3fn"), "--fp8-block", f"{1 << 64}x128"),
     SystemExit, r"--fp8-block '18446744073709551616x128': fp8_block\[0\] must be an int <="),
]:
    row(name, fn, exc, pat)


# --- files: model configs, hardware, scenarios
def jfile(name: str, text: str | None) -> str:
    """A path under a temporary folder holding ``text`` (``None``: nothing is there)."""
    path = os.path.join(_DIR.name, name)
    if text is not None:
        with open(path, "w") as f:
            f.write(text)
    return path


def _argv(flag: str, value: str) -> list[str]:
    """``jreshard plan`` flags that plan a tiny model, with ``flag`` set to ``value``."""
    return [x for k, v in {**FLAGS, flag: value}.items() for x in (k, v)]


def folder(name: str) -> str:
    path = os.path.join(_DIR.name, name)
    os.makedirs(path, exist_ok=True)
    return path


TINY = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "name": "tiny-cfg"}
BAD_FILES = {  # name -> (file maker, message pattern after the argument)
    "JSON list": (lambda: jfile("list.json", "[1, 2]"), "holds a JSON list, not a JSON object"),
    "missing file": (lambda: jfile("missing.json", None), "does not exist"),
    "malformed JSON": (lambda: jfile("bad.json", '{"a": '), "is not valid JSON"),
    "folder": (lambda: folder("folder.json"), "does not exist"),  # a checkpoint folder without config.json
}
for what, (make, pat) in BAD_FILES.items():
    row(f"load_config {what}", lambda m=make: catalog.load_config(m()), ValueError, f"config '.*' {pat}")
    row(f"LlamaConfig.load {what}", lambda m=make: LlamaConfig.load(m()), ValueError, f"name_or_path '.*' {pat}")
    row(f"load_scenario model {what}", lambda m=make: load_scenario({"model": m(), "hardware": "dgx-h100",
                                                                     "train": {"fsdp": 4}, "infer": {"tp": 4}}),
        ScenarioError, f"field 'model': config '.*' {pat}")
    row(f"cli --model {what}", lambda m=make: cli(*_argv("--model", m())), SystemExit, f"--model '.*' {pat}")
for what, pat in [("JSON list", "holds a JSON list"), ("malformed JSON", "is not valid JSON"),
                  ("folder", "is a folder")]:
    make = BAD_FILES[what][0]
    row(f"load_hardware {what}", lambda m=make: load_hardware(m()), ValueError, f"hardware file '.*' {pat}")
    row(f"load_scenario {what}", lambda m=make: load_scenario(m()), ScenarioError, f"scenario file '.*' {pat}")
    row(f"cli --hardware {what}", lambda m=make: cli(*_argv("--hardware", m())), SystemExit, f"--hardware '.*' {pat}")
row("load_config checkpoint folder holding a list", lambda: (folder("ckpt"), catalog.load_config(
    jfile("ckpt/config.json", "[]")[:-len("/config.json")])), ValueError,
    r"config '.*ckpt/config.json' holds a JSON list")
row("load_config model_type unknown", lambda: catalog.load_config({**TINY, "model_type": "gpt9"}), ValueError,
    "config field 'model_type' is 'gpt9'")
row("load_config model_type unknown beside architecture",
    lambda: catalog.load_config({**TINY, "architecture": "llama", "model_type": "gpt9"}), ValueError,
    "config field 'model_type' is 'gpt9'")
row("load_config architecture and model_type disagree",
    lambda: catalog.load_config({**TINY, "architecture": "llama", "model_type": "qwen3_moe"}), ValueError,
    "'architecture' 'llama' and 'model_type' 'qwen3_moe' name different architectures")
row("load_config architectures unknown", lambda: catalog.load_config({**TINY, "architectures": ["GPT2LMHeadModel"]}),
    ValueError, r"config field 'architectures\[0\]' is 'GPT2LMHeadModel'")
row("LlamaConfig.load model_type unknown", lambda: LlamaConfig.load(jfile("gpt9.json", json.dumps(
    {**TINY, "model_type": "gpt9"}))), ValueError, "name_or_path '.*gpt9.json' has model_type 'gpt9'")
row("MoeConfig.load deepseek", lambda: MoeConfig.load("deepseek-v3"), ValueError,
    "name_or_path 'deepseek-v3' has architecture 'deepseek_v3'")
row("LlamaConfig.load int", lambda: LlamaConfig.load(5), TypeError, "name_or_path must be")
row("LlamaConfig.load empty", lambda: LlamaConfig.load(""), TypeError, "name_or_path must be")
row("LlamaConfig.load unknown override", lambda: LlamaConfig.load("llama-tiny", bogus=1), TypeError,
    r"overrides \['bogus'\] that are not LlamaConfig fields")
row("cli --model model_type unknown", lambda: cli(*_argv("--model", jfile("gpt9-cli.json", json.dumps(
    {**TINY, "model_type": "gpt9"})))), SystemExit, "--model '.*': config field 'model_type' is 'gpt9'")
row("cli --model tensor beyond int64", lambda: cli(*_argv("--model", jfile("huge.json", json.dumps(
    {**TINY, "model_type": "qwen3", "vocab_size": 1 << 62})))), SystemExit,
    r"--model '.*': tensor 'model.embed_tokens.weight' of shape \(4611686018427387904, 16\) has more bytes")
row("cli --model architecture and model_type disagree", lambda: cli(*_argv("--model", jfile("mixed.json", json.dumps(
    {**TINY, "architecture": "qwen3", "model_type": "qwen3_moe"})))), SystemExit,
    "--model '.*' name different architectures")


def test_oversized_blocks_are_whole_dims():
    # A block at least as large as its dim is that whole dim: the same scales and weights as None.
    x = np.random.default_rng(0).normal(size=(6, 10)).astype(np.float32)
    for block in [(1 << 40, 4), (2**63 - 1, 4), (np.int64(1 << 40), 4)]:
        big, whole = quantize(x, Fp8Format(block=block)), quantize(x, Fp8Format(block=(None, 4)))
        assert big.scale_inv.shape == whole.scale_inv.shape == (1, 3)
        assert np.array_equal(big.weight.view(np.uint8), whole.weight.view(np.uint8))
        assert np.array_equal(big.scale_inv, whole.scale_inv)
    part = block_amax(x[2:4], Fp8Format(block=(1 << 40, 4)), (6, 10), (np.int64(2), 0))
    assert isinstance(part, BlockAmax) and part.lo == (0, 0) and part.amax.shape == (1, 3)


def test_good_files_still_load_and_a_refused_one_registers_nothing():
    before = catalog.models()
    with pytest.raises(ValueError, match="does not exist"):
        catalog.register_model(jfile("gone.json", None))
    assert catalog.models() == before
    ckpt = folder("Org-Tiny")
    jfile("Org-Tiny/config.json", json.dumps({**TINY, "model_type": "qwen3", "name": None}))
    assert catalog.load_config(ckpt).name == "org-tiny"  # a checkpoint folder reads its config.json
    cfg = LlamaConfig.load(jfile("both.json", json.dumps({**TINY, "architecture": "qwen3", "model_type": "qwen3"})))
    assert (cfg.hidden_size, cfg.qk_norm) == (16, True)


@pytest.mark.parametrize(("name", "fn", "exc", "pattern"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(name, fn, exc, pattern):
    check_row(name, fn, exc, pattern)
