"""Cost model: predict how long a weight sync takes on a cluster, for jreshard and baselines.

The model (see ``docs/cost_model.md``):

- Topology: devices ``d`` sit in NVLink domains ``d // gpus_per_domain``; each GPU
  has one network NIC (``network_GBps`` per direction) and NVLink
  (``nvlink_GBps`` per direction). A move between two devices of one domain uses
  NVLink, any other move the network. Local copies are free.
- Alpha-beta per device: every device has four independent links (network out/in,
  NVLink out/in); its time is the busiest link's bytes over its bandwidth plus
  ``latency * messages`` (the larger of messages sent and received). The sync takes
  as long as the slowest device. No switch congestion (full-bisection fabric).
- Messages: jreshard and flat direct sends coalesce all bytes between a sender and
  a receiver into messages of at most ``bucket_bytes``; gather-then-broadcast pays
  one message per tensor per hop (one collective per tensor).
- Stages (gather then broadcast; hierarchical injection then fan-out) run one
  after the other: their times add.

Baselines:

- ``gather_broadcast``: each tensor is gathered whole onto the first device of its
  training mesh (its shards sent by their first holders), then broadcast along a
  pipelined chain through every inference device that holds part of it; the chain
  enters each NVLink domain once over the network and continues over NVLink, its
  entry device rotating per tensor (as NCCL rotates rings over NICs).
- ``flat_direct``: point-to-point sends of exactly the missing pieces, each from
  the first replica (no replica balancing, no hierarchy).

Hierarchical delivery (``hierarchical_plan``): when several inference replicas of
a tensor sit in one NVLink domain, stage 1 delivers each byte once per domain over
the network, spread over the domain's replicas (each gets a 1/k slice of its
shard), and stage 2 completes every replica over NVLink. Both stages are ordinary
core plans. ``compare`` predicts direct and hierarchical delivery and keeps the
faster.

Example:
  >>> from jreshard import Layout, Mesh, cost
  >>> topo = cost.Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=0)
  >>> src = Layout((1000,), Mesh([0], "x"), (), dtype="uint8")
  >>> dst = Layout((1000,), Mesh([2, 3], "tp"), ("tp",), dtype="uint8")
  >>> p = cost.predict_plan(jreshard.plan(src, dst), topo)
  >>> round(p.seconds * 1e9)  # device 0 sends 1000 bytes over a 10 GB/s NIC
  100
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

import numpy as np

import jreshard
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh
from jreshard.core.planner import Plan, plan, plan_layouts

__all__ = ["Hardware", "Topology", "Traffic", "Prediction", "TwoStagePlan", "Comparison", "load_hardware",
           "hardware_names", "predict", "sender_load_bound", "predict_plan", "predict_two_stage", "plan_traffic", "hierarchical_plan",
           "gather_broadcast", "flat_direct", "compare"]

_HW_FIELDS = {"gpus_per_domain": int, "nvlink_GBps_per_direction": float, "network_GBps_per_gpu_per_direction": float,
              "latency_us": float}


@dataclasses.dataclass(frozen=True, slots=True)
class Hardware:
    """One hardware description (a file of ``jreshard/data/hardware``)."""

    name: str
    gpus_per_domain: int
    nvlink_GBps: float
    network_GBps: float
    latency_us: float


def hardware_names() -> tuple[str, ...]:
    files = resources.files("jreshard").joinpath("data/hardware").iterdir()
    return tuple(sorted(f.name[:-5] for f in files if f.name.endswith(".json")))


def load_hardware(spec: str | os.PathLike | Mapping | Hardware) -> Hardware:
    """A ``Hardware`` from a name in the package data, a JSON path, or a mapping.

    Raises ValueError naming the missing or bad field.
    """
    if isinstance(spec, Hardware):
        return spec
    where = "hardware"
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if path in hardware_names():
            data = json.loads(resources.files("jreshard").joinpath(f"data/hardware/{path}.json").read_text())
            where = f"hardware {path!r}"
        elif os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            where = f"hardware file {path!r}"
        else:
            raise ValueError(f"hardware {path!r} is neither a known name {hardware_names()} nor a JSON file.")
    elif isinstance(spec, Mapping):
        data = dict(spec)
    else:
        raise TypeError(f"hardware must be a name, a path or a mapping, got {type(spec).__name__}.")
    values = {}
    for key, kind in _HW_FIELDS.items():
        if key not in data:
            raise ValueError(f"{where}: field {key!r} is missing; give it as a number.")
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or v < 0 or (kind is int and (v != int(v) or v < 1)):
            raise ValueError(f"{where}: field {key!r} must be a {'positive int' if kind is int else 'non-negative number'}, "
                             f"got {v!r}.")
        values[key] = kind(v)
    return Hardware(str(data.get("name", "custom")), values["gpus_per_domain"], values["nvlink_GBps_per_direction"],
                    values["network_GBps_per_gpu_per_direction"], values["latency_us"])


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """What the cost model needs of a cluster (bandwidths per GPU per direction)."""

    gpus_per_domain: int
    nvlink_GBps: float
    network_GBps: float
    latency_us: float
    bucket_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_domain, bool) or not isinstance(self.gpus_per_domain, int) or self.gpus_per_domain < 1:
            raise ValueError(f"gpus_per_domain must be a positive int, got {self.gpus_per_domain!r}.")
        for name in ("nvlink_GBps", "network_GBps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}.")
        if self.latency_us < 0 or self.bucket_bytes < 1:
            raise ValueError("latency_us must be >= 0 and bucket_bytes >= 1.")

    @classmethod
    def from_hardware(cls, hw: Hardware | str | Mapping, gpus_per_domain: int | None = None) -> Topology:
        hw = load_hardware(hw)
        return cls(gpus_per_domain or hw.gpus_per_domain, hw.nvlink_GBps, hw.network_GBps, hw.latency_us)

    def domain(self, devices: Any) -> Any:
        return np.asarray(devices) // self.gpus_per_domain


@dataclasses.dataclass(slots=True)
class Traffic:
    """Per-device link loads: bytes and messages, indexed by device id."""

    net_out: np.ndarray
    net_in: np.ndarray
    nvl_out: np.ndarray
    nvl_in: np.ndarray
    msg_out: np.ndarray
    msg_in: np.ndarray

    @classmethod
    def zeros(cls, n: int) -> Traffic:
        return cls(*(np.zeros(n) for _ in range(6)))

    def grow(self, n: int) -> None:
        for f in dataclasses.fields(self):
            a = getattr(self, f.name)
            if len(a) < n:
                setattr(self, f.name, np.concatenate([a, np.zeros(n - len(a))]))

    def add_edges(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, msgs: np.ndarray,
                  topo: Topology) -> None:
        """Adds sends ``src -> dst`` of ``nbytes`` in ``msgs`` messages each (local ones are free)."""
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        keep = src != dst
        src, dst, nbytes, msgs = src[keep], dst[keep], np.asarray(nbytes, float)[keep], np.asarray(msgs, float)[keep]
        if not len(src):
            return
        n = int(max(src.max(), dst.max())) + 1
        self.grow(n)
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
    d = int(np.argmax(per_device))
    link = list(links)[int(np.argmax(stack[:, d]))]
    return Prediction(float(per_device[d]), f"device {d} {link}", int(traffic.net_out.sum()), int(traffic.nvl_out.sum()),
                      int(traffic.net_in.max()), int(traffic.net_out.max()))


def _plan_arrays(p: Plan | jreshard.TensorPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, bytes, moves) rows of a plan; a row may stand for several moves."""
    if isinstance(p, Plan):
        parts = [g.compressed() for g in p._groups]
        if not parts:
            e = np.zeros(0, np.int64)
            return e, e, e, e
        return tuple(np.concatenate([x[k] for x in parts]) for k in range(4))
    return p.move_src, p.move_dst, p.move_bytes, np.ones(len(p.move_src), np.int64)


def plan_traffic(p: Plan | jreshard.TensorPlan, topo: Topology) -> Traffic:
    """Per-device loads of a plan, its sends coalesced per (sender, receiver) pair."""
    src, dst, nb, _ = _plan_arrays(p)
    traffic = Traffic.zeros(0)
    net = src != dst
    src, dst, nb = src[net], dst[net], nb[net]
    if len(src):
        top = int(max(src.max(), dst.max())) + 1
        pair_bytes = np.bincount(src * top + dst, weights=nb)
        pairs = np.nonzero(pair_bytes)[0]
        b = pair_bytes[pairs]
        traffic.add_edges(pairs // top, pairs % top, b, np.ceil(b / topo.bucket_bytes), topo)
    return traffic


def predict_plan(p: Plan | jreshard.TensorPlan, topo: Topology) -> Prediction:
    """Predicted time of a core plan (jreshard's executors send its moves point to point)."""
    return predict(plan_traffic(p, topo), topo)


def sender_load_bound(src: Mapping[str, Layout], stats: jreshard.PlanStats) -> float:
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
    for lay in src.values():
        key = (id(lay.mesh), lay.spec, lay.shape)
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


# --------------------------------------------------------------------------- hierarchical delivery


@dataclasses.dataclass(frozen=True, slots=True)
class TwoStagePlan:
    """Stage 1 injects each byte once per NVLink domain, stage 2 fans out inside domains.

    Both stages are core ``Plan``s keyed ``'<tensor>@<part>'``; executing stage 1
    and then stage 2 (whose sources are stage 1's destination layouts) leaves every
    destination device with its shard. ``stage2`` is ``None`` when no domain holds
    two replicas of a tensor (then stage 1 is the direct plan).
    """

    stage1: Plan
    stage2: Plan | None
    names: tuple[str, ...]

    def network_bytes(self, topo: Topology) -> int:
        return predict_two_stage(self, topo).network_bytes


def _replica_units(dst: Layout) -> tuple[np.ndarray, tuple[str, ...], tuple[int, ...]]:
    """Devices of each replica of ``dst`` as rows [units, rest] (rest in mesh order of the
    sharding axes), the sharding axes' names and sizes."""
    used = {a for axes in dst.spec for a in axes}
    names = dst.mesh.axis_names
    rep = [i for i, n in enumerate(names) if n not in used]
    other = [i for i, n in enumerate(names) if n in used]
    arr = np.transpose(dst.mesh.devices, rep + other)
    rest_shape = tuple(dst.mesh.shape[i] for i in other)
    return arr.reshape(-1, math.prod(rest_shape)), tuple(names[i] for i in other), rest_shape


def _split_spec(dst: Layout, rep: str, k: int) -> tuple:
    """``dst.spec`` with ``rep`` added (minor) to the dim whose shards are longest."""
    g = dst.grid
    extent = [(-(-n // p), -len(axes), d) for d, (n, p, axes) in enumerate(zip(dst.shape, g.parts, dst.spec, strict=True))]
    _, _, dim = max(extent)
    spec = list(dst.spec)
    spec[dim] = tuple(spec[dim]) + (rep,)
    return tuple(spec)


def _hier_parts(dst: Layout, topo: Topology, cache: dict) -> list:
    """[(part name, stage-1 layout, stage-2 destination layout or None)] for one dst layout."""
    key = (id(dst.mesh), dst.spec)
    groups = cache.get(key)
    if groups is None:
        units, other_names, rest_shape = _replica_units(dst)
        dom = topo.domain(units)
        whole = (dom == dom[:, :1]).all(axis=1)
        by_dom: dict[int, list[int]] = {}
        direct: list[int] = []
        for u in range(len(units)):
            (by_dom.setdefault(int(dom[u, 0]), []) if whole[u] else direct).append(u)
        for d, us in list(by_dom.items()):
            if len(us) == 1:
                direct.extend(by_dom.pop(d))
        rep = "replica"
        while rep in other_names:
            rep += "_"
        names = (rep,) + other_names
        groups = []
        if direct:
            groups.append(("direct", Mesh(units[sorted(direct)].reshape((len(direct),) + rest_shape), names), None))
        for d, us in sorted(by_dom.items()):
            groups.append((f"domain{d}", Mesh(units[us].reshape((len(us),) + rest_shape), names), rep))
        groups = (dst.mesh, groups)  # the mesh is kept so that its id() in the key stays its own
        cache[key] = groups
    _, parts = groups
    if len(parts) == 1 and parts[0][2] is None:
        return [("direct", dst, None)]
    # Tensors of one shape share their stage layouts: build them once.
    lkey = (dst.shape, dst.dtype, id(dst.mesh), dst.spec)
    out = cache.get(lkey)
    if out is not None:
        return out
    out = cache[lkey] = []
    for part, mesh, rep in parts:
        target = Layout(dst.shape, mesh, dst.spec, dst.dtype)
        if rep is None:
            out.append((part, target, None))
        elif dst.rank == 0:
            # A scalar cannot be sliced: the first replica of the domain gets it whole.
            first = Mesh(mesh.devices[:1], mesh.axis_names)
            out.append((part, Layout(dst.shape, first, dst.spec, dst.dtype), target))
        else:
            out.append((part, Layout(dst.shape, mesh, _split_spec(dst, rep, mesh.shape[0]), dst.dtype), target))
    return out


def hierarchical_plan(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, *,
                      progress: Callable | None = None) -> TwoStagePlan:
    """Builds a two-stage plan: network injection once per domain, then NVLink fan-out.

    Args:
      src, dst: flat dicts {name: Layout} with the same keys.
      topo: the topology that defines the NVLink domains.
      progress: optional callable wrapping an iterable (a progress bar).
    """
    _check_dicts(src, dst)
    cache: dict = {}
    stage1, stage2 = [], []
    names = sorted(src)
    for name in (progress(names) if progress else names):
        for part, l1, target in _hier_parts(dst[name], topo, cache):
            stage1.append((f"{name}@{part}", src[name], l1))
            if target is not None:
                stage2.append((f"{name}@{part}", l1, target))
    return TwoStagePlan(plan_layouts(stage1), plan_layouts(stage2) if stage2 else None, tuple(names))


def predict_two_stage(tsp: TwoStagePlan, topo: Topology) -> Prediction:
    first = predict_plan(tsp.stage1, topo)
    return first + predict_plan(tsp.stage2, topo) if tsp.stage2 is not None else first


# --------------------------------------------------------------------------- baselines


def _check_dicts(src: Any, dst: Any) -> None:
    if not isinstance(src, Mapping) or not isinstance(dst, Mapping):
        raise TypeError(f"src and dst must be dicts of Layouts, got {type(src).__name__} and {type(dst).__name__}.")
    if set(src) != set(dst):
        diff = sorted(set(src) ^ set(dst))[:3]
        raise ValueError(f"src and dst must have the same tensor names; they differ in {diff}.")


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


def gather_broadcast(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology) -> Prediction:
    """Predicted time of gathering each tensor whole, then broadcasting it along a chain."""
    _check_dicts(src, dst)
    names = sorted(src)
    roots = _roots(src, names)
    gather = plan({n: src[n] for n in names}, roots, balance=False)
    traffic = Traffic.zeros(0)
    s, d, nb, moves = _plan_arrays(gather)
    traffic.add_edges(s, d, nb, moves, topo)  # one message per piece per tensor
    first = predict(traffic, topo)

    # Broadcast: group tensors by destination mesh and spec, build each group's chain.
    bcast = Traffic.zeros(0)
    groups: dict[tuple, list[int]] = {}
    for t, n in enumerate(names):
        lay = dst[n]
        groups.setdefault((id(lay.mesh), lay.spec, lay.shape), []).append(t)
    sizes = np.array([src[n].size * dst[n].itemsize for n in names], dtype=float)
    root_ids = np.array([roots[n].mesh.device_ids[0] for n in names], dtype=np.int64)
    for (_, _, _), ts in groups.items():
        lay = dst[names[ts[0]]]
        g = lay.grid
        holders = np.array(lay.mesh.device_ids, np.int64)[np.prod(g.stop - g.start, axis=1) > 0] if lay.rank else \
            np.array(lay.mesh.device_ids, np.int64)
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
    _check_dicts(src, dst)
    return predict_plan(plan(dict(src), dict(dst), balance=False), topo)


@dataclasses.dataclass(frozen=True, slots=True)
class Comparison:
    """Predictions for one sync: jreshard (the faster delivery) and the baselines."""

    jreshard: Prediction
    delivery: str
    direct: Prediction
    hierarchical: Prediction | None
    gather_broadcast: Prediction
    flat_direct: Prediction

    def seconds(self) -> dict[str, float]:
        return {"jreshard": self.jreshard.seconds, "gather_broadcast": self.gather_broadcast.seconds,
                "flat_direct": self.flat_direct.seconds}


def _has_domain_replicas(dst: Mapping[str, Layout], topo: Topology) -> bool:
    seen = set()
    for lay in dst.values():
        key = (id(lay.mesh), lay.spec)
        if key in seen:
            continue
        seen.add(key)
        if any(target is not None for _, _, target in _hier_parts(lay, topo, {})):
            return True
    return False


def compare(src: Mapping[str, Layout], dst: Mapping[str, Layout], topo: Topology, *, hierarchical: str = "auto",
            jreshard_plan: Plan | None = None, progress: Callable | None = None) -> Comparison:
    """Predicts jreshard (direct and, where it applies, hierarchical) and both baselines.

    Args:
      hierarchical: ``'auto'`` (predict both, keep the faster), ``'always'`` or ``'never'``.
      jreshard_plan: the direct plan if already computed.
    """
    if hierarchical not in ("auto", "always", "never"):
        raise ValueError(f"hierarchical must be 'auto', 'always' or 'never', got {hierarchical!r}.")
    _check_dicts(src, dst)
    direct = predict_plan(jreshard_plan if jreshard_plan is not None else plan(dict(src), dict(dst)), topo)
    hier = None
    if hierarchical != "never" and _has_domain_replicas(dst, topo):
        hier = predict_two_stage(hierarchical_plan(src, dst, topo, progress=progress), topo)
    use_hier = hier is not None and (hierarchical == "always" or hier.seconds < direct.seconds)
    return Comparison(hier if use_hier else direct, "hierarchical" if use_hier else "direct", direct, hier,
                      gather_broadcast(src, dst, topo), flat_direct(src, dst, topo))
