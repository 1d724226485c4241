"""Casts in the host copies (CPU backends): by NumPy while copying, or one compiled program per dtype.

A cast program per leaf and device compiles once per (leaf, device): a first
bfloat16 sync of a few hundred leaves spent minutes compiling the same
conversion. The host copies instead cast with NumPy (ml_dtypes for the narrow
floats) where NumPy's conversion gives XLA's bits, inside the copy that packs or
places the piece (one pass over the bytes, no program). Every other dtype pair is
cast by one jitted program per output dtype run on host arrays, which places them
on the default device: it compiles once per input shape and dtype, not per leaf
or device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence

import jax
import ml_dtypes
import numpy as np

from jreshard.jax_executor import host

__all__ = ["NUMPY_CASTS", "HostCasts", "compiled_cast"]


def _pairs(sources: Sequence[type], targets: Sequence[type]) -> set[tuple[np.dtype, np.dtype]]:
    return {(np.dtype(s), np.dtype(t)) for s, t in itertools.product(sources, targets) if s is not t}


_F8 = (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
_HALF = (ml_dtypes.bfloat16, np.float16)
# (source, output) dtype pairs whose NumPy conversion equals XLA's on CPU bit for bit:
# round to nearest even, subnormals kept, infinities, and NaN payloads as XLA leaves
# them. Checked against jnp.astype by tests/test_transfer.py for every input of 8- and
# 16-bit sources and for every float32 exponent and rounding boundary. Left out,
# because they differ: float16 -> float32 and float32 -> float16 (XLA quiets signalling
# NaNs), bfloat16/float16 -> float8_e5m2 (NaN), int32 -> bfloat16 (XLA rounds twice).
NUMPY_CASTS: frozenset[tuple[np.dtype, np.dtype]] = frozenset(
    _pairs((np.float32,), (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn))
    | _pairs((ml_dtypes.bfloat16,), (np.float32, ml_dtypes.float8_e4m3fn))
    | _pairs((np.float16,), (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn))
    | _pairs(_F8, (np.float32, *_HALF))
    | _pairs((np.int8, np.uint8, np.int16, np.uint16), (np.float32, *_HALF))
)


@functools.cache
def compiled_cast(dtype: np.dtype) -> Callable[[np.ndarray], jax.Array]:
    """The one jitted cast to ``dtype``: given host arrays, it compiles once per input shape and dtype."""

    def cast(x: jax.Array) -> jax.Array:
        return x.astype(dtype)

    return jax.jit(cast)


@dataclasses.dataclass(frozen=True, slots=True)
class HostCasts:
    """How one executor's host copies cast each leaf whose dtype changes.

    A leaf whose elements each go to one destination is cast by the copy that
    moves it (``by_numpy``). One whose elements go to several (replicas) is cast
    once per source shard by NumPy (``numpy_first``), then copied as uint:
    converting costs several times a copy, so casting once per replica would
    dominate the sync.
    """

    dtypes: tuple[np.dtype, ...]  # output dtypes
    by_numpy: frozenset[int]  # leaves cast by the copies themselves
    numpy_first: frozenset[int]  # leaves cast by NumPy before copying
    compiled: frozenset[int]  # leaves cast by ``compiled_cast`` before copying

    @classmethod
    def build(cls, src_dtypes: Sequence[np.dtype], dtypes: Sequence[np.dtype],
              fan_out: Sequence[bool]) -> HostCasts:
        """``fan_out[i]``: leaf ``i`` moves more elements than it has (to several destinations)."""
        changed = [(i, (s, d)) for i, (s, d) in enumerate(zip(src_dtypes, dtypes, strict=True)) if s != d]
        numpy = {i for i, pair in changed if pair in NUMPY_CASTS}
        return cls(tuple(dtypes), frozenset(i for i in numpy if not fan_out[i]),
                   frozenset(i for i in numpy if fan_out[i]),
                   frozenset(i for i, pair in changed if pair not in NUMPY_CASTS))

    def source(self, leaf: int, shard: jax.Array) -> np.ndarray:
        """What the copies read of a source shard: a zero-copy view, as uint unless NumPy casts it on the way."""
        x = np.asarray(shard)
        if leaf in self.by_numpy:  # read in its own dtype: assigning it into ``sink`` casts
            return x
        if leaf in self.numpy_first:
            x = x.astype(self.dtypes[leaf])
        elif leaf in self.compiled:
            x = np.asarray(compiled_cast(self.dtypes[leaf])(x))
        return host.as_uint(x)

    def sink(self, leaf: int, buffer: np.ndarray) -> np.ndarray:
        """What the copies write: ``buffer`` (uint of the output width), in the output dtype if NumPy casts."""
        return buffer.view(self.dtypes[leaf]) if leaf in self.by_numpy else buffer
