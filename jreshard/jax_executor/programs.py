"""The compiled programs of a bucket: pack, unpack and the collective that moves messages.

Per bucket, each sender runs one *pack* program that slices, casts and bit-packs
every piece it sends to each receiver, across all leaves, into one contiguous
``uint8`` buffer per message; the buffers travel by one ``jax.lax.ppermute`` per
round inside one ``jax.shard_map`` (``comm``), or by ``jax.device_put``; each
receiver runs one *unpack* program that writes the pieces (and its local copies)
into its destination shards. Programs are keyed by what they do, not by leaf or
device, so equal work shares one (``launch.py`` runs it once for all the devices
of a process that do it).

Data moves as unsigned integers of the element's width: XLA may compute float ops
on some element types in a wider type (bfloat16 on CPU), which would canonicalise
NaN payloads; integer copies keep every bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jreshard.core.schedule import Message, Piece

__all__ = ["PackArgs", "UnpackArgs", "program", "make_comm", "assemble", "UINT", "PROGRAM_CACHE_SIZE"]

UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
AXIS = "x"  # the one axis of the mesh of every device of a transfer
PROGRAM_CACHE_SIZE = 256  # pack and unpack programs kept, keyed by what they do (not by leaf or device)


def _as_uint(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):  # bitcasts refuse complex: move its two words
        half = UINT[x.dtype.itemsize // 2]
        words = jnp.stack([jax.lax.bitcast_convert_type(jnp.real(x), half),
                           jax.lax.bitcast_convert_type(jnp.imag(x), half)], axis=-1)
        return jax.lax.bitcast_convert_type(words, UINT[x.dtype.itemsize])
    return jax.lax.bitcast_convert_type(x, UINT[x.dtype.itemsize])


def _from_uint(u: jax.Array, dtype: np.dtype) -> jax.Array:
    if dtype == np.bool_:
        return u != 0
    if np.issubdtype(dtype, np.complexfloating):
        half = dtype.itemsize // 2
        words = jax.lax.bitcast_convert_type(u, UINT[half])
        real = np.dtype(f"float{8 * half}")
        return jax.lax.complex(jax.lax.bitcast_convert_type(words[..., 0], real),
                               jax.lax.bitcast_convert_type(words[..., 1], real))
    return jax.lax.bitcast_convert_type(u, dtype)


def _piece(shard_uint: jax.Array, p: Piece, src: np.dtype, dst: np.dtype) -> jax.Array:
    """A piece of a source shard (given as uint), cast to ``dst``, as uint."""
    u = shard_uint
    if tuple(u.shape) != p.shape:
        u = jax.lax.slice(u, p.src_box.lo, p.src_box.hi)
    return u if src == dst else _as_uint(_from_uint(u, src).astype(dst))


def _to_bytes(u: jax.Array) -> jax.Array:
    if u.dtype.itemsize == 1:
        return u.reshape(-1)
    return jax.lax.bitcast_convert_type(u, jnp.uint8).reshape(-1)


def _from_bytes(buf: jax.Array, offset: int, shape: tuple[int, ...], itemsize: int) -> jax.Array:
    raw = jax.lax.slice(buf, (offset,), (offset + math.prod(shape) * itemsize,))
    if itemsize == 1:
        return raw.reshape(shape)
    return jax.lax.bitcast_convert_type(raw.reshape(shape + (itemsize,)), UINT[itemsize])


def assemble(parts: Sequence[tuple[tuple[int, ...], jax.Array]], shape: tuple[int, ...]) -> jax.Array | None:
    """The array of ``shape`` tiled by ``parts`` (start, value), by concatenation; None if they do not tile it.

    Concatenation along guillotine cuts is a single copy; writing pieces into zeros
    with dynamic_update_slice (the fallback) copies several times slower on CPU.
    """
    if sum(math.prod(v.shape) for _, v in parts) != math.prod(shape):
        return None
    if len(parts) == 1:
        start, v = parts[0]
        return v if tuple(v.shape) == shape and not any(start) else None
    for k in range(len(shape)):
        edges = sorted({st[k] for st, _ in parts} | {st[k] + v.shape[k] for st, v in parts})
        if edges[0] != 0 or edges[-1] != shape[k]:
            return None
        cuts = [c for c in edges[1:-1] if not any(st[k] < c < st[k] + v.shape[k] for st, v in parts)]
        if not cuts:
            continue
        bounds = [0, *cuts, shape[k]]
        slabs = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            members = [(st[:k] + (st[k] - a,) + st[k + 1:], v) for st, v in parts if a <= st[k] < b]
            slab = assemble(members, shape[:k] + (b - a,) + shape[k + 1:])
            if slab is None:
                return None
            slabs.append(slab)
        return jnp.concatenate(slabs, axis=k)
    return None


def _slots(leaves: Sequence[int]) -> dict[int, int]:
    return {leaf: k for k, leaf in enumerate(leaves)}


def _relabel(p: Piece, slot: Mapping[int, int], side: str = "") -> Piece:
    """``p`` as a program sees it: its leaf as an argument slot, no devices, and with ``side``
    ("src" or "dst") the only box the program reads (the other made equal to it)."""
    p = dataclasses.replace(p, leaf=slot[p.leaf], src=0, dst=0)
    if side == "src":
        return dataclasses.replace(p, dst_box=p.src_box)
    if side == "dst":
        return dataclasses.replace(p, src_box=p.dst_box)
    return p


def _relabel_message(m: Message, slot: Mapping[int, int], side: str) -> Message:
    return Message(0, 0, tuple(_relabel(p, slot, side) for p in m.pieces), m.offsets, m.nbytes)


class PackArgs(NamedTuple):
    """What a pack program does, with leaves as argument slots and no devices (equal for equal work)."""

    leaves: tuple[int, ...]
    messages: tuple[tuple[Message, int], ...]  # with the width of its buffer
    src_dtypes: tuple[np.dtype, ...]
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def of(cls, leaves: tuple[int, ...], messages: Sequence[tuple[Message, int]], src_dtypes: Sequence[np.dtype],
           dtypes: Sequence[np.dtype]) -> PackArgs:
        slot = _slots(leaves)
        return cls(tuple(range(len(leaves))), tuple((_relabel_message(m, slot, "src"), w) for m, w in messages),
                   tuple(src_dtypes[i] for i in leaves), tuple(dtypes[i] for i in leaves))


class UnpackArgs(NamedTuple):
    """What an unpack program does, with leaves as argument slots and no devices (see ``PackArgs``)."""

    carried: tuple[int, ...]
    fresh: tuple[int, ...]
    messages: tuple[Message, ...]
    local: tuple[Piece, ...]
    local_leaves: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]  # destination shard shapes
    src_dtypes: tuple[np.dtype, ...]
    dtypes: tuple[np.dtype, ...]
    finish: frozenset[int]

    @classmethod
    def of(cls, carried: tuple[int, ...], fresh: tuple[int, ...], messages: Sequence[Message],
           local: Sequence[Piece], local_leaves: tuple[int, ...], shapes: Mapping[int, tuple[int, ...]],
           src_dtypes: Sequence[np.dtype], dtypes: Sequence[np.dtype], finish: frozenset[int]) -> UnpackArgs:
        leaves = sorted({*carried, *fresh, *local_leaves})
        slot = _slots(leaves)
        return cls(tuple(slot[i] for i in carried), tuple(slot[i] for i in fresh),
                   tuple(_relabel_message(m, slot, "dst") for m in messages), tuple(_relabel(p, slot) for p in local),
                   tuple(slot[i] for i in local_leaves), tuple(shapes.get(i, ()) for i in leaves),
                   tuple(src_dtypes[i] for i in leaves), tuple(dtypes[i] for i in leaves),
                   frozenset(slot[i] for i in finish))


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def program(args: PackArgs | UnpackArgs, mesh: jax.sharding.Mesh | None) -> Callable[..., tuple[jax.Array, ...]]:
    """The jitted pack or unpack program for ``args``, shared by every sender or receiver and bucket that does it.

    With ``mesh`` (a 1-D mesh of several devices that run the same program), one
    ``shard_map`` over them: each argument and result is the devices' arrays
    stacked along dim 0, so the program compiles once for all of them instead of
    once per device.
    """
    if isinstance(args, PackArgs):
        fn = _pack(*args)
        ins: Any = (P(AXIS),) * len(args.leaves)
        outs: Any = (P(AXIS),) * len(args.messages)
        donate: tuple[int, ...] = ()
    else:
        fn = _unpack(*args)
        ins = tuple((P(AXIS),) * n for n in (len(args.carried), len(args.messages), len(args.local_leaves)))
        outs = (P(AXIS),) * (len(args.carried) + len(args.fresh))
        donate = (0,) if args.carried else ()
    if mesh is not None:
        fn = jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs)
    return jax.jit(fn, donate_argnums=donate)


def _pack(leaves: tuple[int, ...], messages: Sequence[tuple[Message, int]], src_dtypes: Sequence[np.dtype],
          dtypes: Sequence[np.dtype]) -> Callable[..., tuple[jax.Array, ...]]:
    """One sender's messages in one bucket: its source shards of ``leaves`` in, one uint8 buffer per message out.

    Each message is padded with zeros to its width (the collective needs one width
    per round).
    """

    def pack(*shards: jax.Array) -> tuple[jax.Array, ...]:
        held = {i: _as_uint(x) for i, x in zip(leaves, shards, strict=True)}
        out = []
        for msg, width in messages:
            parts, end = [], 0
            for p, off in zip(msg.pieces, msg.offsets, strict=True):
                if off > end:  # alignment gap
                    parts.append(jnp.zeros((off - end,), jnp.uint8))
                parts.append(_to_bytes(_piece(held[p.leaf], p, src_dtypes[p.leaf], dtypes[p.leaf])))
                end = off + p.nbytes
            if width > end:
                parts.append(jnp.zeros((width - end,), jnp.uint8))
            out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return tuple(out)

    return pack


def _unpack(carried: tuple[int, ...], fresh: tuple[int, ...], messages: Sequence[Message],
            local: Sequence[Piece], local_leaves: tuple[int, ...], shapes: Sequence[tuple[int, ...]],
            src_dtypes: Sequence[np.dtype], dtypes: Sequence[np.dtype],
            finish: frozenset[int]) -> Callable[..., tuple[jax.Array, ...]]:
    """One receiver's writes in one bucket: ``(carried shards, received buffers, own source shards)`` in.

    Returns the destination shards of ``carried + fresh``: those in ``finish`` in
    their output dtype, the others as uint, to be carried into a later bucket
    (whose unpack takes them as ``carried`` and donates them).
    """

    def unpack(prev: tuple[jax.Array, ...], received: tuple[jax.Array, ...],
               shards: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        held = {i: _as_uint(x) for i, x in zip(local_leaves, shards, strict=True)}
        writes: dict[int, list[tuple[tuple[int, ...], jax.Array]]] = defaultdict(list)
        for msg, raw in zip(messages, received, strict=True):
            for p, off in zip(msg.pieces, msg.offsets, strict=True):
                writes[p.leaf].append((p.dst_box.lo, _from_bytes(raw, off, p.shape, dtypes[p.leaf].itemsize)))
        for p in local:
            writes[p.leaf].append((p.dst_box.lo, _piece(held[p.leaf], p, src_dtypes[p.leaf], dtypes[p.leaf])))
        acc = dict(zip(carried, prev, strict=True))
        out = []
        for leaf in carried + fresh:
            parts = writes[leaf]
            a = None if leaf in acc else assemble(parts, shapes[leaf])
            if a is None:  # part of the shard (a leaf over several buckets), or not a guillotine tiling
                a = acc[leaf] if leaf in acc else jnp.zeros(shapes[leaf], UINT[dtypes[leaf].itemsize])
                for start, v in parts:
                    a = jax.lax.dynamic_update_slice(a, v, start)
            out.append(_from_uint(a, dtypes[leaf]) if leaf in finish else a)
        return tuple(out)

    return unpack


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def make_comm(mesh: jax.sharding.Mesh, perms: tuple[tuple[tuple[int, int], ...], ...]) -> Callable[..., Any]:
    """One ``ppermute`` per round inside one ``shard_map`` over ``mesh`` (every device of the transfer).

    Shared by the buckets (and executors) with the same rounds over the same devices.
    """

    def comm(*bufs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jax.lax.ppermute(b, AXIS, perm=list(perm)) for b, perm in zip(bufs, perms, strict=True))

    specs = (P(AXIS),) * len(perms)
    return jax.jit(jax.shard_map(comm, mesh=mesh, in_specs=specs, out_specs=specs))
