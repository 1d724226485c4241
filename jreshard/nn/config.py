"""The configs of ``jreshard.nn``'s decoder, and its parameter shapes (pure: no jax, no torch).

A ``LlamaConfig`` describes the dense Llama/Qwen3 model; a ``MoeConfig`` (a subclass) the
same decoder whose sparse layers route their MLP to experts (Qwen3-MoE).

Vocabulary: a *leaf path* is the '/'-joined key path of a parameter in the flax
``params`` tree (``'layers_0/attn/q_proj/kernel'``); a *kernel* is a flax
``Dense`` weight, laid out ``[in, out]``.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from importlib import resources
from pathlib import Path, PurePath
from typing import Any

from jreshard.core.jsonfile import read_json_object

__all__ = ["LlamaConfig", "MoeConfig", "param_shapes", "fsdp_spec"]

_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim")


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Hyperparameters of a decoder-only Llama (``qk_norm=True``: Qwen3-style) model.

    Example:
      >>> from jreshard.nn import LlamaConfig
      >>> cfg = LlamaConfig.load("llama-tiny")
      >>> cfg.hidden_size, cfg.q_size, cfg.kv_size
      (256, 256, 128)
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    name: str = "llama"

    def __post_init__(self) -> None:
        for f in _INT_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise ValueError(f"LlamaConfig.{f} must be a positive int, got {v!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}.")

    @classmethod
    def load(cls, name_or_path: str | Path, **overrides: Any) -> LlamaConfig:
        """Reads a model JSON: a name in ``jreshard/data/models``, a file path, or a checkpoint folder.

        A Hugging Face ``config.json`` (a checkpoint's, or ``transformers.Qwen3MoeConfig(...).to_dict()``
        saved) reads as ``transformers`` writes it: ``num_local_experts`` is ``num_experts``,
        ``rope_parameters["rope_theta"]`` is ``rope_theta``, ``head_dim`` defaults to
        ``hidden_size // num_attention_heads``, and a ``qwen3``/``qwen3_moe`` ``model_type`` has
        ``qk_norm``. ``overrides`` win over the file.

        Example:
          >>> from jreshard.nn import MoeConfig
          >>> MoeConfig.load("qwen3-moe-tiny", num_experts=16).num_experts
          16
        """
        if not isinstance(name_or_path, (str, PurePath)) or not str(name_or_path):
            raise TypeError(f"name_or_path must be a model name, a .json path or a checkpoint folder (str or Path), "
                            f"got {type(name_or_path).__name__} {name_or_path!r}; pass for example 'llama-tiny'.")
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if path.suffix != ".json":
            ref = resources.files("jreshard") / "data" / "models" / f"{name_or_path}.json"
            if not ref.is_file():
                raise ValueError(
                    f"name_or_path {str(name_or_path)!r} is neither a .json file nor a model in "
                    "jreshard/data/models; pass for example 'llama-tiny'."
                )
            data = json.loads(ref.read_text())
        else:
            data = read_json_object("name_or_path", path, "a model config (a checkpoint's config.json)")
        _check_family(data, str(path))
        raw = _from_hf(data)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"{cls.__name__}.load got overrides {unknown} that are not {cls.__name__} fields; "
                            f"its fields are {sorted(fields)}.")
        kwargs = {k: v for k, v in raw.items() if k in fields}
        kwargs.update(overrides)
        return cls(**kwargs)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def hf_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.LlamaConfig`` (or ``Qwen3Config``) with the same shapes."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }


# The model_type (or the catalog's own "architecture") of every config the decoder can build.
_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")


def _check_family(data: dict[str, Any], where: str) -> None:
    """Refuses a config of another model family (a ``model_type`` this decoder does not build)."""
    for field in ("model_type", "architecture"):
        kind = data.get(field)
        if kind is not None and kind not in _FAMILIES:
            raise ValueError(f"name_or_path {where!r} has {field} {kind!r}, which jreshard.nn's decoder does not "
                             f"build; it builds {list(_FAMILIES)}.")


def _from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """A model JSON with ``transformers``' names and defaults translated to the configs' fields."""
    out = dict(raw)
    if "num_experts" not in out and "num_local_experts" in out:  # transformers 5.x's Qwen3-MoE and Mixtral
        out["num_experts"] = out["num_local_experts"]
    rope = out.get("rope_parameters")
    if "rope_theta" not in out and isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    if out.get("head_dim") is None and out.get("hidden_size") and out.get("num_attention_heads"):
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if "qk_norm" not in out and out.get("model_type") in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = True
    if out.get("num_key_value_heads") is None and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # transformers' default: no grouping
    if out.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers {out['mlp_only_layers']} is not supported: jreshard.nn's MoE model "
                         "makes every decoder_sparse_step-th layer sparse; give an empty list.")
    return out


_MOE_INT_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclasses.dataclass(frozen=True, slots=True)
class MoeConfig(LlamaConfig):
    """A Qwen3-MoE-style model: Llama attention, and a routed mixture of experts as the MLP.

    Every ``decoder_sparse_step``-th layer routes each token to its ``num_experts_per_tok``
    most probable experts (softmax over the router's logits, then top-k, renormalised
    when ``norm_topk_prob``); the other layers keep a dense MLP of ``intermediate_size``.
    Expert weights are stacked along a leading expert dim, as JAX trainers keep them.
    ``shared_expert_intermediate_size > 0`` adds a dense expert that every token uses
    (DeepSeek-V3's shared expert; Qwen3-MoE has none).

    Example:
      >>> from jreshard.nn import MoeConfig
      >>> cfg = MoeConfig.load("qwen3-moe-tiny")
      >>> cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
      (8, 2, 64)
      >>> cfg.is_sparse(0)
      True
    """

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        LlamaConfig.__post_init__(self)
        for f in (*_MOE_INT_FIELDS, "decoder_sparse_step"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise ValueError(f"MoeConfig.{f} must be a positive int, got {v!r}.")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoeConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}; route to at most every expert.")
        v = self.shared_expert_intermediate_size
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"MoeConfig.shared_expert_intermediate_size must be an int >= 0 (0: none), got {v!r}.")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` routes to experts (else it has a dense MLP), as Qwen3-MoE decides."""
        return (layer + 1) % self.decoder_sparse_step == 0

    def hf_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.Qwen3MoeConfig`` with the same shapes (no shared expert)."""
        if self.shared_expert_intermediate_size:
            raise ValueError("transformers' Qwen3-MoE has no shared expert; set shared_expert_intermediate_size=0.")
        return {
            **LlamaConfig.hf_kwargs(self),
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": [],
            "output_router_logits": False,
        }


def _mlp_shapes(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}/gate_proj/kernel": (hidden, inner), f"{prefix}/up_proj/kernel": (hidden, inner),
            f"{prefix}/down_proj/kernel": (inner, hidden)}


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's leaf path and shape, in the flax model's tree order.

    Example:
      >>> from jreshard.nn import LlamaConfig, param_shapes
      >>> shapes = param_shapes(LlamaConfig.load("llama-tiny"))
      >>> shapes["layers_0/attn/q_proj/kernel"], shapes["embed/embedding"]
      ((256, 256), (1024, 256))
    """
    c = config
    h = c.hidden_size
    out: dict[str, tuple[int, ...]] = {"embed/embedding": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"layers_{i}"
        out[f"{p}/input_norm/scale"] = (h,)
        out[f"{p}/attn/q_proj/kernel"] = (h, c.q_size)
        out[f"{p}/attn/k_proj/kernel"] = (h, c.kv_size)
        out[f"{p}/attn/v_proj/kernel"] = (h, c.kv_size)
        out[f"{p}/attn/o_proj/kernel"] = (c.q_size, h)
        if c.qk_norm:
            out[f"{p}/attn/q_norm/scale"] = (c.head_dim,)
            out[f"{p}/attn/k_norm/scale"] = (c.head_dim,)
        out[f"{p}/post_attention_norm/scale"] = (h,)
        if isinstance(c, MoeConfig) and c.is_sparse(i):
            e, m = c.num_experts, c.moe_intermediate_size
            out[f"{p}/mlp/router/kernel"] = (h, e)
            out[f"{p}/mlp/experts/gate_proj"] = (e, h, m)
            out[f"{p}/mlp/experts/up_proj"] = (e, h, m)
            out[f"{p}/mlp/experts/down_proj"] = (e, m, h)
            if c.shared_expert_intermediate_size:
                out.update(_mlp_shapes(f"{p}/mlp/shared_expert", h, c.shared_expert_intermediate_size))
        else:
            out.update(_mlp_shapes(f"{p}/mlp", h, c.intermediate_size))
    out["final_norm/scale"] = (h,)
    if not c.tie_word_embeddings:
        out["lm_head/kernel"] = (h, c.vocab_size)
    return out


def fsdp_spec(path: str, shape: tuple[int, ...], axis: str | tuple[str, ...] = "fsdp") -> tuple:
    """The FSDP partition spec of one parameter: matrices split on dim 0, vectors replicated.

    Example:
      >>> from jreshard.nn import fsdp_spec
      >>> fsdp_spec("layers_0/mlp/up_proj/kernel", (256, 688))
      ('fsdp', None)
      >>> fsdp_spec("final_norm/scale", (256,))
      (None,)
    """
    if len(shape) >= 2:
        return (axis,) + (None,) * (len(shape) - 1)
    return (None,) * len(shape)
