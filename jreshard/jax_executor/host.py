"""Host memory for backends whose device buffers are host memory (CPU).

There the executor copies with NumPy into 64-byte-aligned blocks, which jax's CPU
client adopts without a copy. On the machines measured, faulting in fresh pages
cost more than filling them, so blocks are kept between syncs: destination shards
come from an ``OutputPool`` and outgoing messages are packed into one kept staging
arena per sending device (``Staging``). The copies run on a small thread pool
(NumPy copies release the GIL).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import math
import os
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from jreshard.core.schedule import ALIGN  # jax's CPU client adopts buffers aligned to it without a copy

# What jax.make_array_from_callback places with (it gives replicas one shared buffer, which
# donation could write through, so the executor calls it with a buffer per device itself).
_batched_device_put: Callable[..., Any] | None
try:
    from jax._src import core as _jax_core
    from jax._src.interpreters.pxla import batched_device_put as _batched_device_put
except ImportError:  # pragma: no cover - a jax without it: the public route
    _batched_device_put = None

__all__ = ["aligned_empty", "uint_dtype", "as_uint", "OutputPool", "OUTPUTS", "Staging", "STAGING", "place",
           "parallel_map", "release_transfer_buffers", "LOCK"]
_UINT: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

T = TypeVar("T")
R = TypeVar("R")


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array on a 64-byte boundary."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + n].view(dtype).reshape(shape)


def uint_dtype(itemsize: int) -> type[np.unsignedinteger]:
    """The unsigned integer as wide as an element: copies in it keep every bit."""
    return _UINT[itemsize]


def as_uint(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` as unsigned integers of its element's width."""
    return a.view(np.uint8 if a.dtype == np.bool_ else _UINT[a.dtype.itemsize])


_THREADS = max(2, min(8, os.cpu_count() or 2))


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="jreshard-memcpy")


def place(shape: tuple[int, ...], sharding: Any, dtype: Any, indices: Mapping[Any, Any],
          shards: Sequence[np.ndarray]) -> Any:
    """The jax Array of ``sharding`` whose shard on each device of ``indices`` (jax's order) is in ``shards``.

    One placement per array, as ``jax.make_array_from_callback`` does it, costs a
    tenth of placing each shard with ``jax.device_put`` and assembling them (on CPU
    the aligned buffers are adopted without a copy either way). Each device gets its
    own buffer, replicas included, so that donating one never writes another.
    """
    if _batched_device_put is None:
        placed = jax.device_put(list(shards), list(indices))
        return jax.make_array_from_single_device_arrays(shape, sharding, placed, dtype=dtype)
    aval = _jax_core.update_aval_with_sharding(_jax_core.ShapedArray(shape, dtype), sharding)
    return _batched_device_put(aval, sharding, list(shards), list(indices))


def parallel_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``fn`` over ``items`` on the copy threads (in this thread for a single item).

    ``fn`` runs without NumPy's floating-point error reports: a cast inside a copy
    meets NaNs and overflows as data, exactly as XLA's does.
    """
    items = list(items)
    # A task per thread and a few more, each a stride of the items: submitting thousands of
    # small copies one by one cost more than the copies.
    n = min(len(items), 4 * _THREADS)

    def run(k: int) -> list[R]:
        with np.errstate(all="ignore"):  # thread-local, so set in the thread that copies
            return [fn(x) for x in items[k::n]]

    if n <= 1:
        return run(0) if items else []
    strides = list(_pool().map(run, range(n)))
    out: list[R] = [None] * len(items)  # type: ignore[list-item]
    for k, results in enumerate(strides):
        out[k::n] = results
    return out


class OutputPool:
    """A caching allocator for the destination shards that host copies write.

    Each shard is a view of a 64-byte-aligned block. The view is made through a
    ctypes array over the block, which is the object jax keeps alive as long as any
    array uses the memory; when it is collected the block goes back to the pool, to
    be refilled by the next sync of the same shapes. The pool keeps free blocks up
    to the largest output of one sync seen so far (``reserve``), so a loop that
    keeps one set of synced weights alive holds at most one extra set.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._leased: dict[int, np.ndarray] = {}
        self._free_bytes = 0
        self._limit = 0
        self._next = 0
        self._lock = threading.RLock()  # re-entrant: a collection inside take() may give a block back

    def reserve(self, nbytes: int) -> None:
        """Keeps up to ``nbytes`` of free blocks from now on (the largest reservation wins)."""
        with self._lock:
            self._limit = max(self._limit, nbytes)

    def take(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An aligned array of ``shape`` whose block returns to the pool once nothing uses it."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if nbytes == 0:
            return aligned_empty(shape, dtype)
        with self._lock:
            blocks = self._free.get(nbytes)
            block = blocks.pop() if blocks else None
            if block is not None:
                self._free_bytes -= nbytes
            token, self._next = self._next, self._next + 1
        if block is None:
            block = aligned_empty((nbytes,), np.uint8)
        with self._lock:
            self._leased[token] = block
        owner = (ctypes.c_uint8 * nbytes).from_address(block.ctypes.data)
        weakref.finalize(owner, self._give_back, token).atexit = False
        return np.frombuffer(owner, np.uint8).view(dtype).reshape(shape)

    def _give_back(self, token: int) -> None:
        with self._lock:
            block = self._leased.pop(token)
            if self._free_bytes + block.nbytes <= self._limit:
                self._free[block.nbytes].append(block)
                self._free_bytes += block.nbytes

    def clear(self) -> None:
        """Drops the free blocks and the reservation; blocks in use are dropped when freed."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
            self._limit = 0

    def stats(self) -> tuple[int, int]:
        """(bytes of free blocks kept, bytes of blocks in use by live arrays)."""
        with self._lock:
            return self._free_bytes, sum(b.nbytes for b in self._leased.values())


class Staging:
    """Kept per-device host buffers: a send arena per sender and zeros for idle rounds.

    The arena of a sending device holds the largest bucket's outgoing messages seen
    so far (so at most the cap); the zeros are what a device that sends nothing in
    a round hands ``ppermute``. Shared by all plans; callers hold ``LOCK``.
    """

    def __init__(self) -> None:
        self._arenas: dict[int, np.ndarray] = {}
        self._zeros: dict[int, np.ndarray] = {}

    def arena(self, device: int, nbytes: int) -> np.ndarray:
        """The device's send arena, grown to at least ``nbytes``."""
        arena = self._arenas.get(device)
        if arena is None or len(arena) < nbytes:
            arena = self._arenas[device] = aligned_empty((nbytes,), np.uint8)
        return arena

    def zeros(self, device: int, nbytes: int) -> np.ndarray:
        """``nbytes`` zero bytes kept for the device."""
        zeros = self._zeros.get(device)
        if zeros is None or len(zeros) < nbytes:
            zeros = self._zeros[device] = aligned_empty((nbytes,), np.uint8)
            zeros[...] = 0
        return zeros[:nbytes]

    def clear(self) -> None:
        self._arenas.clear()
        self._zeros.clear()


OUTPUTS = OutputPool()
STAGING = Staging()
# Serialises syncs: they share STAGING (and an executor's state between its buckets).
LOCK = threading.Lock()


def release_transfer_buffers() -> None:
    """Frees the staging buffers and cached output blocks kept between syncs.

    Blocks still used by live arrays are freed when those arrays are.
    """
    with LOCK:
        STAGING.clear()
        OUTPUTS.clear()
