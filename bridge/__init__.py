"""bridge: sync JAX-sharded weights into PyTorch ranks over torch.distributed.

Importing this package imports neither jax nor torch: params, rules and plans
are pure, so inference processes (torch only) and trainer processes (JAX)
compute the same plan. ``Receiver`` and ``init_group`` import torch on first use;
``bridge.sender.Sender`` (trainer processes only) imports jax. The words
(param, region, rule, param map, piece, message, bucket, rank) are those of
``docs/glossary.md``.

Modules: ``_source`` (the trainer side over source ids), ``_param_map`` (params
and regions), ``_dims`` (named dims of a rule), ``_rules`` (rules and the TP/EP
param map), ``_dtensor`` (DTensor params), ``_reduce`` and
``_plan`` (the plan), ``_plan_key`` (what a fingerprint covers), ``_args`` (argument
checks), ``_wire`` (the torch.distributed protocol), ``_vote`` (per-bucket votes: sizes,
checksums, failures), ``receiver``, ``sender``; model recipes live in
``bridge.recipes``.
"""

from __future__ import annotations

from typing import Any

from bridge._dtensor import dtensor_params
from bridge._fp8 import Fp8ParamMap, fp8_param_map
from bridge._param_map import Param, ParamMap, Region
from bridge._plan import BridgePlan, Message, ParamMove, Piece, Segment
from bridge._rules import Rule, tp_param_map
from bridge._source import SOURCE_BASE, Source, source_id, split_source_id, trainer_mesh
from bridge.recipes.llama import llama_param_map, llama_rules
from bridge.recipes.qwen3_moe import qwen3_moe_param_map, qwen3_moe_rules

__all__ = [
    "BridgePlan",
    "Fp8ParamMap",
    "Message",
    "Param",
    "ParamMap",
    "ParamMove",
    "Piece",
    "PlanMismatchError",
    "Receiver",
    "Region",
    "Rule",
    "SOURCE_BASE",
    "Segment",
    "Source",
    "SyncError",
    "dtensor_param_map",
    "dtensor_params",
    "fp8_param_map",
    "init_group",
    "llama_param_map",
    "llama_rules",
    "qwen3_moe_param_map",
    "qwen3_moe_rules",
    "rebuild_group",
    "reject_sync",
    "source_id",
    "split_source_id",
    "tp_param_map",
    "trainer_mesh",
]

# Old names, kept so that existing code keeps working (not in __all__: ``Mapping`` would
# shadow collections.abc.Mapping under a star import).
Target = Param
Mapping = ParamMap
Transfer = ParamMove
tp_mapping = tp_param_map
llama_mapping = llama_param_map
dtensor_targets = dtensor_params

# torch-side names, imported on first use (they import torch, never jax).
_LAZY: dict[str, str] = {
    "Receiver": "bridge.receiver",
    "SyncError": "bridge._wire",
    "PlanMismatchError": "bridge._wire",
    "init_group": "bridge._wire",
    "reject_sync": "bridge._wire",
    "rebuild_group": "bridge._wire",
    "dtensor_param_map": "bridge.receiver",
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
