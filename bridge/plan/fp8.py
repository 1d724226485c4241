"""Block-scaled FP8 through the bridge: each quantized param gets its weight target and its scale target.

The trainer quantizes where its shards live (``bridge.trainer.fp8.quantize_params``), so
only FP8 bytes and float32 scales cross the wire. This module is the pure half both
sides compute from the model's sizes: ``fp8_param_map`` takes any param map (a recipe's,
``tp_param_map``'s) and, for every param whose name matches ``quantize`` (linear layers
by default), retypes the weight to FP8 and adds its ``weight_scale_inv`` param (float32,
one per block), split as vLLM splits ``BlockQuantScaleParameter``: scale rows follow a
column-parallel split, scale columns a row-parallel one, each fused part's scales at its
own part's place. A split that cuts a block is refused with vLLM's words.

Blocks are given in the param's dims (``[out, in]``: ``block=(block_n, block_k)``, as
vLLM's ``weight_block_size``); each trainer leaf is quantized in its own dims, with the
block permuted by its rule (a flax kernel ``[in, out]`` gets ``(block_k, block_n)``).
A region is the box of one leaf, so a block must not straddle two regions: every
region of a quantized param must start on a block boundary of the leaf and of the
param, and end on one or at the end of the dim. That is vLLM's rule for merged
layers (``qkv_proj``, ``gate_up_proj``: each logical partition a multiple of
``block_n``) and for tensor parallelism.

Words: the *weight leaf* is the trainer's tensor (``layers_0/attn/q_proj/kernel``); its
*scale leaf* ``<leaf>_scale_inv`` holds its scales in the leaf's dims, where the trainer's
quantization leaves them (``scale_source_layout``).

The wire carries FP8 as itself: the quantized weight leaves and the weight params have
dtype ``fmt.dtype`` (``'float8_e4m3fn'``, one of ``bridge.plan.bridge_plan.WIRE_DTYPES``), the
receiver holds ``torch.float8_e4m3fn`` tensors, and every bit arrives as quantized.

Example (a column-parallel q projection and a row-parallel o projection on TP2):
  >>> from bridge import Rule, Source, tp_param_map, trainer_mesh, fp8_param_map
  >>> from jreshard.core.fp8 import Fp8Format
  >>> shapes = {"q/kernel": (256, 512), "o/kernel": (512, 256), "norm/scale": (256,)}
  >>> src = Source.build(shapes, trainer_mesh((4,), "fsdp", [0, 1], 2),
  ...                    lambda path, shape: ("fsdp",) if len(shape) == 2 else ())
  >>> rules = [Rule("q/kernel", "q_proj.weight", transpose=True, dim=0),
  ...          Rule("o/kernel", "o_proj.weight", transpose=True, dim=1), Rule("norm/scale", "norm.weight")]
  >>> fp8 = fp8_param_map(src, tp_param_map(src, rules, tp_ranks=[2, 3]), Fp8Format(block=(128, 128)))
  >>> [(p.name, p.shape, p.dtype) for p in fp8.param_map.for_rank(3)]  # doctest: +NORMALIZE_WHITESPACE
  [('norm.weight', (256,), 'float32'), ('o_proj.weight', (256, 256), 'float8_e4m3fn'),
   ('o_proj.weight_scale_inv', (2, 2), 'float32'), ('q_proj.weight', (256, 256), 'float8_e4m3fn'),
   ('q_proj.weight_scale_inv', (2, 2), 'float32')]
  >>> fp8.formats["q/kernel"].block, fp8.source.layout("q/kernel_scale_inv").shape
  ((128, 128), (2, 4))
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from bridge.plan.bridge_plan import WIRE_DTYPES
from bridge.plan.param_map import Param, ParamMap, Region
from bridge.plan.source import Source
from jreshard.core.box import Box
from jreshard.core.fp8 import SCALE_DTYPE, Fp8Format
from jreshard.core.fp8_split import _vllm_words  # vLLM's names for the dims of [out, in]
from jreshard.core.layout import Layout

__all__ = ["Fp8ParamMap", "fp8_param_map", "scale_name", "scale_leaf", "scale_source_layout", "QUANTIZE_LINEAR"]

# vLLM's quantized linear layers: attention and MLP projections (fused or not), MoE experts.
# Embeddings, lm_head, norms and the router stay in the model's dtype, as in FP8 checkpoints.
QUANTIZE_LINEAR = r".*_proj\.weight|.*\.w(13|2)_weight"


def scale_name(param: str) -> str:
    """vLLM's name of a param's block scales: ``x.weight`` -> ``x.weight_scale_inv``."""
    return param + "_scale_inv"


def scale_leaf(leaf: str) -> str:
    """The path of a weight leaf's scale leaf in the quantized tree."""
    return leaf + "_scale_inv"


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8ParamMap:
    """What an FP8 sync moves: the quantized tree's source, the params, and each weight leaf's format.

    Attributes:
      source: the trainer leaves as they are sent: quantized weight leaves retyped to
        ``fmt.dtype``, one scale leaf (float32) per quantized leaf.
      param_map: weight params retyped to ``fmt.dtype`` plus their ``weight_scale_inv`` params.
      quantized: ``(leaf, Fp8Format)`` per quantized weight leaf, the block in the leaf's dims.
      weights: the names of the quantized weight params (each has a ``scale_name`` param).
      fmt: the format in the params' dims.
    """

    source: Source
    param_map: ParamMap
    quantized: tuple[tuple[str, Fp8Format], ...]
    weights: frozenset[str]
    fmt: Fp8Format

    @property
    def formats(self) -> dict[str, Fp8Format]:
        """``{weight leaf: its Fp8Format in the leaf's dims}``: what the trainer quantizes."""
        return dict(self.quantized)

    def __repr__(self) -> str:
        return (f"Fp8ParamMap({len(self.quantized)} leaves quantized to {self.fmt}, "
                f"{len(self.param_map)} params on ranks {list(self.param_map.ranks)})")


def _param_blocks(p: Param, fmt: Fp8Format) -> tuple[int | None, ...]:
    """The block of every param dim: ``fmt.block`` on the trailing dims, 1 on the leading ones."""
    if len(p.shape) < len(fmt.block):
        raise ValueError(f"param {p.name!r} has shape {p.shape}, fewer dims than the block {fmt.block}; "
                         "quantize only matrices (pass quantize= to leave it out).")
    return (1,) * (len(p.shape) - len(fmt.block)) + fmt.block


def _region_blocks(p: Param, r: Region, fmt: Fp8Format) -> tuple[int | None, ...]:
    """The block of every view dim of region ``r``: its view may split or add leading dims only."""
    view = r.view_shape(p.shape)
    t = len(fmt.block)
    if tuple(view[-t:]) != tuple(p.shape[-t:]):
        raise ValueError(f"param {p.name!r}: its region from {r.leaf!r} sees the param as {view}, which reshapes "
                         f"the blocked dims {p.shape[-t:]}; FP8 scales need regions whose view keeps them.")
    return (1,) * (len(view) - t) + fmt.block


def _scale_region(p: Param, r: Region, vblocks: tuple[int | None, ...], leaf_shape: tuple[int, ...]) -> Region:
    """The region of ``p``'s scale param that ``r``'s blocks fill, after checking they are whole."""
    view = r.view_shape(p.shape)
    box, off, sview = [], [], []
    for i, (b, (lo, hi), o, d) in enumerate(zip(vblocks, (r.box.bounds()[t] for t in r.transpose), r.offset,
                                               r.transpose, strict=True)):
        n, size = leaf_shape[d], view[i]
        if b is None:  # one scale for the whole dim: every rank holds the same one
            if o != 0 or hi - lo != size:
                raise ValueError(
                    f"param {p.name!r} on rank {p.rank}: a whole-dim block (None) in dim {i}, but its region from "
                    f"{r.leaf!r} fills only {o}:{o + hi - lo} of {size} (a fused param): each part would need its "
                    "own scale there. Give that dim a block size, or leave the param unfused.")
            box.append((0, 1))
            off.append(0)
            sview.append(1)
            continue
        ends = (lo % b, hi % b if hi != n else 0, o % b, (o + hi - lo) % b if o + hi - lo != size else 0)
        if any(ends):
            cut = next(v for v in (hi - lo, o, lo) if v % b)  # the part's size, else where it starts
            raise ValueError(
                f"param {p.name!r} on rank {p.rank}: its region from leaf {r.leaf!r} ({lo}:{hi} of leaf dim "
                f"{d}, at {o} of param dim {i}) cuts the FP8 blocks of {b} in that dim; vLLM refuses this split too "
                f"({_vllm_words(i, len(view), cut, b)}). Use a block that divides every part and every shard "
                f"(fmt.block), or a TP degree whose shards hold whole blocks.")
        box.append((lo // b, -(-hi // b)))
        off.append(o // b)
        sview.append(-(-size // b))
    # Back to leaf dim order for the box.
    leaf_box = [(0, 0)] * len(box)
    for i, d in enumerate(r.transpose):
        leaf_box[d] = box[i]
    return Region(scale_leaf(r.leaf), Box(leaf_box), tuple(off), r.transpose,
                  None if r.view is None else tuple(sview))


def _leaf_format(fmt: Fp8Format, r: Region, vblocks: tuple[int | None, ...]) -> Fp8Format:
    """The format of the region's leaf in its own dims (the param's block permuted back)."""
    leaf_block: list[int | None] = [1] * len(vblocks)
    for i, d in enumerate(r.transpose):
        leaf_block[d] = vblocks[i]
    return dataclasses.replace(fmt, block=tuple(leaf_block))


def scale_source_layout(layout: Layout, fmt: Fp8Format) -> Layout:
    """Where the trainer holds a leaf's scales once quantized where its shards are.

    As ``jreshard.jax_executor.fp8.scale_sharding`` places them: split as the weight on
    the dims whose shards hold whole blocks, replicated on the dims whose shard
    boundaries cut blocks (every holder of a cut block knows its scale) and on whole-dim
    blocks; all replicated when the weight's shards are uneven.
    """
    g = layout.grid
    bs = fmt.block_shape(layout.shape)
    lead = layout.ndim - len(fmt.block)
    even = all(n % k == 0 for n, k in zip(layout.shape, g.parts, strict=True))
    spec = tuple(axes if even and not (k > 1 and c % b) and not (d >= lead and fmt.block[d - lead] is None) else ()
                 for d, (axes, k, c, b) in enumerate(zip(layout.dim_axes, g.parts, g.chunk, bs, strict=True)))
    return Layout(fmt.scale_shape(layout.shape), layout.mesh, spec, SCALE_DTYPE)


def _matcher(quantize: str | Callable[[str], bool]) -> Callable[[str], bool]:
    if callable(quantize):
        return quantize
    if not isinstance(quantize, str):
        raise TypeError(f"quantize must be a regular expression or a callable name -> bool, got {quantize!r}.")
    pattern = re.compile(quantize)
    return lambda name: pattern.fullmatch(name) is not None


def fp8_param_map(source: Source, param_map: ParamMap, fmt: Fp8Format | None = None, *,
                  quantize: str | Callable[[str], bool] = QUANTIZE_LINEAR) -> Fp8ParamMap:
    """The FP8 sync of ``param_map``: quantized weight targets, their scale targets and the quantized source.

    Args:
      source: the trainer leaves (in the model's dtype).
      param_map: the params as the unquantized sync would fill them.
      fmt: the format, its block in the params' dims (``(block_n, block_k)`` for ``[out, in]``);
        default ``Fp8Format()`` (e4m3fn, 128 x 128, vLLM's and DeepSeek-V3's).
      quantize: which params are quantized: a regular expression matching the whole param
        name (default ``QUANTIZE_LINEAR``: the ``*_proj.weight`` linear layers and MoE
        ``w13_weight``/``w2_weight``) or a callable ``name -> bool``.

    Returns:
      An ``Fp8ParamMap``: plan ``BridgePlan(fp8.source, fp8.param_map)`` on every rank,
      quantize on the trainer with ``bridge.trainer.fp8.quantize_params(params, fp8)``.

    Raises:
      TypeError: ``fmt`` is not an Fp8Format, ``quantize`` neither a pattern nor a callable.
      ValueError: ``fmt.dtype`` is not a wire dtype (float8_e5m2), a split or a fused part
        cuts a block (vLLM's words), a weight leaf
        would be quantized for one param but sent unquantized (or with another block)
        to another, or no param matches ``quantize``.
    """
    fmt = Fp8Format() if fmt is None else fmt
    if not isinstance(fmt, Fp8Format):
        raise TypeError(f"fmt must be a jreshard.core.fp8.Fp8Format, got {type(fmt).__name__}.")
    if not isinstance(source, Source) or not isinstance(param_map, ParamMap):
        raise TypeError(f"source and param_map must be a bridge.Source and a bridge.ParamMap, got "
                        f"{type(source).__name__} and {type(param_map).__name__}.")
    if fmt.dtype not in WIRE_DTYPES:
        raise ValueError(f"fmt.dtype {fmt.dtype!r} is not a dtype the wire carries ({list(WIRE_DTYPES)}); "
                         "use Fp8Format(dtype='float8_e4m3fn'), vLLM's FP8 type.")
    match = _matcher(quantize)
    leaf_fmt: dict[str, Fp8Format] = {}
    plain: dict[str, str] = {}  # leaf -> a param that reads it unquantized
    params: list[Param] = []
    weights: set[str] = set()
    for p in param_map.params:
        if not match(p.name):
            params.append(p)
            for r in p.regions:
                plain.setdefault(r.leaf, p.name)
            continue
        blocks = _param_blocks(p, fmt)
        scale_regions = []
        for r in p.regions:
            vblocks = _region_blocks(p, r, fmt)
            scale_regions.append(_scale_region(p, r, vblocks, source.layout(r.leaf).shape))
            lf = _leaf_format(fmt, r, vblocks)
            if leaf_fmt.setdefault(r.leaf, lf) != lf:
                raise ValueError(f"leaf {r.leaf!r} is quantized with blocks {leaf_fmt[r.leaf].block} for one param "
                                 f"and {lf.block} for {p.name!r} (in the leaf's dims); its params must agree.")
        sshape = tuple(-(-n // b) if b is not None else 1 for n, b in zip(p.shape, blocks, strict=True))
        params.append(dataclasses.replace(p, dtype=fmt.dtype))
        weights.add(p.name)
        params.append(Param(scale_name(p.name), p.rank, sshape, SCALE_DTYPE, tuple(scale_regions)))
    if not leaf_fmt:
        raise ValueError(f"no param matches quantize={quantize!r}; the param map has e.g. "
                         f"{list(dict.fromkeys(param_map.names()))[:4]}.")
    both = sorted(set(leaf_fmt) & set(plain))
    if both:
        raise ValueError(f"leaf {both[0]!r} fills the quantized param of one rule and the unquantized param "
                         f"{plain[both[0]]!r}; the trainer sends a leaf one way. Quantize both or neither (quantize=).")
    clash = sorted(set(dict(source.items())) & {scale_leaf(x) for x in leaf_fmt})
    if clash:
        raise ValueError(f"the source already has a leaf {clash[0]!r}, the name of a scale leaf; rename it.")
    leaves: dict[str, Layout] = {}
    for path, layout in source.items():
        if path in leaf_fmt:
            leaves[path] = layout.with_dtype(fmt.dtype)
            leaves[scale_leaf(path)] = scale_source_layout(layout, leaf_fmt[path])
        else:
            leaves[path] = layout
    out = Fp8ParamMap(Source(leaves), ParamMap(params), tuple(sorted(leaf_fmt.items())), frozenset(weights), fmt)
    out.param_map.check(out.source)
    return out
