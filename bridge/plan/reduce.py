"""Region groups reduced to Layout pairs, in the leaf's own coordinates, for ``jreshard.plan_layouts``.

A region group is one region index of one param across the ranks that hold it.
It becomes a destination Layout over torch ranks: a regular Layout when the
ranks' boxes are a JAX-style split of the whole leaf (plain tensor parallelism),
otherwise one Layout pair per cell of the grid cut by the source shards and the
destination boxes (padded vocabularies, sub-boxes). Pure: no jax, no torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from bridge.plan.param_map import ParamMap, Region
from bridge.plan.source import Source
from jreshard.core.box import Box
from jreshard.core.domains import Domains
from jreshard.core.hierarchical import StagePair, split_stages
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh

__all__ = ["RegionRef", "Job", "jobs", "two_stage"]


class RegionRef(NamedTuple):
    """Region number ``region`` of param ``param`` (on the rank that the reference is keyed by)."""

    param: str
    region: int


class _RankBox(NamedTuple):
    """The box of a leaf that one rank's region reads."""

    rank: int
    box: Box


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One Layout pair to plan: a whole region group, or one cell of it.

    ``src`` and ``dst`` are in coordinates shifted by ``origin`` (the cell's corner in the
    leaf); ``regions`` says which param region each destination rank fills.
    """

    name: str
    leaf: str
    origin: tuple[int, ...]
    regions: dict[int, RegionRef]
    src: Layout
    dst: Layout


def _regular_dst(shape: tuple[int, ...], entries: list[_RankBox], dtype: str) -> Layout | None:
    """A Layout whose shards are exactly ``entries``, if their boxes are a JAX-style split."""
    index = []
    for d, n in enumerate(shape):
        iv = sorted({(e.box[d].start, e.box[d].stop) for e in entries})
        c = -(-n // len(iv))
        if iv != [(min(i * c, n), min((i + 1) * c, n)) for i in range(len(iv))]:
            return None
        index.append({v: i for i, v in enumerate(iv)})
    cells: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for e in entries:
        cells[tuple(index[d][(e.box[d].start, e.box[d].stop)] for d in range(len(shape)))].append(e.rank)
    ks = [len(ix) for ix in index]
    reps = {len(v) for v in cells.values()}
    if len(cells) != math.prod(ks) or len(reps) != 1:
        return None
    devices = np.zeros(ks + [reps.pop()], dtype=np.int64)
    for cell, ranks in cells.items():
        devices[cell] = sorted(ranks)
    axes = tuple(f"d{d}" for d in range(len(shape))) + ("replica",)
    spec = tuple(f"d{d}" if ks[d] > 1 else None for d in range(len(shape)))
    return Layout(shape, Mesh(devices, axes), spec, dtype)


def _cells(src: Layout, entries: list[_RankBox]) -> Iterator[tuple[Box, list[int]]]:
    """The grid cells cut by source shards and destination boxes, with the ranks that want each."""
    ndim = len(src.shape)
    shard_boxes = list(src.shards().values())
    cuts = []
    for d in range(ndim):
        lo = min(e.box[d].start for e in entries)
        hi = max(e.box[d].stop for e in entries)
        pts = {lo, hi}
        for box in shard_boxes:
            pts.update(x for x in (box[d].start, box[d].stop) if lo < x < hi)
        for e in entries:
            pts.update((e.box[d].start, e.box[d].stop))
        ordered = sorted(pts)
        cuts.append(list(zip(ordered[:-1], ordered[1:], strict=True)) or [(lo, hi)])
    for cell in itertools.product(*cuts):
        if ndim and any(a >= b for a, b in cell):
            continue
        box = Box(cell)
        want = [e.rank for e in entries if e.box.contains(box)]
        if want:
            yield box, want


def jobs(source: Source, param_map: ParamMap) -> list[Job]:
    """Every region group of ``param_map`` as Layout pairs over source ids and torch ranks."""
    groups: dict[tuple, list[tuple[int, Region]]] = defaultdict(list)
    for p in param_map.params:
        for k, r in enumerate(p.regions):
            groups[(p.name, k, r.leaf, r.transpose, p.dtype)].append((p.rank, r))
    out = []
    for j, ((name, k, path, _, dtype), regs) in enumerate(groups.items()):
        src = source.layout(path)
        entries = [_RankBox(rank, r.box) for rank, r in regs]
        where = {rank: RegionRef(name, k) for rank, _ in regs}
        label = f"{j}:{name}#{k}"
        dst = _regular_dst(src.shape, entries, dtype)
        if dst is not None:
            out.append(Job(label, path, (0,) * len(src.shape), where, src, dst))
            continue
        for cell, want in _cells(src, entries):
            cs = Layout(cell.shape, Mesh(list(src.holders(cell)), "r"), (), src.dtype)
            cd = Layout(cell.shape, Mesh(sorted(want), "r"), (), dtype)
            out.append(Job(f"{label}@{list(cell.lo)}", path, cell.lo, {r: where[r] for r in want}, cs, cd))
    return out


# ---------------------------------------------------------------- hierarchical delivery
def two_stage(direct: list[Job], domains: Domains) -> tuple[list[Job], list[Job]]:
    """The jobs of hierarchical delivery: stage 1 (sources -> each domain once) and stage 2 (inside domains).

    Each job's destination is cut by ``jreshard.core.hierarchical.split_stages``: replicas that
    lie whole in a domain holding another whole replica receive each byte once per domain in
    stage 1, spread over them, and stage 2 completes every replica from the others of its
    domain; stage 2's sources are stage 1's destinations (inference ranks). Both stages plan
    with ``jreshard.plan_layouts`` and stay exact by its invariants.

    Example:
      >>> from bridge.plan.reduce import Job, RegionRef, two_stage
      >>> from jreshard import Layout, Mesh
      >>> from jreshard.core.domains import Domains
      >>> src = Layout((8,), Mesh([1000000], "x"), (), "float32")
      >>> dst = Layout((8,), Mesh([2, 3, 4], "r"), (), "float32")  # three replicas
      >>> job = Job("0:norm#0", "w", (0,), {r: RegionRef("norm", 0) for r in (2, 3, 4)}, src, dst)
      >>> s1, s2 = two_stage([job], Domains.from_groups([[2, 3], [4], [1000000]]))  # 2 and 3 share a node
      >>> [(j.name, j.dst.shard_box(3)) for j in s1 if 3 in j.regions], [j.name for j in s2]
      ([('0:norm#0@domain0', (slice(4, 8, None),))], ['0:norm#0@domain0'])
    """
    first, second = split_stages([(job.name, job.src, job.dst) for job in direct], domains)

    def as_job(pair: StagePair) -> Job:
        whole = direct[pair.tensor]
        return dataclasses.replace(whole, name=pair.name, src=pair.src, dst=pair.dst,
                                   regions={r: whole.regions[r] for r in pair.dst.mesh.device_ids})

    return [as_job(p) for p in first], [as_job(p) for p in second]
