"""FP8 end to end: the flax Llama quantized on 2 JAX trainer processes into 2 torch ranks (TP2), over gloo.

One launch of tests/bridge/fp8_worker.py: the trainers (FSDP over 4 CPU devices, whose
shards cut the 128-wide input blocks) quantize the linear layers where their shards are
and sync FP8 weights and scales into vLLM's fused names, then the same weights in
bfloat16. Checked here: the received bits equal the NumPy quantizer of
tests/bridge/test_fp8_rules.py on the full weights, sliced as vLLM slices them; a
dequantized Hugging Face model (``weight = fp8 * scale_inv`` per block) gives the JAX
model's logits within what FP8 allows; the receivers counted about half the bytes of
the bfloat16 sync.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests.bridge import _common as C
from tests.bridge.test_fp8_rules import bits, expected

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HERE = Path(__file__).parent
LIMIT = 180  # seconds for the whole launch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    port, jax_port = C.free_port(), C.free_port()
    env = C.worker_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                       TOKENIZERS_PARALLELISM="false")
    procs = []
    for r in range(C.WORLD):
        cmd = [sys.executable, str(HERE / "fp8_worker.py"), "--rank", str(r), "--port", str(port),
               "--jax-port", str(jax_port), "--out", str(out)]
        with open(out / f"rank{r}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    C.wait_all(procs, LIMIT)
    events = {r: json.loads(f.read_text()) if (f := out / f"rank{r}.json").exists() else {} for r in range(C.WORLD)}
    logs = C.read_logs(out, tail=3000)
    for r in range(C.WORLD):
        assert events[r].get("done"), f"rank {r}: {events[r]}\n{logs}"
    return {"out": out, "events": events}


def _received(run) -> list[dict[str, np.ndarray]]:
    out = []
    for r in C.RECEIVERS:
        with np.load(run["out"] / f"rank{r}_fp8.npz") as z:
            out.append(dict(z))
    return out


def test_received_bits_equal_the_reference_quantizer(run):
    from tests.bridge.fp8_worker import FMT, config

    cfg = config()
    with np.load(run["out"] / "params.npz") as z:
        flat = dict(z)
    want = expected(cfg, flat, 2, FMT.block, fused=True)
    for i, got in enumerate(_received(run)):
        assert sorted(got) == sorted(want[i])
        for name, w in want[i].items():
            if got[name].dtype == np.uint8 or name.endswith("_scale_inv"):  # FP8 bits, or float32 scales: exact
                np.testing.assert_array_equal(got[name], bits(w), err_msg=name)
            else:  # embeddings, lm_head and norms travel in bfloat16
                np.testing.assert_array_equal(got[name], w.astype(ml_dtypes.bfloat16).astype(np.float32), name)
    for r in C.RECEIVERS:
        assert run["events"][r]["fp8_dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float8_e4m3fn"]
        assert run["events"][r]["jax_imported"] is False
    for r in C.TRAINERS:
        ev = run["events"][r]
        assert ev["describe_matches_config"] and ev["quantized_matches_plan"], ev


def _dequantized_hf_state(cfg, shards: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Each rank dequantizes its own blocks (weight = fp8 * scale_inv), then the TP shards are gathered."""
    from tests.bridge.fp8_worker import FMT

    bn, bk = FMT.block
    local = []
    for s in shards:
        d = {}
        for name, a in s.items():
            if name.endswith("_scale_inv"):
                continue
            if a.dtype == np.uint8:
                scale = s[name + "_scale_inv"]
                a = a.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(
                    np.repeat(scale, bn, axis=0), bk, axis=1)[: a.shape[0], : a.shape[1]]
            d[name] = a
        local.append(d)
    q, kv = cfg.q_size // 2, cfg.kv_size // 2
    full = {}
    for name in local[0]:
        parts = [d[name] for d in local]
        if name.endswith("qkv_proj.weight"):
            h = name.removesuffix("qkv_proj.weight")
            for n, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
                full[f"{h}{n}_proj.weight"] = np.concatenate([p[lo:hi] for p in parts])
        elif name.endswith("gate_up_proj.weight"):
            h, i = name.removesuffix("gate_up_proj.weight"), parts[0].shape[0] // 2
            full[h + "gate_proj.weight"] = np.concatenate([p[:i] for p in parts])
            full[h + "up_proj.weight"] = np.concatenate([p[i:] for p in parts])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            full[name] = np.concatenate(parts, axis=1)
        elif parts[0].ndim == 2:
            full[name] = np.concatenate(parts)[: cfg.vocab_size]
        else:
            full[name] = parts[0]
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in full.items()}


def test_dequantized_model_logits_match_jax_within_fp8_tolerance(run):
    from tests.bridge.fp8_worker import config

    cfg = config()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.hf_kwargs(), attn_implementation="eager"))
    hf.load_state_dict(_dequantized_hf_state(cfg, _received(run)), strict=True)
    with torch.no_grad():
        got = hf(torch.from_numpy(C.tokens(cfg)).long()).logits.numpy()
    want = np.load(run["out"] / "jax_logits.npy")
    err = np.abs(got - want).max() / np.abs(want).max()
    cos = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    assert err < 0.1 and cos > 0.995, (err, cos)  # e4m3 keeps 3 mantissa bits: up to 6% per weight
    assert not np.allclose(got, want, rtol=1e-5, atol=1e-5)  # FP8 did change the weights


def test_receivers_count_about_half_the_bytes_of_bfloat16(run):
    for r in C.RECEIVERS:
        ev = run["events"][r]
        fp8, bf16 = ev["fp8"]["bytes"], ev["bf16"]["bytes"]
        assert ev["fp8"]["version"] == 1 and ev["bf16"]["version"] == 2
        assert 0.5 < fp8 / bf16 < 0.6, (fp8, bf16)  # linear layers halved; embeddings and lm_head stay bfloat16
