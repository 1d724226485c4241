"""bridge: sync JAX-sharded weights into PyTorch ranks over torch.distributed.

Importing this package imports neither jax nor torch: the mapping and planning
layer is pure, so inference processes (torch only) and trainer processes (JAX)
compute the same plan. ``Receiver`` and ``init_group`` import torch on first use;
``bridge.sender.Sender`` (trainer processes only) imports jax.
"""

from __future__ import annotations

from typing import Any

from bridge._mapping import (
    Mapping,
    Region,
    Rule,
    Target,
    dtensor_targets,
    llama_mapping,
    llama_rules,
    tp_mapping,
)
from bridge._plan import BridgePlan, Message, Transfer
from bridge._source import SOURCE_BASE, Source, source_id, split_source_id, trainer_mesh

__all__ = [
    "BridgePlan",
    "Mapping",
    "Message",
    "PlanMismatchError",
    "Receiver",
    "Region",
    "Rule",
    "SOURCE_BASE",
    "Source",
    "SyncError",
    "Target",
    "Transfer",
    "dtensor_mapping",
    "dtensor_targets",
    "init_group",
    "llama_mapping",
    "llama_rules",
    "reject_sync",
    "source_id",
    "split_source_id",
    "tp_mapping",
    "trainer_mesh",
]

# torch-side names, imported on first use (they import torch, never jax).
_LAZY: dict[str, str] = {
    "Receiver": "bridge.receiver",
    "SyncError": "bridge._wire",
    "PlanMismatchError": "bridge._wire",
    "init_group": "bridge._wire",
    "reject_sync": "bridge._wire",
    "dtensor_mapping": "bridge.receiver",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bridge' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
