"""Small flax models for tests, demos and notebooks: Llama/Qwen3 dense, and Qwen3-MoE.

``LlamaConfig``, ``MoeConfig``, ``param_shapes`` and ``fsdp_spec`` are pure (a torch-only
process can describe the model's parameters); the flax models (``Llama``, ``Moe``) and
``init_params``, ``logits``, ``loss``, ``make_optimizer``, ``train_step`` (for either
config) are imported from ``jreshard.nn.llama`` and ``jreshard.nn.moe`` on first use,
which import jax and flax.
"""

from __future__ import annotations

from typing import Any

from jreshard.nn.config import LlamaConfig, MoeConfig, fsdp_spec, param_shapes

__all__ = ["LlamaConfig", "MoeConfig", "param_shapes", "fsdp_spec",
           "Llama", "Moe", "init_params", "logits", "loss", "make_optimizer", "train_step"]

_FLAX = {"Llama": "llama", "init_params": "llama", "logits": "llama", "loss": "llama",
         "make_optimizer": "llama", "train_step": "llama", "Moe": "moe"}


def __getattr__(name: str) -> Any:
    if name in _FLAX:
        import importlib

        return getattr(importlib.import_module(f"jreshard.nn.{_FLAX[name]}"), name)
    raise AttributeError(f"module 'jreshard.nn' has no attribute {name!r}")
