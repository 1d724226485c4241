"""Mesh: an N-D array of distinct integer device ids with one name per array axis.

Vocabulary used throughout jreshard: an *axis* is a mesh axis, a *dim* is a tensor
dimension, a *device* is a global device id or rank, a *box* is one half-open range
per dim, and a *shard* is the box a device holds.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy as np

__all__ = ["Mesh"]


def _parse_axis_names(axis_names: Any) -> tuple[str, ...]:
    if isinstance(axis_names, str):
        axis_names = (axis_names,)
    if not isinstance(axis_names, (tuple, list)):
        raise TypeError(
            f"axis_names must be a tuple of strings, got {type(axis_names).__name__} "
            f"{axis_names!r}; pass for example ('dp', 'tp')."
        )
    for name in axis_names:
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"axis_names must hold non-empty strings, got {name!r} in {tuple(axis_names)!r}."
            )
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(
            f"axis_names must be distinct, got {tuple(axis_names)!r}; give each mesh axis its own name."
        )
    return tuple(axis_names)


def _check_fits(ids: Any) -> None:
    big = [i for i in ids if i > _INT64_MAX]
    if big:
        raise ValueError(f"devices must be ids that fit in int64 (at most 2**63 - 1), got {big[0]}.")


_INT64_MAX = (1 << 63) - 1


def _parse_devices(devices: Any) -> np.ndarray:
    try:
        array = np.asarray(devices)
    except Exception as exc:  # ragged nested lists and the like
        raise TypeError(
            f"devices must be a rectangular array of integer device ids, got {devices!r}"
        ) from exc
    if array.size == 0:
        raise ValueError(f"devices must hold at least one device id, got shape {array.shape}.")
    if array.dtype == object:
        flat = array.reshape(-1)
        for item in flat:
            if isinstance(item, bool) or not isinstance(item, numbers.Integral):
                raise TypeError(
                    f"devices must hold integer device ids, got {item!r} "
                    f"({type(item).__name__}); pass ids such as [[0, 1], [2, 3]]."
                )
        _check_fits(int(x) for x in flat)
        array = np.array([int(x) for x in flat], dtype=np.int64).reshape(array.shape)
    elif array.dtype.kind not in "iu" or array.dtype == np.bool_:
        bad = array.reshape(-1)[0] if array.size else devices
        raise TypeError(
            f"devices must hold integer device ids, got dtype {array.dtype} (for example {bad!r}); "
            "pass ids such as [[0, 1], [2, 3]]."
        )
    if array.dtype == np.uint64:
        _check_fits(array.reshape(-1).tolist())
    array = array.astype(np.int64)
    if (array < 0).any():
        raise ValueError(
            f"devices must be non-negative ids, got {int(array.min())} in {array.tolist()!r}."
        )
    uniq, counts = np.unique(array, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1].tolist()
        raise ValueError(
            f"devices must be distinct, got {dup!r} more than once in {array.tolist()!r}."
        )
    return array


@dataclasses.dataclass(frozen=True, slots=True, init=False, eq=False)
class Mesh:
    """An N-D array of distinct device ids with one name per axis.

    Args:
      devices: array-like of distinct non-negative integers (JAX device ids or
        torch global ranks), of any rank and in any order.
      axis_names: one name per axis of ``devices`` (a single string for 1-D).

    Example:
      >>> from jreshard import Mesh
      >>> mesh = Mesh([[0, 1], [2, 3]], ("dp", "tp"))
      >>> mesh.shape, mesh.axis_sizes["tp"], mesh.device_ids
      ((2, 2), 2, (0, 1, 2, 3))
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_ids: tuple[int, ...]
    _position: dict = dataclasses.field(repr=False)
    _hash: int = dataclasses.field(repr=False)

    def __init__(self, devices: Any, axis_names: Any) -> None:
        names = _parse_axis_names(axis_names)
        array = _parse_devices(devices)
        if array.ndim != len(names):
            raise ValueError(
                f"devices has rank {array.ndim} (shape {array.shape}) but axis_names has "
                f"{len(names)} names {names!r}; give one name per devices axis."
            )
        ids = tuple(int(x) for x in array.reshape(-1))
        object.__setattr__(self, "shape", tuple(int(s) for s in array.shape))
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "_position", {d: i for i, d in enumerate(ids)})
        object.__setattr__(self, "_hash", hash((self.shape, names, ids)))

    @classmethod
    def from_jax(cls, mesh: Any) -> Mesh:
        """Converts a ``jax.sharding.Mesh`` (its device ids and axis names)."""
        devices = getattr(mesh, "devices", None)
        if devices is None or not hasattr(mesh, "axis_names"):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
        ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(np.asarray(devices))
        return cls(ids, tuple(mesh.axis_names))

    @property
    def devices(self) -> np.ndarray:
        """The device ids as an array of ``shape``."""
        return np.array(self.device_ids, dtype=np.int64).reshape(self.shape)

    @property
    def size(self) -> int:
        return len(self.device_ids)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape, strict=True))

    def position(self, device: int) -> int:
        """The flat (row-major) position of ``device`` in the mesh."""
        try:
            return self._position[device]
        except (KeyError, TypeError):
            raise ValueError(
                f"device {device!r} is not in the mesh; its devices are {list(self.device_ids)!r}."
            ) from None

    def __contains__(self, device: object) -> bool:
        try:
            return device in self._position
        except TypeError:
            return False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.shape == other.shape
            and self.axis_names == other.axis_names
            and self.device_ids == other.device_ids
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        ids = list(self.device_ids)
        if len(ids) > 16:
            shown = f"[{ids[0]}..{ids[-1]}]" if ids == list(range(ids[0], ids[0] + len(ids))) else f"{ids[:8]}..."
        else:
            shown = str(ids)
        return f"Mesh({axes}; devices {shown})"

    def __getstate__(self):
        return (self.devices.tolist(), self.axis_names)

    def __setstate__(self, state):
        Mesh.__init__(self, *state)
