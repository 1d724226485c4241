"""Where an FP8 tensor and its scales live on the inference side, split as vLLM splits them.

vLLM's block-quantized linear layers give every tensor-parallel rank the weight rows
(column parallel) or columns (row parallel) of its shard and the ``weight_scale_inv``
rows or columns of the same blocks; a split whose shard size is not a multiple of
the block is refused (``validate_fp8_block_shape``: "input_size_per_partition ... is
not divisible by block_k"). ``fp8_split`` applies that rule to any Layout: each dim
split into shards of whole blocks has its scale dim split over the same mesh axes;
a dim whose block is the whole dim (per-tensor or per-channel scales) has one scale
that every shard of it shares, so that scale dim is replicated.

Example:
  >>> from jreshard.core.fp8 import Fp8Format
  >>> from jreshard.core.fp8_split import fp8_tp_split
  >>> t = fp8_tp_split((7168, 2048), tp=8, dim=1)  # a row-parallel down projection
  >>> t.weight.shard_shape(3), t.scale.shape, t.scale.shard_shape(3)
  ((7168, 256), (56, 16), (56, 2))
  >>> fp8_tp_split((7168, 2048), tp=32, dim=1)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ValueError: tp=32 splits dim 1 (size 2048) into shards of 64, which cuts its blocks of 128 ...
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from jreshard.core.args import check_int
from jreshard.core.fp8 import SCALE_DTYPE, Fp8Format, check_format
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh

__all__ = ["Fp8Split", "fp8_split", "fp8_tp_split", "scale_layout"]


class Fp8Split(NamedTuple):
    """The layouts of a quantized tensor on the inference side: FP8 ``weight`` and float32 ``scale``."""

    weight: Layout
    scale: Layout


def _vllm_words(dim: int, ndim: int, shard: int, block: int) -> str:
    # vLLM's own names for the two dims of a linear weight [out, in].
    if dim == ndim - 1:
        return f"input_size_per_partition = {shard} is not divisible by block_k = {block}"
    if dim == ndim - 2:
        return f"output_partition_size = {shard} is not divisible by block_n = {block}"
    return f"a shard of {shard} does not hold whole blocks of {block}"


def _check(layout: Layout, fmt: Fp8Format, what: str) -> None:
    bs = fmt.block_shape(layout.shape)
    g = layout.grid
    lead = layout.ndim - len(fmt.block)
    for d, (n, k, c, b) in enumerate(zip(layout.shape, g.parts, g.chunk, bs, strict=True)):
        whole = d >= lead and fmt.block[d - lead] is None
        if k > 1 and not whole and c % b:
            raise ValueError(
                f"{what} splits dim {d} (size {n}) into shards of {c}, which cuts its blocks of {b} "
                f"(fmt.block); vLLM refuses this split too ({_vllm_words(d, layout.ndim, c, b)}). Split that dim "
                f"into shards of a multiple of {b} elements, or choose a block that divides {c}.")


def _check_layout(layout: Any) -> Layout:
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a jreshard.Layout, got {type(layout).__name__} {layout!r}; "
                        "build one with Layout(shape, mesh, spec).")
    return layout


def scale_layout(layout: Layout, fmt: Fp8Format) -> Layout:
    """The scale grid over ``layout``'s mesh: each dim split as the weight's, whole-dim blocks replicated.

    Where no shard boundary cuts a block (``fp8_split`` checks it), every device holds
    the scales of exactly the blocks its weight shard holds. Where boundaries cut blocks
    (a trainer's FSDP shards), a cut block's scale is placed by the scale grid's own
    split; the cost model uses that as the source of the scales.
    """
    layout, fmt = _check_layout(layout), check_format(fmt)
    lead = layout.ndim - len(fmt.block)
    spec = tuple(() if d >= lead and fmt.block[d - lead] is None else axes for d, axes in enumerate(layout.dim_axes))
    return Layout(fmt.scale_shape(layout.shape), layout.mesh, spec, SCALE_DTYPE)


def _split(layout: Layout, fmt: Fp8Format, what: str) -> Fp8Split:
    _check(layout, fmt, what)
    return Fp8Split(layout.with_dtype(fmt.dtype), scale_layout(layout, fmt))


def fp8_split(layout: Layout, fmt: Fp8Format | None = None) -> Fp8Split:
    """The FP8 weight layout and the ``weight_scale_inv`` layout for a destination ``layout``.

    Args:
      layout: where the inference side holds the weight (any mesh and spec; its dtype is replaced).
      fmt: the format; defaults to ``Fp8Format()`` (e4m3fn, 128 x 128 blocks).

    Raises:
      TypeError: ``layout`` is not a Layout or ``fmt`` not an Fp8Format.
      ValueError: a shard boundary of ``layout`` cuts a block, as vLLM refuses.
    """
    return _split(_check_layout(layout), check_format(fmt), "layout")


def fp8_tp_split(shape: tuple[int, ...], tp: int, dim: int | None, fmt: Fp8Format | None = None,
                 devices: Iterable[int] | None = None) -> Fp8Split:
    """The FP8 split of one tensor cut ``tp`` ways on ``dim`` (``None``: replicated), as vLLM splits it.

    Args:
      shape: the weight's shape, ``[out, in]`` for a linear layer (leading dims for stacked experts).
      tp: the tensor-parallel degree.
      dim: the dim ``tp`` splits: ``ndim - 2`` for column parallel, ``ndim - 1`` for row
        parallel, ``None`` for a replicated weight.
      fmt: the format; defaults to ``Fp8Format()``.
      devices: the ``tp`` ranks, in order; defaults to ``range(tp)``.
    """
    tp = check_int("tp", tp, minimum=1)
    shape = tuple(shape)
    if dim is not None and not 0 <= check_int("dim", dim) < len(shape):
        raise ValueError(f"dim must be None or a dim of shape {shape} (0 to {len(shape) - 1}), got {dim!r}.")
    ids = list(range(tp) if devices is None else devices)
    if len(ids) != tp:
        raise ValueError(f"devices must list tp={tp} ranks, got {len(ids)}.")
    spec: list[str | None] = [None] * len(shape)
    if dim is not None:
        spec[dim] = "tp"
    return _split(Layout(shape, Mesh(ids, ("tp",)), tuple(spec)), check_format(fmt), f"tp={tp}")
