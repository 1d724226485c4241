"""Launching pack and unpack programs: once per device, or once for all the devices that run the same one.

A program compiled for one device is compiled again for every other device, even
when it does the same work: on accelerators that made the first sync of a model
cost one compile per device and bucket. Devices of this process whose programs
do the same work on arrays of the same shapes run it as one ``shard_map`` over a
1-D mesh of them, their arrays stacked along dim 0 (without a copy), so it
compiles once. Work that passes a scalar (nothing to stack on) runs per device.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jreshard.jax_executor import programs

__all__ = ["Launch", "launches"]


@dataclasses.dataclass(frozen=True, slots=True)
class Launch:
    """One compiled program run for ``devices``: per device, or stacked over a mesh of them."""

    devices: tuple[int, ...]
    fn: Callable[..., tuple[jax.Array, ...]]
    sharding: NamedSharding | None  # dim 0 over the mesh of ``devices``; None: one device

    def __call__(self, args: Sequence[tuple[Any, ...]]) -> list[tuple[jax.Array, ...]]:
        """Each device's results, given each device's arguments (in ``devices`` order)."""
        if self.sharding is None:
            return [self.fn(*args[0])]
        sharding, n = self.sharding, len(self.devices)

        def stack(*xs: jax.Array) -> jax.Array:
            return jax.make_array_from_single_device_arrays((n * xs[0].shape[0], *xs[0].shape[1:]), sharding, list(xs))

        outs = self.fn(*jax.tree.map(stack, *args))
        per = [{s.device.id: s.data for s in o.addressable_shards} for o in outs]
        return [tuple(p[d] for p in per) for d in self.devices]


def launches(work: Mapping[int, tuple[programs.PackArgs | programs.UnpackArgs, Hashable, bool]],
             devices: Mapping[int, Any]) -> tuple[Launch, ...]:
    """The launches for ``work``: device -> (program arguments, the shapes it passes, whether all can stack).

    Devices with equal arguments and shapes that can all stack share one launch.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    for d, (args, shapes, stackable) in work.items():
        groups[(args, shapes, stackable)].append(d)
    out = []
    for (args, _, stackable), members in groups.items():
        if len(members) > 1 and stackable:
            mesh = jax.sharding.Mesh(np.array([devices[d] for d in members], dtype=object), (programs.AXIS,))
            out.append(Launch(tuple(members), programs.program(args, mesh), NamedSharding(mesh, P(programs.AXIS))))
        else:
            out.extend(Launch((d,), programs.program(args, None), None) for d in members)
    return tuple(out)
