"""A small flax Qwen3-MoE-style decoder: Llama attention and a routed mixture of experts.

The maths follows Hugging Face ``transformers``' ``Qwen3MoeForCausalLM``: the router's
logits (``[tokens, experts]``) go through a float32 softmax, each token keeps its
``num_experts_per_tok`` largest probabilities (renormalised to sum to one when
``norm_topk_prob``), and the layer's output is the weighted sum of those experts'
SiLU-gated MLPs. Expert weights are stacked along a leading expert dim
(``experts/gate_proj [E, hidden, moe_intermediate]``, ``experts/down_proj
[E, moe_intermediate, hidden]``), as JAX trainers keep them so that an ``ep`` mesh axis
can split the experts. Every expert runs on every token and the router's weights
select: the same result as dispatching tokens to experts, at a cost that only a
small model can afford. A shared expert (DeepSeek-V3) is a dense MLP every token uses.

``init_params``, ``logits``, ``loss`` and ``train_step`` of ``jreshard.nn`` take a
``MoeConfig`` as they take a ``LlamaConfig``.

Example:
  >>> import jax
  >>> import jax.numpy as jnp
  >>> from jreshard.nn import MoeConfig, init_params, logits
  >>> cfg = MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
  ...                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
  ...                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  >>> params = init_params(cfg, jax.random.key(0))
  >>> params["layers_0"]["mlp"]["experts"]["gate_proj"].shape
  (4, 32, 16)
  >>> logits(cfg, params, jnp.zeros((2, 5), jnp.int32)).shape
  (2, 5, 64)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jreshard.nn.config import MoeConfig
from jreshard.nn.llama import Llama, Mlp, dense

__all__ = ["Moe", "MoeLayer", "route"]


def route(router_logits: jax.Array, top_k: int, normalize: bool) -> jax.Array:
    """Each token's weight for every expert, ``[tokens, experts]``: top-k of the softmax, zero elsewhere.

    Example:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> from jreshard.nn.moe import route
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


class MoeLayer(nn.Module):
    """Router, routed experts and the optional shared expert of one sparse layer."""

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


# One decoder serves both configs: ``Llama``'s blocks pick ``MoeLayer`` for sparse layers.
Moe = Llama
