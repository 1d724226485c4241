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
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from jreshard.core.layout import Layout
from jreshard.core.plans import Plan, TensorPlan
from jreshard.core.schedule import Piece, pieces, schedule
from jreshard.jax_executor import host, programs
from jreshard.jax_executor.buckets import BucketRunner, Results, Transport, build_programs
from jreshard.jax_executor.casts import HostCasts
from jreshard.jax_executor.shards import Destinations, SourceShards

__all__ = ["Spec", "Executor", "executor", "EXECUTOR_CACHE_SIZE"]

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

    def __call__(self, shards: SourceShards) -> Results:
        dests = self.dests
        views = shards.host_views(self.sources)
        host.OUTPUTS.reserve(dests.output_bytes)

        def fill(c: ShardCopy) -> np.ndarray:
            out = host.OUTPUTS.take(dests.shape(c.leaf, c.device), host.uint_dtype(dests.dtypes[c.leaf].itemsize))
            sink = shards.casts.sink(c.leaf, out)
            for p in c.pieces:
                sink[p.dst_box] = views[(c.leaf, p.src)][p.src_box]
            return out.view(dests.dtypes[c.leaf])

        filled = host.parallel_map(fill, self.copies)
        return {(c.leaf, c.device): x for c, x in zip(self.copies, filled, strict=True)}


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
        self._run: Callable[[SourceShards], Results]
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

    def __call__(self, values: Sequence[jax.Array], donate: bool) -> list[jax.Array]:
        """One sync: the outputs in leaf order; deletes the sources that are not kept when ``donate``."""
        shards = SourceShards(values, self._casts)
        results = self._run(shards)
        out = [values[i] if i in self.dests.passthrough else self._assemble(i, shards, results)
               for i in range(len(values))]
        if donate:
            kept = self.dests.passthrough | {i for i, _ in self.dests.reuse}
            for i, v in enumerate(values):
                if i not in kept:
                    v.delete()
        return out

    def _assemble(self, leaf: int, shards: SourceShards, results: Results) -> jax.Array:
        dests, shape, dtype = self.dests, self.dests.shapes[leaf], self.dests.dtypes[leaf]
        sharding = dests.shardings[leaf]
        values: list[jax.Array | np.ndarray] = []
        indices: Mapping[Any, Any] = sharding.addressable_devices_indices_map(shape)
        for dev in indices:
            if (leaf, dev.id) in dests.reuse:
                values.append(shards.get(leaf, dev.id))
            elif (leaf, dev.id) in results:
                values.append(results[(leaf, dev.id)])
            else:  # an empty shard (a dim of size 0): nothing moves into it
                values.append(host.aligned_empty(dests.shape(leaf, dev.id), dtype))
        if all(isinstance(v, np.ndarray) for v in values):
            return host.place(shape, sharding, dtype, indices, values)  # type: ignore[arg-type]
        arrays = [jax.device_put(v, dev) if isinstance(v, np.ndarray) else v
                  for v, dev in zip(values, indices, strict=True)]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


@functools.lru_cache(maxsize=EXECUTOR_CACHE_SIZE)
def executor(spec: Spec) -> Executor:
    """The executor for ``spec``, built on first use (the most recently used ones are kept)."""
    return Executor(spec)

