"""Llama and Qwen3 (``jreshard.nn``'s flax model) to Hugging Face names, split over TP ranks as vLLM does."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from bridge.plan.param_map import ParamMap
from bridge.plan.rules import Rule, tp_param_map
from bridge.plan.source import Source
from jreshard.core.args import check_flag, check_int
from jreshard.core.tp_split import TP_DIMS

if TYPE_CHECKING:
    from jreshard.nn.config import LlamaConfig

__all__ = ["llama_rules", "llama_param_map", "tie_lm_head"]


def llama_rules(config: LlamaConfig, *, fused: bool = False, vocab_pad: int = 64) -> list[Rule]:
    """Rules from the flax model in ``jreshard.nn`` to Hugging Face Llama/Qwen3 names, vLLM-style TP.

    Column parallel: q, k, v, gate, up (``fused=True``: ``qkv_proj``, ``gate_up_proj``);
    row parallel: o, down; vocabulary parallel embedding and lm_head padded to ``vocab_pad``;
    norms replicated. Attention splits whole heads; with more TP ranks than KV heads each
    KV head is replicated on ``tp // num_key_value_heads`` consecutive ranks (as vLLM does).
    """
    if not all(hasattr(config, a) for a in ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")):
        raise TypeError(f"config must be a jreshard.nn.LlamaConfig (LlamaConfig.load(name)), "
                        f"got {type(config).__name__}.")
    fused = check_flag("fused", fused)
    vocab_pad = check_int("vocab_pad", vocab_pad, minimum=1)
    L = r"layers_(\d+)"
    col, row, embed, head = (TP_DIMS[r] for r in ("column", "row", "embed", "head"))  # as vLLM splits them
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads, "v": config.num_key_value_heads}
    rules = [Rule("embed/embedding", "model.embed_tokens.weight", dim=embed, pad_to=vocab_pad)]
    if fused:
        rules += [Rule(rf"{L}/attn/{x}_proj/kernel", "model.layers.{1}.self_attn.qkv_proj.weight",
                       transpose=True, dim=col, part=i, heads=heads[x], replicate_heads=x != "q")
                  for i, x in enumerate("qkv")]
        rules += [Rule(rf"{L}/mlp/{x}_proj/kernel", "model.layers.{1}.mlp.gate_up_proj.weight",
                       transpose=True, dim=col, part=i) for i, x in enumerate(("gate", "up"))]
    else:
        rules += [Rule(rf"{L}/attn/({x})_proj/kernel", "model.layers.{1}.self_attn.{2}_proj.weight",
                       transpose=True, dim=col, heads=heads[x], replicate_heads=x != "q") for x in "qkv"]
        rules.append(Rule(rf"{L}/mlp/(gate|up)_proj/kernel", "model.layers.{1}.mlp.{2}_proj.weight",
                          transpose=True, dim=col))
    rules += [
        Rule(rf"{L}/attn/o_proj/kernel", "model.layers.{1}.self_attn.o_proj.weight", transpose=True, dim=row,
             heads=config.num_attention_heads),
        Rule(rf"{L}/mlp/down_proj/kernel", "model.layers.{1}.mlp.down_proj.weight", transpose=True, dim=row),
        Rule(rf"{L}/attn/(q|k)_norm/scale", "model.layers.{1}.self_attn.{2}_norm.weight"),
        Rule(rf"{L}/input_norm/scale", "model.layers.{1}.input_layernorm.weight"),
        Rule(rf"{L}/post_attention_norm/scale", "model.layers.{1}.post_attention_layernorm.weight"),
        Rule("final_norm/scale", "model.norm.weight"),
        Rule("lm_head/kernel", "lm_head.weight", transpose=True, dim=head, pad_to=vocab_pad),
    ]
    return rules


def llama_param_map(config: LlamaConfig, source: Source, tp_ranks: Any, *, fused: bool = False,
                    vocab_pad: int = 64, dtype: Any = "float32") -> ParamMap:
    """The ready param map for ``jreshard.nn``'s dense ``Decoder`` to Hugging Face names on TP ranks.

    With ``tie_word_embeddings`` the param ``lm_head.weight`` is filled from the embedding too.

    Example:
      >>> from jreshard.nn import LlamaConfig, param_shapes, fsdp_spec
      >>> from bridge import Source, llama_param_map, trainer_mesh
      >>> cfg = LlamaConfig.load("llama-tiny", vocab_size=1000)
      >>> src = Source.build(param_shapes(cfg), trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
      >>> m = llama_param_map(cfg, src, tp_ranks=[2, 3], fused=True)
      >>> [(p.name, p.shape) for p in m.for_rank(3) if "layers.0.self" in p.name]
      [('model.layers.0.self_attn.o_proj.weight', (256, 128)), ('model.layers.0.self_attn.qkv_proj.weight', (256, 256))]
      >>> [str(r.box) for r in m.for_rank(3)[0].regions]  # lm_head: vocab rows 512..1000 of 1024 padded
      ['[0:256, 512:1000]']
    """
    param_map = tp_param_map(source, llama_rules(config, fused=fused, vocab_pad=vocab_pad), tp_ranks, dtype=dtype)
    return tie_lm_head(param_map) if config.tie_word_embeddings else param_map


def tie_lm_head(param_map: ParamMap) -> ParamMap:
    """Adds ``lm_head.weight``, filled from the embedding as ``model.embed_tokens.weight`` is on each rank."""
    tied = [dataclasses.replace(p, name="lm_head.weight") for p in param_map.params
            if p.name == "model.embed_tokens.weight"]
    return param_map + ParamMap(tied)
