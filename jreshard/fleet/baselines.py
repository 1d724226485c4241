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
from jreshard.fleet.classes import Classes, class_parts, class_rows, classes
from jreshard.fleet.hardware import Topology
from jreshard.fleet.traffic import Prediction, Traffic, check_pair, parts_traffic, predict

__all__ = ["gather_broadcast", "pipelined_tree", "flat_direct"]


def _root_layout(lay: Layout, meshes: dict[int, Mesh]) -> Layout:
    """``lay``'s tensor whole on the first device of its mesh (one Mesh per root)."""
    root = lay.mesh.device_ids[0]
    mesh = meshes.get(root)
    if mesh is None:
        mesh = meshes[root] = Mesh([root], ("root",))
    return Layout(lay.shape, mesh, (), lay.dtype)


def _rider_bytes(names: list[str], dst: Mapping[str, Layout], riders: Mapping[str, str]) -> np.ndarray:
    """Per tensor of ``names``, the bytes of the riders its collective carries."""
    if not riders:
        return np.zeros(len(names))
    extra: dict[str, int] = {}
    for rider, host in riders.items():
        extra[host] = extra.get(host, 0) + dst[rider].nbytes
    return np.array([extra.get(n, 0) for n in names], dtype=float)


def _without(src: Mapping[str, Layout], dst: Mapping[str, Layout], riders: Mapping[str, str],
             by_class: Classes | None) -> Classes:
    """The classes of every tensor but the riders (which travel in their hosts' collectives)."""
    if by_class is not None:
        return by_class.without(riders)
    return classes(src, dst, sorted(n for n in src if n not in riders))


def _holders(lay: Layout) -> np.ndarray:
    """The devices of ``lay``'s mesh that hold a non-empty shard."""
    g = lay.grid  # start and stop of each mesh position's shard, in device_ids order
    return np.asarray(lay.mesh.device_ids, np.int64)[np.prod(g.stop - g.start, axis=1) > 0]


def pipelined_tree(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, *,
                   riders: Mapping[str, str] | None = None, by_class: Classes | None = None) -> Prediction:
    """Predicted time of an ideal gather-then-broadcast: per-stage roots, one pipelined chain per tensor.

    A bound, not what a stack runs (``gather_broadcast`` is): the chains of all tensors
    share the links at once, as if every collective ran in parallel.

    ``riders`` maps a leaf to the leaf whose collective carries it (a scale to its weight).
    ``by_class``: ``classes(src, dst)`` if already made.
    """
    check_pair(src, dst)
    riders = riders or {}
    k = _without(src, dst, riders, by_class)
    meshes: dict[int, Mesh] = {}
    roots = [_root_layout(s, meshes) for s, _ in k.pairs]
    traffic = Traffic.zeros(0)
    traffic.add_edges(*class_rows([(s, r) for (s, _), r in zip(k.pairs, roots, strict=True)], k.counts),
                      topo)  # one message per piece per tensor
    first = predict(traffic, topo)

    # Broadcast: group tensors by destination mesh and spec, build each group's chain.
    bcast = Traffic.zeros(0)
    keys: dict[tuple, int] = {}
    reps: list[Layout] = []  # the destination layout of each group
    group_of = np.empty(len(k.pairs), np.int64)
    for c, (_, d) in enumerate(k.pairs):
        g = group_of[c] = keys.setdefault((d.mesh, d.dim_axes, d.shape), len(reps))
        if g == len(reps):
            reps.append(d)
    by_group = group_of[k.of]
    order = np.argsort(by_group, kind="stable")  # each group's tensors in name order
    bounds = np.searchsorted(by_group[order], np.arange(len(reps) + 1))
    sizes = k.per_tensor(s.size * d.itemsize for s, d in k.pairs) + _rider_bytes(k.names, dst, riders)
    root_ids = k.per_tensor(r.mesh.device_ids[0] for r in roots).astype(np.int64)
    for g, lay in enumerate(reps):
        ts_a = order[bounds[g]:bounds[g + 1]]
        holders = _holders(lay)
        dom = topo.domain(holders)
        o = np.lexsort((holders, dom))
        holders, dom = holders[o], dom[o]
        prev = root_ids[ts_a]
        b = sizes[ts_a]
        for dm in np.unique(dom):
            members = holders[dom == dm]
            prev = _chain(bcast, prev, ts_a % len(members), b, members, topo)
    return first + predict(bcast, topo)


def _chain(bcast: Traffic, prev: np.ndarray, entry: np.ndarray, nbytes: np.ndarray, members: np.ndarray,
           topo: Topology) -> np.ndarray:
    """Adds each tensor's chain through ``members``, from ``prev`` in at ``members[entry]``; returns where it ends.

    Tensors that come from the same device and enter at the same member follow the same
    chain: its bytes and messages are added once per chain, not once per tensor.
    """
    n_m = len(members)
    keys, inv = np.unique(prev * n_m + entry, return_inverse=True)
    inv = inv.ravel()
    b = np.bincount(inv, weights=nbytes, minlength=len(keys))
    count = np.bincount(inv, minlength=len(keys)).astype(float)
    chain = members[((keys % n_m)[:, None] + np.arange(n_m)) % n_m]  # [chains, n_m]
    bcast.add_edges(keys // n_m, chain[:, 0], b, count, topo)
    if n_m > 1:
        bcast.add_edges(chain[:, :-1].ravel(), chain[:, 1:].ravel(), np.repeat(b, n_m - 1), np.repeat(count, n_m - 1),
                        topo)
    return members[(entry + n_m - 1) % n_m]


def gather_broadcast(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, *,
                     riders: Mapping[str, str] | None = None, overlap: bool = True,
                     by_class: Classes | None = None) -> Prediction:
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
    k = _without(src, dst, riders, by_class)
    # Every source mesh: the classes' (riders included) when given, else each tensor's.
    sources = [a for a, _ in by_class.pairs] if by_class is not None else src.values()
    meshes = {id(lay.mesh): lay.mesh for lay in sources}
    root = min(min(m.device_ids) for m in meshes.values())
    mesh = Mesh([root], ("root",))
    s, d, nb, _ = class_rows([(a, Layout(a.shape, mesh, (), a.dtype)) for a, _ in k.pairs], k.counts)
    remote = s != d
    s, nb = s[remote], nb[remote].astype(float)
    same = topo.domain(s) == topo.domain(np.full(len(s), root))
    net_in, nvl_in = float(nb[~same].sum()), float(nb[same].sum())
    # One collective per tensor, one after another: the root's links do not overlap across tensors.
    g = net_in / (topo.network_GBps * 1e9) + nvl_in / (topo.nvlink_GBps * 1e9)
    gathered = int(k.per_tensor(a.mesh.device_ids != (root,) for a, _ in k.pairs).sum())
    g += topo.latency_us * 1e-6 * gathered
    sizes = k.per_tensor(a.size * b.itemsize for a, b in k.pairs) + _rider_bytes(k.names, dst, riders)
    root_dom = int(topo.domain(np.array([root]))[0])
    chains: dict[tuple, tuple[int, int]] = {}  # (devices of the chain, network entries: other domains)
    for _, lay in k.pairs:
        key = (lay.mesh, lay.dim_axes, lay.shape)
        if key not in chains:
            doms = np.unique(topo.domain(_holders(lay)))
            chains[key] = (len(_holders(lay)), len(doms) - int(root_dom in doms))
    chain = [chains[(b.mesh, b.dim_axes, b.shape)] for _, b in k.pairs]
    n_holders, entries = k.per_tensor(c[0] for c in chain), k.per_tensor(c[1] for c in chain)
    net_b, nvl_b = float((sizes * entries).sum()), float((sizes * (n_holders - entries)).sum())
    rate = np.where(entries > 0, topo.network_GBps * 1e9, topo.nvlink_GBps * 1e9)
    # The broadcasts run one after another: a running sum in name order, as a loop adds them.
    secs = float(np.cumsum(sizes / rate)[-1]) if len(sizes) else 0.0
    hops = int(n_holders.max()) if len(sizes) else 0
    buckets = max(1, math.ceil(sizes.sum() / topo.bucket_bytes))
    b = secs + topo.latency_us * 1e-6 * (buckets + hops)  # one launch per bucket, the chain's depth once
    seconds = float(max(g, b) + min(g, b) / buckets if overlap else g + b)
    slow = "gather into" if g >= b else "broadcast from"
    return Prediction(seconds, f"device {root} ({slow} one rank, {'overlapped' if overlap else 'in series'})",
                      int(net_in + net_b), int(nvl_in + nvl_b), int(net_in), int(sizes.sum()), (g, b))


def flat_direct(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, *,
                by_class: Classes | None = None) -> Prediction:
    """Predicted time of sending each missing piece from its first replica (no balancing).

    ``by_class``: ``classes(src, dst)`` if already made.
    """
    check_pair(src, dst)
    k = by_class if by_class is not None else classes(src, dst)
    parts = class_parts(k.pairs, k.counts)
    return predict(parts_traffic([(a.src, a.dst, a.nbytes) for a in parts], topo), topo)
