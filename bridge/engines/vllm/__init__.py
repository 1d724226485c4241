"""bridge.engines.vllm: jreshard as a vLLM weight-transfer backend (``WeightTransferConfig(backend="jreshard")``).

Inference side: nothing to write. Installing this package registers the backend
through the ``vllm.general_plugins`` entry point (``bridge.engines.vllm.plugin``); every
worker then builds a ``bridge.engines.vllm.engine.JReshardEngine`` (torch and vLLM, never jax).

Trainer side (JAX)::

    from bridge.engines.vllm import LLMClient, Recipe, VLLMWeightSync
    sync = VLLMWeightSync(Recipe.llama(config), workers=2, client=LLMClient(llm), port=29600)
    report = sync.sync(params, version=step)

Modules: ``_handshake`` (pure: plain-data descriptions, recipe, param map, target
checks), ``_agree`` (the plan every rank agrees on), ``_group`` (the sync's own gloo
group), ``_model`` (targets of a live vLLM model and how new weights enter it),
``engine`` (the worker side), ``plugin``, ``client`` (``LLMClient``), ``trainer``
(``VLLMWeightSync``, imports jax). See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

from bridge.engines.hello import EngineShape, Recipe, Target
from bridge.engines.vllm.client import LLMClient

__all__ = ["EngineShape", "LLMClient", "Recipe", "SyncReport", "Target", "VLLMWeightSync"]

_LAZY = {"VLLMWeightSync": "bridge.engines.vllm.trainer", "SyncReport": "bridge.engines.vllm.trainer"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bridge.engines.vllm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
