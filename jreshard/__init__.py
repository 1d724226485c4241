"""jreshard: move sharded tensors between layouts by sending only what each device lacks.

The core (this package's planner) is pure Python and NumPy: it imports neither
jax nor torch. Executors are imported lazily when first used.
"""

from __future__ import annotations

from typing import Any

from jreshard.core import reference
from jreshard.core.layout import Box, Layout
from jreshard.core.mesh import Mesh
from jreshard.core.planner import (
    Move,
    Plan,
    PlanError,
    PlanStats,
    TensorPlan,
    check_tensor_plan,
    clear_cache,
    plan,
    plan_layouts,
)

__version__ = "0.1.0"

__all__ = [
    "Box",
    "Layout",
    "Mesh",
    "Move",
    "Plan",
    "PlanError",
    "PlanStats",
    "TensorPlan",
    "check_tensor_plan",
    "clear_cache",
    "plan",
    "plan_layouts",
    "reference",
    "release_transfer_buffers",
    "transfer",
]

# Names served by optional layers, imported on first use so that `import jreshard`
# works on machines without jax (a torch-only inference server plans with it too).
_LAZY: dict[str, str] = {
    "transfer": "jreshard.jax_executor.transfer",
    "release_transfer_buffers": "jreshard.jax_executor.transfer",
}
# Submodules reachable as attributes (`jreshard.cost.predict(...)`) without importing
# them up front: `viz` needs matplotlib, `nn` flax, the rest only the planner.
_SUBMODULES = {
    "catalog": "jreshard.fleet.catalog",
    "cost": "jreshard.fleet.cost",
    "presets": "jreshard.fleet.presets",
    "scenario": "jreshard.fleet.scenario",
    "nn": "jreshard.nn",
    "viz": "jreshard.viz",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jreshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
