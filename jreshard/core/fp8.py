"""Block-scaled FP8: the format, block amax, the reference quantizer and its inverse.

The format is the one of DeepSeek-V3 checkpoints and vLLM's block-quantized linear
layers: ``float8_e4m3fn`` weights ``[out, in]`` plus float32 scales
``weight_scale_inv [ceil(out/128), ceil(in/128)]``, one per 128 x 128 block, each the
factor that dequantizes its block (``weight = fp8 * scale_inv``). Every value is
computed as vLLM's ``per_block_cast_to_fp8`` (taken from DeepGEMM) computes it:

1. ``amax``: the largest ``|x|`` of the block, in float32 (inputs are rounded to
   float32 first; rounding is monotonic, so this is the rounded true amax);
2. ``amax = max(amax, amax_floor)`` with ``amax_floor = 1e-4``: an all-zero block gets
   a finite scale and quantizes to zeros;
3. ``scale_inv = amax / fmax`` (float32 division, ``fmax = 448`` for e4m3fn);
4. ``q = x * (1 / scale_inv)`` in float32 (``scaling='reciprocal'``), rounded to the
   nearest FP8 value, ties to even (``astype``; the scaled values never exceed
   ``fmax`` by more than one float32 ulp, which rounds back to ``fmax``).

``scaling='divide'`` computes ``q = x / scale_inv`` (DeepSeek-V3's own kernels) and
``scaling='ratio'`` ``q = x * (fmax / amax)`` (DeepGEMM's first version); the three
can differ in the last bit of the float32 factor, hence in rare FP8 roundings.

Blocks cover the trailing dims (``block`` gives their sizes, ``None`` for a whole
dim); leading dims (stacked experts) have blocks of 1. Per-tensor scales are
``block=(None, None)``, per-channel (one per output row) ``block=(1, None)``.

Each step is a function of one block's amax and of one element, so a block split
across devices quantizes exactly as a whole once its holders agree on the amax
(``jreshard.core.fp8_blocks``; docs/fp8.md).

Example:
  >>> import numpy as np
  >>> from jreshard.core.fp8 import Fp8Format, dequantize, quantize
  >>> fmt = Fp8Format(block=(2, 2))
  >>> x = np.array([[1.0, -2.0, 0.0], [0.5, 4.0, 0.0]], np.float32)
  >>> q = quantize(x, fmt)
  >>> q.scale_inv  # [ceil(2/2), ceil(3/2)]: amax 4 / 448, then the all-zero block's floor 1e-4 / 448
  array([[8.9285718e-03, 2.2321429e-07]], dtype=float32)
  >>> dequantize(q.weight, q.scale_inv, fmt).tolist()
  [[1.0, -2.0, 0.0], [0.5, 4.0, 0.0]]
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import numpy as np

from jreshard.core.args import INT64_MAX, check_ints
from jreshard.core.dtypes import canonical_dtype, numpy_dtype

__all__ = ["Fp8Format", "Quantized", "BlockAmax", "SCALE_DTYPE", "SCALINGS", "quantize", "dequantize",
           "block_amax", "quantize_local", "float32_input", "check_format"]

SCALE_DTYPE = "float32"
SCALINGS = ("reciprocal", "divide", "ratio")
_TINY = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Format:
    """How a tensor is quantized: FP8 element type, block shape, amax floor and scaling.

    Args:
      block: the block size of each trailing dim (an int, or ``None`` for the whole
        dim); leading dims have blocks of 1. ``(128, 128)`` is DeepSeek-V3's.
      dtype: an FP8 element type of ml_dtypes (``'float8_e4m3fn'``, ``'float8_e5m2'``, ...).
      amax_floor: the smallest amax a block scales by (DeepSeek and vLLM clamp at 1e-4),
        at least float32's smallest normal number so that flushing denormals to zero on
        a device never changes a scale.
      scaling: ``'reciprocal'`` (``x * (1 / s)``, vLLM), ``'divide'`` (``x / s``) or
        ``'ratio'`` (``x * (fmax / amax)``), each in float32.
    """

    block: tuple[int | None, ...] = (128, 128)
    dtype: str = "float8_e4m3fn"
    amax_floor: float = 1e-4
    scaling: str = "reciprocal"

    def __post_init__(self) -> None:
        block = self.block
        if isinstance(block, (numbers.Integral, type(None))) and not isinstance(block, bool):
            block = (block,)
        if not isinstance(block, (tuple, list)) or not block:
            raise TypeError(f"block must be a non-empty tuple of ints or None, got {self.block!r}; "
                            "pass for example (128, 128), or (1, None) for one scale per row.")
        for b in block:
            if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Integral)):
                raise TypeError(f"block must hold ints or None, got {b!r} in {tuple(block)!r}.")
            if b is not None and not 1 <= b <= INT64_MAX:
                raise ValueError(f"block sizes must be positive and fit in int64, got {b} in {tuple(block)!r}; "
                                 "a block at least as large as its dim is that whole dim (or pass None).")
        object.__setattr__(self, "block", tuple(None if b is None else int(b) for b in block))
        name = canonical_dtype(self.dtype, arg="dtype")
        if name is None or not name.startswith("float8"):
            raise ValueError(f"dtype must be an FP8 type such as 'float8_e4m3fn' or 'float8_e5m2', got {self.dtype!r}.")
        object.__setattr__(self, "dtype", name)
        floor = self.amax_floor
        if isinstance(floor, bool) or not isinstance(floor, numbers.Real):
            raise TypeError(f"amax_floor must be a float, got {type(floor).__name__} {floor!r}.")
        if not (math.isfinite(floor) and _TINY <= float(np.float32(floor)) < float(self.fmax)):
            raise ValueError(f"amax_floor must be a finite float32 between {_TINY:.4g} (the smallest normal) and "
                             f"{float(self.fmax)}, got {floor!r}; DeepSeek and vLLM use 1e-4.")
        object.__setattr__(self, "amax_floor", float(floor))
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}.")

    @classmethod
    def per_tensor(cls, **kwargs: Any) -> Fp8Format:
        """One scale per ``[out, in]`` matrix (per expert when stacked)."""
        return cls(block=(None, None), **kwargs)

    @classmethod
    def per_channel(cls, **kwargs: Any) -> Fp8Format:
        """One scale per output row (vLLM's channel-wise ``weight_scale [out, 1]``)."""
        return cls(block=(1, None), **kwargs)

    @property
    def fmax(self) -> np.float32:
        """The largest finite value of the FP8 type (448 for e4m3fn), as float32."""
        import ml_dtypes  # here, not at import: it takes half a second to load, and planning needs no finfo

        return np.float32(ml_dtypes.finfo(numpy_dtype(self.dtype)).max)

    def block_shape(self, shape: tuple[int, ...], arg: str = "shape") -> tuple[int, ...]:
        """The block size of every dim of a tensor of ``shape`` (whole dims resolved, at least 1)."""
        shape = check_ints(arg, shape)
        if len(shape) < len(self.block):
            raise ValueError(f"a block of {len(self.block)} dims {self.block} needs a tensor of at least as many dims, "
                             f"got shape {shape}; use a shorter block, e.g. (128,) for vectors.")
        lead = len(shape) - len(self.block)
        return (1,) * lead + tuple(max(n, 1) if b is None else b
                                   for n, b in zip(shape[lead:], self.block, strict=True))

    def kernel_block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``block_shape`` with each block cut to its dim: the same blocks (a block at least as large as
        its dim covers the whole dim), and the most a kernel pads a dim to."""
        return tuple(min(b, max(n, 1)) for n, b in zip(shape, self.block_shape(shape), strict=True))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of ``scale_inv`` for a tensor of ``shape``: ``ceil(n / b)`` per dim."""
        return tuple(-(-int(n) // b) for n, b in zip(shape, self.block_shape(shape), strict=True))

    def scales(self, amax: np.ndarray) -> np.ndarray:
        """``scale_inv`` (float32) of blocks whose amax is ``amax``; the floor applies here."""
        return self._floored(amax) / self.fmax

    def _floored(self, amax: np.ndarray) -> np.ndarray:
        return np.maximum(np.asarray(amax, np.float32), np.float32(self.amax_floor))

    def __str__(self) -> str:
        block = "x".join("all" if b is None else str(b) for b in self.block)
        return f"{self.dtype} with {block} blocks"


class Quantized(NamedTuple):
    """A quantized tensor: FP8 ``weight`` and its float32 ``scale_inv`` (one per block)."""

    weight: np.ndarray
    scale_inv: np.ndarray


class BlockAmax(NamedTuple):
    """The amax of the blocks a box touches: blocks ``[lo, lo + amax.shape)`` of the scale grid."""

    lo: tuple[int, ...]
    amax: np.ndarray


def float32_input(x: Any, arg: str = "x") -> np.ndarray:
    """``x`` as a float32 array; TypeError for anything but a floating array (bfloat16 included)."""
    a = np.asarray(x)
    dt = a.dtype
    if not (dt.kind == "f" or (dt.type.__module__ == "ml_dtypes" and "float" in dt.name)):
        raise TypeError(f"{arg} must hold floating-point numbers (float32, bfloat16, ...), got dtype {dt}.")
    return a.astype(np.float32, copy=False)


def check_format(fmt: Any, arg: str = "fmt") -> Fp8Format:
    """``fmt`` as an Fp8Format: ``None`` is ``Fp8Format()`` (e4m3fn, 128 x 128 blocks)."""
    if fmt is None:
        return Fp8Format()
    if not isinstance(fmt, Fp8Format):
        raise TypeError(f"{arg} must be an Fp8Format (jreshard.core.fp8) or None for the default, got "
                        f"{type(fmt).__name__} {fmt!r}; pass for example Fp8Format(block=(128, 128)).")
    return fmt


def _box(x_shape: tuple[int, ...], shape: Any, offset: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the whole tensor's shape, where the box ``x`` starts in it), checked: the box lies inside the tensor."""
    ndim = len(x_shape)
    full = x_shape if shape is None else check_ints("shape", shape)
    off = (0,) * ndim if offset is None else check_ints("offset", offset)
    for arg, value in (("shape", full), ("offset", off)):
        if len(value) != ndim:
            raise ValueError(f"{arg} {value} must give one entry per dim of x, which has shape {x_shape}.")
    if any(o + n > m for o, n, m in zip(off, x_shape, full, strict=True)):
        raise ValueError(f"x of shape {x_shape} at offset {off} reaches beyond shape {full}, the whole tensor's; "
                         "pass the box's start (offset) and the whole tensor's shape.")
    return full, off


def block_amax(x: Any, fmt: Fp8Format, shape: tuple[int, ...] | None = None, offset: Any = None) -> BlockAmax:
    """The amax (float32, not floored) of every block that ``x`` touches.

    Args:
      x: a floating array: the whole tensor, or the box of it that starts at ``offset``.
      fmt: the format (its block shape).
      shape: the whole tensor's shape (defaults to ``x.shape``): blocks are cut from it.
      offset: where ``x`` starts in the whole tensor (defaults to the origin).

    A block only partly inside ``x`` gets the amax of that part: its *partial amax*.
    """
    fmt = check_format(fmt)
    a = np.abs(float32_input(x))
    full, off = _box(a.shape, shape, offset)
    bs = fmt.block_shape(full)
    lo = tuple(o // b for o, b in zip(off, bs, strict=True))
    if a.size == 0:  # touches no block; the grid keeps its extent in the non-empty dims
        count = tuple(0 if n == 0 else -(-(o + n) // b) - j for o, n, b, j in zip(off, a.shape, bs, lo, strict=True))
        return BlockAmax(lo, np.zeros(count, np.float32))
    bs = fmt.kernel_block_shape(full)  # the same blocks (x is inside the tensor), padded to at most the dim
    # Pad to whole blocks with zeros (|x| >= 0 leaves every max unchanged), then reduce each block.
    pad = [(o - j * b, -(-(o + n) // b) * b - (o + n)) for o, n, j, b in zip(off, a.shape, lo, bs, strict=True)]
    padded = np.pad(a, pad)
    split = [d for n, b in zip(padded.shape, bs, strict=True) for d in (n // b, b)]
    amax = padded.reshape(split).max(axis=tuple(range(1, 2 * a.ndim, 2)))
    return BlockAmax(lo, amax.astype(np.float32, copy=False))


def _expand(per_block: np.ndarray, lo: tuple[int, ...], bs: tuple[int, ...], off: tuple[int, ...],
            shape: tuple[int, ...]) -> np.ndarray:
    """The value of each element's block, for a box of ``shape`` at ``off`` (blocks from ``lo``)."""
    idx = [(o + np.arange(n)) // b - j for o, n, b, j in zip(off, shape, bs, lo, strict=True)]
    return per_block[np.ix_(*idx)] if idx else per_block


def quantize_local(x: Any, amax: BlockAmax, fmt: Fp8Format, shape: tuple[int, ...] | None = None,
                   offset: Any = None) -> Quantized:
    """Quantizes the box ``x`` of a tensor given the (whole-block) amax of every block it touches.

    ``amax`` must be the amax of the whole blocks, agreed by every holder of a block;
    then the result is the box of the full tensor's quantization, bit for bit.
    Returns the FP8 box and the ``scale_inv`` of the blocks it touches (``amax``'s grid).
    """
    fmt = check_format(fmt)
    if not isinstance(amax, BlockAmax):
        raise TypeError(f"amax must be a BlockAmax (from block_amax, agreed by the block's holders), got "
                        f"{type(amax).__name__}.")
    x32 = float32_input(x)
    full, off = _box(x32.shape, shape, offset)
    bs = fmt.kernel_block_shape(full)
    floored = fmt._floored(amax.amax)
    scale = floored / fmt.fmax
    if fmt.scaling == "divide":
        y = x32 / _expand(scale, amax.lo, bs, off, x32.shape)
    else:
        factor = np.float32(1) / scale if fmt.scaling == "reciprocal" else fmt.fmax / floored
        y = x32 * _expand(factor, amax.lo, bs, off, x32.shape)
    return Quantized(y.astype(numpy_dtype(fmt.dtype)), scale)


def quantize(x: Any, fmt: Fp8Format | None = None) -> Quantized:
    """Quantizes a whole tensor in one place: the reference every sharded quantization must equal.

    Args:
      x: a floating array (float32, bfloat16, float16; float64 is rounded to float32 first).
      fmt: the format; defaults to ``Fp8Format()`` (e4m3fn, 128 x 128 blocks).

    Returns:
      ``Quantized(weight, scale_inv)``: the FP8 tensor and float32 scales of shape ``fmt.scale_shape(x.shape)``.
    """
    fmt = check_format(fmt)
    x32 = float32_input(x)
    return quantize_local(x32, block_amax(x32, fmt), fmt)


def dequantize(weight: Any, scale_inv: Any, fmt: Fp8Format | None = None, dtype: Any = "float32") -> np.ndarray:
    """``weight * scale_inv`` per block in float32, cast to ``dtype``: what an FP8 checkpoint loader computes."""
    fmt = check_format(fmt)
    w = np.asarray(weight)
    s = np.asarray(scale_inv, np.float32)
    want = fmt.scale_shape(w.shape)
    if s.shape != want:
        raise ValueError(f"scale_inv has shape {s.shape} but a weight of shape {w.shape} in {fmt} needs {want}.")
    bs = fmt.kernel_block_shape(w.shape)
    out = w.astype(np.float32) * _expand(s, (0,) * w.ndim, bs, (0,) * w.ndim, w.shape)
    return out.astype(numpy_dtype(dtype, arg="dtype"), copy=False)
