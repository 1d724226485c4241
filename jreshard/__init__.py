"""jreshard: move sharded tensors between layouts by sending only what each device lacks.

The core (this package's planner) is pure Python and NumPy: it imports neither
jax nor torch. Executors are imported lazily when first used.
"""

from __future__ import annotations

from typing import Any

from jreshard.core import planner as _planner
from jreshard.core.domains import Domains
from jreshard.core.layout import Box, Layout
from jreshard.core.lazy import lazy_attributes
from jreshard.core.mesh import Mesh
from jreshard.core.planner import (
    Move,
    MoveArrays,
    Plan,
    PlanError,
    PlanStats,
    TensorPlan,
    check_tensor_plan,
    clear_cache,
    plan_layouts,
)
from jreshard.core.tree import first_leaf as _first_leaf

__version__ = "0.1.0"

__all__ = [
    "Box",
    "Domains",
    "Layout",
    "Mesh",
    "Move",
    "MoveArrays",
    "Plan",
    "PlanError",
    "PlanStats",
    "TensorPlan",
    "check_tensor_plan",
    "clear_cache",
    "last_transfer_stats",
    "plan",
    "plan_layouts",
    "release_transfer_buffers",
    "transfer",
]

# Names served by optional layers, imported on first use so that `import jreshard`
# works on machines without jax (a torch-only inference server plans with it too).
_LAZY: dict[str, str] = {
    "transfer": "jreshard.jax_executor.transfer",
    "release_transfer_buffers": "jreshard.jax_executor.transfer",
    "last_transfer_stats": "jreshard.jax_executor.transfer",
}
# Subpackages reachable as attributes (`jreshard.viz.draw_plan(...)`) without importing
# them up front: `viz` needs matplotlib, `nn` flax.
_SUBPACKAGES = {"nn": "jreshard.nn", "viz": "jreshard.viz"}


def plan(src: Any, dst: Any, *, balance: bool = True, **kwargs: Any) -> TensorPlan | Plan:
    """Plans a reshard from ``src`` to ``dst``: Layouts, or jax arrays and shardings.

    Layouts and pytrees of them are planned by the pure core
    (``jreshard.core.planner.plan``, whose docstring has the details). A pytree of
    ``jax.Array``s or ``jax.ShapeDtypeStruct``s with shardings goes to the JAX
    executor's adapter with the arguments ``jreshard.transfer`` takes (``mesh=``,
    ``dtype=``); this needs jax.

    Example:
      >>> from jreshard import Layout, Mesh, plan
      >>> src = Layout((8, 4), Mesh([0, 1, 2, 3], "fsdp"), ("fsdp",), dtype="float32")
      >>> dst = Layout((8, 4), Mesh([[4, 5], [6, 7]], ("dp", "tp")), (None, "tp"), dtype="float32")
      >>> plan(src, dst).moves[0]
      Move(0 -> 4, [0:2, 0:2])
    """
    if not isinstance(src, Layout) and _is_jax_like(_first_leaf(src)):
        from jreshard.jax_executor.adapter import plan_from_jax  # imports jax

        return plan_from_jax(src, dst, balance=balance, **kwargs)
    if kwargs:
        raise TypeError(f"unexpected arguments {sorted(kwargs)!r}; they apply to jax arrays only")
    return _planner.plan(src, dst, balance=balance)


def _is_jax_like(x: Any) -> bool:
    # A tracer (a call inside jax.jit) goes to the adapter too, which says to call outside jit.
    tracer = any(c.__name__ == "Tracer" and c.__module__.startswith("jax") for c in type(x).__mro__)
    return tracer or (hasattr(x, "sharding") and hasattr(x, "shape") and not isinstance(x, Layout))


__getattr__ = lazy_attributes('jreshard', _LAZY, globals=globals(), modules=_SUBPACKAGES)
