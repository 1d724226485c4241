"""A small flax Llama/Qwen3-style decoder: init, logits, loss and one training step.

The maths follows Hugging Face ``transformers``' Llama (and Qwen3 with
``qk_norm=True``): RMSNorm computed in float32, rotary embeddings on the two
halves of each head (``rotate_half``), grouped-query attention, SiLU-gated MLP.
Parameter leaf paths are listed by ``jreshard.nn.param_shapes``.

Example:
  >>> import jax
  >>> import jax.numpy as jnp
  >>> from jreshard.nn import LlamaConfig, init_params, logits
  >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
  ...                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
  >>> params = init_params(cfg, jax.random.key(0))
  >>> logits(cfg, params, jnp.zeros((2, 5), jnp.int32)).shape
  (2, 5, 64)
"""

from __future__ import annotations

from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from jreshard.nn.config import LlamaConfig, MoeConfig

__all__ = ["Llama", "model", "init_params", "logits", "loss", "make_optimizer", "train_step"]


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * x32.astype(x.dtype)


def dense(features: int, name: str) -> nn.Dense:
    """A bias-free ``Dense`` (kernel ``[in, out]``), initialised as the models here are."""
    return nn.Dense(features, use_bias=False, kernel_init=nn.initializers.normal(0.02), name=name)


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    # x: [batch, seq, heads, head_dim]; the two halves of head_dim rotate together.
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, seq, d/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        b, t, _ = x.shape
        q = dense(c.q_size, "q_proj")(x).reshape(b, t, c.num_attention_heads, c.head_dim)
        k = dense(c.kv_size, "k_proj")(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        v = dense(c.kv_size, "v_proj")(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, name="k_norm")(k)
        q, k = _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta)
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(c.head_dim, x.dtype))
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, c.q_size)
        return dense(c.hidden_size, "o_proj")(out)


class Mlp(nn.Module):
    """SiLU-gated MLP of width ``features`` (the model's ``intermediate_size``, or a shared expert's)."""

    config: LlamaConfig
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = dense(self.features, "gate_proj")(x)
        up = dense(self.features, "up_proj")(x)
        return dense(self.config.hidden_size, "down_proj")(nn.silu(gate) * up)


def _mlp(config: LlamaConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: the routed experts of a sparse ``MoeConfig`` layer, else the dense MLP."""
    if isinstance(config, MoeConfig) and config.is_sparse(layer):
        from jreshard.nn.moe import MoeLayer  # moe.py builds on this module's parts

        return MoeLayer(config, name="mlp")
    return Mlp(config, config.intermediate_size, name="mlp")


class Block(nn.Module):
    config: LlamaConfig
    layer: int

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        x = x + Attention(c, name="attn")(RMSNorm(c.rms_norm_eps, name="input_norm")(x), positions)
        return x + _mlp(c, self.layer)(RMSNorm(c.rms_norm_eps, name="post_attention_norm")(x))


class Llama(nn.Module):
    """The decoder: token ids ``[batch, seq]`` in, logits ``[batch, seq, vocab]`` out.

    With a ``MoeConfig`` (a subclass of ``LlamaConfig``) it is the Qwen3-MoE decoder of
    ``jreshard.nn.moe``: each sparse layer's MLP is a ``MoeLayer``.
    """

    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        embed = nn.Embed(c.vocab_size, c.hidden_size, embedding_init=nn.initializers.normal(0.02), name="embed")
        x = embed(tokens)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        for i in range(c.num_hidden_layers):
            x = Block(c, i, name=f"layers_{i}")(x, positions)
        x = RMSNorm(c.rms_norm_eps, name="final_norm")(x)
        if c.tie_word_embeddings:
            return embed.attend(x)
        return dense(c.vocab_size, "lm_head")(x)


def model(config: LlamaConfig) -> nn.Module:
    """The flax module for ``config`` (a ``LlamaConfig``, or a ``MoeConfig`` whose sparse layers route)."""
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be a jreshard.nn.LlamaConfig or MoeConfig, got {type(config).__name__}.")
    return Llama(config)


def init_params(config: LlamaConfig, key: jax.Array) -> dict[str, Any]:
    """Fresh float32 parameters (the ``params`` collection), leaf paths as in ``param_shapes``."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    return model(config).init(key, tokens)["params"]


def logits(config: LlamaConfig, params: Any, tokens: jax.Array) -> jax.Array:
    """Next-token logits ``[batch, seq, vocab]`` for integer ``tokens`` ``[batch, seq]``."""
    # flax types apply() as "output, or (output, state) when mutable= is given"; it is not here.
    return cast(jax.Array, model(config).apply({"params": params}, tokens))


def loss(config: LlamaConfig, params: Any, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens`` (each position predicts the next)."""
    out = logits(config, params, tokens[:, :-1]).astype(jnp.float32)
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(out, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_optimizer(learning_rate: float = 1e-3) -> Any:
    """AdamW (optax) with the given learning rate."""
    import optax

    return optax.adamw(learning_rate)


def train_step(config: LlamaConfig, optimizer: Any, params: Any, opt_state: Any, tokens: jax.Array):
    """One optimiser step; returns ``(params, opt_state, loss)``. Wrap in ``jax.jit`` (static config, optimizer)."""
    import optax

    value, grads = jax.value_and_grad(lambda p: loss(config, p, tokens))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
