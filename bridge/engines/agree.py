"""The plan every rank of a sync group agrees on from everyone's hello (torch only, no engine, no jax).

When the engine serves a block-FP8 model (its workers' hellos carry the format,
``bridge.engines.fp8.fp8_hello``), the recipe's param map becomes its FP8 sync
(``fp8_sync_map``: FP8 weights and ``weight_scale_inv`` scales where the engine holds
FP8) over the quantized source, and that is what is checked against the engine params and
planned; the trainer quantizes with the agreement's ``fp8``. Otherwise the plan is the
recipe's param map as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from bridge.engines.fp8 import fp8_from_hellos, fp8_sync_map
from bridge.engines.hello import (
    PROTOCOL,
    build_param_map,
    check_engine_params,
    engine_params_of,
    engine_shape,
    resolve_names,
    source_from_data,
)
from bridge.errors import PlanMismatchError
from bridge.plan.bridge_plan import BridgePlan
from bridge.plan.fp8 import Fp8ParamMap
from bridge.recipes.recipe import Recipe

__all__ = ["Agreement", "agree", "plan_from_hellos"]


@dataclasses.dataclass(frozen=True, slots=True)
class Agreement:
    """What every rank takes from the hellos.

    Attributes:
      plan: the sync plan (over the quantized source when the engine is FP8).
      fp8: the FP8 sync the trainer quantizes for (``bridge.trainer.fp8.quantize_params``);
        ``None`` when the engine is not FP8.
      tied: engine params each worker fills from another param's received tensor instead of
        receiving them (``{name: source name}``, ``Recipe.tied``).
    """

    plan: BridgePlan
    fp8: Fp8ParamMap | None = None
    tied: Mapping[str, str] = dataclasses.field(default_factory=dict)


def agree(hellos: list[dict[str, Any]]) -> Agreement:
    """The sync plan (and FP8 sync) every rank builds from the hellos; refuses a mismatch on every rank alike.

    Raises:
      PlanMismatchError: the hellos disagree (protocol, leaves, recipe or FP8 format against the engine params).
    """
    versions = {h.get("protocol") for h in hellos}
    if versions != {PROTOCOL}:
        raise PlanMismatchError(f"the ranks speak hello protocols {sorted(map(str, versions))}; "
                                "run one jreshard version everywhere.")
    lead = hellos[0]
    if lead.get("role") != "trainer" or "leaves" not in lead:
        raise PlanMismatchError("sync rank 0 must be trainer rank 0 with the leaves and the recipe.")
    workers = [h for h in hellos if h.get("role") == "worker"]
    source = source_from_data(lead["leaves"])
    recipe = Recipe.from_data(lead["recipe"])
    engine = engine_shape(workers)
    try:
        param_map = build_param_map(source, recipe, engine)
        fmt = fp8_from_hellos(workers)
    except ValueError as e:
        raise PlanMismatchError(f"the trainer's leaves and recipe do not fit the engine: {e}") from None
    engine_params = {h["rank"]: engine_params_of(h) for h in workers}
    param_map = resolve_names(param_map, engine_params)
    fp8 = None
    if fmt is not None:
        try:
            fp8 = fp8_sync_map(source, param_map, engine_params, fmt)
        except ValueError as e:
            raise PlanMismatchError(f"the trainer's leaves and recipe do not fit the FP8 engine ({fmt}): {e}") from None
        fp8 = dataclasses.replace(fp8, param_map=resolve_names(fp8.param_map, engine_params))  # scales nest as weights
        source, param_map = fp8.source, fp8.param_map
    problems = check_engine_params(param_map, engine_params, source, recipe.tied)
    if problems:
        raise PlanMismatchError("the trainer's leaves and recipe do not match the engine; nothing was sent: "
                                + "; ".join(problems[:6]) + (f" (and {len(problems) - 6} more)" if len(problems) > 6
                                                            else ""))
    return Agreement(BridgePlan(source, param_map, bucket_bytes=int(lead["bucket_bytes"])), fp8, recipe.tied)


def plan_from_hellos(hellos: list[dict[str, Any]]) -> BridgePlan:
    """The sync plan of ``agree(hellos)`` (what a worker needs)."""
    return agree(hellos).plan
