"""A policy-gradient step for ``jreshard.nn``'s decoder: group-normalised advantages, as GRPO.

The rollouts come from elsewhere (an inference engine): ``G`` sampled completions for each of
``P`` prompts, one reward each. Each completion's advantage is its reward against the others of
its group, ``(r - mean) / (std + eps)``; the loss is the mean over completion tokens of
``-advantage * log pi(token)``. One step per batch of rollouts keeps it on-policy, so no ratio
to the sampling policy and no clipping are needed (GRPO with a single update per batch, and
without the KL term). Rollouts sampled while a refit was in flight are partly off-policy (their
tokens come from the weights before the step, or from two versions); given the log-probabilities
the engine sampled each token with (``behaviour``), each token's term is weighted by its
truncated importance ratio ``min(pi / mu, max_ratio)``, held constant in the gradient, as
IMPALA's V-trace and asynchronous RL stacks weight off-policy tokens.

Example:
  >>> import numpy as np
  >>> from jreshard.nn.rl import group_advantages
  >>> group_advantages(np.array([[0.0, 1.0], [2.0, 2.0]])).round(3).tolist()
  [[-1.0, 1.0], [0.0, 0.0]]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jreshard.nn.config import LlamaConfig
from jreshard.nn.decoder import logits

__all__ = ["group_advantages", "token_logprobs", "policy_gradient_loss", "policy_gradient_step"]


def group_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Each reward against its group's: ``(r - mean) / (std + eps)`` along the last axis (``[P, G]``).

    A group whose rewards are all equal teaches nothing: its advantages are 0.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, samples] with at least 2 samples per prompt, got shape {r.shape}.")
    centred = r - r.mean(axis=1, keepdims=True)
    return (centred / (r.std(axis=1, keepdims=True) + eps)).astype(np.float32)


def token_logprobs(config: LlamaConfig, params: Any, tokens: jax.Array) -> jax.Array:
    """``log pi(tokens[:, t] | tokens[:, :t])`` for ``t >= 1``: ``[batch, seq - 1]``."""
    out = logits(config, params, tokens[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(out, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def policy_gradient_loss(config: LlamaConfig, params: Any, tokens: jax.Array, mask: jax.Array,
                         advantages: jax.Array, behaviour: jax.Array | None = None,
                         max_ratio: float = 2.0) -> jax.Array:
    """Mean over the tokens ``mask`` marks of ``-w * advantage * log pi(token)``.

    Args:
      tokens: ``[batch, seq]`` prompt and completion, one row per rollout.
      mask: ``[batch, seq - 1]``, 1 where ``tokens[:, 1:]`` is a completion token (0 on the prompt).
      advantages: ``[batch]``, one per rollout (``group_advantages(...).ravel()``).
      behaviour: ``[batch, seq - 1]``, the log-probability each token had under the policy that
        sampled it (the engine's; any value where ``mask`` is 0), or None for on-policy rollouts.
      max_ratio: the cap of the importance weight ``w = min(exp(log pi - behaviour), max_ratio)``
        (no gradient flows through ``w``); ``w = 1`` without ``behaviour``.
    """
    logp = token_logprobs(config, params, tokens)
    mask = mask.astype(jnp.float32)
    weight = advantages[:, None]
    if behaviour is not None:
        weight = weight * jnp.minimum(jnp.exp(jax.lax.stop_gradient(logp) - behaviour), max_ratio)
    return -jnp.sum(logp * mask * weight) / jnp.maximum(jnp.sum(mask), 1.0)


def policy_gradient_step(config: LlamaConfig, optimizer: Any, params: Any, opt_state: Any, tokens: jax.Array,
                         mask: jax.Array, advantages: jax.Array, behaviour: jax.Array | None = None,
                         max_ratio: float = 2.0):
    """One optimiser step on ``policy_gradient_loss``; returns ``(params, opt_state, loss)``.

    Wrap in ``jax.jit`` with ``config`` and ``optimizer`` static, as ``train_step``.
    """
    import optax

    value, grads = jax.value_and_grad(
        lambda p: policy_gradient_loss(config, p, tokens, mask, advantages, behaviour, max_ratio))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
