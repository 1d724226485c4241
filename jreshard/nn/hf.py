"""A dense ``jreshard.nn`` model's parameters as a Hugging Face checkpoint's tensors (Llama, Qwen3).

Flax kernels are ``[in, out]``; ``transformers`` keeps ``[out, in]``. The result loads with
``strict=True`` into ``transformers.LlamaForCausalLM`` or ``Qwen3ForCausalLM`` (``qk_norm``), and
``save_pretrained`` then writes the checkpoint an inference engine starts from. It gathers every
tensor into host memory: for oracles and first checkpoints, not for refits (those are the bridge's).

Example:
  >>> import jax
  >>> from jreshard.nn import LlamaConfig, init_params
  >>> from jreshard.nn.hf import hf_state
  >>> cfg = LlamaConfig.load("llama-tiny", qk_norm=True)
  >>> state = hf_state(cfg, init_params(cfg, jax.random.key(0)))
  >>> state["model.layers.0.self_attn.q_proj.weight"].shape, len(state)
  ((256, 256), 47)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path

from jreshard.nn.config import LlamaConfig, MoeConfig

__all__ = ["hf_state"]


def hf_state(config: LlamaConfig, params: Any) -> dict[str, np.ndarray]:
    """Every tensor of ``params`` (``init_params``' tree, any sharding) in Hugging Face names, float32.

    A tied model's ``lm_head.weight`` is left out (``transformers`` ties it to the embedding).
    """
    if isinstance(config, MoeConfig) or not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be a dense jreshard.nn.LlamaConfig, got {type(config).__name__}.")
    flat = {keystr(k, simple=True, separator="/"): np.asarray(x, dtype=np.float32)
            for k, x in tree_flatten_with_path(params)[0]}
    out = {"model.embed_tokens.weight": flat["embed/embedding"], "model.norm.weight": flat["final_norm/scale"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = flat["lm_head/kernel"].T
    for i in range(config.num_hidden_layers):
        j, h = f"layers_{i}/", f"model.layers.{i}."
        for n in "qkvo":
            out[h + f"self_attn.{n}_proj.weight"] = flat[j + f"attn/{n}_proj/kernel"].T
        if config.qk_norm:
            for n in "qk":
                out[h + f"self_attn.{n}_norm.weight"] = flat[j + f"attn/{n}_norm/scale"]
        for n in ("gate", "up", "down"):
            out[h + f"mlp.{n}_proj.weight"] = flat[j + f"mlp/{n}_proj/kernel"].T
        out[h + "input_layernorm.weight"] = flat[j + "input_norm/scale"]
        out[h + "post_attention_layernorm.weight"] = flat[j + "post_attention_norm/scale"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
