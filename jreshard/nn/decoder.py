"""The flax decoder of ``jreshard.nn``: dense Llama/Qwen3, or Qwen3-MoE, as the config says.

One model serves both configs. Attention, norms, embedding and lm head are shared; each
block's MLP is the SiLU-gated dense MLP, or, on a sparse layer of a ``MoeConfig``
(``MoeConfig.is_sparse``), a routed mixture of experts. Parameter leaf paths are listed by
``jreshard.nn.param_shapes``.

The maths follows Hugging Face ``transformers``' Llama (Qwen3 with ``qk_norm=True``, and
``Qwen3MoeForCausalLM`` for a ``MoeConfig``): RMSNorm computed in float32, rotary
embeddings on the two halves of each head (``rotate_half``), grouped-query attention.
An MoE MLP takes the router's logits (``[tokens, experts]``) through a float32 softmax,
keeps each token's ``num_experts_per_tok`` largest probabilities (renormalised to sum to
one when ``norm_topk_prob``), and sums those experts' SiLU-gated MLPs with these weights.
Expert weights are stacked along a leading expert dim (``experts/gate_proj [E, hidden,
moe_intermediate]``), as JAX trainers keep them so that an ``ep`` mesh axis can split the
experts. Every expert runs on every token and the routing weights select: the same result
as dispatching tokens to experts, at a cost only a small model can afford. A shared expert
(DeepSeek-V3) is a dense MLP every token uses.

Example:
  >>> import jax
  >>> import jax.numpy as jnp
  >>> from jreshard.nn import LlamaConfig, MoeConfig, init_params, logits
  >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
  ...                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
  >>> params = init_params(cfg, jax.random.key(0))
  >>> logits(cfg, params, jnp.zeros((2, 5), jnp.int32)).shape
  (2, 5, 64)
  >>> moe = MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
  ...                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
  ...                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  >>> params = init_params(moe, jax.random.key(0))
  >>> params["layers_0"]["mlp"]["experts"]["gate_proj"].shape
  (4, 32, 16)
  >>> logits(moe, params, jnp.zeros((2, 5), jnp.int32)).shape
  (2, 5, 64)
"""

from __future__ import annotations

from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from jreshard.nn.config import LlamaConfig, MoeConfig

__all__ = ["Decoder", "Block", "Mlp", "MoeMlp", "route", "model", "init_params", "logits", "loss",
           "make_optimizer", "train_step"]


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
    """SiLU-gated MLP of width ``features``: a dense layer's MLP (``intermediate_size``) or a shared expert."""

    config: LlamaConfig
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = dense(self.features, "gate_proj")(x)
        up = dense(self.features, "up_proj")(x)
        return dense(self.config.hidden_size, "down_proj")(nn.silu(gate) * up)


def route(router_logits: jax.Array, top_k: int, normalize: bool) -> jax.Array:
    """Each token's weight for every expert, ``[tokens, experts]``: top-k of the softmax, zero elsewhere.

    Example:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> from jreshard.nn.decoder import route
      >>> np.round(np.asarray(route(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), 2, True)), 3)
      array([[0.   , 0.667, 0.333]], dtype=float32)
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top, index = jax.lax.top_k(probs, top_k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(index, router_logits.shape[-1], dtype=jnp.float32)  # [tokens, k, experts]
    return jnp.einsum("tk,tke->te", top, one_hot).astype(router_logits.dtype)


class Experts(nn.Module):
    """The stacked experts: ``x [tokens, hidden]`` and routing weights ``[tokens, experts]`` in."""

    config: MoeConfig

    @nn.compact
    def __call__(self, x: jax.Array, weights: jax.Array) -> jax.Array:
        c = self.config
        e, h, m = c.num_experts, c.hidden_size, c.moe_intermediate_size
        init = nn.initializers.normal(0.02)
        gate = self.param("gate_proj", init, (e, h, m), jnp.float32).astype(x.dtype)
        up = self.param("up_proj", init, (e, h, m), jnp.float32).astype(x.dtype)
        down = self.param("down_proj", init, (e, m, h), jnp.float32).astype(x.dtype)
        inner = nn.silu(jnp.einsum("th,ehm->etm", x, gate)) * jnp.einsum("th,ehm->etm", x, up)
        out = jnp.einsum("etm,emh->eth", inner, down)
        return jnp.einsum("te,eth->th", weights, out)


class MoeMlp(nn.Module):
    """A sparse layer's MLP: the router, the routed experts and the optional shared expert."""

    config: MoeConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)
        weights = route(dense(c.num_experts, "router")(tokens), c.num_experts_per_tok, c.norm_topk_prob)
        out = Experts(c, name="experts")(tokens, weights).reshape(b, t, h)
        if c.shared_expert_intermediate_size:
            out = out + Mlp(c, c.shared_expert_intermediate_size, name="shared_expert")(x)
        return out


class Block(nn.Module):
    """Layer ``layer`` of the decoder: attention, then the MLP the config gives this layer."""

    config: LlamaConfig
    layer: int

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        x = x + Attention(c, name="attn")(RMSNorm(c.rms_norm_eps, name="input_norm")(x), positions)
        mlp: nn.Module
        if isinstance(c, MoeConfig) and c.is_sparse(self.layer):
            mlp = MoeMlp(c, name="mlp")
        else:
            mlp = Mlp(c, c.intermediate_size, name="mlp")
        return x + mlp(RMSNorm(c.rms_norm_eps, name="post_attention_norm")(x))


class Decoder(nn.Module):
    """The decoder: token ids ``[batch, seq]`` in, logits ``[batch, seq, vocab]`` out.

    A ``LlamaConfig`` gives the dense Llama/Qwen3 model; a ``MoeConfig`` gives Qwen3-MoE,
    whose sparse layers' MLPs are ``MoeMlp``.
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


def model(config: LlamaConfig) -> Decoder:
    """The flax module for ``config`` (a ``LlamaConfig``, or a ``MoeConfig`` whose sparse layers route)."""
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be a jreshard.nn.LlamaConfig or MoeConfig, got {type(config).__name__}.")
    return Decoder(config)


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
    labels = tokens[:, 1:]
    logp = jax.nn.log_softmax(out, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


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
