"""The baselines the cost model predicts next to jreshard: gather-then-broadcast and flat direct sends.

- ``gather_broadcast``: each tensor is gathered whole onto the first device of its
  training mesh (its shards sent by their first holders), then broadcast along a
  pipelined chain through every inference device that holds part of it; the chain
  enters each NVLink domain once over the network and continues over NVLink, its
  entry device rotating per tensor (as NCCL rotates rings over NICs). One message
  per tensor per hop (one collective per tensor). A *rider* (an FP8 weight's scale)
  travels in its weight's collective: its bytes join the weight's broadcast and it
  adds no message (its gather, 1/4096 of the weight's bytes at 128x128 blocks, is left out).
- ``flat_direct``: point-to-point sends of exactly the missing pieces, each from
  the first replica (no replica balancing, no hierarchy).

Example:
  >>> from jreshard import Layout, Mesh
  >>> from jreshard.fleet.baselines import flat_direct
  >>> from jreshard.fleet.hardware import Topology
  >>> topo = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=0)
  >>> src = {"w": Layout((1000,), Mesh([0, 1], "dp"), (), dtype="uint8")}
  >>> dst = {"w": Layout((1000,), Mesh([2, 3], "tp"), ("tp",), dtype="uint8")}
  >>> round(flat_direct(src, dst, topo).seconds * 1e9)  # device 0 sends both halves
  100
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh
from jreshard.core.planner import plan
from jreshard.fleet.hardware import Topology
from jreshard.fleet.traffic import Prediction, Traffic, check_pair, predict, predict_plan

__all__ = ["gather_broadcast", "flat_direct"]


def _roots(src: Mapping[str, Layout], names: list[str]) -> dict[str, Layout]:
    meshes: dict[int, Mesh] = {}
    out = {}
    for n in names:
        s = src[n]
        root = s.mesh.device_ids[0]
        mesh = meshes.get(root)
        if mesh is None:
            mesh = meshes[root] = Mesh([root], ("root",))
        out[n] = Layout(s.shape, mesh, (), s.dtype)
    return out


def gather_broadcast(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, *,
                     riders: Mapping[str, str] | None = None) -> Prediction:
    """Predicted time of gathering each tensor whole, then broadcasting it along a chain.

    ``riders`` maps a leaf to the leaf whose collective carries it (a scale to its weight).
    """
    check_pair(src, dst)
    riders = riders or {}
    names = sorted(n for n in src if n not in riders)
    roots = _roots(src, names)
    gather = plan({n: src[n] for n in names}, roots, balance=False)
    traffic = Traffic.zeros(0)
    s, d, nb, moves = gather.move_arrays()
    traffic.add_edges(s, d, nb, moves, topo)  # one message per piece per tensor
    first = predict(traffic, topo)

    # Broadcast: group tensors by destination mesh and spec, build each group's chain.
    bcast = Traffic.zeros(0)
    groups: dict[tuple, list[int]] = {}
    for t, n in enumerate(names):
        lay = dst[n]
        groups.setdefault((lay.mesh, lay.dim_axes, lay.shape), []).append(t)
    sizes = np.array([src[n].size * dst[n].itemsize for n in names], dtype=float)
    extra: dict[str, int] = {}
    for rider, host in riders.items():
        extra[host] = extra.get(host, 0) + dst[rider].nbytes
    sizes += np.array([extra.get(n, 0) for n in names], dtype=float)
    root_ids = np.array([roots[n].mesh.device_ids[0] for n in names], dtype=np.int64)
    for ts in groups.values():
        lay = dst[names[ts[0]]]
        holders = np.array([d for d in lay.mesh.device_ids if math.prod(lay.shard_shape(d)) > 0], np.int64)
        ts_a = np.array(ts, np.int64)
        dom = topo.domain(holders)
        order = np.lexsort((holders, dom))
        holders, dom = holders[order], dom[order]
        prev = root_ids[ts_a]
        b = sizes[ts_a]
        for dm in np.unique(dom):
            members = holders[dom == dm]
            n_m = len(members)
            entry_i = ts_a % n_m
            chain = members[(entry_i[:, None] + np.arange(n_m)) % n_m]  # [T, n_m]
            bcast.add_edges(prev, chain[:, 0], b, np.ones(len(ts_a)), topo)
            if n_m > 1:
                bcast.add_edges(chain[:, :-1].ravel(), chain[:, 1:].ravel(), np.repeat(b, n_m - 1),
                                np.ones(len(ts_a) * (n_m - 1)), topo)
            prev = chain[:, -1]
    return first + predict(bcast, topo)


def flat_direct(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology) -> Prediction:
    """Predicted time of sending each missing piece from its first replica (no balancing)."""
    check_pair(src, dst)
    return predict_plan(plan(dict(src), dict(dst), balance=False), topo)
