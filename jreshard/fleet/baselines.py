"""The baselines the cost model predicts next to jreshard: gather-then-broadcast, flat direct sends, a pipelined tree.

- ``gather_broadcast``: gather-then-broadcast as the RL stacks that publish it run it
  (NeMo-RL's default non-colocated "collective" refit, as verl and OpenRLHF do it):
  every tensor is gathered whole onto one training rank (trainer rank 0: Megatron-Bridge
  restores full Hugging Face tensors there, NVIDIA-NeMo/RL issue #3745), collective after
  collective, then broadcast from that rank to every inference rank in packed buckets of
  ``bucket_bytes``, bucket after bucket. One broadcast runs along a pipelined chain, so it
  goes no faster than its slowest hop: a NIC (``network_GBps``) when the chain leaves the
  root's NVLink domain. The gathers run one after another into the root, so their times
  add. NeMo-RL overlaps the gather of one bucket with the broadcast of the previous one
  with two buffers (NVIDIA-NeMo/RL pull request #1379: DeepSeek-V3 34 s -> 14 s), so by
  default the sync takes the longer of the two plus one bucket's fill (``overlap=False``:
  their sum, as verl and OpenRLHF run them). The root's packing and the receivers' copies
  are not charged. A *rider* (an FP8 weight's scale) travels in its weight's bucket.
- ``pipelined_tree``: an idealised gather-then-broadcast, kept as a bound: each tensor is
  gathered whole onto the first device of its training mesh (its shards sent by their
  first holders), then broadcast along a pipelined chain through every inference device that holds part of it; the chain
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

__all__ = ["gather_broadcast", "pipelined_tree", "flat_direct"]


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


def pipelined_tree(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, *,
                   riders: Mapping[str, str] | None = None) -> Prediction:
    """Predicted time of an ideal gather-then-broadcast: per-stage roots, one pipelined chain per tensor.

    A bound, not what a stack runs (``gather_broadcast`` is): the chains of all tensors
    share the links at once, as if every collective ran in parallel.

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


def _bucket_sizes(src: Mapping[str, Layout], dst: Mapping[str, Layout], names: list[str],
                  riders: Mapping[str, str]) -> np.ndarray:
    """Bytes each tensor adds to the broadcast: its elements in the delivered dtype, plus its riders'."""
    extra: dict[str, int] = {}
    for rider, host in riders.items():
        extra[host] = extra.get(host, 0) + dst[rider].nbytes
    return np.array([src[n].size * dst[n].itemsize + extra.get(n, 0) for n in names], dtype=float)


def gather_broadcast(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, *,
                     riders: Mapping[str, str] | None = None, overlap: bool = True) -> Prediction:
    """Predicted time of gather-then-broadcast as RL stacks run it: through one training rank, in series.

    Every tensor is gathered whole onto the lowest training device (its pieces sent by their
    first holders, one collective per tensor, one after another), then broadcast from there
    to every inference device that holds part of it, bucket after bucket, along a chain whose
    slowest hop sets its rate. ``overlap``: the gather of one bucket runs beside the broadcast
    of the previous (NeMo-RL's two buffers), else after it. ``stages`` holds (gather, broadcast).

    Example:
      >>> from jreshard import Layout, Mesh
      >>> from jreshard.fleet.baselines import gather_broadcast
      >>> from jreshard.fleet.hardware import Topology
      >>> topo = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=0)
      >>> src = {"w": Layout((1000,), Mesh([0, 1], "tp"), ("tp",), dtype="uint8")}
      >>> dst = {"w": Layout((1000,), Mesh([2, 3, 4, 5], "dp"), (), dtype="uint8")}
      >>> p = gather_broadcast(src, dst, topo, overlap=False)
      >>> [round(t * 1e9) for t in p.stages]  # 500 B over NVLink into device 0, then 1000 B at 10 GB/s
      [5, 100]
    """
    check_pair(src, dst)
    riders = riders or {}
    names = sorted(n for n in src if n not in riders)
    root = min(min(src[n].mesh.device_ids) for n in src)
    mesh = Mesh([root], ("root",))
    gather = plan({n: src[n] for n in names}, {n: Layout(src[n].shape, mesh, (), src[n].dtype) for n in names},
                  balance=False)
    s, d, nb, _ = gather.move_arrays()
    remote = s != d
    s, nb = s[remote], nb[remote].astype(float)
    same = topo.domain(s) == topo.domain(np.full(len(s), root))
    net_in, nvl_in = float(nb[~same].sum()), float(nb[same].sum())
    # One collective per tensor, one after another: the root's links do not overlap across tensors.
    g = net_in / (topo.network_GBps * 1e9) + nvl_in / (topo.nvlink_GBps * 1e9)
    gathered = sum(1 for n in names if src[n].mesh.device_ids != (root,))
    g += topo.latency_us * 1e-6 * gathered
    sizes = _bucket_sizes(src, dst, names, riders)
    root_dom = int(topo.domain(np.array([root]))[0])
    net_b = nvl_b = secs = 0.0
    hops = 0
    chains: dict[tuple, tuple[int, int]] = {}
    for t, n in enumerate(names):
        lay = dst[n]
        key = (lay.mesh, lay.dim_axes, lay.shape)
        if key not in chains:
            holders = np.array([x for x in lay.mesh.device_ids if math.prod(lay.shard_shape(x)) > 0], np.int64)
            doms = np.unique(topo.domain(holders))
            chains[key] = (len(holders), len(doms) - int(root_dom in doms))  # network entries: other domains
        n_holders, entries = chains[key]
        net_b += sizes[t] * entries
        nvl_b += sizes[t] * (n_holders - entries)
        secs += sizes[t] / ((topo.network_GBps if entries else topo.nvlink_GBps) * 1e9)
        hops = max(hops, n_holders)
    buckets = max(1, math.ceil(sizes.sum() / topo.bucket_bytes))
    b = secs + topo.latency_us * 1e-6 * (buckets + hops)  # one launch per bucket, the chain's depth once
    seconds = float(max(g, b) + min(g, b) / buckets if overlap else g + b)
    slow = "gather into" if g >= b else "broadcast from"
    return Prediction(seconds, f"device {root} ({slow} one rank, {'overlapped' if overlap else 'in series'})",
                      int(net_in + net_b), int(nvl_in + nvl_b), int(net_in), int(sizes.sum()), (g, b))


def flat_direct(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology) -> Prediction:
    """Predicted time of sending each missing piece from its first replica (no balancing)."""
    check_pair(src, dst)
    return predict_plan(plan(dict(src), dict(dst), balance=False), topo)
