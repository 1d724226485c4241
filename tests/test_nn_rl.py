"""jreshard.nn.rl (group-normalised advantages, the policy-gradient step) and jreshard.nn.hf (HF tensors)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
from jax.tree_util import keystr, tree_flatten_with_path  # noqa: E402

from jreshard.nn import LlamaConfig, init_params, make_optimizer  # noqa: E402
from jreshard.nn.hf import hf_state  # noqa: E402
from jreshard.nn.rl import (  # noqa: E402
    group_advantages,
    policy_gradient_loss,
    policy_gradient_step,
    token_logprobs,
)
from tests.helpers import hf_state as oracle_hf_state  # noqa: E402

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, qk_norm=True)


def test_advantages_are_normalised_per_group():
    r = np.array([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    a = group_advantages(r)
    np.testing.assert_allclose(a[0].mean(), 0.0, atol=1e-6)
    np.testing.assert_allclose(a[0].std(), 1.0, atol=1e-5)
    assert (a[1] == 0).all()  # equal rewards teach nothing


@pytest.mark.parametrize("rewards", [np.zeros(4), np.zeros((3, 1))])
def test_advantages_refuse_a_bad_shape(rewards):
    with pytest.raises(ValueError, match="rewards must be"):
        group_advantages(rewards)


def test_a_step_raises_the_log_probability_of_the_better_completion():
    params = init_params(CFG, jax.random.key(0))
    tokens = jnp.asarray([[1, 2, 3, 10, 11], [1, 2, 3, 20, 21]], jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1], [0, 0, 1, 1]], jnp.float32)
    adv = jnp.asarray(group_advantages(np.array([[1.0, 0.0]])).ravel())
    opt = make_optimizer(1e-2)
    new, _, loss = jax.jit(policy_gradient_step, static_argnums=(0, 1))(CFG, opt, params, opt.init(params), tokens,
                                                                         mask, adv)
    before, after = (np.asarray(token_logprobs(CFG, p, tokens))[:, 2:].sum(axis=1) for p in (params, new))
    assert np.isfinite(float(loss))
    assert after[0] > before[0] and after[1] < before[1]


def test_importance_weights_to_the_sampling_policy():
    # With the tokens' own log-probabilities as the behaviour policy's, the loss and its gradient are the
    # on-policy ones; otherwise each token's term is weighted by min(pi / mu, max_ratio), held constant.
    params = init_params(CFG, jax.random.key(1))
    tokens = jnp.asarray([[1, 2, 3, 10, 11], [1, 2, 3, 20, 21]], jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1], [0, 0, 1, 1]], jnp.float32)
    adv = jnp.asarray([1.0, -1.0])
    logp = token_logprobs(CFG, params, tokens)
    grad = jax.grad(policy_gradient_loss, argnums=1)
    on = policy_gradient_loss(CFG, params, tokens, mask, adv)
    np.testing.assert_allclose(policy_gradient_loss(CFG, params, tokens, mask, adv, logp), on, rtol=1e-6)
    flat = [jax.tree.leaves(grad(CFG, params, tokens, mask, adv, *b)) for b in ((), (logp,))]
    for a, b in zip(*flat, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # The sampler gave token (0, 3) half the probability pi gives it (w = 2) and token (1, 2) four times (w = 1/4);
    # a sampler giving token (0, 2) a tenth of pi's is capped at max_ratio = 3.
    shift = jnp.zeros_like(logp).at[0, 3].set(-jnp.log(2.0)).at[1, 2].set(jnp.log(4.0)).at[0, 2].set(-jnp.log(10.0))
    w = np.ones(logp.shape, np.float32)
    w[0, 3], w[1, 2], w[0, 2] = 2.0, 0.25, 3.0
    want = -np.sum(np.asarray(logp) * np.asarray(mask) * np.asarray(adv)[:, None] * w) / 4
    got = policy_gradient_loss(CFG, params, tokens, mask, adv, logp + shift, max_ratio=3.0)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_state_equals_the_oracle(tied):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    params = init_params(cfg, jax.random.key(1))
    flat = {keystr(k, simple=True, separator="/"): np.asarray(x) for k, x in tree_flatten_with_path(params)[0]}
    want = oracle_hf_state(flat, cfg)
    if tied:
        del want["lm_head.weight"]  # transformers ties it; the checkpoint leaves it out
    got = hf_state(cfg, params)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_hf_state_refuses_a_non_dense_config():
    with pytest.raises(TypeError, match="config must be a dense"):
        hf_state({"vocab_size": 8}, {})
