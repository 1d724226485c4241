"""bridge: sync JAX-sharded weights into PyTorch ranks (and inference engines) over torch.distributed.

Importing this package imports neither jax nor torch: params, rules and plans are pure,
so inference processes (torch only) and trainer processes (JAX) compute the same plan.
The torch names below are imported on first use and never import jax; the trainer's
``bridge.trainer.Sender`` imports jax. The words (param, region, rule, param map, piece,
message, bucket, rank, transport) are those of ``docs/glossary.md``.

Layers, each folder importing only the ones below it (enforced by import-linter):

=================  ==========================================================  ==================
folder             what lives there                                            imports
=================  ==========================================================  ==================
``engines/``       engine-generic hello, plan agreement, sync group; one       all below; vLLM
                   folder per engine (``engines/vllm``)
``trainer/``       the JAX side: ``Sender``, FP8 quantizing sender             wire, plan, jax
``wire/``          the sync session, transports, votes, digests, alarm,        plan, torch
                   ``Receiver`` and its commit strategies
``recipes/``       model rules (Llama/Qwen3, Qwen3-MoE, MaxText trees)         plan
``plan/``          sources, params, rules, ``BridgePlan``, fingerprints        jreshard.core
``errors``         ``SyncError``, ``PlanMismatchError``                        nothing
=================  ==========================================================  ==================
"""

from __future__ import annotations

from bridge.errors import PlanMismatchError, SyncError
from bridge.plan.bridge_plan import BridgePlan, Message, ParamMove, Piece, Segment
from bridge.plan.dtensor import dtensor_params
from bridge.plan.fp8 import Fp8ParamMap, fp8_param_map
from bridge.plan.param_map import Param, ParamMap, Region
from bridge.plan.rules import Rule, tp_param_map
from bridge.plan.source import SOURCE_BASE, Source, source_id, split_source_id, trainer_mesh
from bridge.recipes.llama import llama_param_map, llama_rules
from bridge.recipes.qwen3_moe import qwen3_moe_param_map, qwen3_moe_rules
from jreshard.core.lazy import lazy_attributes

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

# torch-side names, imported on first use (they import torch, never jax).
_LAZY: dict[str, str] = {
    "Receiver": "bridge.wire.receiver",
    "init_group": "bridge.wire.group",
    "reject_sync": "bridge.wire.session",
    "rebuild_group": "bridge.wire.group",
    "dtensor_param_map": "bridge.wire.receiver",
}


__getattr__ = lazy_attributes('bridge', _LAZY, globals=globals())
