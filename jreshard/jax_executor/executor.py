"""The executor: a plan made runnable on jax devices, built once and called once per sync.

Construction does all the set-up (destination shards, the schedule, the programs);
a call reads the source shards, runs the transport, assembles the outputs with
``jax.make_array_from_single_device_arrays`` and, when asked, deletes the sources.
Executors are cached by ``executor(spec)``: a second sync of the same arguments
builds and traces nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, Sharding

from jreshard.core.hierarchical import StagePart, TwoStagePlan, stage_parts
from jreshard.core.layout import Layout
from jreshard.core.plans import Plan, TensorPlan
from jreshard.core.schedule import Piece, pieces, schedule
from jreshard.jax_executor import host, programs
from jreshard.jax_executor.buckets import BucketRunner, Results, Transport, build_programs
from jreshard.jax_executor.casts import HostCasts
from jreshard.jax_executor.shards import Destinations, SourceShards

__all__ = ["Spec", "Executor", "executor", "TwoStageExecutor", "two_stage_executor", "EXECUTOR_CACHE_SIZE"]

EXECUTOR_CACHE_SIZE = 16


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """What an executor is built for; equal specs share one executor (and its compiled programs)."""

    plan: Plan | TensorPlan
    sources: tuple[Sharding, ...]  # the source arrays' shardings
    targets: tuple[Sharding, ...]
    src_dtypes: tuple[np.dtype, ...]
    dtypes: tuple[np.dtype, ...]  # output dtypes
    transport: str  # "collective", "device_put" or "memcpy"
    cap: int  # max_bytes_in_flight
    host_packing: bool  # pack and unpack with NumPy copies instead of compiled programs
    # Derived from the fields above, so left out of equality and hashing.
    tplans: tuple[TensorPlan, ...] = dataclasses.field(compare=False)
    src: tuple[Layout, ...] = dataclasses.field(compare=False)
    dst: tuple[Layout, ...] = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardCopy:
    """``transport="memcpy"``: one destination shard, filled piece by piece from source shards."""

    leaf: int
    device: int
    pieces: tuple[Piece, ...]


class MemcpyRunner:
    """Copies every piece straight between the devices' host buffers (CPU, one process)."""

    def __init__(self, spec: Spec, dests: Destinations) -> None:
        by_shard: dict[tuple[int, int], list[Piece]] = defaultdict(list)
        for p in pieces(spec.tplans, itemsizes=[dt.itemsize for dt in spec.dtypes],
                        skip_leaves=dests.passthrough, skip_shards=dests.reuse):
            by_shard[(p.leaf, p.dst)].append(p)
        # Largest first, so that the copy threads finish together.
        self.copies = sorted((ShardCopy(i, d, tuple(ps)) for (i, d), ps in by_shard.items()),
                             key=lambda c: -dests.boxes[c.leaf][c.device].size * dests.dtypes[c.leaf].itemsize)
        self.sources = tuple(dict.fromkeys((c.leaf, p.src) for c in self.copies for p in c.pieces))
        self.dests = dests
        self.link_bytes: Counter[tuple[int, int]] = Counter()  # bytes copied between devices in the last call
        self.total_bytes = sum(p.nbytes for c in self.copies for p in c.pieces if p.src != p.dst)
        self.progress: Any = None

    def __call__(self, shards: SourceShards) -> Results:
        dests = self.dests
        views = shards.host_views(self.sources)
        host.OUTPUTS.reserve(dests.output_bytes)
        self.link_bytes = Counter()

        def fill(c: ShardCopy) -> tuple[np.ndarray, Counter[tuple[int, int]]]:
            out = host.OUTPUTS.take(dests.shape(c.leaf, c.device), host.uint_dtype(dests.dtypes[c.leaf].itemsize))
            sink = shards.casts.sink(c.leaf, out)
            copied: Counter[tuple[int, int]] = Counter()
            for p in c.pieces:
                sink[p.dst_box] = views[(c.leaf, p.src)][p.src_box]
                if p.src != p.dst:
                    copied[(p.src, p.dst)] += p.nbytes
            if self.progress is not None:
                self.progress.update(sum(copied.values()))
            return out.view(dests.dtypes[c.leaf]), copied

        filled = host.parallel_map(fill, self.copies)
        for _, copied in filled:
            self.link_bytes.update(copied)
        return {(c.leaf, c.device): x for c, (x, _) in zip(self.copies, filled, strict=True)}


class Executor:
    """A plan made runnable on jax devices for one ``Spec``."""

    def __init__(self, spec: Spec) -> None:
        devices = {d.id: d for d in jax.devices()}
        me = jax.process_index()
        self.spec = spec
        self.dests = dests = Destinations.build(
            spec.tplans, spec.src, spec.dst, spec.sources, spec.targets, spec.src_dtypes, spec.dtypes,
            local_ids=(i for i, d in devices.items() if d.process_index == me))
        missing = [d for d in dests.union if d not in devices]
        if missing:
            raise ValueError(f"the plan names devices {missing} that jax does not have; its devices are "
                             f"{sorted(devices)}. Make the plan from the arrays and shardings passed.")
        self._devices = devices
        fan_out = [int(tp.move_bytes.sum()) > math.prod(tp.shape) * tp.itemsize for tp in spec.tplans]
        self._casts = HostCasts.build(spec.src_dtypes, spec.dtypes, fan_out)
        self.buckets = [] if spec.transport == "memcpy" else schedule(
            spec.tplans, itemsizes=[dt.itemsize for dt in spec.dtypes], cap=spec.cap,
            skip_leaves=dests.passthrough, skip_shards=dests.reuse)
        self._run: MemcpyRunner | BucketRunner
        if spec.transport == "memcpy":
            self._run = MemcpyRunner(spec, dests)
        else:
            mesh = None
            if spec.transport == "collective" and any(b.rounds for b in self.buckets):
                mesh = jax.sharding.Mesh(np.array([devices[d] for d in dests.union], dtype=object), (programs.AXIS,))
            transport = Transport(spec.transport, devices, dests.local_ids, mesh, spec.host_packing)
            src_shards = [layout.shards() for layout in spec.src]
            progs = build_programs(self.buckets, dests, transport, spec.src_dtypes,
                                   lambda i, d: src_shards[i][d].shape)
            self._run = BucketRunner(progs, dests, transport)

    def source_shards(self, values: Sequence[jax.Array],
                      given: Mapping[tuple[int, int], Any] | None = None) -> SourceShards:
        """One sync's source shards: those of ``values``, or ``given`` by (leaf, device)."""
        return SourceShards(values, self._casts, given)

    @property
    def link_bytes(self) -> Counter[tuple[int, int]]:
        """Payload bytes this process's devices sent in the last call, per (sender, receiver)."""
        return self._run.link_bytes

    @property
    def total_bytes(self) -> int:
        """Payload bytes this process's devices send per call (what a progress bar counts)."""
        return self._run.total_bytes

    def __call__(self, values: Sequence[jax.Array], donate: bool, progress: Any = None) -> list[jax.Array]:
        """One sync: the outputs in leaf order; deletes the sources that are not kept when ``donate``.

        ``progress``: a tqdm-like bar updated with the bytes sent, or ``None``.
        """
        shards = SourceShards(values, self._casts)
        local = self.local_outputs(shards, progress)
        out = [values[i] if i in self.dests.passthrough else
               assemble(self.dests.shapes[i], self.dests.shardings[i], self.dests.dtypes[i], local, i)
               for i in range(len(values))]
        if donate:
            delete_sources(values, self.kept())
        return out

    def kept(self) -> set[int]:
        """Leaves whose source arrays the outputs use (not deleted when donated)."""
        return set(self.dests.passthrough) | {i for i, _ in self.dests.reuse}

    def local_outputs(self, shards: SourceShards, progress: Any = None) -> dict[tuple[int, int], Any]:
        """Runs the transport; every destination shard on this process's devices, by (leaf, device)."""
        self._run.progress = progress
        try:
            results = self._run(shards)
        finally:
            self._run.progress = None
        dests = self.dests
        out: dict[tuple[int, int], Any] = {}
        for leaf, boxes in enumerate(dests.boxes):
            for d in boxes:
                if d not in dests.local_ids:
                    continue
                if leaf in dests.passthrough or (leaf, d) in dests.reuse:
                    out[(leaf, d)] = shards.get(leaf, d)
                elif (leaf, d) in results:
                    out[(leaf, d)] = results[(leaf, d)]
                else:  # an empty shard (a dim of size 0): nothing moves into it
                    out[(leaf, d)] = host.aligned_empty(dests.shape(leaf, d), dests.dtypes[leaf])
        return out


def assemble(shape: tuple[int, ...], sharding: Sharding, dtype: np.dtype, shards: Mapping[tuple[int, int], Any],
             leaf: int) -> jax.Array:
    """The array of ``sharding`` whose shard on each of this process's devices is ``shards[(leaf, device)]``."""
    indices: Mapping[Any, Any] = sharding.addressable_devices_indices_map(shape)
    values = [shards[(leaf, dev.id)] for dev in indices]
    if all(isinstance(v, np.ndarray) for v in values):
        return host.place(shape, sharding, dtype, indices, values)
    arrays = [jax.device_put(v, dev) if isinstance(v, np.ndarray) else v
              for v, dev in zip(values, indices, strict=True)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


def delete_sources(values: Sequence[jax.Array], kept: set[int]) -> None:
    """Deletes the donated source arrays whose buffers no output uses."""
    for i, v in enumerate(values):
        if i not in kept:
            v.delete()


@functools.lru_cache(maxsize=EXECUTOR_CACHE_SIZE)
def executor(spec: Spec) -> Executor:
    """The executor for ``spec``, built on first use (the most recently used ones are kept)."""
    return Executor(spec)



def sharding_of(layout: Layout, devices: Mapping[int, Any]) -> NamedSharding:
    """The jax sharding of a jreshard ``Layout`` (its mesh looked up by device id)."""
    mesh = jax.sharding.Mesh(np.array([devices[d] for d in layout.mesh.device_ids], dtype=object)
                             .reshape(layout.mesh.shape), layout.mesh.axis_names)
    return NamedSharding(mesh, P(*(None if not axes else axes[0] if len(axes) == 1 else axes
                                   for axes in layout.dim_axes)))


class TwoStageExecutor:
    """Hierarchical delivery of a ``Spec``: stage 1 into each domain once, stage 2 inside each domain.

    Stage 1 is an ``Executor`` for the core stage-1 plan (each leaf once per part of its
    destination: ``jreshard.core.hierarchical.stage_parts``), run with the spec's
    transport. Stage 2 is an ``Executor`` for the fan-out, reading stage 1's shards in
    place: when every domain that fans out lies in one JAX process, each process runs
    only its own domains with local copies (``memcpy`` on CPU, else ``device_put``);
    otherwise all processes run it with the spec's transport. Both run under the
    spec's cap. The outputs are assembled from the shards of the parts.
    """

    def __init__(self, spec: Spec, names: tuple[str, ...], two_stage: TwoStagePlan) -> None:
        devices = {d.id: d for d in jax.devices()}
        me = jax.process_index()
        self.spec, self.two_stage = spec, two_stage
        n = len(spec.tplans)
        # Stage-1 leaves: (leaf, part), with each part's stage-1 and final layouts.
        self.parts: list[tuple[int, StagePart]] = [(i, part) for i in range(n)
                                                   for part in stage_parts(spec.dst[i], two_stage.domains)]
        keys = [f"{names[i]}@{part.part}" for i, part in self.parts]
        s1 = two_stage.stage1
        self.stage1 = executor(Spec(
            s1, tuple(spec.sources[i] for i, _ in self.parts),
            tuple(sharding_of(part.stage1, devices) for _, part in self.parts),
            tuple(spec.src_dtypes[i] for i, _ in self.parts), tuple(spec.dtypes[i] for i, _ in self.parts),
            spec.transport, spec.cap, spec.host_packing, tuple(s1[k] for k in keys),
            tuple(spec.src[i] for i, _ in self.parts), tuple(part.stage1 for _, part in self.parts)))
        # Stage-1 leaves that fan out, with their final layouts.
        finals = {k: part.final for k, (_, part) in enumerate(self.parts) if part.final is not None}
        process_of = {d: dev.process_index for d, dev in devices.items()}
        owners = {k: {process_of[d] for d in t.mesh.device_ids} for k, t in finals.items()}
        if all(len(p) == 1 for p in owners.values()):  # each process fans out its own domains, locally
            fan = [k for k in finals if owners[k] == {me}]
            on_cpu = {devices[d].platform for k in fan for d in finals[k].mesh.device_ids} <= {"cpu"}
            transport = "memcpy" if on_cpu and spec.transport != "device_put" else "device_put"
        else:
            fan, transport = list(finals), spec.transport
        self.fan = tuple(fan)  # stage-1 leaves that stage 2 reads, in stage-2 leaf order
        self.stage2 = None
        if fan and two_stage.stage2 is not None:
            s2 = two_stage.stage2
            first = [self.parts[k][1].stage1 for k in fan]
            final = [finals[k] for k in fan]
            dtypes = tuple(spec.dtypes[self.parts[k][0]] for k in fan)
            self.stage2 = executor(Spec(
                s2, tuple(sharding_of(lay, devices) for lay in first),
                tuple(sharding_of(lay, devices) for lay in final),
                dtypes, dtypes, transport, spec.cap, spec.host_packing and transport != "memcpy",
                tuple(s2[keys[k]] for k in fan), tuple(first), tuple(final)))
        self.transports = (spec.transport, transport if self.stage2 is not None else None)

    @property
    def link_bytes(self) -> Counter[tuple[int, int]]:
        """Payload bytes this process's devices sent in the last call (both stages), per (sender, receiver)."""
        out = Counter(self.stage1.link_bytes)
        if self.stage2 is not None:
            out.update(self.stage2.link_bytes)
        return out

    @property
    def total_bytes(self) -> int:
        return self.stage1.total_bytes + (self.stage2.total_bytes if self.stage2 is not None else 0)

    def __call__(self, values: Sequence[jax.Array], donate: bool, progress: Any = None) -> list[jax.Array]:
        """One sync in two stages: the outputs in leaf order, as ``Executor.__call__``."""
        spec = self.spec
        part_values = [values[i] for i, _ in self.parts]
        first = self.stage1.local_outputs(self.stage1.source_shards(part_values), progress)
        final: dict[tuple[int, int], Any] = {}
        for k, (i, part) in enumerate(self.parts):
            if part.final is None:
                final.update(((i, d), x) for (kk, d), x in first.items() if kk == k)
        if self.stage2 is not None:
            given = {(j, d): x for j, k in enumerate(self.fan) for (kk, d), x in first.items() if kk == k}
            second = self.stage2.local_outputs(self.stage2.source_shards((), given), progress)
            final.update(((self.parts[self.fan[j]][0], d), x) for (j, d), x in second.items())
        out = [assemble(spec.dst[i].shape, spec.targets[i], spec.dtypes[i], final, i) for i in range(len(values))]
        if donate:
            kept = {self.parts[k][0] for k in self.stage1.kept()}
            delete_sources(values, kept)
        return out


@functools.lru_cache(maxsize=EXECUTOR_CACHE_SIZE)
def two_stage_executor(spec: Spec, names: tuple[str, ...], two_stage: TwoStagePlan) -> TwoStageExecutor:
    """The hierarchical executor for ``spec`` (cached like ``executor``)."""
    return TwoStageExecutor(spec, names, two_stage)
