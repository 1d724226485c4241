"""Cost model: predict how long a weight sync takes on a cluster, for jreshard and baselines.

The model (see ``docs/cost_model.md``):

- Topology (``jreshard.fleet.hardware``): devices ``d`` sit in NVLink domains
  ``d // gpus_per_domain`` (or any ``Domains`` the topology is given); each GPU
  has one network NIC (``network_GBps`` per direction) and NVLink (``nvlink_GBps`` per direction). A move between two
  devices of one domain uses NVLink, any other move the network. A move from a
  device to itself loads no link.
- Local copies, when the topology gives ``copy_GBps`` (the hardware files do): one
  per byte a device sends (packing), one per byte it receives (unpacking), one per
  byte it moves to itself, charged after its link time. Gather-then-broadcast is
  charged none (its collectives write into the tensors).
- Alpha-beta per device (``jreshard.fleet.traffic``): every device has four
  independent links (network out/in, NVLink out/in); its time is the busiest
  link's bytes over its bandwidth plus ``latency * messages`` (the larger of
  messages sent and received). The sync takes as long as the slowest device. No
  switch congestion (full-bisection fabric).
- Messages: jreshard and flat direct sends coalesce all bytes between a sender and
  a receiver into messages of at most ``bucket_bytes``; the pipelined tree pays
  one message per tensor per hop (one collective per tensor); gather-then-broadcast
  runs its collectives one after another through one rank (``baselines``).
- Stages (gather then broadcast; hierarchical injection then fan-out) run one
  after the other: their times add; except hierarchical delivery by an executor that
  carries both stages in the same buckets (``overlap=``, the bridge): the longer
  stage plus the pipeline's drain (``predict_two_stage``).

Deliveries and baselines: *direct* delivery is the core plan (``jreshard.plan``);
*hierarchical* delivery (``jreshard.fleet.hierarchical``) crosses the network once
per NVLink domain and fans out over NVLink; the baselines
(``jreshard.fleet.baselines``) are gather-then-broadcast as RL stacks run it, flat
direct sends, and an idealised pipelined tree.
``compare`` predicts them all and keeps the faster of jreshard's two deliveries
(``decide``, the same choice ``jreshard.transfer(hierarchical="auto")`` makes).
Every name of those modules is reachable from this one.

Example:
  >>> import jreshard
  >>> from jreshard import Layout, Mesh
  >>> from jreshard.fleet import cost
  >>> topo = cost.Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=0)
  >>> src = Layout((1000,), Mesh([0], "x"), (), dtype="uint8")
  >>> dst = Layout((1000,), Mesh([2, 3], "tp"), ("tp",), dtype="uint8")
  >>> p = cost.predict_plan(jreshard.plan(src, dst), topo)
  >>> round(p.seconds * 1e9)  # device 0 sends 1000 bytes over a 10 GB/s NIC
  100
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from jreshard.core.layout import Layout
from jreshard.core.planner import Plan
from jreshard.fleet.baselines import flat_direct, gather_broadcast, pipelined_tree
from jreshard.fleet.classes import classes
from jreshard.fleet.fp8 import Fp8Costs
from jreshard.fleet.hardware import Hardware, Topology, hardware_names, load_hardware
from jreshard.fleet.hierarchical import (
    Decision,
    StagePart,
    TwoStagePlan,
    decide,
    has_domain_replicas,
    hierarchical_plan,
    predict_two_stage,
)
from jreshard.fleet.traffic import (
    Prediction,
    Traffic,
    check_pair,
    plan_traffic,
    predict,
    predict_plan,
    sender_load_bound,
)

__all__ = ["Hardware", "Topology", "Traffic", "Prediction", "TwoStagePlan", "Comparison", "load_hardware",
           "hardware_names", "predict", "sender_load_bound", "predict_plan", "predict_two_stage", "plan_traffic",
           "hierarchical_plan", "gather_broadcast", "pipelined_tree", "flat_direct", "compare", "StagePart",
           "has_domain_replicas", "decide", "Decision"]


@dataclasses.dataclass(frozen=True, slots=True)
class Comparison:
    """Predictions for one sync: jreshard (the faster delivery) and the baselines.

    ``delivery`` names the delivery ``jreshard`` uses (``'direct'`` or
    ``'hierarchical'``); ``hierarchical`` is ``None`` when it was not predicted
    (``hierarchical='never'``, or no NVLink domain holds two replicas of a tensor).
    Each ``Prediction`` splits its bytes into ``network_bytes`` and ``nvlink_bytes``.
    """

    jreshard: Prediction
    delivery: str
    direct: Prediction
    hierarchical: Prediction | None
    gather_broadcast: Prediction
    flat_direct: Prediction
    pipelined_tree: Prediction

    def seconds(self) -> dict[str, float]:
        """Predicted seconds of jreshard (its chosen delivery) and of each baseline."""
        return {"jreshard": self.jreshard.seconds, "gather_broadcast": self.gather_broadcast.seconds,
                "flat_direct": self.flat_direct.seconds, "pipelined_tree": self.pipelined_tree.seconds}


def compare(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, *, hierarchical: str = "auto",
            jreshard_plan: Plan | None = None, progress: Callable | None = None,
            fp8: Fp8Costs | None = None, overlap: int = 0) -> Comparison:
    """Predicts jreshard (direct and, where it applies, hierarchical) and both baselines.

    Args:
      src, dst: flat dicts {name: Layout} with the same keys.
      topo: the cluster.
      hierarchical: ``'auto'`` (predict both, keep the faster), ``'always'`` or ``'never'``.
      jreshard_plan: the direct plan if already computed.
      progress: optional callable wrapping an iterable (a progress bar) for the hierarchical plan.
      fp8: what FP8 delivery adds (``jreshard.fleet.fp8.fp8_costs``): the partial-amax exchange,
        a first stage of the deliveries that quantize at sharded senders (jreshard's and flat
        direct sends), and the scales, which gather-then-broadcast sends in their weights'
        collectives (it quantizes whole tensors at the root and needs no exchange).
      overlap: how the executor runs hierarchical delivery's stages (``predict_two_stage``):
        ``0`` one after the other (``jreshard.transfer``), ``2`` the bridge's pipeline.

    Example:
      >>> import numpy as np
      >>> from jreshard import Layout, Mesh
      >>> from jreshard.fleet.cost import Topology, compare
      >>> src = {"w": Layout((4096, 64), Mesh([0, 1], "fsdp"), ("fsdp",), "float32")}
      >>> dst = {"w": Layout((4096, 64), Mesh(np.arange(8, 16).reshape(4, 2), ("dp", "tp")), ("tp",), "float32")}
      >>> c = compare(src, dst, Topology(gpus_per_domain=4, nvlink_GBps=900, network_GBps=10, latency_us=10))
      >>> c.delivery, c.hierarchical.network_bytes, c.direct.network_bytes  # once per domain, not per replica
      ('hierarchical', 2097152, 4194304)
    """
    check_pair(src, dst)
    first = predict(fp8.exchange, topo) if fp8 is not None and len(fp8.exchange.msg_out) else None
    k = classes(src, dst)  # the tensors by class of shared layouts, made once for every prediction
    d = decide(src, dst, topo, hierarchical, direct_plan=jreshard_plan, progress=progress, first=first,
               overlap=overlap, plans=False, by_class=k)
    chosen = d.hierarchical if d.delivery == "hierarchical" and d.hierarchical is not None else d.direct
    riders = fp8.scales if fp8 else None
    baseline = gather_broadcast(src, dst, topo, riders=riders, by_class=k)
    flat = flat_direct(src, dst, topo, by_class=k)
    return Comparison(chosen, d.delivery, d.direct, d.hierarchical, baseline, flat if first is None else first + flat,
                      pipelined_tree(src, dst, topo, riders=riders, by_class=k))
