"""Model catalog: every weight tensor of a model, with its name, shape and role.

Shapes follow the torch / Hugging Face convention (``[out_features, in_features]``
for linear weights). Each ``TensorInfo`` also carries what the parallelism
presets need: the decoder layer it belongs to (``None`` for embeddings, the final
norm and the head), its *role* (how tensor parallelism cuts it) and, for routed
experts, the expert index (or ``stacked=True`` when the experts are one
``[experts, ...]`` tensor), and for attention projections the number of heads in
the tensor-parallel dim (split by the vLLM head rule of ``jreshard.core.heads``).
``quantize`` marks the tensors an FP8 checkpoint stores in block-scaled FP8
(``jreshard.core.fp8``): the weights of linear layers, as in DeepSeek-V3's
checkpoint; embeddings, heads, norms, routers and the multi-token-prediction
``eh_proj`` (a plain linear layer in vLLM) stay in the model's dtype.

Roles:
  ``embed``     vocabulary-parallel embedding ``[vocab, hidden]`` (dim 0 over tp)
  ``head``      the output projection ``[vocab, hidden]`` (dim 0 over tp)
  ``column``    column-parallel linear ``[out, in]`` (dim 0 over tp)
  ``row``       row-parallel linear ``[out, in]`` (dim 1 over tp)
  ``replicated`` norms, routers, low-rank down projections (whole on every rank)

Example:
  >>> import jreshard.fleet.catalog as catalog
  >>> t = catalog.tensors("qwen3-32b")
  >>> len(t), round(catalog.num_params(t) / 1e9, 1)
  (707, 32.8)
  >>> t[2].name, t[2].shape, t[2].role, t[2].heads
  ('model.layers.0.self_attn.q_proj.weight', (8192, 5120), 'column', 64)
  >>> t[3].name, t[3].heads, t[3].replicate_heads  # KV heads: replicated when tp exceeds them
  ('model.layers.0.self_attn.k_proj.weight', 8, True)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from importlib import resources
from typing import Any

from jreshard.core.args import check_int
from jreshard.core.jsonfile import read_json_object

__all__ = ["TensorInfo", "ModelConfig", "tensors", "num_params", "models", "get_model", "register_model",
           "load_config", "ARCHITECTURES"]

ARCHITECTURES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")
_EXPERTS = ("separate", "stacked")
_ROLES = ("embed", "head", "column", "row", "replicated")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    """One weight tensor: Hugging Face name, shape, dtype and how it is parallelised.

    ``heads`` is the number of attention heads in the tensor-parallel dim (dim 0 of
    a column, dim 1 of a row projection), ``None`` for tensors without heads;
    ``replicate_heads`` marks KV heads, which vLLM replicates over extra TP ranks;
    ``quantize`` tensors that FP8 delivery quantizes (the others keep ``dtype``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    layer: int | None = None
    expert: int | None = None
    stacked: bool = False
    heads: int | None = None
    replicate_heads: bool = False
    quantize: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_expert(self) -> bool:
        return self.expert is not None or self.stacked


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """The hyperparameters of one model (a Hugging Face ``config.json`` subset)."""

    name: str
    architecture: str
    params: tuple[tuple[str, Any], ...]

    def __getitem__(self, key: str) -> Any:
        return dict(self.params)[key]

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @property
    def num_layers(self) -> int:
        """Decoder layers including multi-token-prediction layers."""
        return int(self["num_hidden_layers"]) + int(self.get("num_nextn_predict_layers", 0) or 0)


_REGISTRY: dict[str, ModelConfig] = {}

# Keys each architecture needs, checked when a config is loaded.
_REQUIRED = {
    "llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "qwen3": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "qwen3_moe": ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_experts"),
    "deepseek_v3": ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "n_routed_experts"),
}
# Hugging Face model classes (a config's ``architectures``) for configs without ``model_type``.
_HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
               "DeepseekV3ForCausalLM": "deepseek_v3"}
# Hugging Face model_type values that share an architecture's tensor list.
_ALIASES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
            "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3"}


def load_config(config: Any, name: str | None = None) -> ModelConfig:
    """Reads a Hugging Face-style config (a dict, or a path to ``config.json``).

    Args:
      config: the mapping, or a path to a JSON file holding it.
      name: the catalog name; defaults to the config's ``name`` or ``_name_or_path``, else (for a
        path) the file's name, or its folder's for a file named ``config.json``; lowercased.

    Raises:
      TypeError: ``config`` is neither a mapping nor a path.
      ValueError: the architecture is not supported or a hyperparameter is missing.
    """
    file_name = None
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):  # a checkpoint folder
            path = os.path.join(path, "config.json")
        file_name = _name_from_path(path)
        config = read_json_object("config", path, "a model's config.json")
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or a path to a config.json, got {type(config).__name__}.")
    arch = _architecture(config)
    missing = [k for k in _REQUIRED[arch] if k not in config]
    if missing:
        raise ValueError(f"config for architecture {arch!r} lacks field(s) {missing}; "
                         "add them from the model's config.json.")
    for k in _REQUIRED[arch]:
        check_int(f"config field {k!r}", config[k], minimum=1)
    model_name = name or config.get("name") or config.get("_name_or_path") or file_name
    if not isinstance(model_name, str) or not model_name:
        raise ValueError("config has no 'name' nor '_name_or_path'; pass name='my-model' to register it.")
    params = tuple(sorted((k, v) for k, v in config.items() if isinstance(v, (int, float, str, bool, type(None)))))
    return ModelConfig(model_name.split("/")[-1].lower() if name is None else name, arch, params)


def _architecture(config: dict) -> str:
    """The catalog architecture of a config: its ``architecture``, ``model_type`` or ``architectures[0]``.

    ``architecture`` (the catalog's own field) and ``model_type`` (Hugging Face's) must both be
    known and agree where both are given, so that an unknown ``model_type`` is never read as
    another model.
    """
    named = [(f, config[f]) for f in ("architecture", "model_type") if config.get(f) is not None]
    if not named and isinstance(config.get("architectures"), list) and config["architectures"]:
        first = config["architectures"][0]
        named = [("architectures[0]", _HF_CLASSES.get(str(first), first))]
    if not named:
        raise ValueError(f"config has no field 'model_type' (or 'architecture'); add one of {sorted(_ALIASES)}.")
    archs = set()
    for field, value in named:
        if str(value) not in _ALIASES:
            raise ValueError(f"config field {field!r} is {value!r}, which the catalog does not support; "
                             f"supported: {sorted(_ALIASES)}.")
        archs.add(_ALIASES[str(value)])
    if len(archs) > 1:
        raise ValueError(f"config fields 'architecture' {config['architecture']!r} and 'model_type' "
                         f"{config['model_type']!r} name different architectures; give one of them.")
    return archs.pop()


def _name_from_path(path: str) -> str:
    """``.../Qwen3-8B/config.json`` -> ``Qwen3-8B``; ``.../my-model.json`` -> ``my-model``."""
    stem = os.path.splitext(os.path.basename(path))[0]
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return parent if stem == "config" and parent else stem


def _builtin() -> dict[str, ModelConfig]:
    if not _REGISTRY:
        for entry in resources.files("jreshard").joinpath("data/models").iterdir():
            if entry.name.endswith(".json"):
                cfg = load_config(json.loads(entry.read_text()))
                _REGISTRY[cfg.name] = cfg
    return _REGISTRY


def models() -> tuple[str, ...]:
    """Names of the models in the catalog (built in and registered)."""
    return tuple(sorted(_builtin()))


def get_model(name: str | ModelConfig) -> ModelConfig:
    """The ``ModelConfig`` of a catalog name (a ``ModelConfig`` passes through)."""
    if isinstance(name, ModelConfig):
        return name
    if not isinstance(name, str):
        raise TypeError(f"model must be a catalog name or a ModelConfig, got {type(name).__name__} {name!r}.")
    reg = _builtin()
    if name not in reg:
        raise ValueError(f"model {name!r} is not in the catalog; known models: {sorted(reg)}; "
                         "add one with jreshard.fleet.catalog.register_model(config_json).")
    return reg[name]


def register_model(config: Any, name: str | None = None) -> ModelConfig:
    """Adds a model from a Hugging Face-style config (dict or path); returns its config."""
    cfg = load_config(config, name)
    _builtin()[cfg.name] = cfg
    return cfg


def num_params(infos: list[TensorInfo]) -> int:
    """Total number of parameters (elements) of a tensor list."""
    return sum(t.size for t in infos)


def tensors(model: str | ModelConfig, *, experts: str = "separate", mtp: bool = True,
            dtype: str | None = None) -> list[TensorInfo]:
    """Every weight tensor of ``model``, in checkpoint order.

    Args:
      model: a catalog name (see ``models()``) or a ``ModelConfig``.
      experts: ``'separate'`` (one tensor per routed expert and projection, the Hugging
        Face layout) or ``'stacked'`` (one ``[experts, ...]`` tensor per layer and
        projection, the grouped layout of JAX and Megatron trainers).
      mtp: include multi-token-prediction layers (DeepSeek-V3's layer 61).
      dtype: element type; defaults to the config's ``dtype`` (``torch_dtype``).
    """
    cfg = get_model(model)
    if experts not in _EXPERTS:
        raise ValueError(f"experts must be one of {_EXPERTS}, got {experts!r}.")
    dt = dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    try:
        return list(_tensors(cfg, experts, mtp, dt))
    except TypeError:  # a config with a list among its values: not hashable, not cached
        return list(_tensors.__wrapped__(cfg, experts, mtp, dt))


# A scenario reads its model's tensors a few times (checks, both sides' layouts, FP8 costs);
# TensorInfo is frozen, so the lists share one tuple.
@functools.lru_cache(maxsize=16)
def _tensors(cfg: ModelConfig, experts: str, mtp: bool, dt: str) -> tuple[TensorInfo, ...]:
    out: list[TensorInfo] = []
    add = _Adder(out, dt)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    add("model.embed_tokens.weight", (v, h), "embed")
    n_main = cfg["num_hidden_layers"]
    n_layers = n_main + (int(cfg.get("num_nextn_predict_layers", 0) or 0) if mtp else 0)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        if i >= n_main:  # DeepSeek-V3 multi-token prediction: its own embedding, projections and head
            add(p + "embed_tokens.weight", (v, h), "embed", i)
            add(p + "enorm.weight", (h,), "replicated", i)
            add(p + "hnorm.weight", (h,), "replicated", i)
            add(p + "eh_proj.weight", (h, 2 * h), "replicated", i)
        add(p + "input_layernorm.weight", (h,), "replicated", i)
        _attention(cfg, add, p + "self_attn.", i)
        add(p + "post_attention_layernorm.weight", (h,), "replicated", i)
        _mlp(cfg, add, p + "mlp.", i, experts)
        if i >= n_main:
            add(p + "shared_head.norm.weight", (h,), "replicated", i)
            add(p + "shared_head.head.weight", (v, h), "head", i)
    add("model.norm.weight", (h,), "replicated")
    if not cfg.get("tie_word_embeddings", False):
        add("lm_head.weight", (v, h), "head")
    return tuple(out)


class _Adder:
    def __init__(self, out: list[TensorInfo], dtype: str) -> None:
        self.out, self.dtype = out, dtype

    def __call__(self, name: str, shape: tuple[int, ...], role: str, layer: int | None = None,
                 expert: int | None = None, stacked: bool = False, *, heads: int | None = None,
                 replicate_heads: bool = False, linear: bool = False) -> None:
        # FP8 checkpoints quantize the tensor-parallel linear layers and the replicated low-rank ones.
        quantize = linear or role in ("column", "row")
        self.out.append(TensorInfo(name, tuple(int(n) for n in shape), self.dtype, role, layer, expert, stacked,
                                   heads, replicate_heads, quantize))

    def experts(self, p: str, n_exp: int, shape: tuple[int, int], layer: int) -> None:
        """Each routed expert's gate, up and down projections (``[inter, hidden]`` twice, then its transpose).

        The largest models have about 200,000 of them: one loop with the shapes made once.
        """
        col, row, dt, append = shape, shape[::-1], self.dtype, self.out.append
        for e in range(n_exp):
            q = f"{p}{e}."
            append(TensorInfo(q + "gate_proj.weight", col, dt, "column", layer, e, False, None, False, True))
            append(TensorInfo(q + "up_proj.weight", col, dt, "column", layer, e, False, None, False, True))
            append(TensorInfo(q + "down_proj.weight", row, dt, "row", layer, e, False, None, False, True))


def _attention(cfg: ModelConfig, add: _Adder, p: str, i: int) -> None:
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.architecture == "deepseek_v3":
        nope, rope, vd, kvr = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
        qr = cfg.get("q_lora_rank")
        if qr:
            add(p + "q_a_proj.weight", (qr, h), "replicated", i, linear=True)
            add(p + "q_a_layernorm.weight", (qr,), "replicated", i)
            add(p + "q_b_proj.weight", (nh * (nope + rope), qr), "column", i, heads=nh)
        else:
            add(p + "q_proj.weight", (nh * (nope + rope), h), "column", i, heads=nh)
        add(p + "kv_a_proj_with_mqa.weight", (kvr + rope, h), "replicated", i, linear=True)
        add(p + "kv_a_layernorm.weight", (kvr,), "replicated", i)
        add(p + "kv_b_proj.weight", (nh * (nope + vd), kvr), "column", i, heads=nh)
        add(p + "o_proj.weight", (h, nh * vd), "row", i, heads=nh)
        return
    hd = cfg.get("head_dim") or h // nh
    nkv = cfg.get("num_key_value_heads") or nh
    add(p + "q_proj.weight", (nh * hd, h), "column", i, heads=nh)
    add(p + "k_proj.weight", (nkv * hd, h), "column", i, heads=nkv, replicate_heads=True)
    add(p + "v_proj.weight", (nkv * hd, h), "column", i, heads=nkv, replicate_heads=True)
    add(p + "o_proj.weight", (h, nh * hd), "row", i, heads=nh)
    if cfg.architecture in ("qwen3", "qwen3_moe"):
        add(p + "q_norm.weight", (hd,), "replicated", i)
        add(p + "k_norm.weight", (hd,), "replicated", i)


def _dense_mlp(add: _Adder, p: str, h: int, inter: int, i: int) -> None:
    add(p + "gate_proj.weight", (inter, h), "column", i)
    add(p + "up_proj.weight", (inter, h), "column", i)
    add(p + "down_proj.weight", (h, inter), "row", i)


def _mlp(cfg: ModelConfig, add: _Adder, p: str, i: int, experts: str) -> None:
    h = cfg["hidden_size"]
    arch = cfg.architecture
    if arch in ("llama", "qwen3"):
        _dense_mlp(add, p, h, cfg["intermediate_size"], i)
        return
    if arch == "deepseek_v3" and i < int(cfg.get("first_k_dense_replace", 0) or 0):
        _dense_mlp(add, p, h, cfg["intermediate_size"], i)
        return
    n_exp = cfg["num_experts"] if arch == "qwen3_moe" else cfg["n_routed_experts"]
    mi = cfg["moe_intermediate_size"]
    add(p + "gate.weight", (n_exp, h), "replicated", i)
    if arch == "deepseek_v3":
        add(p + "gate.e_score_correction_bias", (n_exp,), "replicated", i)
    if experts == "stacked":
        add(p + "experts.gate_proj.weight", (n_exp, mi, h), "column", i, stacked=True)
        add(p + "experts.up_proj.weight", (n_exp, mi, h), "column", i, stacked=True)
        add(p + "experts.down_proj.weight", (n_exp, h, mi), "row", i, stacked=True)
    else:
        add.experts(p + "experts.", n_exp, (int(mi), int(h)), i)
    n_shared = int(cfg.get("n_shared_experts", 0) or 0) if arch == "deepseek_v3" else 0
    if n_shared:
        _dense_mlp(add, p + "shared_experts.", h, mi * n_shared, i)
