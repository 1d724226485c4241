"""Per-device link loads and the alpha-beta prediction of one transfer.

Every GPU has four independent links (network out/in, NVLink out/in); a move
between two devices of one NVLink domain uses NVLink, any other the network. A
device's time is its busiest link's bytes over that link's bandwidth plus
``latency * messages``, plus, when the topology gives ``copy_GBps``, its local
copies at that rate (one per byte it sends, packing; one per byte it receives,
unpacking; one per byte moved to itself), which do not overlap its links. A
transfer takes as long as its slowest device. See ``docs/cost_model.md``.

Example:
  >>> import jreshard
  >>> from jreshard import Layout, Mesh
  >>> from jreshard.fleet.hardware import Topology
  >>> from jreshard.fleet.traffic import predict_plan
  >>> topo = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=0)
  >>> src = Layout((1000,), Mesh([0], "x"), (), dtype="uint8")
  >>> dst = Layout((1000,), Mesh([2, 3], "tp"), ("tp",), dtype="uint8")
  >>> p = predict_plan(jreshard.plan(src, dst), topo)
  >>> round(p.seconds * 1e9), p.network_bytes, p.nvlink_bytes  # 1000 bytes leave device 0 at 10 GB/s
  (100, 1000, 0)
  >>> import dataclasses
  >>> copies = dataclasses.replace(topo, copy_GBps=20)
  >>> round(predict_plan(jreshard.plan(src, dst), copies).seconds * 1e9)  # device 0 also packs them: + 50 ns
  150
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jreshard.core.hierarchical import check_pair
from jreshard.core.layout import Layout
from jreshard.core.planner import Plan, PlanStats, TensorPlan
from jreshard.fleet.hardware import Topology

__all__ = ["Traffic", "Prediction", "predict", "plan_traffic", "rows_traffic", "parts_traffic", "predict_plan",
           "sender_load_bound", "check_pair"]


@dataclasses.dataclass(slots=True)
class Traffic:
    """Per-device link loads: bytes and messages, and bytes copied locally, indexed by device id."""

    net_out: np.ndarray
    net_in: np.ndarray
    nvl_out: np.ndarray
    nvl_in: np.ndarray
    msg_out: np.ndarray
    msg_in: np.ndarray
    copied: np.ndarray  # packed (sent), unpacked (received) and moved to itself

    @classmethod
    def zeros(cls, n: int) -> Traffic:
        return cls(*(np.zeros(n) for _ in dataclasses.fields(cls)))

    def grow(self, n: int) -> None:
        for f in dataclasses.fields(self):
            a = getattr(self, f.name)
            if len(a) < n:
                setattr(self, f.name, np.concatenate([a, np.zeros(n - len(a))]))

    def add_edges(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, msgs: np.ndarray,
                  topo: Topology, *, copies: bool = False) -> None:
        """Adds sends ``src -> dst`` of ``nbytes`` in ``msgs`` messages each (local ones load no link).

        ``copies``: the sends are packed and unpacked (jreshard's executors), so each byte is
        also copied once at its sender and once at its receiver, a local one once; collectives
        that write into the tensors themselves (the baselines) pass ``False``.
        """
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        if not len(src):
            return
        self.grow(int(max(src.max(), dst.max())) + 1)
        nbytes = np.asarray(nbytes, float)
        keep = src != dst
        if copies:
            self.copied += np.bincount(src, weights=nbytes, minlength=len(self.copied))  # packing, or the local copy
            self.copied += np.bincount(dst[keep], weights=nbytes[keep], minlength=len(self.copied))  # unpacking
        src, dst, nbytes, msgs = src[keep], dst[keep], nbytes[keep], np.asarray(msgs, float)[keep]
        if not len(src):
            return
        same = topo.domain(src) == topo.domain(dst)
        for out, inn, m in ((self.nvl_out, self.nvl_in, same), (self.net_out, self.net_in, ~same)):
            out += np.bincount(src[m], weights=nbytes[m], minlength=len(out))
            inn += np.bincount(dst[m], weights=nbytes[m], minlength=len(inn))
        self.msg_out += np.bincount(src, weights=msgs, minlength=len(self.msg_out))
        self.msg_in += np.bincount(dst, weights=msgs, minlength=len(self.msg_in))


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted time of one transfer and where its bottleneck is."""

    seconds: float
    bottleneck: str
    network_bytes: int
    nvlink_bytes: int
    max_network_in_bytes: int
    max_network_out_bytes: int
    stages: tuple[float, ...] = ()

    def __add__(self, other: Prediction) -> Prediction:
        """Two stages one after the other."""
        slow = self if self.seconds >= other.seconds else other
        return Prediction(self.seconds + other.seconds, slow.bottleneck, self.network_bytes + other.network_bytes,
                          self.nvlink_bytes + other.nvlink_bytes,
                          max(self.max_network_in_bytes, other.max_network_in_bytes),
                          max(self.max_network_out_bytes, other.max_network_out_bytes),
                          (self.stages or (self.seconds,)) + (other.stages or (other.seconds,)))


def predict(traffic: Traffic, topo: Topology) -> Prediction:
    """The alpha-beta time of ``traffic``: the slowest device's busiest link plus its latency."""
    if not len(traffic.net_out):
        return Prediction(0.0, "nothing to send", 0, 0, 0, 0)
    links = {
        "network send": traffic.net_out / (topo.network_GBps * 1e9),
        "network receive": traffic.net_in / (topo.network_GBps * 1e9),
        "NVLink send": traffic.nvl_out / (topo.nvlink_GBps * 1e9),
        "NVLink receive": traffic.nvl_in / (topo.nvlink_GBps * 1e9),
    }
    stack = np.stack(list(links.values()))
    busiest = stack.max(axis=0)
    per_device = busiest + topo.latency_us * 1e-6 * np.maximum(traffic.msg_out, traffic.msg_in)
    if topo.copy_GBps is not None:
        per_device = per_device + traffic.copied / (topo.copy_GBps * 1e9)
    d = int(np.argmax(per_device))
    link = list(links)[int(np.argmax(stack[:, d]))]
    return Prediction(float(per_device[d]), f"device {d} {link}", int(traffic.net_out.sum()),
                      int(traffic.nvl_out.sum()),
                      int(traffic.net_in.max()), int(traffic.net_out.max()))


def plan_traffic(p: Plan | TensorPlan, topo: Topology) -> Traffic:
    """Per-device loads of a plan, its sends coalesced per (sender, receiver) pair, packed and unpacked."""
    src, dst, nb, _ = p.move_arrays()
    return rows_traffic(src, dst, nb, topo)


def rows_traffic(src: np.ndarray, dst: np.ndarray, nb: np.ndarray, topo: Topology) -> Traffic:
    """``plan_traffic`` of move rows (sender, receiver, bytes), however many moves a row stands for."""
    return parts_traffic([(src, dst, nb)], topo)


def parts_traffic(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], topo: Topology) -> Traffic:
    """``rows_traffic`` of the rows of every part together, without joining them into one set of arrays.

    Sends are coalesced per (sender, receiver) pair across the parts. The sums are of whole
    byte counts, which float64 adds exactly (below 2**53), so they do not depend on the parts.
    """
    traffic = Traffic.zeros(0)
    remote = []  # each part's sends between distinct devices
    for src, dst, nb in parts:
        n = src != dst
        if not n.all():
            traffic.add_edges(src[~n], dst[~n], nb[~n], np.zeros(int((~n).sum())), topo, copies=True)
        if n.any():
            remote.append((src[n], dst[n], nb[n]))
    if remote:
        top = max(int(max(src.max(), dst.max())) for src, dst, _ in remote) + 1
        pair_bytes = np.zeros(top * top)
        for src, dst, nb in remote:
            pair_bytes += np.bincount(src * top + dst, weights=nb, minlength=top * top)
        pairs = np.nonzero(pair_bytes)[0]
        b = pair_bytes[pairs]
        traffic.add_edges(pairs // top, pairs % top, b, np.ceil(b / topo.bucket_bytes), topo, copies=True)
    return traffic


def predict_plan(p: Plan | TensorPlan, topo: Topology) -> Prediction:
    """Predicted time of a core plan (jreshard's executors send its moves point to point)."""
    return predict(plan_traffic(p, topo), topo)


def sender_load_bound(src: Mapping[str, Layout], stats: PlanStats) -> float:
    """A lower bound on the largest sender load of any plan with these sends.

    Replicas link devices: a piece may come from any holder of its shard. Within a
    linked set the total sent is fixed, so some device sends at least the set's mean.
    ``stats.max_send_bytes`` over this bound is how far balancing is from the best.
    """
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    seen = set()
    values = list(src.values())
    for lay in dict(zip(map(id, values), values, strict=True)).values():  # distinct objects first (in C)
        key = (lay.mesh, lay.dim_axes, lay.shape)
        if key in seen:
            continue
        seen.add(key)
        for group in lay.replica_groups():
            root = find(group[0])
            for d in group[1:]:
                parent[find(d)] = root
    totals: dict[int, list[float]] = {}
    for d, b in stats.send_bytes.items():
        totals.setdefault(find(d), []).append(b)
    sizes: dict[int, int] = {}
    for d in parent:
        sizes[find(d)] = sizes.get(find(d), 0) + 1
    return max(sum(v) / sizes.get(r, len(v)) for r, v in totals.items()) if totals else 0.0
