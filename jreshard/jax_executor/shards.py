"""What an executor reads and writes: one sync's source shards, and the destination shards it builds."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from jreshard.core.box import Box
from jreshard.core.layout import Layout
from jreshard.core.plans import TensorPlan
from jreshard.jax_executor import host
from jreshard.jax_executor.casts import HostCasts

__all__ = ["Destinations", "SourceShards"]


@dataclasses.dataclass(frozen=True, slots=True)
class Destinations:
    """Per leaf, the destination shards an executor must produce, and which it can skip."""

    shapes: tuple[tuple[int, ...], ...]  # global shapes
    shardings: tuple[Sharding, ...]  # the target shardings
    dtypes: tuple[np.dtype, ...]  # output dtypes
    boxes: tuple[Mapping[int, Box], ...]  # per leaf, device -> destination shard
    passthrough: frozenset[int]  # leaves returned as they are (same sharding and dtype)
    reuse: frozenset[tuple[int, int]]  # (leaf, device) whose source shard is its destination shard
    local_ids: frozenset[int]  # the devices of this process
    union: tuple[int, ...]  # every source and destination device of the leaves that move
    output_bytes: int  # of the destination shards one sync writes on this process's devices

    @classmethod
    def build(cls, tplans: Sequence[TensorPlan], src: Sequence[Layout], dst: Sequence[Layout],
              sources: Sequence[Sharding], targets: Sequence[Sharding], src_dtypes: Sequence[np.dtype],
              dtypes: Sequence[np.dtype], local_ids: Iterable[int]) -> Destinations:
        n = len(tplans)
        passthrough = frozenset(i for i in range(n) if src[i] == dst[i] and sources[i] == targets[i])
        reuse: set[tuple[int, int]] = set()
        for i, tp in enumerate(tplans):
            if i in passthrough or src_dtypes[i] != dtypes[i]:
                continue
            # The planner never sends a device what it holds, so such a shard has one local move.
            held = tp.src.shards()
            reuse.update((i, d) for d, box in tp.dst.shards().items() if held.get(d) == box)
        union = sorted({d for i, tp in enumerate(tplans) if i not in passthrough
                        for d in tp.src.mesh.device_ids + tp.dst.mesh.device_ids})
        boxes = tuple(tp.dst.shards() for tp in tplans)
        local = frozenset(local_ids)
        output_bytes = sum(box.size * dtypes[i].itemsize for i, shards in enumerate(boxes)
                           for d, box in shards.items()
                           if d in local and i not in passthrough and (i, d) not in reuse)
        return cls(tuple(tp.shape for tp in tplans), tuple(targets), tuple(dtypes), boxes, passthrough,
                   frozenset(reuse), local, tuple(union), output_bytes)

    def shape(self, leaf: int, device: int) -> tuple[int, ...]:
        """The shape of ``device``'s destination shard of ``leaf``."""
        return self.boxes[leaf][device].shape



class SourceShards:
    """One sync's source shards by (leaf, device), looked up once per leaf."""

    def __init__(self, values: Sequence[jax.Array], casts: HostCasts,
                 given: Mapping[tuple[int, int], jax.Array | np.ndarray] | None = None) -> None:
        """``given``: the shards by (leaf, device) instead of ``values``' (the output of an earlier stage)."""
        self._values = values
        self.casts = casts
        self._given = given
        self._shards: dict[int, dict[int, jax.Array]] = {}
        self._views: dict[tuple[int, int], np.ndarray] = {}

    def get(self, leaf: int, device: int) -> jax.Array:
        """The shard of ``leaf`` on ``device``, as the caller passed it."""
        if self._given is not None:
            return self._given[(leaf, device)]  # type: ignore[return-value]  # host memory is read alike
        if leaf not in self._shards:
            self._shards[leaf] = {s.device.id: s.data for s in self._values[leaf].addressable_shards}
        return self._shards[leaf][device]

    def host_views(self, needed: Iterable[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
        """Zero-copy NumPy views of the ``needed`` (leaf, device) shards, to be copied into ``casts.sink``.

        Returned to the calling thread before any copy starts (casts run on the copy threads).
        """
        missing = [key for key in dict.fromkeys(needed) if key not in self._views]
        shards = [(key[0], self.get(*key)) for key in missing]
        views = host.parallel_map(lambda item: self.casts.source(*item), shards)
        self._views.update(zip(missing, views, strict=True))
        return self._views
