"""Inference engines: the engine-generic part of a sync with a live engine, and one folder per engine.

A sync with an engine runs in the engine's own process group (``group``): the trainers
and the workers exchange hellos (``hello``: pure, what each side tells the other), agree
on one plan from them (``agree``; ``fp8`` for engines serving block-FP8 models), then the
trainers send (``trainer.TrainerSync``, imports jax) and the workers receive into staging
tensors and commit (``worker.WorkerSync``). An engine's folder (``vllm/``: the ``"jreshard"``
weight-transfer backend of vLLM) adds only what the engine knows, through two seams:

- worker side: the worker's hello (``worker_hello`` with its place in the engine and its
  ``EngineParam`` list) and a commit function (``WorkerSync.receive(version, commit)``,
  returning a ``Commit``), called from the engine's own worker hooks (``WorkerSync.start``
  first, where the engine serves while the bytes arrive);
- trainer side: an ``EngineControl`` (connect, pause, begin_update, update, end_update) over
  the engine's control API, given to ``TrainerSync``.

Importing this package imports neither torch nor jax: the pure names below are imported
at once, the torch names (``WorkerSync``, ``Commit``, ``GroupInfo``, ``StagingReceiver``,
``Agreement``, ``agree``) and the jax ones (``TrainerSync``, ``EngineControl``,
``SyncReport``) on first use.
"""

from __future__ import annotations

from bridge.engines.fp8 import engine_fp8_format, fp8_from_hellos, fp8_hello
from bridge.engines.hello import (
    PROTOCOL,
    EngineParam,
    EngineShape,
    build_param_map,
    check_engine_params,
    engine_params_of,
    engine_shape,
    trainer_hello,
    worker_hello,
    worker_rank,
)
from jreshard.core.lazy import lazy_attributes

__all__ = ["Agreement", "Commit", "EngineControl", "EngineParam", "EngineShape", "GroupInfo", "PROTOCOL",
           "StagingReceiver", "SyncReport", "TrainerSync", "WorkerSync", "agree", "build_param_map",
           "check_engine_params", "engine_fp8_format", "engine_params_of", "engine_shape", "fp8_from_hellos",
           "fp8_hello", "trainer_hello", "worker_hello", "worker_rank"]

# torch names (never jax) and jax names (the trainer side), imported on first use.
_LAZY: dict[str, str] = {
    "Agreement": "bridge.engines.agree",
    "agree": "bridge.engines.agree",
    "Commit": "bridge.engines.worker",
    "GroupInfo": "bridge.engines.worker",
    "StagingReceiver": "bridge.engines.worker",
    "WorkerSync": "bridge.engines.worker",
    "EngineControl": "bridge.engines.trainer",
    "SyncReport": "bridge.engines.trainer",
    "TrainerSync": "bridge.engines.trainer",
}


__getattr__ = lazy_attributes('bridge.engines', _LAZY, globals=globals())
