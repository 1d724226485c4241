"""The ``vllm.general_plugins`` entry point: registers the ``"jreshard"`` weight-transfer backend.

vLLM calls ``register`` in every process it starts (engine core and workers), so
``WeightTransferConfig(backend="jreshard")`` works with no user code on the inference
side. The engine module is imported lazily, when a worker creates the engine.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "jreshard"


def register() -> None:
    """Registers the worker-side engine under ``BACKEND`` (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "bridge.engines.vllm.engine", "JReshardEngine")
