"""Inference engines: the engine-generic part of a sync with a live engine, and one folder per engine.

``hello`` (pure: what trainers and workers tell each other, the recipe, the param map they build
from it, target checks), ``fp8`` (pure: an FP8 engine's hello and sync map), ``agree`` (the plan
every rank agrees on), ``group`` (the sync's own process group and small JSON exchanges);
``vllm/`` (the ``"jreshard"`` weight-transfer backend of vLLM).
"""
