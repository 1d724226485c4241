"""Model catalog: tensor counts and parameter totals against the public figures."""

from __future__ import annotations

import doctest
import json

import pytest

from jreshard.fleet import catalog

# (model, mtp, tensors, parameters in billions, tolerance in billions)
TOTALS = [
    ("qwen3-32b", True, 707, 32.8, 0.05),
    ("deepseek-v3", False, 45395, 671.0, 0.5),
    ("deepseek-v3", True, 46183, 684.5, 0.5),  # "about 685B with the prediction layer"
    ("kimi-k2", True, 69975, 1026.4, 0.5),
    ("qwen3-235b-a22b", True, 36945, 235.1, 0.5),
    ("llama-tiny", True, 39, 0.0034, 0.0001),
    # Hypothetical frontier configurations (docs/cost_model.md, "Frontier scale"): 2.8T and 2.4T quoted.
    ("kimi-k3-hypothetical", True, 191347, 2808.3, 0.5),
    ("qwen3.8-2.4t-a95b-hypothetical", True, 116103, 2433.8, 0.5),
]


def test_hypothetical_qwen_active_parameters():
    """93.4B active: everything but the routed experts, plus 12 of the 384 experts of each layer."""
    infos = catalog.tensors("qwen3.8-2.4t-a95b-hypothetical")
    cfg = catalog.get_model("qwen3.8-2.4t-a95b-hypothetical")
    experts = sum(t.size for t in infos if t.is_expert)
    active = catalog.num_params(infos) - experts + experts * cfg["num_experts_per_tok"] // cfg["num_experts"]
    assert round(active / 1e9, 1) == 93.4


@pytest.mark.parametrize("model, mtp, count, billions, tol", TOTALS)
def test_counts_and_totals(model, mtp, count, billions, tol):
    infos = catalog.tensors(model, mtp=mtp)
    assert len(infos) == count
    assert abs(catalog.num_params(infos) / 1e9 - billions) < tol
    assert len({t.name for t in infos}) == count


@pytest.mark.parametrize("model", ["deepseek-v3", "qwen3-235b-a22b"])
def test_stacked_experts_keep_the_total(model):
    sep = catalog.tensors(model, experts="separate")
    st = catalog.tensors(model, experts="stacked")
    assert catalog.num_params(sep) == catalog.num_params(st)
    stacked = [t for t in st if t.stacked]
    assert stacked and all(t.shape[0] == (256 if model == "deepseek-v3" else 128) for t in stacked)
    assert len(st) < len(sep) // 10


def test_names_shapes_and_roles_follow_hugging_face():
    by = {t.name: t for t in catalog.tensors("deepseek-v3")}
    assert by["model.layers.0.mlp.gate_proj.weight"].shape == (18432, 7168)  # dense: first_k_dense_replace = 3
    assert by["model.layers.3.mlp.experts.255.down_proj.weight"].shape == (7168, 2048)
    assert by["model.layers.3.mlp.experts.255.down_proj.weight"].expert == 255
    assert by["model.layers.3.mlp.shared_experts.up_proj.weight"].shape == (2048, 7168)
    assert by["model.layers.5.self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert by["model.layers.5.self_attn.kv_a_proj_with_mqa.weight"].role == "replicated"
    assert by["model.layers.61.eh_proj.weight"].shape == (7168, 2 * 7168)
    assert by["model.layers.61.shared_head.head.weight"].role == "head"
    assert by["lm_head.weight"].layer is None and by["model.embed_tokens.weight"].role == "embed"
    assert "model.layers.61.embed_tokens.weight" not in {t.name for t in catalog.tensors("deepseek-v3", mtp=False)}


SMALL_QWEN3 = {"model_type": "qwen3", "_name_or_path": "org/Small-Qwen3", "vocab_size": 100, "hidden_size": 16,
               "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 4, "tie_word_embeddings": True, "torch_dtype": "float16"}


def test_register_from_config_dict_and_file(tmp_path):
    cfg = catalog.register_model(SMALL_QWEN3)
    assert cfg.name == "small-qwen3" and "small-qwen3" in catalog.models()
    infos = catalog.tensors("small-qwen3")
    assert len(infos) == 1 + 2 * 11 + 1  # tied embeddings: no lm_head
    assert {t.dtype for t in infos} == {"float16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL_QWEN3, "model_type": "qwen3_moe", "num_experts": 4,
                                "moe_intermediate_size": 8}))
    moe = catalog.register_model(str(path), name="tiny-moe")
    assert sum(t.expert is not None for t in catalog.tensors(moe)) == 2 * 4 * 3


@pytest.mark.parametrize("config, match", [
    ({**SMALL_QWEN3, "model_type": "gpt2"}, "model_type"),
    ({k: v for k, v in SMALL_QWEN3.items() if k != "hidden_size"}, "hidden_size"),
    ({**SMALL_QWEN3, "num_hidden_layers": 0}, "num_hidden_layers"),
    ({k: v for k, v in SMALL_QWEN3.items() if k != "_name_or_path"}, "name"),
])
def test_bad_configs(config, match):
    with pytest.raises(ValueError, match=match):
        catalog.load_config(config)


def test_bad_arguments():
    with pytest.raises(ValueError, match="not in the catalog"):
        catalog.tensors("no-such-model")
    with pytest.raises(ValueError, match="experts"):
        catalog.tensors("qwen3-32b", experts="fused")
    with pytest.raises(TypeError, match="config"):
        catalog.load_config(42)


def test_name_from_the_file_when_the_config_has_none(tmp_path):
    unnamed = {k: v for k, v in SMALL_QWEN3.items() if k != "_name_or_path"}
    (tmp_path / "Org-Model-7B").mkdir()
    (tmp_path / "Org-Model-7B" / "config.json").write_text(json.dumps(unnamed))
    (tmp_path / "my-model.json").write_text(json.dumps(unnamed))
    assert catalog.load_config(str(tmp_path / "Org-Model-7B" / "config.json")).name == "org-model-7b"
    assert catalog.load_config(tmp_path / "my-model.json").name == "my-model"
    assert catalog.load_config(str(tmp_path / "my-model.json"), name="Mine").name == "Mine"


def test_architecture_from_the_model_class():
    cfg = {k: v for k, v in SMALL_QWEN3.items() if k != "model_type"}
    assert catalog.load_config({**cfg, "architectures": ["Qwen3ForCausalLM"]}).architecture == "qwen3"
    assert catalog.load_config({**cfg, "architectures": ["MistralForCausalLM"]}).architecture == "llama"
    with pytest.raises(ValueError, match="'GPT2LMHeadModel', which the catalog does not support"):
        catalog.load_config({**cfg, "architectures": ["GPT2LMHeadModel"]})


def test_attention_heads():
    by = {t.name: t for t in catalog.tensors("qwen3-32b")}
    p = "model.layers.0.self_attn."
    assert [(by[p + n].heads, by[p + n].replicate_heads) for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                                   "o_proj.weight")] == [(64, False), (8, True),
                                                                                         (8, True), (64, False)]
    assert by[p + "q_norm.weight"].heads is None and by["model.layers.0.mlp.up_proj.weight"].heads is None
    mla = {t.name: t for t in catalog.tensors("deepseek-v3", mtp=False)}
    assert [mla[p + n].heads for n in ("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")] == [128] * 3
    assert mla[p + "kv_a_proj_with_mqa.weight"].heads is None


def test_docstring_examples():
    result = doctest.testmod(catalog)
    assert result.attempted > 0 and result.failed == 0


def test_fp8_marks_the_linear_layers_as_deepseek_v3_checkpoints_do():
    infos = {t.name: t for t in catalog.tensors("deepseek-v3")}
    kept = {n for n, t in infos.items() if not t.quantize}
    quantized = {n for n, t in infos.items() if t.quantize}
    for name in ("model.layers.3.self_attn.q_a_proj.weight", "model.layers.3.self_attn.q_b_proj.weight",
                 "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.3.self_attn.kv_b_proj.weight",
                 "model.layers.3.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.3.mlp.shared_experts.up_proj.weight",
                 "model.layers.61.mlp.experts.0.gate_proj.weight"):
        assert name in quantized, name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.3.input_layernorm.weight", "model.layers.3.self_attn.q_a_layernorm.weight",
                 "model.layers.3.self_attn.kv_a_layernorm.weight", "model.layers.3.mlp.gate.weight",
                 "model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.61.eh_proj.weight",
                 "model.layers.61.embed_tokens.weight", "model.layers.61.shared_head.head.weight",
                 "model.layers.61.enorm.weight"):
        assert name in kept, name
    # Every tensor kept in bfloat16 is a vector, an embedding, a head, a router or eh_proj.
    assert all(len(infos[n].shape) == 1 or infos[n].role in ("embed", "head") or n.endswith(("gate.weight",
               "eh_proj.weight")) for n in kept)
    assert len(quantized) == 45808 and len(kept) == 375
    stacked = catalog.tensors("qwen3-235b-a22b", experts="stacked")
    assert all(t.quantize for t in stacked if t.stacked)
    assert not any(t.quantize for t in stacked if t.name.endswith(("q_norm.weight", "mlp.gate.weight")))
