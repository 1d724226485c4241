"""``LlamaConfig.load``/``MoeConfig.load`` read the ``config.json`` files ``transformers`` writes."""

from __future__ import annotations

import json

import pytest

from jreshard.nn import LlamaConfig, MoeConfig

transformers = pytest.importorskip("transformers")

DENSE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
MOE = dict(DENSE, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False)


def saved(tmp_path, conf) -> str:
    """``conf`` saved as a checkpoint folder's config.json (``save_pretrained``); also checks its dict is that."""
    conf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == conf.to_dict()["model_type"]
    return str(tmp_path)


def test_a_transformers_qwen3_moe_config_loads(tmp_path):
    conf = transformers.Qwen3MoeConfig(**MOE)
    assert "num_local_experts" in conf.to_dict()  # what transformers writes
    for where in (saved(tmp_path, conf), str(tmp_path / "config.json")):
        cfg = MoeConfig.load(where)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 2, 32)
        assert (cfg.qk_norm, cfg.rope_theta, cfg.norm_topk_prob, cfg.tie_word_embeddings) == (True, 1e6, False, True)
        assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rms_norm_eps) == (16, 2, 1e-5)


@pytest.mark.parametrize("cls,hf,kw", [(LlamaConfig, "Qwen3Config", DENSE), (MoeConfig, "Qwen3MoeConfig", MOE),
                                       (LlamaConfig, "LlamaConfig", {**DENSE, "head_dim": None})],
                         ids=["qwen3", "qwen3-moe", "llama"])
def test_every_config_transformers_writes_loads_with_its_shapes(tmp_path, cls, hf, kw):
    conf = getattr(transformers, hf)(**{k: v for k, v in kw.items() if v is not None})
    cfg = cls.load(saved(tmp_path, conf))
    d = conf.to_dict()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(cfg, field) == d[field], field
    assert cfg.head_dim == conf.head_dim == 16 and cfg.qk_norm == (hf != "LlamaConfig")
    assert cfg.rope_theta == d["rope_parameters"]["rope_theta"]


@pytest.mark.parametrize("cfg", [LlamaConfig.load("llama-tiny", qk_norm=True), MoeConfig.load("qwen3-moe-tiny")],
                         ids=["qwen3", "qwen3-moe"])
def test_a_config_round_trips_through_transformers(tmp_path, cfg):
    hf = (transformers.Qwen3MoeConfig if isinstance(cfg, MoeConfig) else transformers.Qwen3Config)(**cfg.hf_kwargs())
    back = type(cfg).load(saved(tmp_path, hf), name=cfg.name)
    assert back == cfg


def test_mlp_only_layers_are_refused_with_the_fix(tmp_path):
    conf = transformers.Qwen3MoeConfig(**MOE, mlp_only_layers=[1])
    with pytest.raises(ValueError, match=r"mlp_only_layers \[1\] is not supported.*give an empty list"):
        MoeConfig.load(saved(tmp_path, conf))
