"""Hierarchical delivery in the cost model: NVLink domains as ``Domains``, and the two stages' time.

The two-stage plan itself is pure planning (``jreshard.core.hierarchical``):
stage 1 delivers each byte once per domain over the network, spread over the
domain's replicas, stage 2 completes every replica over NVLink. Here a
``Topology`` supplies the domains (``Topology.domains``: blocks of
``gpus_per_domain`` consecutive GPUs, or any ``Domains`` it was given) and
``predict_two_stage`` adds the stages' predicted times, or, for an executor that
runs stage 2 in the buckets of stage 1 (``overlap=``, the bridge), takes the
longer stage plus the pipeline's drain. ``decide`` is the choice
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
from typing import cast

import numpy as np

from jreshard.core import hierarchical as _core
from jreshard.core.args import check_int
from jreshard.core.domains import Domains
from jreshard.core.hierarchical import StagePart, TwoStagePlan, check_hierarchical
from jreshard.core.layout import Layout
from jreshard.core.planner import Plan, plan, plan_classes
from jreshard.fleet.classes import Classes, classes
from jreshard.fleet.hardware import Topology
from jreshard.fleet.traffic import Prediction, Traffic, plan_traffic, predict, predict_plan, rows_traffic

__all__ = ["TwoStagePlan", "StagePart", "hierarchical_plan", "predict_two_stage", "stage_parts",
           "has_domain_replicas", "decide", "Decision"]


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


def predict_two_stage(tsp: TwoStagePlan, topo: Topology, *, overlap: int = 0) -> Prediction:
    """Predicted time of a two-stage plan.

    Args:
      tsp: the plan (``hierarchical_plan``).
      topo: the cluster; its ``bucket_bytes`` is the executor's bucket with ``overlap``.
      overlap: ``0`` (``jreshard.transfer``): stage 2 starts when stage 1 is done, and their
        times add. ``n >= 1``: the executor carries both stages in the same buckets, each
        stage-2 send at least ``n`` buckets after the stage-1 sends that deliver what it
        forwards (the bridge: ``n = 2``, ``bridge.plan.bridge_plan.STAGE2_LAG``). The sync then takes
        the longer stage plus the pipeline's drain: the part of stage 2 that forwards what
        the last ``n`` buckets delivered, taken as ``n`` buckets' share of stage 2's time
        (``n * bucket_bytes`` over the most bytes a device receives in both stages, at most
        all of it), never more than the stages in a row. Not a fitted factor: the bucket
        arithmetic of such an executor.

    Example:
      >>> from jreshard import Layout, Mesh
      >>> from jreshard.fleet.hardware import Topology
      >>> from jreshard.fleet.hierarchical import hierarchical_plan, predict_two_stage
      >>> topo = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=0,
      ...                 bucket_bytes=1 << 20)
      >>> src = {"w": Layout((16 << 20,), Mesh([0], "x"), (), "uint8")}
      >>> dst = {"w": Layout((16 << 20,), Mesh([2, 3], "dp"), (), "uint8")}  # 2 replicas in domain 1
      >>> tsp = hierarchical_plan(src, dst, topo)
      >>> serial, piped = predict_two_stage(tsp, topo), predict_two_stage(tsp, topo, overlap=2)
      >>> [round(x * 1e3, 3) for x in serial.stages], round(serial.seconds * 1e3, 3)  # ms: they add
      ([1.678, 0.084], 1.762)
      >>> round(piped.seconds * 1e3, 3)  # stage 1, then the 2 of 16 buckets' share of stage 2
      1.688
    """
    # overlap: buckets between a stage-1 send and the stage-2 sends that forward it (0: one after the other)
    overlap = check_int("overlap", overlap)
    return _predict_stages(plan_traffic(tsp.stage1, topo),
                           None if tsp.stage2 is None else plan_traffic(tsp.stage2, topo), topo, overlap)


def _predict_stages(one: Traffic, two: Traffic | None, topo: Topology, overlap: int) -> Prediction:
    """``predict_two_stage`` of the two stages' loads."""
    first = predict(one, topo)
    if two is None:
        return first
    second = predict(two, topo)
    serial = first + second
    if not overlap:
        return serial
    n = max(len(one.net_in), len(two.net_in))
    one.grow(n)
    two.grow(n)
    most = float(max((one.net_in + one.nvl_in + two.net_in + two.nvl_in).max(), 1.0))  # bytes a device receives
    drain = min(1.0, overlap * topo.bucket_bytes / most) * second.seconds
    # At most the serial time: with a single bucket the pipeline is the two stages in a row.
    return dataclasses.replace(serial, seconds=min(serial.seconds, max(first.seconds, second.seconds) + drain))


def _by_tensor(ids: list[list[int]], of: np.ndarray) -> np.ndarray:
    """``ids[c]`` (the parts of class ``c``) for each tensor in turn, tensor ``t`` being of class ``of[t]``."""
    n = np.array([len(x) for x in ids], np.int64)
    flat = np.array([i for x in ids for i in x], np.int64)
    per = n[of]  # parts of each tensor
    ends = np.cumsum(per)
    within = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - per, per)
    return flat[np.repeat((np.cumsum(n) - n)[of], per) + within]


def _class_stages(k: Classes, topo: Topology) -> tuple[Traffic, Traffic | None]:
    """Both stages' loads, planned by class of shared layouts (``jreshard.core.planner.plan_classes``).

    The stages are the plans ``hierarchical_plan`` makes, balanced alike, tensor after tensor
    and part after part, without a name or a Layout pair per part.
    """
    pairs: tuple[list[tuple[Layout, Layout]], list[tuple[Layout, Layout]]] = ([], [])
    ids: tuple[list[list[int]], list[list[int]]] = ([], [])
    for s, d in k.pairs:
        mine: tuple[list[int], list[int]] = ([], [])
        for _, l1, final in _core.stage_parts(d, topo.domains):
            for stage, pair in ((0, (s, l1)), (1, (l1, final))):
                if pair[1] is not None:
                    mine[stage].append(len(pairs[stage]))
                    pairs[stage].append(cast(tuple[Layout, Layout], pair))
        ids[0].append(mine[0])
        ids[1].append(mine[1])
    one = rows_traffic(*plan_classes(pairs[0], _by_tensor(ids[0], k.of))[:3], topo)
    return one, rows_traffic(*plan_classes(pairs[1], _by_tensor(ids[1], k.of))[:3], topo) if pairs[1] else None


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What ``decide`` chose: the delivery, both predictions, and the plans it made."""

    delivery: str  # 'direct' or 'hierarchical'
    direct: Prediction
    hierarchical: Prediction | None  # None: not predicted ('never', or no domain holds two replicas)
    direct_plan: Plan = dataclasses.field(repr=False)
    two_stage: TwoStagePlan | None = dataclasses.field(repr=False)  # None also when not asked for (plans=False)


def decide(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, hierarchical: str = "auto", *,
           direct_plan: Plan | None = None, progress: Callable | None = None,
           first: Prediction | None = None, overlap: int = 0, plans: bool = True,
           by_class: Classes | None = None) -> Decision:
    """Direct or hierarchical delivery, as the executors and ``compare`` choose it.

    ``'never'``: direct. Otherwise, when some domain of ``topo`` holds two replicas of a
    tensor, the two-stage plan is made and predicted; ``'always'`` takes it, ``'auto'``
    takes it when it is predicted faster than direct delivery. ``first``: a stage both
    deliveries run first (FP8's amax exchange), added to both predictions. ``overlap``: how the
    executor runs the two stages (``predict_two_stage``; ``0``, ``jreshard.transfer``: one after
    the other). ``plans=False``: only the predictions are read (``compare``); the stages are
    planned by class of shared layouts, with the same moves, and ``two_stage`` is ``None``;
    ``by_class``: ``jreshard.fleet.classes.classes(src, dst)`` if already made.

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
        if plans:
            tsp = hierarchical_plan(src, dst, topo, progress=progress)
            hier = after_first(predict_two_stage(tsp, topo, overlap=overlap))
        else:
            k = by_class if by_class is not None else classes(src, dst)
            hier = after_first(_predict_stages(*_class_stages(k, topo), topo, check_int("overlap", overlap)))
    take = hier is not None and (hierarchical == "always" or hier.seconds < direct.seconds)
    return Decision("hierarchical" if take else "direct", direct, hier, p, tsp)
