"""A small flax Llama/Qwen3-style model for tests, demos and notebooks.

``LlamaConfig``, ``param_shapes`` and ``fsdp_spec`` are pure (a torch-only process
can describe the model's parameters); the flax model itself (``Llama``,
``init_params``, ``logits``, ``loss``, ``make_optimizer``, ``train_step``) is
imported from ``jreshard.nn.llama`` on first use, which imports jax and flax.
"""

from __future__ import annotations

from typing import Any

from jreshard.nn.config import LlamaConfig, fsdp_spec, param_shapes

__all__ = ["LlamaConfig", "param_shapes", "fsdp_spec",
           "Llama", "init_params", "logits", "loss", "make_optimizer", "train_step"]

_FLAX = {"Llama", "init_params", "logits", "loss", "make_optimizer", "train_step"}


def __getattr__(name: str) -> Any:
    if name in _FLAX:
        from jreshard.nn import llama

        return getattr(llama, name)
    raise AttributeError(f"module 'jreshard.nn' has no attribute {name!r}")
