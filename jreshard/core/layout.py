"""Layout: a global tensor shape, a Mesh and a partition spec (JAX semantics)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import numpy as np

from jreshard.core.box import Box
from jreshard.core.dtypes import canonical_dtype, itemsize_of
from jreshard.core.mesh import Mesh

__all__ = ["Layout", "Box", "canonical_dtype", "itemsize_of"]


def _is_partition_spec(spec: Any) -> bool:
    # jax.sharding.PartitionSpec (class `jax.P` in recent releases) is no longer a
    # tuple subclass; recognise it without importing jax.
    cls = type(spec)
    return cls.__name__ in ("PartitionSpec", "P") and cls.__module__.split(".")[0] == "jax"


def _parse_spec(spec: Any, mesh: Mesh, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Parses ``spec`` into one tuple of axis names per dim (``None`` -> ``()``)."""
    if spec is None:
        spec = ()
    if not (isinstance(spec, (tuple, list)) or _is_partition_spec(spec)):
        raise TypeError(
            f"spec must be a tuple, list or jax.sharding.PartitionSpec, got "
            f"{type(spec).__name__} {spec!r}; pass for example ('fsdp', None)."
        )
    entries = list(spec)
    if len(entries) > ndim:
        raise ValueError(
            f"spec {tuple(entries)!r} has {len(entries)} entries but the tensor has {ndim} dims; "
            "give at most one entry per dim."
        )
    parsed: list[tuple[str, ...]] = []
    seen: dict[str, int] = {}
    for dim, entry in enumerate(entries):
        if entry is None:
            axes: tuple = ()
        elif isinstance(entry, str):
            axes = (entry,)
        elif isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
            axes = tuple(entry)
        else:
            raise TypeError(
                f"spec entry {entry!r} for dim {dim} of spec {tuple(entries)!r} must be None, "
                "a mesh axis name or a tuple of axis names."
            )
        for axis in axes:
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"spec {tuple(entries)!r} names axis {axis!r} (dim {dim}), which is not in the "
                    f"mesh; its axes are {mesh.axis_names!r}."
                )
            if axis in seen:
                raise ValueError(
                    f"spec {tuple(entries)!r} uses axis {axis!r} twice (dims {seen[axis]} and {dim}); "
                    "a mesh axis may shard at most one dim."
                )
            seen[axis] = dim
        parsed.append(axes)
    parsed.extend(() for _ in range(ndim - len(parsed)))
    return tuple(parsed)


_INT64_MAX = (1 << 63) - 1


def _parse_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    if isinstance(shape, np.ndarray) and shape.ndim == 1:
        shape = shape.tolist()
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shape must be a tuple of ints, got {type(shape).__name__} {shape!r}.")
    for n in shape:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"shape must hold ints, got {n!r} in {tuple(shape)!r}.")
        if n < 0:
            raise ValueError(f"shape must have non-negative dims, got {n} in {tuple(shape)!r}.")
        if int(n) > _INT64_MAX:
            raise ValueError(f"shape dims must fit in int64 (at most 2**63 - 1), got {n} in {tuple(shape)!r}.")
    return tuple(int(n) for n in shape)



def _check_nbytes(shape: tuple[int, ...], itemsize: int, mesh: Mesh, spec: tuple[tuple[str, ...], ...]) -> None:
    # Planner arithmetic is int64: a tensor must be addressable in bytes within it, and so must
    # the end of every shard (k chunks of ceil(n / k) may reach past n).
    if math.prod(shape) * itemsize > _INT64_MAX:
        raise ValueError(
            f"shape {shape} holds {math.prod(shape) * itemsize} bytes, more than the 2**63 - 1 the planner "
            "can count; split the tensor into smaller ones."
        )
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    for d, (n, axes) in enumerate(zip(shape, spec, strict=True)):
        k = math.prod(sizes[a] for a in axes)
        if -(-n // k) * k > _INT64_MAX:
            raise ValueError(
                f"shape {shape}: dim {d} of {n} split {k} ways gives chunks of {-(-n // k)} that reach "
                f"{-(-n // k) * k}, past the 2**63 - 1 the planner can count; split the tensor into smaller ones."
            )


@dataclasses.dataclass(frozen=True, slots=True)
class _Grid:
    """How a layout cuts a tensor, independent of which ids the devices have.

    ``parts[d]`` shards dim d into ``chunk[d]``-sized chunks; ``groups`` lists the mesh positions holding
    each distinct shard (its replicas), in flat shard order.
    """

    parts: tuple[int, ...]
    chunk: tuple[int, ...]
    shard_flat: np.ndarray  # [mesh size] flat shard id
    groups: np.ndarray  # [num shards, replicas] mesh positions
    start: np.ndarray  # [mesh size, ndim]
    stop: np.ndarray  # [mesh size, ndim]


@functools.lru_cache(maxsize=8192)
def _grid(shape: tuple[int, ...], mesh_shape: tuple[int, ...], axis_names: tuple[str, ...],
          spec: tuple[tuple[str, ...], ...]) -> _Grid:
    size = math.prod(mesh_shape)
    coords = np.indices(mesh_shape, dtype=np.int64).reshape(len(mesh_shape), size)
    sizes = dict(zip(axis_names, mesh_shape, strict=True))
    ndim = len(shape)
    parts, chunk = [], []
    index = np.zeros((size, ndim), dtype=np.int64)
    for d, axes in enumerate(spec):
        k = 1
        for axis in axes:  # major to minor
            index[:, d] = index[:, d] * sizes[axis] + coords[axis_names.index(axis)]
            k *= sizes[axis]
        parts.append(k)
        chunk.append(-(-shape[d] // k))
    parts_t, chunk_t = tuple(parts), tuple(chunk)
    chunk_a = np.array(chunk_t, dtype=np.int64)
    shape_a = np.array(shape, dtype=np.int64)
    start = np.minimum(index * chunk_a, shape_a)
    stop = np.minimum(start + chunk_a, shape_a)
    flat = np.ravel_multi_index(index.T, parts_t) if ndim else np.zeros(size, dtype=np.int64)
    flat = np.asarray(flat, dtype=np.int64)
    order = np.argsort(flat, kind="stable")
    groups = order.reshape(math.prod(parts_t), -1)
    for a in (flat, groups, start, stop):
        a.setflags(write=False)
    return _Grid(parts_t, chunk_t, flat, groups, start, stop)


@dataclasses.dataclass(frozen=True, slots=True, init=False, eq=False)
class Layout:
    """Where the shards of one global tensor live: a shape, a Mesh and a partition spec.

    The spec has ``jax.sharding.PartitionSpec`` meaning: one entry per leading dim,
    each ``None``, an axis name or a tuple of axis names (major to minor); mesh axes
    not named replicate. A dim of size n split k ways gives shard i the range
    ``[i*c, min((i+1)*c, n))`` with ``c = ceil(n/k)``, possibly empty.

    Args:
      shape: the global tensor shape (any number of dims, 0-d and size-0 dims included).
      mesh: the devices.
      spec: a tuple, list or ``PartitionSpec``.
      dtype: optional element type; statistics count bytes with it, elements without.

    Example:
      >>> from jreshard import Layout, Mesh
      >>> mesh = Mesh([[0, 1], [2, 3]], ("dp", "tp"))
      >>> layout = Layout((6, 4), mesh, (None, "tp"), dtype="float32")
      >>> layout.shard_box(3)
      (slice(0, 6, None), slice(2, 4, None))
      >>> layout.holders((slice(0, 6), slice(0, 2)))
      (0, 2)
    """

    shape: tuple[int, ...]
    mesh: Mesh
    dim_axes: tuple[tuple[str, ...], ...]
    dtype: str | None
    _hash: int = dataclasses.field(repr=False)

    def __init__(self, shape: Any, mesh: Mesh, spec: Any = (), dtype: Any = None) -> None:
        shape_t = _parse_shape(shape)
        if not isinstance(mesh, Mesh):
            if type(mesh).__name__ == "Mesh" and hasattr(mesh, "axis_names"):
                mesh = Mesh.from_jax(mesh)
            else:
                raise TypeError(
                    f"mesh must be a jreshard.Mesh (or jax.sharding.Mesh), got {type(mesh).__name__}."
                )
        spec_t = _parse_spec(spec, mesh, len(shape_t))
        dtype_n = canonical_dtype(dtype)
        object.__setattr__(self, "shape", shape_t)
        object.__setattr__(self, "mesh", mesh)
        _check_nbytes(shape_t, itemsize_of(dtype_n), mesh, spec_t)
        object.__setattr__(self, "dim_axes", spec_t)
        object.__setattr__(self, "dtype", dtype_n)
        object.__setattr__(self, "_hash", hash((shape_t, mesh, spec_t, dtype_n)))

    @classmethod
    def from_jax(cls, shape: Any, sharding: Any, dtype: Any = None) -> Layout:
        """Converts a ``jax.sharding.NamedSharding`` (or a single-device sharding)."""
        mesh = getattr(sharding, "mesh", None)
        spec = getattr(sharding, "spec", None)
        if mesh is not None and spec is not None:
            return cls(shape, Mesh.from_jax(mesh), tuple(spec), dtype)
        device_set = getattr(sharding, "device_set", None)
        if device_set is not None and len(device_set) == 1:
            (device,) = tuple(device_set)
            return cls(shape, Mesh(np.array(device.id), ()), (), dtype)
        raise TypeError(
            f"sharding must be a jax.sharding.NamedSharding or a single-device sharding, "
            f"got {type(sharding).__name__}; express it as a NamedSharding over a Mesh."
        )

    def with_dtype(self, dtype: Any) -> Layout:
        return Layout(self.shape, self.mesh, self.dim_axes, dtype)

    @property
    def spec(self) -> tuple[str | tuple[str, ...] | None, ...]:
        """The spec as ``PartitionSpec`` entries, one per dim: ``None``, an axis name, or a tuple of names.

        ``dim_axes`` holds the same as one tuple of axis names per dim.

        Example:
          >>> from jreshard import Layout, Mesh
          >>> mesh = Mesh([[0, 1], [2, 3]], ("dp", "tp"))
          >>> Layout((8, 4, 2), mesh, (("dp", "tp"),)).spec, Layout((8, 4), mesh, (None, "tp")).spec
          ((('dp', 'tp'), None, None), (None, 'tp'))
        """
        return tuple(None if not axes else axes[0] if len(axes) == 1 else axes for axes in self.dim_axes)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element, or 1 when the layout has no dtype (statistics count elements)."""
        return itemsize_of(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def grid(self) -> _Grid:
        return _grid(self.shape, self.mesh.shape, self.mesh.axis_names, self.dim_axes)

    @property
    def num_shards(self) -> int:
        """The number of distinct shards (mesh size divided by the replication)."""
        return math.prod(self.grid.parts)

    @property
    def replication(self) -> int:
        """How many devices hold each shard."""
        return self.mesh.size // self.num_shards

    def shard_box(self, device: int) -> Box:
        """The box ``device`` holds, one ``slice`` per dim in global coordinates."""
        pos = self.mesh.position(device)
        g = self.grid
        return Box._trusted(g.start[pos], g.stop[pos])

    def shard_shape(self, device: int) -> tuple[int, ...]:
        return self.shard_box(device).shape

    def shards(self) -> dict[int, Box]:
        """Every device's shard, in mesh order."""
        g = self.grid
        return {
            d: Box._trusted(g.start[i], g.stop[i]) for i, d in enumerate(self.mesh.device_ids)
        }

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """The devices holding each distinct shard, in shard order."""
        ids = np.array(self.mesh.device_ids)
        return tuple(tuple(int(x) for x in ids[row]) for row in self.grid.groups)

    def holders(self, box: Any) -> tuple[int, ...]:
        """The devices whose shard contains all of ``box`` (its replicas), in mesh order."""
        box = _parse_box(box, self.shape)
        lo = np.array([s.start for s in box], dtype=np.int64)
        hi = np.array([s.stop for s in box], dtype=np.int64)
        if (hi <= lo).any():
            return self.mesh.device_ids  # every shard contains an empty box
        g = self.grid
        inside = np.flatnonzero(((g.start <= lo) & (g.stop >= hi)).all(axis=1))
        return tuple(self.mesh.device_ids[i] for i in inside.tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.shape == other.shape
            and self.dim_axes == other.dim_axes
            and self.dtype == other.dtype
            and self.mesh == other.mesh
        )

    def __hash__(self) -> int:
        return self._hash

    @property
    def spec_str(self) -> str:
        """The spec as ``P('fsdp', None)``-style text (trailing ``None`` dropped)."""
        entries = []
        for axes in self.dim_axes:
            entries.append("None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(axes))
        while entries and entries[-1] == "None":
            entries.pop()
        return "P(" + ", ".join(entries) + ")"

    def __repr__(self) -> str:
        dtype = f", {self.dtype}" if self.dtype else ""
        return f"Layout({self.shape}{dtype}, {self.spec_str}, {self.mesh!r})"

    def __getstate__(self):
        return (self.shape, self.mesh, self.dim_axes, self.dtype)

    def __setstate__(self, state):
        Layout.__init__(self, *state)


def _parse_box(box: Any, shape: tuple[int, ...]) -> Box:
    if not isinstance(box, (tuple, list)) or len(box) != len(shape):
        raise ValueError(f"box must be a tuple of {len(shape)} slices for shape {shape}, got {box!r}.")
    out = []
    for s, n in zip(box, shape, strict=True):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError(f"box must hold slice(start, stop) entries, got {s!r} in {box!r}.")
        start, stop, _ = s.indices(n)
        out.append(slice(start, max(start, stop)))
    return Box(out)
