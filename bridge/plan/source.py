"""The trainer side as the planner sees it: each JAX leaf's Layout over *source ids*.

One id space for the planner: torch global ranks ``0 .. SOURCE_BASE-1`` are the
inference ranks (destinations); JAX device ``local`` of the trainer process with
torch rank ``rank`` is source id ``SOURCE_BASE + rank * 1000 + local``. A printed
plan therefore reads ``1001001 -> 3``: rank 1's second device sends to rank 3.
``local`` is the device's position among its process's devices in JAX device-id
order. Everything here is pure: an inference process builds the same ``Source``
from the model config that the trainer derives from its jax arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.core.args import check_int, check_ints
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh

__all__ = ["SOURCE_BASE", "MAX_LOCAL_DEVICES", "source_id", "split_source_id", "trainer_mesh", "Source"]

SOURCE_BASE = 1_000_000
MAX_LOCAL_DEVICES = 1000


def source_id(rank: int, local: int) -> int:
    """The planner id of JAX device ``local`` of the trainer process with torch rank ``rank``.

    Example:
      >>> from bridge import source_id, split_source_id
      >>> source_id(1, 1), split_source_id(1001001)
      (1001001, (1, 1))
    """
    for arg, v, hi in (("rank", rank, SOURCE_BASE), ("local", local, MAX_LOCAL_DEVICES)):
        if check_int(arg, v) >= hi:
            raise ValueError(f"{arg} must be an int in [0, {hi}), got {v!r}.")
    return SOURCE_BASE + int(rank) * MAX_LOCAL_DEVICES + int(local)


def split_source_id(device: int) -> tuple[int, int]:
    """(torch rank, local device index) of a source id.

    Example:
      >>> from bridge import split_source_id
      >>> split_source_id(1000002)
      (0, 2)
      >>> split_source_id(3)
      Traceback (most recent call last):
      ...
      ValueError: device 3 is a torch rank, not a source id (>= 1000000).
    """
    device = check_int("device", device)
    if device < SOURCE_BASE:
        raise ValueError(f"device {device} is a torch rank, not a source id (>= {SOURCE_BASE}).")
    rank, local = divmod(device - SOURCE_BASE, MAX_LOCAL_DEVICES)
    return rank, local


def trainer_mesh(shape: Sequence[int], axis_names: Any, ranks: Sequence[int], devices_per_rank: int) -> Mesh:
    """A Mesh over source ids laid out process-major, as ``jax.make_mesh`` orders devices on CPU.

    Args:
      shape: the JAX mesh shape, e.g. ``(4,)``.
      axis_names: its axis names, e.g. ``("fsdp",)``.
      ranks: the torch ranks of the trainer processes, in JAX process-index order.
      devices_per_rank: JAX devices per trainer process.

    Example:
      >>> from bridge import trainer_mesh
      >>> trainer_mesh((4,), "fsdp", ranks=[0, 1], devices_per_rank=2)
      Mesh(fsdp=4; devices [1000000, 1000001, 1001000, 1001001])
    """
    shape = check_ints("shape", shape, minimum=1)
    devices_per_rank = check_int("devices_per_rank", devices_per_rank, minimum=1, maximum=MAX_LOCAL_DEVICES)
    ranks = check_ints("ranks", list(ranks) if isinstance(ranks, range) else ranks)
    ids = [source_id(r, local) for r in ranks for local in range(devices_per_rank)]
    if math.prod(shape) != len(ids):
        raise ValueError(
            f"shape {shape} holds {math.prod(shape)} devices but ranks {list(ranks)} x "
            f"devices_per_rank {devices_per_rank} give {len(ids)}; make them agree."
        )
    return Mesh(np.array(ids, dtype=np.int64).reshape(shape), axis_names)


class Source:
    """Every trainer leaf (by '/'-joined path) with its Layout over source ids.

    Args:
      leaves: ``{path: Layout}``; every mesh device must be a source id.

    Example:
      >>> from bridge import Source, trainer_mesh
      >>> from jreshard import Layout
      >>> mesh = trainer_mesh((2,), "fsdp", ranks=[0], devices_per_rank=2)
      >>> src = Source({"w": Layout((4, 2), mesh, ("fsdp",), "float32")})
      >>> src.ranks, src.layout("w").shard_box(1000001)
      ((0,), (slice(2, 4, None), slice(0, 2, None)))
    """

    __slots__ = ("_leaves", "_key", "_ranks")

    def __init__(self, leaves: Mapping[str, Layout]) -> None:
        if not isinstance(leaves, Mapping):
            raise TypeError(f"leaves must be a mapping of path -> Layout, got {type(leaves).__name__}.")
        if not leaves:
            raise ValueError("leaves must hold at least one path -> Layout; a Source of no leaves has nothing to send.")
        for path, layout in leaves.items():
            if not isinstance(path, str):
                raise TypeError(f"leaf paths must be str, got {path!r}.")
            if not isinstance(layout, Layout):
                raise TypeError(f"leaves[{path!r}] must be a jreshard.Layout, got {type(layout).__name__}.")
            low = [d for d in layout.mesh.device_ids if d < SOURCE_BASE]
            if low:
                raise ValueError(
                    f"leaves[{path!r}] has devices {low} below SOURCE_BASE={SOURCE_BASE}; name trainer "
                    "devices with bridge.source_id(rank, local) (or build the mesh with bridge.trainer_mesh)."
                )
        self._leaves = dict(sorted(leaves.items()))
        self._key = tuple((p, lay.shape, lay.dtype, lay.spec, lay.mesh.shape, lay.mesh.axis_names,
                           lay.mesh.device_ids) for p, lay in self._leaves.items())
        # Read on every sync (the handshake checks every trainer rank's role): computed once.
        self._ranks = tuple(sorted({split_source_id(d)[0] for lay in self._leaves.values()
                                    for d in lay.mesh.device_ids}))

    @classmethod
    def build(cls, shapes: Mapping[str, Sequence[int]], mesh: Mesh,
              spec: Callable[[str, tuple[int, ...]], Any] | Mapping[str, Any], dtype: Any = "float32") -> Source:
        """One Layout per leaf from shapes, a mesh and a spec (a ``{path: spec}`` or ``f(path, shape)``).

        Example:
          >>> from bridge import Source, trainer_mesh
          >>> from jreshard.nn import LlamaConfig, param_shapes, fsdp_spec
          >>> mesh = trainer_mesh((4,), "fsdp", ranks=[0, 1], devices_per_rank=2)
          >>> src = Source.build(param_shapes(LlamaConfig.load("llama-tiny")), mesh, fsdp_spec)
          >>> src.layout("lm_head/kernel")
          Layout((256, 1024), float32, P('fsdp'), Mesh(fsdp=4; devices [1000000, 1000001, 1001000, 1001001]))
        """
        out = {}
        for path, shape in shapes.items():
            shape_t = tuple(int(n) for n in shape)
            s = spec(path, shape_t) if callable(spec) else spec[path]
            out[path] = Layout(shape_t, mesh, s, dtype)
        return cls(out)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self._leaves)

    def layout(self, path: str) -> Layout:
        try:
            return self._leaves[path]
        except KeyError:
            raise ValueError(
                f"no trainer leaf {path!r}; the source has {len(self._leaves)} leaves, e.g. "
                f"{list(self._leaves)[:4]!r}."
            ) from None

    def items(self):
        return self._leaves.items()

    @property
    def ranks(self) -> tuple[int, ...]:
        """The torch ranks of the trainer processes holding any leaf."""
        return self._ranks

    def key(self) -> tuple:
        """A canonical, hashable description (what the fingerprint covers)."""
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Source) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __len__(self) -> int:
        return len(self._leaves)

    def __repr__(self) -> str:
        return f"Source({len(self._leaves)} leaves on trainer ranks {list(self.ranks)})"
