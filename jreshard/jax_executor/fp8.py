"""Block-scaled FP8 on jax devices: quantizing where the shards are, and FP8 delivery.

``quantize(x, fmt)`` quantizes a sharded ``jax.Array`` exactly as
``jreshard.core.fp8.quantize`` quantizes the whole tensor in one place, bit for bit,
without gathering it: inside one ``jax.shard_map`` over ``x``'s mesh every device

1. computes the partial amax of each block its shard touches (a max: no rounding);
2. takes the max of the partial amaxes with ``lax.pmax`` over the mesh axes of the
   dims whose shard boundaries cut blocks, and only those: the array reduced holds
   one float32 per block, spanning the cut dims whole and the other dims only as far
   as the device's own shard (4 bytes per block, no element of the tensor moves);
3. quantizes its own shard with the agreed amax (floor, ``amax / fmax``, the factor,
   round to nearest even), as the core's ``quantize_local`` does.

The FP8 weight keeps ``x``'s sharding; ``scale_inv`` is sharded as ``x`` on the dims
that shards of whole blocks split and replicated on the others (words as in
docs/glossary.md; why this is exact: docs/fp8.md). An array whose sharding is not a
``NamedSharding`` (one device, an ``OpSharding``-based sharding) is quantized by one
jitted program over the whole array, which XLA partitions as it sees fit (same
arithmetic, same result; the bytes it moves are XLA's choice).

``transfer(params, target, dtype="float8_e4m3fn", block=(128, 128))`` (also reached as
``jreshard.transfer(..., block=...)``) quantizes every chosen leaf this way at its
source and moves the FP8 weights and their scales with ``jreshard.transfer``, so
only FP8 bytes and scales travel.

Example:
  >>> import jax, numpy as np
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> from jreshard.core.fp8 import Fp8Format, quantize as reference
  >>> from jreshard.jax_executor.fp8 import quantize
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
  >>> x = np.linspace(-3, 5, 12 * 32, dtype=np.float32).reshape(12, 32)
  >>> xs = jax.device_put(x, NamedSharding(mesh, P("fsdp")))  # 3 rows a shard: blocks of 4 are cut
  >>> w, s = quantize(xs, Fp8Format(block=(4, 8)))
  >>> w.dtype, w.sharding.spec, s.shape, s.sharding.spec
  (dtype(float8_e4m3fn), P('fsdp',), (3, 4), P())
  >>> ref = reference(x, Fp8Format(block=(4, 8)))
  >>> bool(np.array_equal(np.asarray(w).view(np.uint8), ref.weight.view(np.uint8)))
  True
  >>> bool(np.array_equal(np.asarray(s), ref.scale_inv))
  True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jreshard.core.dtypes import canonical_dtype
from jreshard.core.fp8 import Fp8Format, check_format
from jreshard.core.fp8_split import fp8_split
from jreshard.jax_executor import transfer as _transfer
from jreshard.jax_executor.adapter import check_concrete, parse

__all__ = ["quantize", "quantize_tree", "scale_sharding", "transfer", "fp8_format", "amax_reduce", "AmaxReduce"]


def fp8_format(block: Any, dtype: Any = "float8_e4m3fn") -> Fp8Format:
    """``block`` as an Fp8Format: an Fp8Format as is, else a block shape for ``dtype``."""
    if isinstance(block, Fp8Format):
        return block
    if isinstance(block, list):
        block = tuple(block)
    return Fp8Format(block=block, dtype=dtype)


def _is_fp8(dtype: Any) -> bool:
    return str(canonical_dtype(dtype)).startswith("float8")


def _dim_axes(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of every dim, ``None`` -> ``()``, ``'x'`` -> ``('x',)``."""
    entries = list(spec) + [None] * (ndim - len(spec))
    out = []
    for e in entries[:ndim]:
        if e is None or e is PartitionSpec.UNCONSTRAINED:
            out.append(())
        else:
            out.append(tuple(e) if isinstance(e, (tuple, list)) else (e,))
    return tuple(out)


def _spec(dim_axes: tuple[tuple[str, ...], ...]) -> PartitionSpec:
    entries = [None if not a else a[0] if len(a) == 1 else a for a in dim_axes]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _cut_dims(shape: tuple[int, ...], parts: tuple[int, ...], bs: tuple[int, ...]) -> tuple[bool, ...]:
    """Which dims have shard boundaries inside blocks (shards of ``n / parts`` elements)."""
    return tuple(k > 1 and (n // k) % b != 0 for n, k, b in zip(shape, parts, bs, strict=True))


def scale_sharding(sharding: Sharding, shape: tuple[int, ...], fmt: Fp8Format) -> Sharding:
    """Where ``scale_inv`` lives for a weight of ``shape`` sharded as ``sharding``.

    Sharded as the weight on the dims split into shards of whole blocks (each device
    holds the scales of its own blocks), replicated on the dims whose shard boundaries
    cut blocks (every holder of a cut block knows its scale) and on whole-dim blocks.
    A sharding that is not a ``NamedSharding`` gives a replicated scale on its devices.
    """
    fmt = check_format(fmt)
    shape = tuple(int(n) for n in shape)
    if not isinstance(sharding, NamedSharding):
        if sharding.is_fully_replicated:
            return sharding
        devices: list[Any] = sorted(sharding.device_set, key=lambda d: d.id)
        return NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)),
                             PartitionSpec())
    mesh = sharding.mesh
    axes = _dim_axes(sharding.spec, len(shape))
    parts = tuple(math.prod(mesh.shape[a] for a in ax) for ax in axes)
    bs = fmt.block_shape(shape)
    even = all(n % k == 0 for n, k in zip(shape, parts, strict=True))
    cut = _cut_dims(shape, parts, bs) if even else (True,) * len(shape)
    lead = len(shape) - len(fmt.block)
    keep = tuple(() if c or (d >= lead and fmt.block[d - lead] is None) else ax
                 for d, (ax, c) in enumerate(zip(axes, cut, strict=True)))
    return NamedSharding(mesh, _spec(keep))


def _opaque(v: jax.Array, bits: jax.Array, zero: jax.Array) -> jax.Array:
    """``v`` unchanged, in a form XLA cannot see through: its bits or'ed with ``bits & zero`` (zero at run time)."""
    u = jax.lax.bitcast_convert_type(v, jnp.uint32) | (bits & zero)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def _quantize_block(x32: jax.Array, amax: jax.Array, zero: jax.Array, fmt: Fp8Format,
                    expand: Callable[[jax.Array], jax.Array]) -> tuple[jax.Array, jax.Array]:
    """FP8 values of ``x32`` given the agreed amax of its blocks; the arithmetic of ``core.fp8.quantize_local``.

    ``zero`` is a uint32 0 passed at run time.
    """
    floored = jnp.maximum(amax, jnp.float32(fmt.amax_floor))
    # XLA's algebraic simplifier rewrites `a / broadcast(c)` into `a * (1 / c)`, `1 / (a / c)`
    # into `c / a` and `a * (1 / b)` into `a / b`, each of which changes a rounding now and then
    # (optimization barriers do not stop it: CPU removes them first). Operands whose bits
    # depend on a run-time zero match none of its patterns, so each operation stays as written.
    bits = jax.lax.bitcast_convert_type(floored, jnp.uint32)
    fmax = _opaque(jnp.full(amax.shape, fmt.fmax, jnp.float32), bits, zero)
    scale = _opaque(floored / fmax, bits, zero)
    if fmt.scaling == "divide":
        y = x32 / expand(scale)
    else:
        factor = jnp.float32(1) / scale if fmt.scaling == "reciprocal" else fmax / floored
        y = x32 * expand(_opaque(factor, bits, zero))
    return y.astype(jnp.dtype(fmt.dtype)), scale


def _block_max(a: jax.Array, dim: int, b: int, start: Any, width: int) -> jax.Array:
    """Max over blocks of ``b`` along ``dim`` of ``a`` placed at ``start`` in a zero buffer of ``width`` blocks."""
    shape = list(a.shape)
    shape[dim] = width * b
    buf = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, a.dtype), a, start, dim)
    split = shape[:dim] + [width, b] + shape[dim + 1:]
    return buf.reshape(split).max(axis=dim + 1)


def _expand_dim(g: jax.Array, dim: int, b: int, start: Any, n: int) -> jax.Array:
    """Element ``i`` of ``dim`` gets block ``(start + i) // b`` of ``g`` (``0 <= start < b``)."""
    shape = list(g.shape)
    keep = (*range(dim + 1), *range(dim + 2, g.ndim + 1))  # g's dims; dim + 1 is the new one
    wide = jax.lax.broadcast_in_dim(g, (*shape[:dim + 1], b, *shape[dim + 1:]), keep)
    shape[dim] *= b
    return jax.lax.dynamic_slice_in_dim(wide.reshape(shape), start, n, dim)


class AmaxReduce(NamedTuple):
    """The partial-amax exchange of one tensor: a ``lax.pmax`` of ``floats`` float32 per device
    over groups of ``group`` devices (the mesh axes ``axes``); ``floats == 0``: no exchange."""

    floats: int
    group: int
    axes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """float32 bytes each device contributes (an all-reduce moves about twice that per device)."""
        return 4 * self.floats


def _geometry(mesh: jax.sharding.Mesh, axes: tuple[tuple[str, ...], ...], shape: tuple[int, ...], fmt: Fp8Format
              ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...], tuple[int, ...], tuple[str, ...]]:
    """Per dim: shard size, block size, cut, blocks in one shard's window; and the axes to reduce over."""
    parts = tuple(math.prod(mesh.shape[a] for a in ax) for ax in axes)
    chunk = tuple(n // k for n, k in zip(shape, parts, strict=True))
    bs = fmt.kernel_block_shape(shape)
    cut = _cut_dims(shape, parts, bs)
    window = tuple(-(-(c + b - 1) // b) if k else -(-c // b) for c, b, k in zip(chunk, bs, cut, strict=True))
    reduce_axes = tuple(a for ax, k in zip(axes, cut, strict=True) if k for a in ax)
    return chunk, bs, cut, window, reduce_axes


def amax_reduce(sharding: Sharding, shape: tuple[int, ...], fmt: Fp8Format) -> AmaxReduce | None:
    """What ``quantize`` exchanges for an array of ``shape`` sharded as ``sharding``; ``None`` where
    XLA partitions the whole-array program (not a ``NamedSharding``) and decides itself."""
    fmt = check_format(fmt)
    shape = tuple(int(n) for n in shape)
    if not isinstance(sharding, NamedSharding):
        return None
    axes = _dim_axes(sharding.spec, len(shape))
    mesh: Any = sharding.mesh
    _, _, cut, window, reduce_axes = _geometry(mesh, axes, shape, fmt)
    if not reduce_axes:
        return AmaxReduce(0, 1, ())
    grid = fmt.scale_shape(shape)
    floats = math.prod(g + w if k else w for g, w, k in zip(grid, window, cut, strict=True))
    return AmaxReduce(floats, math.prod(sharding.mesh.shape[a] for a in reduce_axes), reduce_axes)


@functools.lru_cache(maxsize=512)
def _sharded_program(mesh: jax.sharding.Mesh, axes: tuple[tuple[str, ...], ...], shape: tuple[int, ...],
                     fmt: Fp8Format) -> Callable[[jax.Array, Any], tuple[jax.Array, jax.Array]]:
    # A cut dim's partial amax spans its whole scale grid (plus room for the window of one shard),
    # so that the devices sharing a block put it at the same index; the others stay local.
    chunk, bs, cut, window, reduce_axes = _geometry(mesh, axes, shape, fmt)
    grid = fmt.scale_shape(shape)

    def local(x: jax.Array, zero: jax.Array) -> tuple[jax.Array, jax.Array]:
        x32 = x.astype(jnp.float32)
        offsets = []
        for ax, c in zip(axes, chunk, strict=True):
            idx: Any = 0
            for a in ax:
                idx = idx * mesh.shape[a] + jax.lax.axis_index(a)
            offsets.append(idx * c)
        amax = jnp.abs(x32)
        for d, (off, b, k, w, g) in enumerate(zip(offsets, bs, cut, window, grid, strict=True)):
            if k:
                part = _block_max(amax, d, b, off % b, w)
                full = list(part.shape)
                full[d] = g + w
                amax = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(full, part.dtype), part, off // b, d)
            else:
                amax = _block_max(amax, d, b, 0, w)
        if reduce_axes:
            amax = jax.lax.pmax(amax, reduce_axes)

        def expand(per_block: jax.Array) -> jax.Array:
            for d, (off, b, k, w, c) in enumerate(zip(offsets, bs, cut, window, chunk, strict=True)):
                if k:
                    per_block = jax.lax.dynamic_slice_in_dim(per_block, off // b, w, d)
                per_block = _expand_dim(per_block, d, b, off % b if k else 0, c)
            return per_block

        q, scale = _quantize_block(x32, amax, zero, fmt, expand)
        for d, (k, g) in enumerate(zip(cut, grid, strict=True)):
            if k:
                scale = jax.lax.slice_in_dim(scale, 0, g, axis=d)
        return q, scale

    spec = _spec(axes)
    scale_spec = _spec(tuple(() if k else ax for ax, k in zip(axes, cut, strict=True)))
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, PartitionSpec()),
                                 out_specs=(spec, scale_spec)))


@functools.lru_cache(maxsize=512)
def _whole_program(shape: tuple[int, ...], fmt: Fp8Format, w_sharding: Sharding, s_sharding: Sharding
                   ) -> Callable[[jax.Array, Any], tuple[jax.Array, jax.Array]]:
    bs = fmt.kernel_block_shape(shape)
    grid = fmt.scale_shape(shape)

    def whole(x: jax.Array, zero: jax.Array) -> tuple[jax.Array, jax.Array]:
        x32 = x.astype(jnp.float32)
        amax = jnp.abs(x32)
        for d, (b, g) in enumerate(zip(bs, grid, strict=True)):
            amax = _block_max(amax, d, b, 0, g)

        def expand(per_block: jax.Array) -> jax.Array:
            for d, (b, n) in enumerate(zip(bs, shape, strict=True)):
                per_block = _expand_dim(per_block, d, b, 0, n)
            return per_block

        return _quantize_block(x32, amax, zero, fmt, expand)

    return jax.jit(whole, out_shardings=(w_sharding, s_sharding))


def quantize(x: jax.Array, fmt: Fp8Format | None = None) -> tuple[jax.Array, jax.Array]:
    """Quantizes a sharded array where its shards are: equal, bit for bit, to ``core.fp8.quantize``.

    Args:
      x: a floating ``jax.Array`` (float32, bfloat16, float16) with any sharding, in one
        process or across ``jax.distributed`` processes (call it on every process).
      fmt: the format; defaults to ``Fp8Format()`` (e4m3fn, 128 x 128 blocks).

    Returns:
      ``(weight, scale_inv)``: the FP8 array with ``x``'s sharding, and the float32 scales
      ``fmt.scale_shape(x.shape)`` with ``scale_sharding(x.sharding, x.shape, fmt)``.

    Raises:
      TypeError: ``x`` is not a floating jax Array, or ``fmt`` not an Fp8Format.
      ValueError: ``fmt.block`` has more dims than ``x``.
    """
    fmt = check_format(fmt)
    check_concrete("x", x, "quantize")
    if not isinstance(x, jax.Array):
        raise TypeError(f"x must be a concrete jax.Array (call quantize outside jit), got {type(x).__name__}.")
    if not jnp.issubdtype(x.dtype, jnp.floating) or _is_fp8(x.dtype):
        raise TypeError(f"x must hold float32, bfloat16 or float16 numbers, got dtype {x.dtype}.")
    shape = tuple(int(n) for n in x.shape)
    fmt.block_shape(shape)
    sharding = x.sharding
    if isinstance(sharding, NamedSharding) and x.size:
        axes = _dim_axes(sharding.spec, len(shape))
        parts = tuple(math.prod(sharding.mesh.shape[a] for a in ax) for ax in axes)
        if all(n % k == 0 for n, k in zip(shape, parts, strict=True)):
            mesh: Any = sharding.mesh
            return _sharded_program(mesh, axes, shape, fmt)(x, np.uint32(0))
    return _whole_program(shape, fmt, sharding, scale_sharding(sharding, shape, fmt))(x, np.uint32(0))


def quantize_tree(params: Any, fmts: Callable[[tuple, Any], Fp8Format | None]) -> tuple[Any, Any]:
    """Quantizes the leaves of a pytree that ``fmts(path, leaf)`` gives a format, where they are.

    Returns ``(weights, scales)`` of ``params``' structure: a quantized leaf's FP8 weight
    and ``scale_inv``; a leaf whose format is ``None`` as it is, with ``None`` for its scale.

    Example:
      >>> import jax, numpy as np
      >>> from jreshard.core.fp8 import Fp8Format
      >>> from jreshard.jax_executor.fp8 import quantize_tree
      >>> params = {"w": jax.numpy.ones((4, 8)), "norm": jax.numpy.ones(4)}
      >>> w, s = quantize_tree(params, lambda path, x: Fp8Format(block=(2, 4)) if x.ndim == 2 else None)
      >>> w["w"].dtype, w["norm"].dtype, s["w"].shape, s["norm"]
      (dtype(float8_e4m3fn), dtype('float32'), (2, 2), None)
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    weights: list[Any] = []
    scales: list[Any] = []
    for path, leaf in flat:
        fmt = fmts(path, leaf)
        if fmt is None:
            weights.append(leaf)
            scales.append(None)
        else:
            w, s = quantize(leaf, fmt)
            weights.append(w)
            scales.append(s)
    return jax.tree_util.tree_unflatten(treedef, weights), jax.tree_util.tree_unflatten(treedef, scales)


def transfer(params: Any, target: Any, *, block: Any = (128, 128), dtype: Any = "float8_e4m3fn",
             plan: Any = None, donate: bool = False, max_bytes_in_flight: int = _transfer.DEFAULT_MAX_BYTES_IN_FLIGHT,
             mesh: Any = None, transport: str = "auto", **options: Any) -> tuple[Any, Any]:
    """Delivers a pytree as block-scaled FP8, quantized at the source: only FP8 bytes and scales move.

    Which leaves are quantized: those whose output ``dtype`` (one dtype, or a pytree
    prefix of dtypes as in ``jreshard.transfer``) is an FP8 type and that have at
    least as many dims as ``block`` (so with one FP8 dtype, the 2-D and larger leaves
    for 2-D blocks). An FP8 leaf with fewer dims (norms, biases) keeps its own dtype;
    a leaf given another dtype is cast to it at the sender, as ``jreshard.transfer`` does.

    Args:
      params: a pytree of ``jax.Array`` with any shardings.
      target: the destination shardings, as for ``jreshard.transfer``. The scales of a
        weight go to the same mesh, split on the same axes as the weight
        (``scale_sharding``); a target whose shards cut blocks is refused, as vLLM refuses it.
      block: the block shape (``(128, 128)``; ``(None, None)`` per tensor; ``(1, None)``
        per channel) or an ``Fp8Format`` (its dtype is used for every FP8 leaf).
      dtype: the output dtype or a pytree prefix of dtypes.
      plan: must be ``None`` (the plan covers the FP8 weights and scales and is built here).
      donate, max_bytes_in_flight, mesh, transport: as for ``jreshard.transfer``; with
        ``donate`` the quantized leaves are deleted once quantized.
      options: the other keywords of ``jreshard.transfer`` (``hierarchical``, ...), passed on.

    Returns:
      ``(weights, scales)``, two pytrees of ``params``' structure: ``weights`` holds each
      leaf in its target sharding (FP8 where quantized), ``scales`` the float32
      ``scale_inv`` of each quantized leaf in its scale sharding, ``None`` elsewhere.

    Raises:
      TypeError, ValueError: as ``jreshard.transfer``; ValueError also for a bad
        ``block``, a ``plan``, or a target that cuts blocks.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> import jreshard
      >>> devs = np.array(jax.devices()[:8])
      >>> train = jax.sharding.Mesh(devs[:4], ("fsdp",))
      >>> serve = jax.sharding.Mesh(devs[4:6], ("tp",))
      >>> params = {"w": jax.device_put(np.ones((12, 32), np.float32), NamedSharding(train, P(None, "fsdp"))),
      ...           "norm": jax.device_put(np.ones(12, np.float32), NamedSharding(train, P()))}
      >>> w, s = jreshard.transfer(params, NamedSharding(serve, P("tp")), dtype="float8_e4m3fn", block=(1, None))
      >>> w["w"].dtype, w["w"].sharding.spec, w["norm"].dtype, s["w"].shape, s["w"].sharding.spec, s["norm"]
      (dtype(float8_e4m3fn), P('tp',), dtype('float32'), (12, 1), P('tp',), None)
    """
    if plan is not None:
        raise ValueError("plan must be None with block=: the plan of the FP8 weights and their scales is made "
                         "inside the call (and cached); drop plan=.")
    if block is None:
        raise ValueError("block must be a block shape such as (128, 128), (None, None) or (1, None), or an Fp8Format.")
    base = fp8_format(block)
    leaves = parse(params, target, mesh=mesh, dtype=dtype, need_data=True)
    if not any(_is_fp8(dt) for dt in leaves.dtypes):
        raise ValueError(f"block={block!r} quantizes the leaves whose dtype is an FP8 type, but dtype={dtype!r} "
                         "gives none; pass dtype='float8_e4m3fn' (or a pytree prefix naming FP8 leaves).")
    values: list[Any] = []
    targets: list[Sharding] = []
    out_dtypes: list[Any] = []
    scale_at: list[int | None] = []
    scale_values: list[Any] = []
    scale_targets: list[Sharding] = []
    for name, v, t, dt, dst in zip(leaves.names, leaves.values, leaves.shardings, leaves.dtypes, leaves.dst,
                                   strict=True):
        kind = str(canonical_dtype(dt))
        if not _is_fp8(dt) or v.ndim < len(base.block):
            keep = _is_fp8(dt)
            values.append(v)
            targets.append(t)
            out_dtypes.append(None if keep else dt)
            scale_at.append(None)
            continue
        fmt = base if isinstance(block, Fp8Format) else fp8_format(base.block, kind)
        where = f"target at {name!r}" if name else "target"
        try:
            fp8_split(dst, fmt)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        w, s = quantize(v, fmt)
        if donate:
            v.delete()
        values.append(w)
        targets.append(t)
        out_dtypes.append(None)
        scale_at.append(len(scale_values))
        scale_values.append(s)
        scale_targets.append(scale_sharding(t, tuple(v.shape), fmt))
    moved = _transfer.transfer(values + scale_values, targets + scale_targets,
                               dtype=out_dtypes + [None] * len(scale_values), donate=donate,
                               max_bytes_in_flight=max_bytes_in_flight, transport=transport, **options)
    n = len(values)
    scales = [None if i is None else moved[n + i] for i in scale_at]
    return (jax.tree_util.tree_unflatten(leaves.treedef, moved[:n]),
            jax.tree_util.tree_unflatten(leaves.treedef, scales))
