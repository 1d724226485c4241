"""FP8 end to end: the flax Llama and MoE models quantized on 2 JAX trainer processes into 2 torch ranks (TP2).

One launch of tests/bridge/fp8_worker.py, over gloo: for the dense Llama, then the MoE
model, the trainers (FSDP over 4 CPU devices, whose shards cut the dense kernels'
128-wide input blocks; one expert per device) quantize the linear layers and stacked
experts where their shards are and sync FP8 weights and scales into vLLM's names (fused
``qkv_proj``/``gate_up_proj``, FusedMoE's ``w13_weight``/``w2_weight``), then the same
weights in bfloat16. Checked here, for each model: the received bits equal the NumPy
quantizer of tests/bridge/test_fp8_rules.py on the full weights (one expert at a time),
sliced as vLLM slices them; a dequantized Hugging Face model (``weight = fp8 * scale_inv``
per block) gives the JAX model's logits within what FP8 allows; the receivers counted
about half the bytes of the bfloat16 sync.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests.bridge import _common as C, test_moe_rules as M
from tests.bridge.test_fp8_rules import bits, expected, quantize_full
from tests.helpers import hf_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HERE = Path(__file__).parent
LIMIT = 180  # seconds for the whole launch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    port, jax_port = C.free_ports(2)
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


def _received(run, model: str) -> list[dict[str, np.ndarray]]:
    out = []
    for r in C.RECEIVERS:
        with np.load(run["out"] / f"rank{r}_{model}_fp8.npz") as z:
            out.append(dict(z))
    return out


def _params(run, model: str) -> dict[str, np.ndarray]:
    with np.load(run["out"] / f"{model}_params.npz") as z:
        return dict(z)


def _moe_expected(cfg, flat: dict[str, np.ndarray], block) -> list[dict[str, np.ndarray]]:
    """Every rank's MoE params: the full vLLM tensors quantized here (one expert at a time), then sliced."""
    bn, bk = block
    quantized, scales = quantize_full(hf_state(flat, cfg, experts="vllm"), bn, bk)
    # The scale grids are sliced as the weights, in blocks: w13 by its rows (bn), w2 by its columns (bk).
    rows, cols = (dataclasses.replace(cfg, moe_intermediate_size=cfg.moe_intermediate_size // b) for b in (bn, bk))
    ranks = []
    for c in range(2):
        want = M._oracle(quantized, cfg, 2, c, 1, 0, 2, c, 64, True)
        by_rows, by_cols = (M._oracle(scales, small, 2, c, 1, 0, 2, c, 64, True) for small in (rows, cols))
        want |= {n + "_scale_inv": (by_cols if n.endswith("w2_weight") else by_rows)[n] for n in by_rows}
        ranks.append(want)
    return ranks


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_received_bits_equal_the_reference_quantizer(run, model):
    from tests.bridge.fp8_worker import FMT, MODELS

    cfg = MODELS[model][0]()
    flat = _params(run, model)
    want = expected(cfg, flat, 2, FMT.block, fused=True) if model == "dense" else _moe_expected(cfg, flat, FMT.block)
    if model == "moe":
        assert {"model.layers.0.mlp.experts.w13_weight_scale_inv", "model.layers.0.mlp.experts.w2_weight_scale_inv",
                "model.layers.0.self_attn.qkv_proj.weight_scale_inv"} <= set(want[0])
    for i, got in enumerate(_received(run, model)):
        assert sorted(got) == sorted(want[i])
        for name, w in want[i].items():
            if got[name].dtype == np.uint8 or name.endswith("_scale_inv"):  # FP8 bits, or float32 scales: exact
                np.testing.assert_array_equal(got[name], bits(w), err_msg=name)
            else:  # embeddings, lm_head and norms travel in bfloat16
                np.testing.assert_array_equal(got[name], w.astype(ml_dtypes.bfloat16).astype(np.float32), name)
    for r in C.RECEIVERS:
        assert run["events"][r][model]["fp8_dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float8_e4m3fn"]
        assert run["events"][r]["jax_imported"] is False
    for r in C.TRAINERS:
        ev = run["events"][r][model]
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
            if a.dtype == np.uint8:  # [..., out, in] with scales [..., out / bn, in / bk]
                scale = np.repeat(np.repeat(s[name + "_scale_inv"], bn, axis=-2), bk, axis=-1)
                a = a.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale[..., : a.shape[-2], : a.shape[-1]]
            d[name] = a
        local.append(d)
    q, kv, m = cfg.q_size // 2, cfg.kv_size // 2, getattr(cfg, "moe_intermediate_size", 0) // 2
    full = {}
    for name in local[0]:
        parts = [d[name] for d in local]
        if name.endswith("qkv_proj.weight"):
            h = name.removesuffix("qkv_proj.weight")
            for n, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
                full[f"{h}{n}_proj.weight"] = np.concatenate([p[lo:hi] for p in parts])
        elif name.endswith("experts.w13_weight"):  # each rank: its gate rows, then its up rows
            full[name.replace("w13_weight", "gate_up_proj")] = np.concatenate(
                [p[:, :m] for p in parts] + [p[:, m:] for p in parts], axis=1)
        elif name.endswith("experts.w2_weight"):
            full[name.replace("w2_weight", "down_proj")] = np.concatenate(parts, axis=2)
        elif name.endswith("gate_up_proj.weight"):
            h, i = name.removesuffix("gate_up_proj.weight"), parts[0].shape[0] // 2
            full[h + "gate_proj.weight"] = np.concatenate([p[:i] for p in parts])
            full[h + "up_proj.weight"] = np.concatenate([p[i:] for p in parts])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            full[name] = np.concatenate(parts, axis=1)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            full[name] = np.concatenate(parts)[: cfg.vocab_size]
        else:  # norms and the MoE router: replicated
            np.testing.assert_array_equal(parts[0], parts[1], err_msg=name)
            full[name] = parts[0]
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in full.items()}


def _relative_error_and_cosine(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    err = float(np.abs(got - want).max() / np.abs(want).max())
    return err, float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))


def test_dequantized_model_logits_match_jax_within_fp8_tolerance(run):
    from tests.bridge.fp8_worker import config

    cfg = config()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.hf_kwargs(), attn_implementation="eager"))
    hf.load_state_dict(_dequantized_hf_state(cfg, _received(run, "dense")), strict=True)
    with torch.no_grad():
        got = hf(torch.from_numpy(C.tokens(cfg)).long()).logits.numpy()
    want = np.load(run["out"] / "dense_jax_logits.npy")
    err, cos = _relative_error_and_cosine(got, want)
    assert err < 0.1 and cos > 0.995, (err, cos)  # e4m3 keeps 3 mantissa bits: up to 6% per weight
    assert not np.allclose(got, want, rtol=1e-5, atol=1e-5)  # FP8 did change the weights


def _moe_logits_and_experts(cfg, state: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3MoeForCausalLM's logits of the test tokens, and each token's chosen experts (sorted) in layer 0."""
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg.hf_kwargs(), attn_implementation="eager"))
    hf.load_state_dict(state, strict=True)
    router, chosen = hf.model.layers[0].mlp.gate, []
    # The router's own scores from its input (as the layer computes them), whatever the module returns.
    hook = router.register_forward_hook(lambda mod, args, _: chosen.append(
        torch.topk(torch.nn.functional.linear(args[0], mod.weight), cfg.num_experts_per_tok).indices))
    try:
        with torch.no_grad():
            logits = hf(torch.from_numpy(C.tokens(cfg)).long()).logits.numpy()
    finally:
        hook.remove()
    return logits, np.sort(chosen[0].reshape(-1, cfg.num_experts_per_tok).numpy(), axis=-1)


def test_dequantized_moe_logits_match_jax_within_fp8_tolerance(run):
    """As the dense model, on the tokens whose experts FP8 left unchanged; a routing flip is bounded apart."""
    from tests.bridge.fp8_worker import moe_config

    cfg = moe_config()
    want = np.load(run["out"] / "moe_jax_logits.npy")
    full = hf_state(_params(run, "moe"), cfg, experts="hf")
    exact = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in full.items()}
    reference, experts = _moe_logits_and_experts(cfg, exact)  # the float32 weights: JAX's logits and routing
    np.testing.assert_allclose(reference, want, rtol=1e-5, atol=1e-5)
    got, fp8_experts = _moe_logits_and_experts(cfg, _dequantized_hf_state(cfg, _received(run, "moe")))
    kept = (experts == fp8_experts).all(-1).reshape(want.shape[:-1])
    assert kept.mean() >= 0.8, kept  # a router score within FP8's error of the next one: few tokens
    err, cos = _relative_error_and_cosine(got[kept], want[kept])
    assert err < 0.1 and cos > 0.995, (err, cos)  # the dense model's bounds
    # A flipped token mixes another expert's output: its logits move more (measured 0.14 of the largest logit).
    err, cos = _relative_error_and_cosine(got, want)
    assert err < 0.25 and cos > 0.995, (err, cos)
    assert not np.allclose(got, want, rtol=1e-5, atol=1e-5)  # FP8 did change the weights


@pytest.mark.parametrize("model,version", [("dense", 1), ("moe", 3)])
def test_receivers_count_about_half_the_bytes_of_bfloat16(run, model, version):
    for r in C.RECEIVERS:
        ev = run["events"][r][model]
        fp8, bf16 = ev["fp8"]["bytes"], ev["bf16"]["bytes"]
        assert ev["fp8"]["version"] == version and ev["bf16"]["version"] == version + 1
        assert 0.5 < fp8 / bf16 < 0.6, (fp8, bf16)  # linear layers halved; embeddings and lm_head stay bfloat16
