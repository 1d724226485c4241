"""Small flax models for tests, demos and notebooks: one decoder, dense (Llama/Qwen3) or MoE (Qwen3-MoE).

The config picks the model: a ``LlamaConfig`` is dense, a ``MoeConfig`` routes the MLP of
its sparse layers to experts. ``LlamaConfig``, ``MoeConfig``, ``param_shapes`` and
``fsdp_spec`` are pure (a torch-only process can describe the model's parameters); the
flax ``Decoder`` and ``init_params``, ``logits``, ``loss``, ``make_optimizer``,
``train_step`` (for either config) are imported from ``jreshard.nn.decoder`` on first use,
which imports jax and flax.

Beside them: ``jreshard.nn.rl`` (group-normalised advantages and one on-policy
policy-gradient step, as GRPO without its KL term) and ``jreshard.nn.hf`` (a dense
model's parameters in Hugging Face ``transformers``' names, for a checkpoint or a check).
"""

from __future__ import annotations

from typing import Any

from jreshard.nn.config import LlamaConfig, MoeConfig, fsdp_spec, param_shapes

__all__ = ["LlamaConfig", "MoeConfig", "param_shapes", "fsdp_spec",
           "Decoder", "init_params", "logits", "loss", "make_optimizer", "train_step"]

_FLAX = ("Decoder", "init_params", "logits", "loss", "make_optimizer", "train_step")


def __getattr__(name: str) -> Any:
    if name in _FLAX:
        import importlib

        return getattr(importlib.import_module("jreshard.nn.decoder"), name)
    raise AttributeError(f"module 'jreshard.nn' has no attribute {name!r}")
