"""FP8 delivery of a whole model: which tensors are quantized, their scales, and the amax exchange.

The trainer holds the model in its own dtype (bfloat16); FP8 delivery quantizes at
the sender, so the wire carries 1 byte per element of every tensor the catalog
marks ``quantize`` (``jreshard.fleet.catalog``) plus its float32 ``weight_scale_inv``
(4 bytes per block), and the model's dtype for the tensors that stay in higher
precision (embeddings, heads, norms, routers). Before quantizing, the holders of
blocks that the trainer's shard boundaries cut exchange their partial amax
(``jreshard.core.fp8_blocks``): 4 bytes per block and pair of parts, in one round.

- ``fp8_layouts``: the training and inference layouts with FP8 weights and a scale
  leaf ``<name>_scale_inv`` per quantized tensor (vLLM's and DeepSeek-V3's name);
  an inference split that cuts a block is refused, naming the tensor.
- ``amax_exchange``: the exchange as per-device traffic for the cost model, and its summary;
  ``fp8_costs`` that traffic with the scale of each weight, as ``cost.compare`` takes them.

Example:
  >>> from jreshard.core.fp8 import Fp8Format
  >>> from jreshard.fleet import catalog, presets
  >>> from jreshard.fleet.fp8 import amax_exchange, fp8_layouts
  >>> from jreshard.fleet.hardware import Topology
  >>> infos = catalog.tensors("llama-tiny")
  >>> src = presets.train_layouts(infos, presets.TrainParallel(fsdp=4), range(4))
  >>> dst = presets.infer_layouts(infos, presets.InferParallel(tp=2), range(4, 6))
  >>> fmt = Fp8Format(block=(8, 8))
  >>> src8, dst8 = fp8_layouts(infos, src, dst, fmt)
  >>> w = "model.layers.0.mlp.down_proj.weight"
  >>> src8[w].dtype, dst8[w].dtype, dst8[w + "_scale_inv"].shape, dst8["model.norm.weight"].dtype
  ('float32', 'float8_e4m3fn', (32, 86), 'float32')
  >>> traffic, summary = amax_exchange(infos, src, fmt, Topology(4, 900, 50, 5))
  >>> summary.cut_blocks, summary.nbytes, summary.messages  # FSDP4 cuts 688 rows at 172 and 516
  (512, 4096, 4)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jreshard.core.args import check_ints
from jreshard.core.fp8 import Fp8Format
from jreshard.core.fp8_blocks import AMAX_BYTES, quant_plan
from jreshard.core.fp8_split import fp8_split, scale_layout
from jreshard.core.layout import Layout
from jreshard.fleet.catalog import TensorInfo
from jreshard.fleet.hardware import Topology
from jreshard.fleet.traffic import Traffic

__all__ = ["SCALE_SUFFIX", "scale_name", "fp8_layouts", "amax_exchange", "AmaxSummary", "parse_block", "Fp8Costs",
           "fp8_costs"]

SCALE_SUFFIX = "_scale_inv"
_BLOCKS = {"tensor": (None, None), "channel": (1, None)}


def scale_name(name: str) -> str:
    """The scale leaf of a quantized tensor: ``x.weight`` -> ``x.weight_scale_inv``."""
    return name + SCALE_SUFFIX


def parse_block(spec: object, arg: str = "fp8_block") -> tuple[int | None, ...]:
    """A block given as ``[128, 128]``, ``'128x128'``, ``'128'`` (square), ``'tensor'`` or ``'channel'``."""
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text in _BLOCKS:
            return _BLOCKS[text]
        parts = text.split("x")
        if all(p.isdigit() and int(p) > 0 for p in parts) and len(parts) in (1, 2):
            sizes = [int(p) for p in parts]
            return check_ints(arg, (sizes[0], sizes[-1]), minimum=1)  # sizes beyond int64 refused
    elif isinstance(spec, (list, tuple)) and len(spec) == 2:
        return check_ints(arg, spec, minimum=1)
    raise ValueError(f"{arg} must be two positive block sizes ('128x128', [128, 128]), one ('128'), 'tensor' or "
                     f"'channel', got {spec!r}.")


def fp8_layouts(infos: Sequence[TensorInfo], src: Mapping[str, Layout], dst: Mapping[str, Layout],
                fmt: Fp8Format) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """The layouts of an FP8 delivery: quantized tensors in FP8 at the destination, plus their scales.

    Args:
      infos: the model's tensors (``catalog.tensors``); ``quantize`` says which are quantized.
      src, dst: their training and inference layouts, keyed by name.
      fmt: the FP8 format.

    Returns:
      ``(src, dst)`` with a ``<name>_scale_inv`` leaf after each quantized tensor. The
      source keeps the training dtype (the sender quantizes); a scale's source is
      the scale grid over the weight's training mesh (``scale_layout``).

    Raises:
      ValueError: an inference layout cuts a block (vLLM refuses it); the message names the tensor.
    """
    out_src: dict[str, Layout] = {}
    out_dst: dict[str, Layout] = {}
    checked: dict[tuple, tuple[Layout, Layout]] = {}
    scales: dict[Layout, Layout] = {}  # a model's tensors share a few layouts, and so do their scales
    for t in infos:
        s, d = src[t.name], dst[t.name]
        out_src[t.name] = s
        if not t.quantize:
            out_dst[t.name] = d
            continue
        key = (d.shape, d.mesh, d.dim_axes)
        if key not in checked:
            try:
                checked[key] = fp8_split(d, fmt)
            except ValueError as exc:
                raise ValueError(f"FP8 delivery of {t.name} ({fmt}): {exc}") from None
        weight, scale = checked[key]
        out_dst[t.name] = weight
        if s not in scales:
            scales[s] = scale_layout(s, fmt)
        out_src[scale_name(t.name)] = scales[s]
        out_dst[scale_name(t.name)] = scale
    return out_src, out_dst


@dataclasses.dataclass(frozen=True, slots=True)
class AmaxSummary:
    """The FP8 side of a sync: tensors quantized and kept, their bytes, and the amax exchange.

    ``cut_blocks`` counts blocks that training shard boundaries cut; ``nbytes`` and
    ``messages`` are the exchange's (one message per pair of devices that exchange).
    """

    quantized: int
    kept: int
    fp8_bytes: int
    scale_bytes: int
    kept_bytes: int
    cut_blocks: int
    nbytes: int
    messages: int


def amax_exchange(infos: Sequence[TensorInfo], src: Mapping[str, Layout], fmt: Fp8Format,
                  topo: Topology) -> tuple[Traffic, AmaxSummary]:
    """The partial-amax exchange of every quantized tensor, as traffic, and the FP8 summary.

    The exchange of the whole model runs as one round before the weights move: every
    pair of devices that shares cut blocks sends one message carrying all their
    partial amaxes (``AMAX_BYTES`` each).
    """
    fp8_bytes = kept_bytes = quantized = 0
    layouts: dict[Layout, int] = {}  # quantized tensors per training layout: their exchanges are alike
    shapes: dict[tuple[int, ...], int] = {}
    for t in infos:
        layout = src[t.name]
        if not t.quantize:
            kept_bytes += layout.nbytes
            continue
        quantized += 1
        fp8_bytes += math.prod(t.shape)
        shapes[t.shape] = shapes.get(t.shape, 0) + 1
        layouts[layout] = layouts.get(layout, 0) + 1
    scale_bytes = sum(math.prod(fmt.scale_shape(shape)) * 4 * n for shape, n in shapes.items())
    src_ids: list[np.ndarray] = []
    dst_ids: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    cut = 0
    for layout, n in layouts.items():
        qp = quant_plan(layout.with_dtype(None), fmt)
        n_cut = qp.num_cut_blocks()
        if not n_cut:
            continue
        cut += n_cut * n
        pairs = qp.pairs()
        src_ids.append(pairs.src)
        dst_ids.append(pairs.dst)
        counts.append(pairs.values * n)
    traffic = Traffic.zeros(0)
    nbytes = messages = 0
    if src_ids:
        s, d, v = np.concatenate(src_ids), np.concatenate(dst_ids), np.concatenate(counts)
        top = int(max(s.max(), d.max())) + 1
        per_pair = np.bincount(s * top + d, weights=v)
        pairs_i = np.nonzero(per_pair)[0]
        b = per_pair[pairs_i] * AMAX_BYTES
        traffic.add_edges(pairs_i // top, pairs_i % top, b, np.ones(len(pairs_i)), topo)
        nbytes, messages = int(b.sum()), len(pairs_i)
    summary = AmaxSummary(quantized, len(infos) - quantized, fp8_bytes, scale_bytes, kept_bytes, cut, nbytes, messages)
    return traffic, summary


class Fp8Costs(NamedTuple):
    """What FP8 delivery adds to the cost model: the amax exchange, and each scale leaf's weight."""

    exchange: Traffic
    scales: Mapping[str, str]


def fp8_costs(infos: Sequence[TensorInfo], src: Mapping[str, Layout], fmt: Fp8Format,
              topo: Topology) -> tuple[Fp8Costs, AmaxSummary]:
    """``amax_exchange`` with the scale of every quantized tensor, for ``cost.compare(fp8=...)``."""
    traffic, summary = amax_exchange(infos, src, fmt, topo)
    return Fp8Costs(traffic, {scale_name(t.name): t.name for t in infos if t.quantize}), summary
