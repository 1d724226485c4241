"""Quantizing a sharded tensor at its holders: cut blocks, their parts, and the partial-amax exchange.

A block (``jreshard.core.fp8``) that shard boundaries cut has several *parts*, one
per distinct shard that overlaps it; every replica of such a shard holds the same
part. Before quantizing, the holders of a cut block agree on its amax in one
round of tiny messages: every holder of a part receives the partial amax of each
other part of the block from exactly one of that part's replicas, the one at its
own position on the replicated mesh axes (so replica groups exchange among
themselves and the load is even). Each holder then takes the max of its own and
the received partial amaxes, which is the block's amax, and quantizes its shard
with ``quantize_local``: the result equals the full tensor's quantization bit for
bit (docs/fp8.md). Blocks that no boundary cuts need no message.

``QuantPlan.exchange()`` lists every message (one float32 each, per block);
``QuantPlan.pairs()`` counts them per pair of devices without listing blocks, for
the cost model. ``execute`` runs the plan on NumPy shards, as executors do on devices.

Example:
  >>> import numpy as np
  >>> from jreshard import Layout, Mesh
  >>> from jreshard.core.fp8 import Fp8Format, quantize
  >>> from jreshard.core.fp8_blocks import execute, quant_plan
  >>> from jreshard.core.reference import shard
  >>> layout = Layout((6, 8), Mesh([0, 1, 2], ("fsdp",)), ("fsdp",))  # 2 rows per shard
  >>> qp = quant_plan(layout, Fp8Format(block=(4, 4)))
  >>> qp.cut_blocks().tolist()  # block row 0 spans shards 0 and 1
  [[0, 0], [0, 1]]
  >>> qp.pairs()
  AmaxPairs(src=array([0, 1]), dst=array([1, 0]), values=array([2, 2]))
  >>> x = np.arange(48, dtype=np.float32).reshape(6, 8) - 20
  >>> out = execute(qp, shard(x, layout))
  >>> bool((out[1].weight.view(np.uint8) == quantize(x, qp.fmt).weight[2:4].view(np.uint8)).all())
  True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, NamedTuple

import numpy as np

from jreshard.core.box import Box
from jreshard.core.fp8 import BlockAmax, Fp8Format, Quantized, block_amax, check_format, quantize_local
from jreshard.core.layout import Layout

__all__ = ["QuantPlan", "BlockPart", "AmaxExchange", "AmaxPairs", "quant_plan", "execute", "AMAX_BYTES"]

AMAX_BYTES = 4  # one float32 per message and block


class _Dim(NamedTuple):
    """How one dim's shards and blocks overlap: per shard its block range, per block its shard range."""

    shard_lo: np.ndarray  # [parts] first block a shard touches
    shard_hi: np.ndarray  # [parts] one past its last (== lo for an empty shard)
    first: np.ndarray  # [blocks] first shard a block overlaps
    stop: np.ndarray  # [blocks] one past its last


@functools.lru_cache(maxsize=4096)
def _dims(shape: tuple[int, ...], parts: tuple[int, ...], chunk: tuple[int, ...],
          block: tuple[int, ...]) -> tuple[_Dim, ...]:
    out = []
    for n, k, c, b in zip(shape, parts, chunk, block, strict=True):
        start = np.minimum(np.arange(k, dtype=np.int64) * c, n)
        end = np.minimum(start + c, n)
        lo = start // b
        hi = np.where(end > start, -(-end // b), lo)
        j = np.arange(-(-n // b), dtype=np.int64)
        c1 = max(c, 1)  # c == 0 only when n == 0, and then there are no blocks
        first = j * b // c1
        stop = (np.minimum((j + 1) * b, n) - 1) // c1 + 1
        for a in (lo, hi, first, stop):
            a.setflags(write=False)
        out.append(_Dim(lo, hi, first, stop))
    return tuple(out)


class BlockPart(NamedTuple):
    """One part of a block: the box of it that one distinct shard holds, and that shard's holders."""

    shard: int
    box: Box
    holders: tuple[int, ...]


class AmaxExchange(NamedTuple):
    """Every partial-amax message: ``src[i]`` sends its amax of block ``block[i]`` to ``dst[i]``."""

    src: np.ndarray  # [E]
    dst: np.ndarray  # [E]
    block: np.ndarray  # [E, ndim] block index (scale coordinates)


class AmaxPairs(NamedTuple):
    """The exchange counted per device pair: ``values[i]`` partial amaxes from ``src[i]`` to ``dst[i]``."""

    src: np.ndarray
    dst: np.ndarray
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.values.sum()) * AMAX_BYTES


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class QuantPlan:
    """How the holders of a sharded tensor quantize it: its cut blocks and the amax exchange.

    Build one with ``quant_plan(layout, fmt)``.
    """

    layout: Layout
    fmt: Fp8Format

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.fmt.block_shape(self.layout.shape)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return self.fmt.scale_shape(self.layout.shape)

    @property
    def _dims(self) -> tuple[_Dim, ...]:
        g = self.layout.grid
        return _dims(self.layout.shape, g.parts, g.chunk, self.block_shape)

    def scale_box(self, device: int) -> Box:
        """The blocks ``device``'s shard touches, as a box of the scale grid (what its ``scale_inv`` covers)."""
        box = self.layout.shard_box(device)
        los, his = [], []
        for s, b in zip(box, self.block_shape, strict=True):
            lo = s.start // b
            los.append(lo)
            his.append(-(-s.stop // b) if s.stop > s.start else lo)
        return Box.from_bounds(los, his)

    def cut_blocks(self) -> np.ndarray:
        """The blocks that shard boundaries cut (more than one part), ``[C, ndim]`` in row-major order."""
        counts = [d.stop - d.first for d in self._dims]
        grid = functools.reduce(np.multiply.outer, counts) if counts else np.ones(())
        return np.argwhere(np.asarray(grid) > 1)

    def num_cut_blocks(self) -> int:
        """How many blocks shard boundaries cut, counted per dim (no block is listed)."""
        counts = [d.stop - d.first for d in self._dims]
        return math.prod(len(c) for c in counts) - math.prod(int((c == 1).sum()) for c in counts)

    def parts(self, block: Any) -> tuple[BlockPart, ...]:
        """The parts of ``block`` (a scale-grid index), one per distinct shard that overlaps it."""
        idx = tuple(int(j) for j in block)
        shape = self.scale_shape
        if len(idx) != len(shape) or not all(0 <= j < n for j, n in zip(idx, shape, strict=True)):
            raise ValueError(f"block must index the scale grid {shape}, got {block!r}.")
        g = self.layout.grid
        ids = np.asarray(self.layout.mesh.device_ids)
        ranges = [range(int(d.first[j]), int(d.stop[j])) for d, j in zip(self._dims, idx, strict=True)]
        out = []
        for shard_idx in itertools.product(*ranges):
            flat = int(np.ravel_multi_index(shard_idx, g.parts))
            pos = int(g.groups[flat, 0])
            lo = np.maximum(g.start[pos], np.multiply(idx, self.block_shape))
            hi = np.minimum(g.stop[pos], (np.asarray(idx) + 1) * self.block_shape)
            out.append(BlockPart(flat, Box.from_bounds(lo.tolist(), hi.tolist()),
                                 tuple(int(d) for d in ids[g.groups[flat]])))
        return tuple(out)

    def exchange(self) -> AmaxExchange:
        """Every message of the exchange, block by block (for execution and checks)."""
        ids = np.asarray(self.layout.mesh.device_ids)
        groups = ids[self.layout.grid.groups]  # [shards, replicas] device ids
        src, dst, blocks = [], [], []
        for block in self.cut_blocks():
            shards = [p.shard for p in self.parts(block)]
            for s, t in itertools.permutations(shards, 2):
                src.append(groups[s])
                dst.append(groups[t])
                blocks.append(np.repeat(block[None], groups.shape[1], axis=0))
        if not src:
            empty = np.zeros(0, np.int64)
            return AmaxExchange(empty, empty, np.zeros((0, self.layout.ndim), np.int64))
        return AmaxExchange(np.concatenate(src), np.concatenate(dst), np.concatenate(blocks))

    def pairs(self) -> AmaxPairs:
        """The exchange counted per (sender, receiver) pair, without listing blocks."""
        return _pairs(self.layout, self.block_shape)


@functools.lru_cache(maxsize=4096)
def _shard_pairs(shape: tuple[int, ...], parts: tuple[int, ...], chunk: tuple[int, ...],
                 block: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Block ranges are intervals per dim, so two shards share prod_d |range_d(a) & range_d(b)| blocks.
    s = np.zeros(1, np.int64)
    t = np.zeros(1, np.int64)
    count = np.ones(1, np.int64)
    for dim, k in zip(_dims(shape, parts, chunk, block), parts, strict=True):
        shared = np.minimum.outer(dim.shard_hi, dim.shard_hi) - np.maximum.outer(dim.shard_lo, dim.shard_lo)
        a, b = np.nonzero(shared > 0)
        s = (s[:, None] * k + a[None]).ravel()
        t = (t[:, None] * k + b[None]).ravel()
        count = (count[:, None] * shared[a, b][None]).ravel()
    other = s != t
    out = (s[other], t[other], count[other])
    for arr in out:
        arr.setflags(write=False)
    return out


def _pairs(layout: Layout, block: tuple[int, ...]) -> AmaxPairs:
    g = layout.grid
    s, t, count = _shard_pairs(layout.shape, g.parts, g.chunk, block)
    groups = np.asarray(layout.mesh.device_ids)[g.groups]  # [shards, replicas]
    r = groups.shape[1]
    return AmaxPairs(groups[s].ravel(), groups[t].ravel(), np.repeat(count, r))


@functools.lru_cache(maxsize=1024)
def quant_plan(layout: Layout, fmt: Fp8Format | None = None) -> QuantPlan:
    """The quantization plan of a tensor laid out as ``layout`` (any sharding, uneven, replicated).

    Raises:
      TypeError: ``layout`` is not a Layout or ``fmt`` not an Fp8Format.
      ValueError: the format's block has more dims than the tensor.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a jreshard.Layout, got {type(layout).__name__}.")
    fmt = check_format(fmt)
    fmt.block_shape(layout.shape)
    return QuantPlan(layout, fmt)


def execute(qp: QuantPlan, src_shards: dict[int, Any]) -> dict[int, Quantized]:
    """Runs a quantization plan on NumPy shards: partial amax, one exchange, local quantization.

    Args:
      qp: the plan.
      src_shards: every device's shard of the tensor, keyed by device id.

    Returns:
      Per device, its shard in FP8 and the ``scale_inv`` of the blocks it touches
      (``qp.scale_box(device)`` of the scale grid).
    """
    layout, fmt = qp.layout, qp.fmt
    boxes = layout.shards()
    missing = [d for d in boxes if d not in src_shards]
    if missing:
        raise ValueError(f"src_shards lacks the shards of devices {missing}; pass one array per device.")
    partial: dict[int, BlockAmax] = {}
    for d, box in boxes.items():
        x = np.asarray(src_shards[d])
        if x.shape != box.shape:
            raise ValueError(f"src_shards[{d}] has shape {x.shape}, but the layout gives it {box.shape}.")
        partial[d] = block_amax(x, fmt, layout.shape, [s.start for s in box])
    # All messages of the round carry the sender's own partial amax; the receiver keeps the max.
    agreed = {d: p.amax.copy() for d, p in partial.items()}
    ex = qp.exchange()
    for s, t, block in zip(ex.src.tolist(), ex.dst.tolist(), ex.block, strict=True):
        here = tuple(block - np.asarray(partial[t].lo))
        there = tuple(block - np.asarray(partial[s].lo))
        agreed[t][here] = max(agreed[t][here], partial[s].amax[there])
    return {d: quantize_local(src_shards[d], BlockAmax(partial[d].lo, agreed[d]), fmt, layout.shape,
                              [s.start for s in box]) for d, box in boxes.items()}
