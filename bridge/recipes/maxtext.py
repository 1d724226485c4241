"""A MaxText-style scanned tree (every layer's weight in one leaf) to Hugging Face Llama names, vLLM-style TP.

MaxText scans over layers (``scan_layers: true``) and stacks each weight along
``param_scan_axis`` (default 1): ``decoder/layers/self_attention/query/kernel [emb, L,
heads, head_dim]``, ``.../out/kernel [heads, L, head_dim, emb]``, ``decoder/layers/mlp/wi_0/kernel
[emb, L, mlp]``, norms ``[emb, L]``. Each rule names the leaf's dims, so one leaf becomes
one param per layer (``{L}`` in the name), heads merge with ``head_dim`` into the torch
dim, and TP splits whole heads. The layer axis may itself be sharded (pipeline stages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bridge.plan.param_map import ParamMap
from bridge.plan.rules import Rule, tp_param_map
from bridge.plan.source import Source
from jreshard.core.tp_split import TP_DIMS

if TYPE_CHECKING:
    from jreshard.nn.config import LlamaConfig

__all__ = ["maxtext_shapes", "maxtext_rules", "maxtext_param_map"]

_P = r"(?:params/)?decoder"
# Per leaf: the unscanned dims by name (the layer axis "L" goes in at the scan axis), the
# torch dims, the param name, the TP split dim and whose heads it holds.
_LAYERS: dict[str, tuple[str, str, str, str | None, str | None]] = {
    "self_attention/query/kernel": ("emb heads hd", "(heads hd) emb", "self_attn.q_proj.weight", "heads", "q"),
    "self_attention/key/kernel": ("emb heads hd", "(heads hd) emb", "self_attn.k_proj.weight", "heads", "kv"),
    "self_attention/value/kernel": ("emb heads hd", "(heads hd) emb", "self_attn.v_proj.weight", "heads", "kv"),
    "self_attention/out/kernel": ("heads hd emb", "emb (heads hd)", "self_attn.o_proj.weight", "heads", "q"),
    "mlp/wi_0/kernel": ("emb mlp", "mlp emb", "mlp.gate_proj.weight", "mlp", None),
    "mlp/wi_1/kernel": ("emb mlp", "mlp emb", "mlp.up_proj.weight", "mlp", None),
    "mlp/wo/kernel": ("mlp emb", "emb mlp", "mlp.down_proj.weight", "mlp", None),
    "pre_self_attention_layer_norm/scale": ("emb", "emb", "input_layernorm.weight", None, None),
    "post_self_attention_layer_norm/scale": ("emb", "emb", "post_attention_layernorm.weight", None, None),
}


def _scanned(dims: str, scan_axis: int) -> str:
    names = dims.split()
    if not 0 <= scan_axis <= len(names):
        raise ValueError(f"scan_axis={scan_axis} is out of range for a leaf of {len(names) + 1} dims; "
                         "MaxText's param_scan_axis is 0 or 1.")
    return " ".join([*names[:scan_axis], "L", *names[scan_axis:]])


def maxtext_shapes(config: LlamaConfig, *, scan_axis: int = 1) -> dict[str, tuple[int, ...]]:
    """The leaves of a MaxText Llama of ``config``'s sizes, scanned at ``scan_axis``.

    Example:
      >>> from jreshard.nn import LlamaConfig
      >>> from bridge.recipes.maxtext import maxtext_shapes
      >>> maxtext_shapes(LlamaConfig.load("llama-tiny"))["decoder/layers/self_attention/query/kernel"]
      (256, 4, 8, 32)
    """
    c = config
    size = {"emb": c.hidden_size, "hd": c.head_dim, "mlp": c.intermediate_size, "L": c.num_hidden_layers}
    out: dict[str, tuple[int, ...]] = {"token_embedder/embedding": (c.vocab_size, c.hidden_size)}
    for leaf, (dims, _, _, _, heads) in _LAYERS.items():
        size["heads"] = c.num_key_value_heads if heads == "kv" else c.num_attention_heads
        out[f"decoder/layers/{leaf}"] = tuple(size[n] for n in _scanned(dims, scan_axis).split())
    out["decoder/decoder_norm/scale"] = (c.hidden_size,)
    out["decoder/logits_dense/kernel"] = (c.hidden_size, c.vocab_size)
    return out


def maxtext_rules(config: LlamaConfig, *, scan_axis: int = 1, vocab_pad: int = 64) -> list[Rule]:
    """Rules from a MaxText-style scanned tree to Hugging Face Llama names split over TP ranks as vLLM does.

    Query heads split whole over TP; with more TP ranks than KV heads each KV head is
    replicated on ``tp // num_key_value_heads`` consecutive ranks; embeddings and the
    output projection are vocabulary parallel, padded to ``vocab_pad``.
    """
    rules = [Rule(r"(?:params/)?token_embedder/embedding", "model.embed_tokens.weight", dim=TP_DIMS["embed"],
                  pad_to=vocab_pad)]
    for leaf, (dims, torch_dims, name, split, heads) in _LAYERS.items():
        n = config.num_key_value_heads if heads == "kv" else config.num_attention_heads
        rules.append(Rule(f"{_P}/layers/{leaf}", "model.layers.{L}." + name,
                          dims=f"{_scanned(dims, scan_axis)} -> {torch_dims}", dim=split,
                          heads=n if heads else None, replicate_heads=heads == "kv"))
    rules += [Rule(f"{_P}/decoder_norm/scale", "model.norm.weight"),
              Rule(f"{_P}/logits_dense/kernel", "lm_head.weight", transpose=True, dim=TP_DIMS["head"],
                   pad_to=vocab_pad)]
    return rules


def maxtext_param_map(config: LlamaConfig, source: Source, tp_ranks: Any, *, scan_axis: int = 1,
                      vocab_pad: int = 64, dtype: Any = "float32") -> ParamMap:
    """The ready param map for a MaxText-style scanned Llama on TP ranks (one param per layer and name)."""
    return tp_param_map(source, maxtext_rules(config, scan_axis=scan_axis, vocab_pad=vocab_pad), tp_ranks,
                        dtype=dtype)
