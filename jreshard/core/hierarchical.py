"""Hierarchical delivery: each byte crosses into a domain once, then fans out inside it.

When several replicas of a destination tensor sit whole in one domain (devices
sharing fast links: an NVLink domain, a node, one JAX process; see
``jreshard.core.domains``), stage 1 delivers each byte once per domain, spread
over the domain's replicas (each gets a 1/k slice of its shard: the replica axis
is added as the minor factor of the dim whose shards are longest), and stage 2
completes every replica from the others of its domain. Replicas that span
domains, or sit alone in theirs, are delivered directly in stage 1. Both stages
are ordinary core plans, exact by the same invariants; stage 2 moves stay inside
one domain. Pure: no devices, no cost model (``jreshard.fleet.hierarchical``
predicts the time).

Example:
  >>> from jreshard import Layout, Mesh
  >>> from jreshard.core.domains import Domains
  >>> from jreshard.core.hierarchical import hierarchical_plan
  >>> nodes = Domains.from_groups([[0, 1, 2, 3], [4, 5, 6, 7]])
  >>> src = {"w": Layout((8,), Mesh([0], "x"), (), "uint8")}
  >>> dst = {"w": Layout((8,), Mesh([4, 5, 6, 7], "dp"), (), "uint8")}  # 4 replicas in domain 1
  >>> tsp = hierarchical_plan(src, dst, nodes)
  >>> tsp.stage1.stats().network_bytes, tsp.stage2.stats().network_bytes  # 8 bytes in, 3 x 8 fanned out
  (8, 24)
  >>> tsp.cross_domain_bytes()  # each byte crosses into domain 1 once
  8
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jreshard.core.domains import Domains
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh
from jreshard.core.planner import Plan, plan_layouts

__all__ = ["HIERARCHICAL", "TwoStagePlan", "StagePart", "StagePair", "hierarchical_plan", "stage_parts",
           "split_stages", "has_domain_replicas", "cross_domain_bytes", "check_pair", "check_hierarchical"]

# The delivery choices every executor takes (``jreshard.transfer``, ``bridge.BridgePlan``).
HIERARCHICAL = ("auto", "always", "never")


def check_hierarchical(hierarchical: Any) -> str:
    """``hierarchical`` checked: one of ``HIERARCHICAL``.

    Example:
      >>> from jreshard.core.hierarchical import check_hierarchical
      >>> check_hierarchical("sometimes")
      Traceback (most recent call last):
      ...
      ValueError: hierarchical must be 'auto', 'always' or 'never', got 'sometimes'.
    """
    if not isinstance(hierarchical, str) or hierarchical not in HIERARCHICAL:
        raise ValueError(f"hierarchical must be 'auto', 'always' or 'never', got {hierarchical!r}.")
    return hierarchical


def check_pair(src: Any, dst: Any) -> None:
    """Raises unless ``src`` and ``dst`` are dicts of Layouts with the same tensor names."""
    if not isinstance(src, Mapping) or not isinstance(dst, Mapping):
        raise TypeError(f"src and dst must be dicts of Layouts, got {type(src).__name__} and {type(dst).__name__}.")
    if src.keys() != dst.keys():
        diff = sorted(set(src) ^ set(dst))[:3]
        raise ValueError(f"src and dst must have the same tensor names; they differ in {diff}.")


def cross_domain_bytes(p: Plan | None, domains: Domains) -> int:
    """Bytes of a plan's moves whose sender and receiver lie in different domains."""
    if p is None:
        return 0
    src, dst, nb, _ = p.move_arrays()
    return int(nb[domains.of(src) != domains.of(dst)].sum()) if len(src) else 0


@dataclasses.dataclass(frozen=True, slots=True)
class TwoStagePlan:
    """Stage 1 injects each byte once per domain, stage 2 fans out inside domains.

    Both stages are core ``Plan``s keyed ``'<tensor>@<part>'``; executing stage 1
    and then stage 2 (whose sources are stage 1's destination layouts) leaves every
    destination device with its shard. ``stage2`` is ``None`` when no domain holds
    two replicas of a tensor (then stage 1 is the direct plan).
    """

    stage1: Plan
    stage2: Plan | None
    names: tuple[str, ...]
    domains: Domains = Domains.contiguous(1)

    def cross_domain_bytes(self) -> int:
        """Bytes that cross a domain boundary in both stages (stage 2 adds none)."""
        return cross_domain_bytes(self.stage1, self.domains) + cross_domain_bytes(self.stage2, self.domains)

    def network_bytes(self, topo: Any = None) -> int:
        """Bytes that cross a boundary of ``topo``'s domains (a ``Topology`` or ``Domains``; default: the plan's)."""
        domains = self.domains if topo is None else topo if isinstance(topo, Domains) else topo.domains
        return cross_domain_bytes(self.stage1, domains) + cross_domain_bytes(self.stage2, domains)


class StagePart(NamedTuple):
    """One part of a tensor's destination: its stage-1 layout and, if it fans out, its final one."""

    part: str  # 'direct' or 'domain<d>'
    stage1: Layout
    final: Layout | None  # the stage-2 destination; None when stage 1 delivers it whole


class _Group(NamedTuple):
    part: str
    mesh: Mesh  # the group's replicas along its first axis, then the sharding axes
    replica_axis: str | None  # None: delivered directly


def _replica_rows(mesh: Mesh, dim_axes: tuple) -> tuple[np.ndarray, tuple[str, ...], tuple[int, ...]]:
    """Devices of each replica as rows (the sharding axes in mesh order), with those axes' names and sizes."""
    used = {a for axes in dim_axes for a in axes}
    names = mesh.axis_names
    rep = [i for i, n in enumerate(names) if n not in used]
    other = [i for i, n in enumerate(names) if n in used]
    arr = np.transpose(mesh.devices, rep + other)
    rest_shape = tuple(mesh.shape[i] for i in other)
    return arr.reshape(-1, math.prod(rest_shape)), tuple(names[i] for i in other), rest_shape


@functools.lru_cache(maxsize=1024)
def _domain_groups(mesh: Mesh, dim_axes: tuple, domains: Domains) -> tuple[_Group, ...]:
    """The replicas of a (mesh, dim_axes) grouped by the domain that holds them whole."""
    rows, other_names, rest_shape = _replica_rows(mesh, dim_axes)
    dom = domains.of(rows)
    whole = (dom == dom[:, :1]).all(axis=1)
    by_dom: dict[int, list[int]] = {}
    direct: list[int] = []
    for u in range(len(rows)):
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
        groups.append(_Group("direct", Mesh(rows[sorted(direct)].reshape((len(direct),) + rest_shape), names), None))
    for d, us in sorted(by_dom.items()):
        groups.append(_Group(f"domain{d}", Mesh(rows[us].reshape((len(us),) + rest_shape), names), rep))
    return tuple(groups)


def _split_dim_axes(dst: Layout, rep: str) -> tuple:
    """``dst.dim_axes`` with ``rep`` added (minor) to the dim whose shards are longest."""
    sizes = dict(zip(dst.mesh.axis_names, dst.mesh.shape, strict=True))
    extent = [(-(-n // math.prod(sizes[a] for a in axes)), -len(axes), d)
              for d, (n, axes) in enumerate(zip(dst.shape, dst.dim_axes, strict=True))]
    _, _, dim = max(extent)
    dim_axes = list(dst.dim_axes)
    dim_axes[dim] = dim_axes[dim] + (rep,)
    return tuple(dim_axes)


def _check_domains(domains: Any) -> Domains:
    if not isinstance(domains, Domains):
        raise TypeError(f"domains must be a jreshard.core.domains.Domains, got {type(domains).__name__} "
                        f"{domains!r}; build one with Domains.from_groups(groups) or Domains.contiguous(n).")
    return domains


@functools.lru_cache(maxsize=4096)
def stage_parts(dst: Layout, domains: Domains) -> tuple[StagePart, ...]:
    """The parts of one destination layout under hierarchical delivery (tensors of one layout share them).

    Example:
      >>> from jreshard import Layout, Mesh
      >>> from jreshard.core.domains import Domains
      >>> from jreshard.core.hierarchical import stage_parts
      >>> dst = Layout((8, 4), Mesh([[0, 1], [2, 3], [4, 5]], ("dp", "tp")), (None, "tp"), "float32")
      >>> [p.part for p in stage_parts(dst, Domains.from_groups([[0, 1, 2, 3], [4, 5]]))]
      ['direct', 'domain0']
    """
    groups = _domain_groups(dst.mesh, dst.dim_axes, _check_domains(domains))
    if len(groups) == 1 and groups[0].replica_axis is None:
        return (StagePart("direct", dst, None),)
    out = []
    for part, mesh, rep in groups:
        final = Layout(dst.shape, mesh, dst.dim_axes, dst.dtype)
        if rep is None:
            out.append(StagePart(part, final, None))
        elif not dst.shape:
            # A scalar cannot be sliced: the first replica of the domain gets it whole.
            first = Mesh(mesh.devices[:1], mesh.axis_names)
            out.append(StagePart(part, Layout(dst.shape, first, dst.dim_axes, dst.dtype), final))
        else:
            out.append(StagePart(part, Layout(dst.shape, mesh, _split_dim_axes(dst, rep), dst.dtype), final))
    return tuple(out)


class StagePair(NamedTuple):
    """One Layout pair of a stage: ``pairs[tensor]``'s part ``name`` (``'<name>@<part>'``)."""

    tensor: int  # the position of the tensor in the pairs given to ``split_stages``
    name: str
    src: Layout
    dst: Layout


def split_stages(pairs: Sequence[tuple[str, Layout, Layout]],
                 domains: Domains) -> tuple[list[StagePair], list[StagePair]]:
    """The Layout pairs of both stages of hierarchical delivery, named ``'<name>@<part>'`` (``stage_parts``).

    Stage 1 takes each tensor from its source to its stage-1 layout; stage 2 from there
    (devices of the destination) to the replicas of each domain. Both executors plan these.

    Example:
      >>> from jreshard import Layout, Mesh
      >>> from jreshard.core.domains import Domains
      >>> from jreshard.core.hierarchical import split_stages
      >>> src = Layout((8,), Mesh([0], "x"), (), "uint8")
      >>> dst = Layout((8,), Mesh([2, 3], "dp"), (), "uint8")
      >>> s1, s2 = split_stages([("w", src, dst)], Domains.from_groups([[0], [2, 3]]))
      >>> [(p.name, p.dst.shard_box(3)) for p in s1], [p.name for p in s2]
      ([('w@domain1', (slice(4, 8, None),))], ['w@domain1'])
    """
    stage1: list[StagePair] = []
    stage2: list[StagePair] = []
    for i, name, src, l1, final in _stage_rows(pairs, domains):
        stage1.append(StagePair(i, name, src, l1))
        if final is not None:
            stage2.append(StagePair(i, name, l1, final))
    return stage1, stage2


def _stage_rows(pairs: Iterable[tuple[str, Layout, Layout]],
                domains: Domains) -> Iterator[tuple[int, str, Layout, Layout, Layout | None]]:
    """Per part of each pair: (pair index, ``'<name>@<part>'``, source, stage-1 layout, final layout or None)."""
    _check_domains(domains)
    parts: dict[int, tuple[StagePart, ...]] = {}  # by destination object: a model's tensors share a few
    for i, (name, src, dst) in enumerate(pairs):
        mine = parts.get(id(dst))
        if mine is None:
            mine = parts[id(dst)] = stage_parts(dst, domains)
        for part, l1, final in mine:
            yield i, f"{name}@{part}", src, l1, final


def has_domain_replicas(dst: Mapping[str, Layout], domains: Domains) -> bool:
    """Whether some domain holds two whole replicas of a tensor (hierarchical delivery applies)."""
    _check_domains(domains)
    values = list(dst.values())
    distinct = dict(zip(map(id, values), values, strict=True)).values()  # a model's tensors share a few Layouts; in C
    pairs = {(lay.mesh, lay.dim_axes) for lay in distinct}
    return any(g.replica_axis is not None for mesh, dim_axes in pairs
               for g in _domain_groups(mesh, dim_axes, domains))


def hierarchical_plan(src: Mapping[str, Layout], dst: Mapping[str, Layout], domains: Domains, *,
                      progress: Callable | None = None) -> TwoStagePlan:
    """Builds a two-stage plan: each byte into each domain once, then the fan-out inside it.

    Args:
      src, dst: flat dicts {name: Layout} with the same keys.
      domains: which devices share fast links.
      progress: optional callable wrapping an iterable (a progress bar).
    """
    check_pair(src, dst)
    names = sorted(src)
    stage1: list[tuple[str, Layout, Layout]] = []
    stage2: list[tuple[str, Layout, Layout]] = []
    for _, name, s, l1, final in _stage_rows(((n, src[n], dst[n]) for n in (progress(names) if progress else names)),
                                             domains):
        stage1.append((name, s, l1))
        if final is not None:
            stage2.append((name, l1, final))
    return TwoStagePlan(plan_layouts(stage1), plan_layouts(stage2) if stage2 else None, tuple(names), domains)
