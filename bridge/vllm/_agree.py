"""The plan every rank of a sync group agrees on from the handshake's descriptions (torch only, no vLLM, no jax)."""

from __future__ import annotations

from typing import Any

from bridge._plan import BridgePlan
from bridge._wire import PlanMismatchError
from bridge.vllm._handshake import (
    PROTOCOL,
    Recipe,
    Target,
    build_param_map,
    check_targets,
    engine_shape,
    resolve_names,
    source_from_data,
)

__all__ = ["plan_from_hellos"]


def plan_from_hellos(hellos: list[dict[str, Any]]) -> BridgePlan:
    """The sync plan every rank builds from the handshake; refuses a mismatch on every rank alike.

    Raises:
      PlanMismatchError: the descriptions disagree (protocol, leaves, recipe against the targets).
    """
    versions = {h.get("protocol") for h in hellos}
    if versions != {PROTOCOL}:
        raise PlanMismatchError(f"the ranks speak handshake protocols {sorted(map(str, versions))}; "
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
    except ValueError as e:
        raise PlanMismatchError(f"the trainer's leaves and recipe do not fit the engine: {e}") from None
    targets = {h["rank"]: [Target(n, tuple(s), d) for n, s, d in h["targets"]] for h in workers}
    param_map = resolve_names(param_map, targets)
    problems = check_targets(param_map, targets)
    if problems:
        raise PlanMismatchError("the trainer's leaves and recipe do not match the vLLM engine; nothing was sent: "
                                + "; ".join(problems[:6]) + (f" (and {len(problems) - 6} more)" if len(problems) > 6
                                                            else ""))
    return BridgePlan(source, param_map, bucket_bytes=int(lead["bucket_bytes"]))
