"""Hierarchical delivery in the cost model: NVLink domains as ``Domains``, and the two stages' time.

The two-stage plan itself is pure planning (``jreshard.core.hierarchical``):
stage 1 delivers each byte once per domain over the network, spread over the
domain's replicas, stage 2 completes every replica over NVLink. Here a
``Topology`` supplies the domains (``Topology.domains``: blocks of
``gpus_per_domain`` consecutive GPUs, or any ``Domains`` it was given) and
``predict_two_stage`` adds the stages' predicted times. ``decide`` is the choice
``compare`` and ``jreshard.transfer(hierarchical="auto")`` both make. See
``docs/cost_model.md``.

Example:
  >>> from jreshard import Layout, Mesh
  >>> from jreshard.fleet.hardware import Topology
  >>> from jreshard.fleet.hierarchical import hierarchical_plan
  >>> topo = Topology(gpus_per_domain=4, nvlink_GBps=100, network_GBps=10, latency_us=0)
  >>> src = {"w": Layout((8,), Mesh([0], "x"), (), "uint8")}
  >>> dst = {"w": Layout((8,), Mesh([4, 5, 6, 7], "dp"), (), "uint8")}  # 4 replicas in domain 1
  >>> tsp = hierarchical_plan(src, dst, topo)
  >>> tsp.stage1.stats().network_bytes, tsp.stage2.stats().network_bytes  # 8 bytes in, 3 x 8 fanned out
  (8, 24)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, cast

from jreshard.core import hierarchical as _core
from jreshard.core.domains import Domains
from jreshard.core.hierarchical import StagePart, TwoStagePlan
from jreshard.core.layout import Layout
from jreshard.core.planner import Plan, plan
from jreshard.fleet.hardware import Topology
from jreshard.fleet.traffic import Prediction, predict_plan

__all__ = ["TwoStagePlan", "StagePart", "hierarchical_plan", "predict_two_stage", "stage_parts",
           "has_domain_replicas", "decide", "Decision", "HIERARCHICAL"]

HIERARCHICAL = ("auto", "always", "never")


def _domains(where: Topology | Domains | int) -> Domains:
    """The domains of a Topology, a Domains, or an int (GPUs per domain, contiguous)."""
    if isinstance(where, Topology):
        return where.domains
    if isinstance(where, Domains):
        return where
    return Domains.contiguous(where)


def stage_parts(dst: Layout, domains: Topology | Domains | int) -> tuple[StagePart, ...]:
    """The parts of one destination layout (``jreshard.core.hierarchical.stage_parts``).

    ``domains`` may also be a ``Topology`` or a number of GPUs per domain.
    """
    return _core.stage_parts(dst, _domains(domains))


def has_domain_replicas(dst: Mapping[str, Layout], topo: Topology | Domains | int) -> bool:
    """Whether some domain holds two whole replicas of a tensor (hierarchical delivery applies)."""
    return _core.has_domain_replicas(dst, _domains(topo))


def hierarchical_plan(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology | Domains | int, *,
                      progress: Callable | None = None) -> TwoStagePlan:
    """Builds a two-stage plan over ``topo``'s domains (``jreshard.core.hierarchical.hierarchical_plan``)."""
    return _core.hierarchical_plan(src, dst, _domains(topo), progress=progress)


def predict_two_stage(tsp: TwoStagePlan, topo: Topology) -> Prediction:
    """Predicted time of a two-stage plan: stage 1, then stage 2."""
    first = predict_plan(tsp.stage1, topo)
    return first + predict_plan(tsp.stage2, topo) if tsp.stage2 is not None else first


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What ``decide`` chose: the delivery, both predictions, and the plans it made."""

    delivery: str  # 'direct' or 'hierarchical'
    direct: Prediction
    hierarchical: Prediction | None  # None: not predicted ('never', or no domain holds two replicas)
    direct_plan: Plan = dataclasses.field(repr=False)
    two_stage: TwoStagePlan | None = dataclasses.field(repr=False)


def check_hierarchical(hierarchical: Any) -> str:
    """``hierarchical`` checked: one of ``HIERARCHICAL``."""
    if not isinstance(hierarchical, str) or hierarchical not in HIERARCHICAL:
        raise ValueError(f"hierarchical must be 'auto', 'always' or 'never', got {hierarchical!r}.")
    return hierarchical


def decide(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, hierarchical: str = "auto", *,
           direct_plan: Plan | None = None, progress: Callable | None = None,
           first: Prediction | None = None) -> Decision:
    """Direct or hierarchical delivery, as the executors and ``compare`` choose it.

    ``'never'``: direct. Otherwise, when some domain of ``topo`` holds two replicas of a
    tensor, the two-stage plan is made and predicted; ``'always'`` takes it, ``'auto'``
    takes it when it is predicted faster than direct delivery. ``first``: a stage both
    deliveries run first (FP8's amax exchange), added to both predictions.

    Example:
      >>> from jreshard import Layout, Mesh
      >>> from jreshard.fleet.hardware import Topology
      >>> from jreshard.fleet.hierarchical import decide
      >>> src = {"w": Layout((1 << 20,), Mesh([0], "x"), (), "uint8")}
      >>> dst = {"w": Layout((1 << 20,), Mesh([4, 5, 6, 7], "dp"), (), "uint8")}
      >>> topo = Topology(gpus_per_domain=4, nvlink_GBps=100, network_GBps=10, latency_us=5)
      >>> decide(src, dst, topo).delivery, decide(src, dst, topo, "never").delivery
      ('hierarchical', 'direct')
    """
    check_hierarchical(hierarchical)
    _core.check_pair(src, dst)
    p = direct_plan if direct_plan is not None else cast(Plan, plan(dict(src), dict(dst)))

    def after_first(x: Prediction) -> Prediction:
        return x if first is None else first + x

    direct = after_first(predict_plan(p, topo))
    tsp, hier = None, None
    if hierarchical != "never" and has_domain_replicas(dst, topo):
        tsp = hierarchical_plan(src, dst, topo, progress=progress)
        hier = after_first(predict_two_stage(tsp, topo))
    take = hier is not None and (hierarchical == "always" or hier.seconds < direct.seconds)
    return Decision("hierarchical" if take else "direct", direct, hier, p, tsp)
