"""jreshard.nn's flax Llama/Qwen3 model equals Hugging Face transformers' on the same weights."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jreshard.nn import LlamaConfig, init_params, logits, make_optimizer, param_shapes, train_step  # noqa: E402
from tests.helpers import hf_state  # noqa: E402


def _flat(params) -> dict[str, np.ndarray]:
    from jax.tree_util import tree_flatten_with_path

    return {"/".join(k.key for k in path): np.asarray(v) for path, v in tree_flatten_with_path(params)[0]}


def _hf_state(flat: dict[str, np.ndarray], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of the flax leaves (the oracle's, ``tests.helpers.hf_state``) as torch tensors."""
    return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in hf_state(flat, cfg).items()}


@pytest.mark.parametrize("qk_norm,tied", [(False, False), (True, True)], ids=["llama", "qwen3-tied"])
def test_logits_match_transformers_after_a_training_step(qk_norm, tied):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, qk_norm=qk_norm,
                      tie_word_embeddings=tied)
    params = init_params(cfg, jax.random.key(0))
    assert {k: v.shape for k, v in _flat(params).items()} == param_shapes(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    opt = make_optimizer(1e-2)
    new, _, loss = jax.jit(train_step, static_argnums=(0, 1))(cfg, opt, params, opt.init(params), tokens)
    assert np.isfinite(float(loss))
    assert not np.array_equal(_flat(new)["layers_0/attn/q_proj/kernel"], _flat(params)["layers_0/attn/q_proj/kernel"])
    hf_cls, conf_cls = ((transformers.Qwen3ForCausalLM, transformers.Qwen3Config) if qk_norm
                        else (transformers.LlamaForCausalLM, transformers.LlamaConfig))
    hf = hf_cls(conf_cls(**cfg.hf_kwargs(), attn_implementation="eager"))
    hf.load_state_dict(_hf_state(_flat(new), cfg), strict=True)
    with torch.no_grad():
        got = hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, np.asarray(logits(cfg, new, tokens)), rtol=1e-5, atol=1e-5)

