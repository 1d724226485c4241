"""jreshard.nn's flax Qwen3-MoE model equals Hugging Face transformers' on the same weights."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.tree_util import tree_flatten_with_path

from jreshard.nn import MoeConfig, init_params, logits, make_optimizer, param_shapes, train_step
from tests.helpers import hf_state


def _flat(params) -> dict[str, np.ndarray]:
    return {"/".join(k.key for k in path): np.asarray(v) for path, v in tree_flatten_with_path(params)[0]}


def _hf_state(flat: dict[str, np.ndarray], cfg: MoeConfig) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of the flax leaves (the oracle's, ``tests.helpers.hf_state``) as torch tensors."""
    return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in hf_state(flat, cfg).items()}


def _config(**kw) -> MoeConfig:
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=24)
    return MoeConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [{}, {"norm_topk_prob": False, "tie_word_embeddings": True},
                                {"decoder_sparse_step": 2, "num_experts_per_tok": 3}],
                         ids=["qwen3-moe", "unnormalised-tied", "every-second-layer-sparse"])
def test_logits_match_transformers_after_a_training_step(kw):
    cfg = _config(**kw)
    params = init_params(cfg, jax.random.key(0))
    assert {k: v.shape for k, v in _flat(params).items()} == param_shapes(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    opt = make_optimizer(1e-2)
    new, _, loss = jax.jit(train_step, static_argnums=(0, 1))(cfg, opt, params, opt.init(params), tokens)
    assert np.isfinite(float(loss))
    sparse = next(i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i))
    leaf = f"layers_{sparse}/mlp/experts/down_proj"
    assert not np.array_equal(_flat(new)[leaf], _flat(params)[leaf])  # the experts trained
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg.hf_kwargs(), attn_implementation="eager"))
    hf.load_state_dict(_hf_state(_flat(new), cfg), strict=True)
    with torch.no_grad():
        got = hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, np.asarray(logits(cfg, new, tokens)), rtol=1e-5, atol=1e-5)


def test_shared_expert_adds_a_dense_mlp_to_the_routed_experts():
    cfg = _config(shared_expert_intermediate_size=32, num_hidden_layers=1)
    params = init_params(cfg, jax.random.key(1))
    assert param_shapes(cfg)["layers_0/mlp/shared_expert/gate_proj/kernel"] == (64, 32)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 6)), jnp.int32)
    zeroed = jax.tree_util.tree_map_with_path(
        lambda path, v: jnp.zeros_like(v) if "shared_expert" in jax.tree_util.keystr(path) else v, params)
    without = _config(num_hidden_layers=1)
    routed_only = dict(params)
    routed_only["layers_0"] = dict(params["layers_0"])
    routed_only["layers_0"]["mlp"] = {k: v for k, v in params["layers_0"]["mlp"].items() if k != "shared_expert"}
    routed = np.asarray(logits(without, routed_only, tokens))
    # A zero shared expert changes nothing; a trained one changes the logits.
    np.testing.assert_array_equal(np.asarray(logits(cfg, zeroed, tokens)), routed)
    assert not np.allclose(np.asarray(logits(cfg, params, tokens)), routed)
    with pytest.raises(ValueError, match="no shared expert"):
        cfg.hf_kwargs()


@pytest.mark.parametrize("kw,match", [
    ({"num_experts": 0}, r"MoeConfig.num_experts must be a positive int, got 0"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 exceeds num_experts=8"),
    ({"moe_intermediate_size": 2.5}, r"MoeConfig.moe_intermediate_size must be a positive int"),
    ({"shared_expert_intermediate_size": -1}, r"shared_expert_intermediate_size must be an int >= 0"),
    ({"decoder_sparse_step": True}, r"MoeConfig.decoder_sparse_step must be a positive int"),
])
def test_bad_moe_config(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_tiny_moe_config_loads_and_docstrings_run():
    from jreshard.nn import config

    cfg = MoeConfig.load("qwen3-moe-tiny")
    assert cfg.num_experts == 8 and cfg.qk_norm
    # jreshard.nn.decoder's examples run once, collected by pytest's --doctest-modules.
    result = doctest.testmod(config)
    assert result.attempted > 0 and result.failed == 0
