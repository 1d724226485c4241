"""bridge.engines.vllm: jreshard as a vLLM weight-transfer backend (``WeightTransferConfig(backend="jreshard")``).

Inference side: nothing to write. Installing this package registers the backend
through the ``vllm.general_plugins`` entry point (``bridge.engines.vllm.plugin``); every
worker then builds a ``bridge.engines.vllm.engine.JReshardEngine`` (torch and vLLM, never jax).

Trainer side (JAX)::

    from bridge.engines.vllm import LLMClient, Recipe, VLLMWeightSync
    sync = VLLMWeightSync(Recipe.llama(config), workers=2, client=LLMClient(llm), port=29600)
    report = sync.sync(params, version=step)

Only what is vLLM's lives here; the engine-generic sync is ``bridge.engines``'s. Modules:
``engine`` (the worker side: vLLM's four phases over ``bridge.engines.worker.WorkerSync``),
``model`` (the engine params of a live vLLM model and how new weights enter it),
``client`` (``LLMClient``), ``http`` (``HTTPClient``: a ``vllm serve`` server over HTTP),
``serve`` (``python -m bridge.engines.vllm.serve``: ``vllm serve`` with this backend),
``server`` (``Server``: that command as a child process, from Python),
``trainer`` (``VLLMWeightSync``: ``bridge.engines.trainer.TrainerSync`` driving vLLM's client;
imports jax), ``plugin`` (the entry point), ``baselines`` (the bytes
vLLM's own backends move, for comparisons). See docs/vllm.md.
"""

from __future__ import annotations

from bridge.engines.hello import EngineParam, EngineShape
from bridge.engines.vllm.client import LLMClient
from bridge.recipes.recipe import Recipe
from jreshard.core.lazy import lazy_attributes

__all__ = ["EngineParam", "EngineShape", "HTTPClient", "LLMClient", "Recipe", "SyncReport", "VLLMWeightSync"]

_LAZY = {"VLLMWeightSync": "bridge.engines.vllm.trainer", "SyncReport": "bridge.engines.trainer",
         "HTTPClient": "bridge.engines.vllm.http"}


__getattr__ = lazy_attributes('bridge.engines.vllm', _LAZY, globals=globals())
