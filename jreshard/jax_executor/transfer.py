"""``jreshard.transfer``: run a reshard plan on jax devices, in one process or many.

How a transfer runs (every process computes the same schedule from the same plan):

1. *Pieces*: each network move of the plan becomes one or more pieces; a move larger
   than ``max_bytes_in_flight`` is cut into pieces that fit.
2. *Waves*: pieces are packed into waves so that, per wave, the bytes any device sends
   plus the bytes it receives stay under ``max_bytes_in_flight``. Local moves (a
   device that already holds what it needs) are copies in the first wave.
3. *Rounds*: within a wave, the (sender, receiver) pairs are coloured so that in each
   round every device sends to at most one peer and receives from at most one (a
   bipartite edge colouring, as many rounds as the largest number of peers of any
   device).
4. *Programs*: per wave, each sender runs one compiled *pack* program that slices,
   casts and bit-packs every piece it sends to each peer, across all tensors, into
   one contiguous ``uint8`` buffer per peer; the buffers travel either by one
   ``jax.lax.ppermute`` per round inside one ``jax.shard_map`` over a mesh of all
   source and destination devices (``transport="collective"``, the path that works
   across processes) or by ``jax.device_put`` per buffer (``transport="device_put"``,
   one process only); each receiver runs one *unpack* program that writes the pieces
   (and its local copies) into its destination shards. On backends whose device
   buffers are host memory (CPU), packing and unpacking are NumPy copies into
   64-byte-aligned buffers that jax adopts without a copy, instead of programs.
5. *Assembly*: ``jax.make_array_from_single_device_arrays`` with exactly the target
   sharding. A destination shard that is exactly a source shard on the same device,
   with the same dtype, is reused without a copy.

On the CPU backend ``transport="memcpy"`` copies every box straight from the source
device's buffer into its destination buffer (one copy per byte, no staging,
several threads). This is the per-box device-to-device path for CPU, and what
``"auto"`` picks there when one process addresses every device: it was the fastest
transport in every run of ``benchmarks/transfer_bench.py`` (see docs/transfer.md).
On CPU the destination buffers are blocks recycled once the arrays that used them
are gone (``_OutputPool``).

The schedule and the jitted programs are cached per plan, so a second transfer of
the same pytree does no tracing.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import math
import numbers
import os
import threading
import weakref
from collections import OrderedDict, defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard.jax_executor.adapter import Leaves, parse
from jreshard.core.planner import Plan, TensorPlan
from jreshard.core.tree import path_str

__all__ = ["transfer", "release_transfer_buffers", "DEFAULT_MAX_BYTES_IN_FLIGHT", "TRANSPORTS"]

DEFAULT_MAX_BYTES_IN_FLIGHT = 256 << 20
TRANSPORTS = ("auto", "collective", "device_put", "memcpy")

# What `transport="auto"` picks, per backend, when one process addresses every
# device (measured with benchmarks/transfer_bench.py, see docs/transfer.md); the
# collective everywhere else.
_AUTO_ONE_PROCESS = {"cpu": "memcpy"}

# Backends whose device buffers are host memory: there the collective and device_put
# transports pack and unpack with NumPy copies (one memcpy per byte each way) instead
# of compiled XLA programs, which on CPU copy slices several times slower.
_HOST_PACKING_BACKENDS = frozenset({"cpu"})

_TRACES = 0  # programs traced so far (tests check that a second sync traces nothing)


def _traced() -> None:
    global _TRACES
    _TRACES += 1


# --------------------------------------------------------------------------- schedule


@dataclasses.dataclass(frozen=True, slots=True)
class _Piece:
    """One box of one tensor: where it starts in the source and destination shards."""

    leaf: int
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int  # in the output dtype


@dataclasses.dataclass(frozen=True, slots=True)
class _Buffer:
    """The pieces ``src`` sends ``dst`` in one wave, packed back to back."""

    src: int
    dst: int
    pieces: tuple[_Piece, ...]
    offsets: tuple[int, ...]  # byte offset of each piece
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Wave:
    rounds: tuple[tuple[_Buffer, ...], ...]  # per round, buffers with distinct senders and receivers
    local: dict[int, tuple[_Piece, ...]]  # device -> local copies


def _split_box(lo: tuple[int, ...], hi: tuple[int, ...], itemsize: int, limit: int) -> list[tuple[tuple, tuple]]:
    """Cuts a box into boxes of at most ``limit`` bytes, outer dims first."""
    rank = len(lo)
    if math.prod(b - a for a, b in zip(lo, hi, strict=True)) * itemsize <= limit:
        return [(lo, hi)]
    out: list[tuple[tuple, tuple]] = []

    def cut(lo: tuple[int, ...], hi: tuple[int, ...], k: int) -> None:
        inner = math.prod(hi[j] - lo[j] for j in range(k + 1, rank)) * itemsize
        if inner <= limit:
            step = max(1, limit // max(inner, 1))
            for a in range(lo[k], hi[k], step):
                out.append((lo[:k] + (a,) + lo[k + 1:], hi[:k] + (min(a + step, hi[k]),) + hi[k + 1:]))
        else:
            for a in range(lo[k], hi[k]):
                cut(lo[:k] + (a,) + lo[k + 1:], hi[:k] + (a + 1,) + hi[k + 1:], k + 1)

    cut(lo, hi, 0)
    return out


def _colour(pairs: list[tuple[int, int]]) -> list[int]:
    """A proper edge colouring of a bipartite graph (senders x receivers) with max-degree colours.

    Each pair gets a colour (round) such that no sender and no receiver appears twice
    in a round. Kempe-chain swaps keep the count at the largest degree (König).
    """
    at_s: dict[int, dict[int, int]] = defaultdict(dict)  # sender -> colour -> receiver
    at_t: dict[int, dict[int, int]] = defaultdict(dict)  # receiver -> colour -> sender
    colour: dict[tuple[int, int], int] = {}

    def free(used: dict[int, int]) -> int:
        c = 0
        while c in used:
            c += 1
        return c

    for s, t in pairs:
        a, b = free(at_s[s]), free(at_t[t])
        if a in at_t[t]:
            # Swap colours a and b along the a/b path from t; s lacks an a-edge, so the
            # path never reaches it, and afterwards a is free at both ends.
            path, node, on_t, col = [], t, True, a
            while True:
                nxt = (at_t if on_t else at_s)[node].get(col)
                if nxt is None:
                    break
                path.append((nxt, node) if on_t else (node, nxt))
                node, on_t, col = nxt, not on_t, (b if col == a else a)
            for u, v in path:
                c0 = colour[(u, v)]
                del at_s[u][c0], at_t[v][c0]
            for u, v in path:
                c1 = b if colour[(u, v)] == a else a
                colour[(u, v)] = c1
                at_s[u][c1], at_t[v][c1] = v, u
        colour[(s, t)] = a
        at_s[s][a], at_t[t][a] = t, s
    return [colour[p] for p in pairs]


def _schedule(tplans: list[TensorPlan], skip: set[int], itemsizes: list[int], cap: int) -> list[_Wave]:
    """Pieces, waves and rounds for the leaves not in ``skip`` (see the module docstring)."""
    network: list[tuple[int, int, _Piece]] = []
    local: dict[int, list[_Piece]] = defaultdict(list)
    for leaf, tp in enumerate(tplans):
        if leaf in skip:
            continue
        src_boxes, dst_boxes = tp.src.shards(), tp.dst.shards()
        isz = itemsizes[leaf]
        for s, d, lo, hi in zip(tp.move_src.tolist(), tp.move_dst.tolist(), tp.move_lo.tolist(),
                                tp.move_hi.tolist(), strict=True):
            s0 = tuple(b.start for b in src_boxes[s])
            d0 = tuple(b.start for b in dst_boxes[d])
            chunks = [(tuple(lo), tuple(hi))] if s == d else _split_box(tuple(lo), tuple(hi), isz, cap)
            for clo, chi in chunks:
                shape = tuple(b - a for a, b in zip(clo, chi, strict=True))
                piece = _Piece(leaf, tuple(a - o for a, o in zip(clo, s0, strict=True)),
                               tuple(a - o for a, o in zip(clo, d0, strict=True)), shape,
                               math.prod(shape) * isz)
                if s == d:
                    local[d].append(piece)
                else:
                    network.append((s, d, piece))

    # First fit, largest first: a wave takes a piece while its sender's and its
    # receiver's bytes in that wave (sent plus received) stay under the cap.
    order = sorted(range(len(network)), key=lambda i: -network[i][2].nbytes)
    loads: list[dict[int, int]] = []
    members: list[list[int]] = []
    for i in order:
        s, d, piece = network[i]
        for w, load in enumerate(loads):
            if load.get(s, 0) + piece.nbytes <= cap and load.get(d, 0) + piece.nbytes <= cap:
                break
        else:
            w = len(loads)
            loads.append({})
            members.append([])
        loads[w][s] = loads[w].get(s, 0) + piece.nbytes
        loads[w][d] = loads[w].get(d, 0) + piece.nbytes
        members[w].append(i)
    if not members and local:
        members.append([])

    waves = []
    for w, idx in enumerate(members):
        by_pair: dict[tuple[int, int], list[_Piece]] = defaultdict(list)
        for i in sorted(idx):  # plan order inside each buffer
            s, d, piece = network[i]
            by_pair[(s, d)].append(piece)
        pairs = sorted(by_pair)
        colours = _colour(pairs)
        rounds: list[list[_Buffer]] = [[] for _ in range(max(colours, default=-1) + 1)]
        for (s, d), c in zip(pairs, colours, strict=True):
            pieces = tuple(by_pair[(s, d)])
            offsets, end = [], 0
            for p in pieces:  # each piece starts on a 64-byte boundary of the buffer
                offsets.append(end)
                end = -(-(end + p.nbytes) // 64) * 64
            rounds[c].append(_Buffer(s, d, pieces, tuple(offsets), offsets[-1] + pieces[-1].nbytes))
        waves.append(_Wave(tuple(tuple(r) for r in rounds),
                           {d: tuple(ps) for d, ps in local.items()} if w == 0 else {}))
    return waves


# --------------------------------------------------------------------------- programs


def _slice(x: jax.Array, start: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    if tuple(x.shape) == shape:
        return x
    return jax.lax.slice(x, start, tuple(a + n for a, n in zip(start, shape, strict=True)))


# Data moves as unsigned integers of the element's width: XLA may compute float ops
# on some element types in a wider type (bfloat16 on CPU), which would canonicalise
# NaN payloads; integer copies keep every bit.


def _as_uint(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):  # bitcasts refuse complex: move its two words
        half = _UINT[x.dtype.itemsize // 2]
        words = jnp.stack([jax.lax.bitcast_convert_type(jnp.real(x), half),
                           jax.lax.bitcast_convert_type(jnp.imag(x), half)], axis=-1)
        return jax.lax.bitcast_convert_type(words, _UINT[x.dtype.itemsize])
    return jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])


def _from_uint(u: jax.Array, dtype: np.dtype) -> jax.Array:
    if dtype == np.bool_:
        return u != 0
    if np.issubdtype(dtype, np.complexfloating):
        half = dtype.itemsize // 2
        words = jax.lax.bitcast_convert_type(u, _UINT[half])
        real = np.dtype(f"float{8 * half}")
        return jax.lax.complex(jax.lax.bitcast_convert_type(words[..., 0], real),
                               jax.lax.bitcast_convert_type(words[..., 1], real))
    return jax.lax.bitcast_convert_type(u, dtype)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _piece(shard_uint: jax.Array, p: _Piece, src: np.dtype, dst: np.dtype) -> jax.Array:
    """A piece of a source shard (given as uint), cast to ``dst``, as uint."""
    u = _slice(shard_uint, p.src_start, p.shape)
    return u if src == dst else _as_uint(_from_uint(u, src).astype(dst))


def _to_bytes(u: jax.Array) -> jax.Array:
    if u.dtype.itemsize == 1:
        return u.reshape(-1)
    return jax.lax.bitcast_convert_type(u, jnp.uint8).reshape(-1)


def _from_bytes(buf: jax.Array, offset: int, shape: tuple[int, ...], itemsize: int) -> jax.Array:
    raw = jax.lax.slice(buf, (offset,), (offset + math.prod(shape) * itemsize,))
    if itemsize == 1:
        return raw.reshape(shape)
    return jax.lax.bitcast_convert_type(raw.reshape(shape + (itemsize,)), _UINT[itemsize])


def _assemble(parts: list[tuple[tuple[int, ...], jax.Array]], shape: tuple[int, ...]) -> jax.Array | None:
    """The shard of ``shape`` tiled by ``parts`` (start, value), by concatenation; None if they do not tile it.

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
            slab = _assemble(members, shape[:k] + (b - a,) + shape[k + 1:])
            if slab is None:
                return None
            slabs.append(slab)
        return jnp.concatenate(slabs, axis=k)
    return None


def _make_pack(leaves: tuple[int, ...], buffers: list[tuple[_Buffer, int]], src_dtypes: list[np.dtype],
               dtypes: list[np.dtype]):
    """One device's sends in one wave: source shards in, one uint8 buffer per peer out."""

    def pack(*shards):
        _traced()
        held = {i: _as_uint(x) for i, x in zip(leaves, shards, strict=True)}
        out = []
        for buf, width in buffers:
            parts, end = [], 0
            for p, off in zip(buf.pieces, buf.offsets, strict=True):
                if off > end:  # alignment gap
                    parts.append(jnp.zeros((off - end,), jnp.uint8))
                parts.append(_to_bytes(_piece(held[p.leaf], p, src_dtypes[p.leaf], dtypes[p.leaf])))
                end = off + p.nbytes
            if width > end:
                parts.append(jnp.zeros((width - end,), jnp.uint8))
            out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return tuple(out)

    return jax.jit(pack)


def _make_unpack(carried: tuple[int, ...], fresh: tuple[int, ...], buffers: list[_Buffer],
                 local: tuple[_Piece, ...], local_leaves: tuple[int, ...], shapes: dict[int, tuple],
                 src_dtypes: list[np.dtype], dtypes: list[np.dtype], finish: frozenset[int], donate: bool):
    """One device's receives in one wave: writes pieces into its destination shards."""

    def unpack(prev, received, shards):
        _traced()
        held = {i: _as_uint(x) for i, x in zip(local_leaves, shards, strict=True)}
        writes: dict[int, list[tuple[tuple[int, ...], jax.Array]]] = defaultdict(list)
        for buf, raw in zip(buffers, received, strict=True):
            for p, off in zip(buf.pieces, buf.offsets, strict=True):
                writes[p.leaf].append((p.dst_start, _from_bytes(raw, off, p.shape, dtypes[p.leaf].itemsize)))
        for p in local:
            writes[p.leaf].append((p.dst_start, _piece(held[p.leaf], p, src_dtypes[p.leaf], dtypes[p.leaf])))
        # Shards carried over from an earlier wave arrive (and leave) as uint.
        acc = dict(zip(carried, prev, strict=True))
        out = []
        for leaf in carried + fresh:
            parts = writes[leaf]
            a = None if leaf in acc else _assemble(parts, shapes[leaf])
            if a is None:  # part of the shard (a wave of several), or not a guillotine tiling
                a = acc[leaf] if leaf in acc else jnp.zeros(shapes[leaf], _UINT[dtypes[leaf].itemsize])
                for start, v in parts:
                    a = jax.lax.dynamic_update_slice(a, v, start)
            out.append(_from_uint(a, dtypes[leaf]) if leaf in finish else a)
        return tuple(out)

    return jax.jit(unpack, donate_argnums=(0,) if donate else ())


def _make_comm(mesh: jax.sharding.Mesh, perms: list[tuple[tuple[int, int], ...]]):
    """One ppermute per round inside one shard_map over the union mesh."""

    def comm(*bufs):
        _traced()
        return tuple(jax.lax.ppermute(b, "x", perm=list(perm)) for b, perm in zip(bufs, perms, strict=True))

    specs = (P("x"),) * len(perms)
    return jax.jit(jax.shard_map(comm, mesh=mesh, in_specs=specs, out_specs=specs))


# --------------------------------------------------------------------------- executor


@dataclasses.dataclass(slots=True)
class _WaveProgram:
    packs: dict[int, tuple[Any, tuple[int, ...], list[tuple[_Buffer, int]]]]  # device -> (fn, leaves, buffers)
    unpacks: dict[int, tuple[Any, tuple[int, ...], tuple[int, ...], list[_Buffer], tuple[int, ...]]]
    comm: Any  # collective only
    widths: tuple[int, ...]
    rounds: tuple[tuple[_Buffer, ...], ...]


class _Executor:
    """A plan compiled for jax: its schedule and jitted programs (built once per plan)."""

    def __init__(self, leaves: Leaves, tplans: list[TensorPlan], transport: str, cap: int, host_packing: bool) -> None:
        self.host_packing = host_packing
        # Host packing stages in the module's per-device arenas (_ARENAS, _ZEROS).
        self.shardings = leaves.shardings
        self.dtypes = list(leaves.dtypes)
        self.src_dtypes = [np.dtype(v.dtype) for v in leaves.values]
        self.shapes = [tuple(int(n) for n in v.shape) for v in leaves.values]
        self.transport = transport
        devices = {d.id: d for d in jax.devices()}
        self.devices = devices
        me = jax.process_index()
        self.local_ids = {i for i, d in devices.items() if d.process_index == me}

        n = len(tplans)
        # Leaves that keep their sharding and dtype are returned as they are.
        self.passthrough = {
            i for i in range(n)
            if leaves.src[i] == leaves.dst[i] and leaves.values[i].sharding == leaves.shardings[i]
        }
        # (leaf, device) whose destination shard is exactly its source shard: no copy.
        self.reuse: set[tuple[int, int]] = set()
        for i, tp in enumerate(tplans):
            if i in self.passthrough or np.dtype(leaves.values[i].dtype) != self.dtypes[i]:
                continue
            sb = tp.src.shards()
            # The planner never sends a device what it holds, so such a shard has one local move.
            for d, box in tp.dst.shards().items():
                if sb.get(d) == box:
                    self.reuse.add((i, d))
        self.dst_boxes = [tp.dst.shards() for tp in tplans]
        skip_moves = set(self.passthrough)
        reuse_by_leaf: dict[int, set[int]] = defaultdict(set)
        for i, d in self.reuse:
            reuse_by_leaf[i].add(d)
        # Drop moves into reused shards by filtering the schedule's pieces afterwards.
        itemsizes = [dt.itemsize for dt in self.dtypes]
        waves = [] if transport == "memcpy" else _schedule(tplans, skip_moves, itemsizes, cap)
        waves = [self._drop_reused(w, reuse_by_leaf) for w in waves]
        self.copies = self._copies(tplans) if transport == "memcpy" else []
        self.casts = {i: jax.jit(functools.partial(_cast, dtype=self.dtypes[i])) for i in range(n)
                      if self.src_dtypes[i] != self.dtypes[i]}
        self.dst_shape = {(i, d): tuple(b.stop - b.start for b in box)
                          for i, boxes in enumerate(self.dst_boxes) for d, box in boxes.items()}
        # Bytes of the new destination shards one sync allocates (host packing and memcpy).
        self.output_bytes = sum(math.prod(shape) * self.dtypes[i].itemsize for (i, d), shape in self.dst_shape.items()
                                if d in self.local_ids and i not in self.passthrough and (i, d) not in self.reuse)
        self.union = sorted({d for i, tp in enumerate(tplans) if i not in self.passthrough
                             for d in tp.src.mesh.device_ids + tp.dst.mesh.device_ids})
        missing = [d for d in self.union if d not in devices]
        if missing:
            raise ValueError(f"the plan names devices {missing} that jax does not have; its devices are {sorted(devices)}.")
        self.mesh = None
        if transport == "collective" and any(w.rounds for w in waves):
            self.mesh = jax.sharding.Mesh(np.array([devices[d] for d in self.union], dtype=object), ("x",))
        self.position = {d: k for k, d in enumerate(self.union)}
        self._started: dict[int, set[int]] = defaultdict(set)  # device -> leaves written so far
        self._last: dict[tuple[int, int], int] = {}  # (leaf, device) -> the last wave writing it
        for w, wave in enumerate(waves):
            for bufs in wave.rounds:
                for b in bufs:
                    self._last.update(((p.leaf, b.dst), w) for p in b.pieces)
            for d, pieces in wave.local.items():
                self._last.update(((p.leaf, d), w) for p in pieces)
        self.waves = [self._programs(w, wave) for w, wave in enumerate(waves)]

    def _copies(self, tplans: list[TensorPlan]) -> list[tuple[int, int, tuple[int, ...], list[tuple]]]:
        """memcpy transport: per (leaf, destination device), the regions to copy from which device."""
        out = []
        for i, tp in enumerate(tplans):
            if i in self.passthrough:
                continue
            sb, db = tp.src.shards(), tp.dst.shards()
            by_dst: dict[int, list[tuple]] = defaultdict(list)
            for s, d, lo, hi in zip(tp.move_src.tolist(), tp.move_dst.tolist(), tp.move_lo.tolist(),
                                    tp.move_hi.tolist(), strict=True):
                if (i, d) in self.reuse:
                    continue
                by_dst[d].append((s, tuple(slice(a - b.start, c - b.start) for a, c, b in zip(lo, hi, sb[s], strict=True)),
                                  tuple(slice(a - b.start, c - b.start) for a, c, b in zip(lo, hi, db[d], strict=True))))
            for d, regions in by_dst.items():
                out.append((i, d, tuple(b.stop - b.start for b in db[d]), regions))
        # Largest first, so that the threads finish together.
        out.sort(key=lambda t: -math.prod(t[2]) * self.dtypes[t[0]].itemsize)
        return out

    def _views(self, shard, needed) -> dict[tuple[int, int], np.ndarray]:
        """Zero-copy NumPy views (as uint, cast first where asked) of the source shards ``needed``."""
        views: dict[tuple[int, int], np.ndarray] = {}
        for i, s in needed:
            if (i, s) not in views:
                x = shard(i, s)
                if i in self.casts:
                    x = self.casts[i](x)
                views[(i, s)] = _uint_view(np.asarray(x))
        return views

    def _host_waves(self, shard) -> dict[tuple[int, int], jax.Array]:
        """The collective and device_put transports with NumPy packing (host-memory backends)."""
        outs: dict[tuple[int, int], np.ndarray] = {}

        def out(i: int, d: int) -> np.ndarray:
            if (i, d) not in outs:
                outs[(i, d)] = _OUTPUTS.take(self.dst_shape[(i, d)], _NP_UINT[self.dtypes[i].itemsize])
            return outs[(i, d)]

        _OUTPUTS.reserve(self.output_bytes)
        for prog in self.waves:
            slots = self._slots(prog)
            views = self._views(shard, [(p.leaf, s) for s, (_, _, bufs) in prog.packs.items() for b, _ in bufs
                                        for p in b.pieces] +
                                [(p.leaf, d) for d, u in prog.unpacks.items() for p in u[5]])

            def pack(task) -> np.ndarray:
                s, b, width = task
                start = slots[(s, b.dst)]
                buf = _ARENAS[s][start:start + width]
                for p, off in zip(b.pieces, b.offsets, strict=True):
                    isz = self.dtypes[p.leaf].itemsize
                    dst = buf[off:off + p.nbytes].view(_NP_UINT[isz]).reshape(p.shape)
                    dst[...] = views[(p.leaf, s)][_region(p.src_start, p.shape)]
                return buf

            tasks = [(s, b, width) for s, (_, _, bufs) in prog.packs.items() for b, width in bufs]
            filled = _map(pack, tasks)
            placed = jax.device_put(filled, [self.devices[s] for s, _, _ in tasks])
            received, done = self._move(prog, {(b.src, b.dst): x for (_, b, _), x in zip(tasks, placed, strict=True)})
            jax.block_until_ready(done)  # the arenas are free again once the sends are done
            for d, u in prog.unpacks.items():  # allocate in this thread, fill in the pool
                for i in u[1] + u[2]:
                    out(i, d)

            def unpack(item) -> None:
                d, (_, _, _, bufs, _, local) = item
                for b in bufs:
                    raw = np.asarray(received[(b.src, b.dst)])
                    for p, off in zip(b.pieces, b.offsets, strict=True):
                        isz = self.dtypes[p.leaf].itemsize
                        outs[(p.leaf, d)][_region(p.dst_start, p.shape)] = (
                            raw[off:off + p.nbytes].view(_NP_UINT[isz]).reshape(p.shape))
                for p in local:
                    outs[(p.leaf, d)][_region(p.dst_start, p.shape)] = views[(p.leaf, d)][_region(p.src_start, p.shape)]

            _map(unpack, list(prog.unpacks.items()))
        keys = list(outs)
        placed = jax.device_put([outs[(i, d)].view(self.dtypes[i]) for i, d in keys], [self.devices[d] for _, d in keys])
        return dict(zip(keys, placed, strict=True))

    def _idle_input(self, device: Any, width: int) -> jax.Array:
        """The input of a device that sends nothing in a round (ppermute needs one from every device)."""
        if not self.host_packing:
            return jnp.zeros((width,), jnp.uint8, device=device)
        # On host memory, a view of one kept zero arena per device, adopted without a copy.
        arena = _ZEROS.get(device.id)
        if arena is None or len(arena) < width:
            arena = _ZEROS[device.id] = _aligned_empty((width,), np.uint8)
            arena[...] = 0
        return jax.device_put(arena[:width], device)

    def _slots(self, prog: _WaveProgram) -> dict[tuple[int, int], int]:
        """Where each of this wave's send buffers starts in its sender's arena (grown as needed)."""
        slots, size = {}, defaultdict(int)
        for s, (_, _, bufs) in prog.packs.items():
            for b, width in bufs:
                slots[(s, b.dst)] = size[s]
                size[s] += -(-width // 64) * 64
        for s, n in size.items():
            if s not in _ARENAS or len(_ARENAS[s]) < n:
                _ARENAS[s] = _aligned_empty((n,), np.uint8)
        return slots

    def _memcpy(self, shard) -> dict[tuple[int, int], jax.Array]:
        """Copies every box between the devices' host buffers (CPU backend, one process)."""
        views = self._views(shard, [(i, s) for i, _, _, regions in self.copies for s, _, _ in regions])
        _OUTPUTS.reserve(self.output_bytes)

        def fill(task) -> np.ndarray:
            i, d, shape, regions = task
            out = _OUTPUTS.take(shape, views[(i, regions[0][0])].dtype)
            for s, src_region, dst_region in regions:
                out[dst_region] = views[(i, s)][src_region]
            return out.view(self.dtypes[i])

        filled = _map(fill, self.copies)
        placed = jax.device_put(filled, [self.devices[d] for _, d, _, _ in self.copies])
        return {(i, d): x for (i, d, _, _), x in zip(self.copies, placed, strict=True)}

    @staticmethod
    def _drop_reused(wave: _Wave, reuse: dict[int, set[int]]) -> _Wave:
        local = {d: tuple(p for p in ps if d not in reuse.get(p.leaf, ())) for d, ps in wave.local.items()}
        return _Wave(wave.rounds, {d: ps for d, ps in local.items() if ps})

    def _programs(self, index: int, wave: _Wave) -> _WaveProgram:
        collective = self.transport == "collective"
        widths = tuple(max(b.nbytes for b in r) for r in wave.rounds)
        sends: dict[int, list[tuple[_Buffer, int]]] = defaultdict(list)
        recvs: dict[int, list[_Buffer]] = defaultdict(list)
        for r, bufs in enumerate(wave.rounds):
            for b in bufs:
                sends[b.src].append((b, widths[r] if collective else b.nbytes))
                recvs[b.dst].append(b)
        packs = {}
        for s, bufs in sends.items():
            if s in self.local_ids:
                leaves = tuple(sorted({p.leaf for b, _ in bufs for p in b.pieces}))
                fn = None if self.host_packing else _make_pack(leaves, bufs, self.src_dtypes, self.dtypes)
                packs[s] = (fn, leaves, bufs)
        unpacks = {}
        for d in sorted(set(recvs) | set(wave.local)):
            if d not in self.local_ids:
                continue
            touched = sorted({p.leaf for b in recvs.get(d, ()) for p in b.pieces} |
                             {p.leaf for p in wave.local.get(d, ())})
            started = self._started[d]
            carried = tuple(i for i in touched if i in started)
            fresh = tuple(i for i in touched if i not in started)
            started.update(touched)
            local = wave.local.get(d, ())
            local_leaves = tuple(sorted({p.leaf for p in local}))
            shapes = {i: self.dst_shape[(i, d)] for i in touched}
            finish = frozenset(i for i in touched if self._last[(i, d)] == index)
            fn = None if self.host_packing else _make_unpack(
                carried, fresh, recvs.get(d, []), local, local_leaves, shapes, self.src_dtypes, self.dtypes, finish,
                donate=bool(carried))
            unpacks[d] = (fn, carried, fresh, recvs.get(d, []), local_leaves, local)
        comm = None
        if collective and wave.rounds:
            perms = [tuple((self.position[b.src], self.position[b.dst]) for b in r) for r in wave.rounds]
            comm = _make_comm(self.mesh, perms)
        return _WaveProgram(packs, unpacks, comm, widths, wave.rounds)

    def __call__(self, values: tuple[jax.Array, ...], donate: bool) -> list[jax.Array]:
        shards: dict[int, dict[int, jax.Array]] = {}

        def shard(leaf: int, device: int) -> jax.Array:
            if leaf not in shards:
                shards[leaf] = {s.device.id: s.data for s in values[leaf].addressable_shards}
            return shards[leaf][device]

        results: dict[tuple[int, int], jax.Array] = self._memcpy(shard) if self.copies else {}
        if self.host_packing:
            results.update(self._host_waves(shard))
        last: list[tuple[int, int]] = []  # what the previous wave wrote
        for prog in [] if self.host_packing else self.waves:
            # Bound staging memory: the previous wave finishes before the next starts.
            jax.block_until_ready([results[k] for k in last])
            packed: dict[tuple[int, int], jax.Array] = {}
            for s, (fn, leaves, bufs) in prog.packs.items():
                outs = fn(*(shard(i, s) for i in leaves))
                for (b, _), o in zip(bufs, outs, strict=True):
                    packed[(b.src, b.dst)] = o
            received, _ = self._move(prog, packed)
            last = []
            for d, (fn, carried, fresh, bufs, local_leaves, _) in prog.unpacks.items():
                outs = fn(tuple(results.pop((i, d)) for i in carried),
                          tuple(received[(b.src, b.dst)] for b in bufs),
                          tuple(shard(i, d) for i in local_leaves))
                for i, o in zip(carried + fresh, outs, strict=True):
                    results[(i, d)] = o
                    last.append((i, d))

        out = []
        for i, sharding in enumerate(self.shardings):
            if i in self.passthrough:
                out.append(values[i])
                continue
            arrays = []
            for dev in sharding.addressable_devices_indices_map(self.shapes[i]):
                d = dev.id
                if (i, d) in self.reuse:
                    arrays.append(shard(i, d))
                elif (i, d) in results:
                    arrays.append(results[(i, d)])
                else:  # an empty shard (a dim of size 0): nothing moves into it
                    arrays.append(jnp.zeros(self.dst_shape[(i, d)], self.dtypes[i], device=dev))
            out.append(jax.make_array_from_single_device_arrays(self.shapes[i], sharding, arrays, dtype=self.dtypes[i]))
        if donate:
            kept = self.passthrough | {i for i, _ in self.reuse}
            for i, v in enumerate(values):
                if i not in kept:
                    v.delete()
        return out

    def _move(self, prog: _WaveProgram, packed: dict[tuple[int, int], jax.Array]) -> tuple[dict, list]:
        """Sends the packed buffers; returns the received ones and arrays that are ready when all sends are done."""
        if not prog.rounds:
            return {}, []
        if self.transport == "device_put":
            received = {key: jax.device_put(buf, self.devices[key[1]]) for key, buf in packed.items()}
            return received, list(received.values())
        sharding = NamedSharding(self.mesh, P("x"))
        inputs = []
        for r, bufs in enumerate(prog.rounds):
            width = prog.widths[r]
            by_src = {b.src: packed[(b.src, b.dst)] for b in bufs if b.src in self.local_ids}
            arrays = [by_src[d.id] if d.id in by_src else self._idle_input(d, width)
                      for d in sharding.addressable_devices]
            inputs.append(jax.make_array_from_single_device_arrays((width * len(self.union),), sharding, arrays))
        outs = prog.comm(*inputs)
        received = {}
        for bufs, o in zip(prog.rounds, outs, strict=True):
            got = {s.device.id: s.data for s in o.addressable_shards}
            for b in bufs:
                if b.dst in self.local_ids:
                    received[(b.src, b.dst)] = got[b.dst]
        return received, list(outs)


def _cast(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x.astype(dtype)


def _uint_view(a: np.ndarray) -> np.ndarray:
    # Copies as unsigned integers: byte-exact whatever the element type.
    return a.view(np.uint8 if a.dtype == np.bool_ else _NP_UINT[a.dtype.itemsize])


_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array on a 64-byte boundary, which jax's CPU client adopts without a copy."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(n + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start:start + n].view(dtype).reshape(shape)


def _region(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))


def _map(fn, items: list) -> list:
    """``fn`` over ``items`` on the copy threads (NumPy copies release the GIL)."""
    return list(_pool().map(fn, items)) if len(items) > 1 else [fn(x) for x in items]


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                                      thread_name_prefix="jreshard-memcpy")
    return _POOL


# Host packing keeps, between syncs, one staging arena per sending device (the largest
# wave's send bytes, so at most the cap) and one zero buffer per device for the rounds
# it sits out: on the machines measured, faulting in fresh pages cost more than
# filling them. They are shared by all plans, so they hold at most about twice the
# largest cap used per device; the lock serialises syncs that use them.
_ARENAS: dict[int, np.ndarray] = {}
_ZEROS: dict[int, np.ndarray] = {}
_LOCK = threading.Lock()


class _OutputPool:
    """A caching allocator for the destination shards that host transports write.

    Each shard is a view of a 64-byte-aligned block that jax adopts without a copy.
    The view is made through a ctypes array over the block, which is the object jax
    keeps alive as long as any array uses the memory; when it is collected the block
    goes back to the pool, to be refilled by the next sync of the same shapes instead
    of faulting in fresh pages (on the machines measured, first-touch page faults cost
    more than the copy itself). The pool keeps free blocks up to the largest output of
    one sync seen so far (``reserve``), so a loop that keeps one set of synced weights
    alive holds at most one extra set.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._leased: dict[int, np.ndarray] = {}
        self._free_bytes = 0
        self._limit = 0
        self._next = 0
        self._lock = threading.RLock()  # re-entrant: a collection inside take() may give a block back

    def reserve(self, nbytes: int) -> None:
        with self._lock:
            self._limit = max(self._limit, nbytes)

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if nbytes == 0:
            return _aligned_empty(shape, dtype)
        with self._lock:
            blocks = self._free.get(nbytes)
            block = blocks.pop() if blocks else None
            if block is not None:
                self._free_bytes -= nbytes
            token, self._next = self._next, self._next + 1
        if block is None:
            block = _aligned_empty((nbytes,), np.uint8)
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
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
            self._limit = 0

    def stats(self) -> tuple[int, int]:
        """(bytes of free blocks kept, bytes of blocks in use by live arrays)."""
        with self._lock:
            return self._free_bytes, sum(b.nbytes for b in self._leased.values())


_OUTPUTS = _OutputPool()


def release_transfer_buffers() -> None:
    """Frees the staging buffers and cached output blocks kept between syncs.

    Blocks still used by live arrays are freed when those arrays are.
    """
    with _LOCK:
        _ARENAS.clear()
        _ZEROS.clear()
        _OUTPUTS.clear()


_EXECUTORS: OrderedDict = OrderedDict()
_EXECUTORS_SIZE = 16


def _executor(leaves: Leaves, tplans: list[TensorPlan], key: tuple, transport: str, cap: int,
              host_packing: bool) -> _Executor:
    ex = _EXECUTORS.get(key)
    if ex is None:
        ex = _Executor(leaves, tplans, transport, cap, host_packing)
        _EXECUTORS[key] = ex
        while len(_EXECUTORS) > _EXECUTORS_SIZE:
            _EXECUTORS.popitem(last=False)
    _EXECUTORS.move_to_end(key)
    return ex


# --------------------------------------------------------------------------- entry point


def _check_plan(plan: Any, leaves: Leaves) -> list[TensorPlan]:
    """The plan's TensorPlans in leaf order; a clear error if it was made for other arguments."""
    hint = "make it with jreshard.plan(params, target) with the same target, mesh and dtype"
    if isinstance(plan, TensorPlan):
        if len(leaves.names) != 1:
            raise ValueError(f"plan is a TensorPlan for one tensor but params has {len(leaves.names)} leaves; {hint}.")
        tplans = [plan]
    elif isinstance(plan, Plan):
        names = [path_str(p) for p in plan.paths]
        if names != list(leaves.names):
            raise ValueError(
                f"plan does not match params: it covers tensors {names[:6]!r}{'...' if len(names) > 6 else ''} "
                f"but params has {list(leaves.names)[:6]!r}{'...' if len(leaves.names) > 6 else ''}; {hint}."
            )
        tplans = [plan[n] for n in names]
    else:
        raise TypeError(f"plan must be a jreshard.Plan or TensorPlan (from jreshard.plan), got {type(plan).__name__}.")
    for name, tp, s, d in zip(leaves.names, tplans, leaves.src, leaves.dst, strict=True):
        for side, have, want in (("source", tp.src, s), ("destination", tp.dst, d)):
            same = (have.shape, have.mesh, have.spec) == (want.shape, want.mesh, want.spec)
            if not same or (have.dtype is not None and have.dtype != want.dtype):
                where = f"tensor {name!r}" if name else "the tensor"
                raise ValueError(f"plan does not match params/target: for {where} the plan's {side} is "
                                 f"{have!r} but the arguments give {want!r}; {hint}.")
    return tplans


def transfer(params: Any, target: Any, *, plan: Plan | TensorPlan | None = None, dtype: Any = None,
             donate: bool = False, max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
             mesh: Any = None, transport: str = "auto") -> Any:
    """Moves a pytree of sharded jax Arrays onto another sharding, sending only what each device lacks.

    Args:
      params: a pytree of ``jax.Array``; each leaf may have any sharding on any devices.
      target: a ``jax.sharding.Sharding`` for every leaf, a pytree (prefix) of Shardings,
        or a PartitionSpec / pytree of PartitionSpecs together with ``mesh``.
      plan: a plan from ``jreshard.plan(params, target, ...)`` to reuse; refused with a
        ``ValueError`` when it was made for other arrays, shardings or dtypes.
      dtype: output dtype, or a pytree prefix of dtypes (``None`` keeps a leaf's dtype).
        The cast happens at the sender, so only the cast bytes move.
      donate: delete the source arrays once they are sent (a source shard that is
        reused as a destination shard is kept).
      max_bytes_in_flight: per device, the most bytes sent plus received in one wave
        (the staging memory on top of the output); larger transfers run in several
        waves, and a tensor larger than this is cut into pieces.
      mesh: the ``jax.sharding.Mesh`` (or ``jreshard.Mesh``) for PartitionSpec targets.
      transport: ``"collective"`` (``ppermute`` inside ``shard_map``; works across
        processes), ``"device_put"`` (one ``device_put`` per packed buffer; one process
        must address every device), ``"memcpy"`` (CPU devices in one process: each box
        copied between the devices' host buffers), or ``"auto"``: the fastest measured
        for the backend when one process addresses every device (``"memcpy"`` on
        CPU), else ``"collective"``.

    Returns:
      The pytree of ``params``' structure, each leaf a ``jax.Array`` with exactly its
      target sharding, bit-identical to the input (or cast to ``dtype``).

    Raises:
      TypeError: a leaf is not a jax Array, or an argument has the wrong kind.
      ValueError: target or dtype do not fit params, or ``plan`` does not match.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> devs = np.array(jax.devices()[:8])
      >>> train = jax.sharding.Mesh(devs[:4], ("fsdp",))
      >>> serve = jax.sharding.Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
      >>> w = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(train, P("fsdp")))
      >>> out = transfer({"w": w}, NamedSharding(serve, P(None, "tp")))
      >>> out["w"].sharding == NamedSharding(serve, P(None, "tp")), np.array_equal(out["w"], w)
      (True, True)
    """
    if not isinstance(donate, bool):
        raise TypeError(f"donate must be True or False, got {donate!r}.")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}.")
    if isinstance(max_bytes_in_flight, bool) or not isinstance(max_bytes_in_flight, numbers.Integral):
        raise TypeError(f"max_bytes_in_flight must be an int number of bytes, got {max_bytes_in_flight!r}.")
    if max_bytes_in_flight < 16:
        raise ValueError(f"max_bytes_in_flight must be at least 16 bytes, got {max_bytes_in_flight}; "
                         f"the default is {DEFAULT_MAX_BYTES_IN_FLIGHT} (256 MiB).")
    leaves = parse(params, target, mesh=mesh, dtype=dtype, need_data=True)
    cap = int(max_bytes_in_flight)
    if cap < max(dt.itemsize for dt in leaves.dtypes):
        raise ValueError(f"max_bytes_in_flight={cap} is smaller than one element; raise it.")
    tplans = _check_plan(plan, leaves) if plan is not None else None
    if tplans is None:
        p = leaves.plan()
        tplans = [p[n] for n in (path_str(q) for q in p.paths)]
        plan = p
    transport = _resolve_transport(transport, leaves)
    platforms = {d.platform for v in leaves.values for d in v.sharding.device_set}
    host_packing = transport != "memcpy" and platforms <= _HOST_PACKING_BACKENDS
    if not host_packing and transport != "memcpy":
        x64 = jax.config.jax_enable_x64
        for name, v, dt in zip(leaves.names, leaves.values, leaves.dtypes, strict=True):
            for d in {np.dtype(v.dtype), dt}:
                if np.issubdtype(d, np.complexfloating) and not (x64 and d.itemsize == 8):
                    raise TypeError(
                        f"params leaf {name!r} has dtype {d}, which this backend's compiled packing cannot "
                        "move (it needs an unsigned integer as wide as the element); move the real and "
                        "imaginary parts as separate float leaves, or enable jax_enable_x64 for complex64."
                    )
    key = (plan, leaves.shardings, tuple(v.sharding for v in leaves.values),
           tuple(dt.name for dt in leaves.dtypes), transport, cap, host_packing)
    ex = _executor(leaves, tplans, key, transport, cap, host_packing)
    with _LOCK:
        out = ex(leaves.values, donate)
    return jax.tree_util.tree_unflatten(leaves.treedef, out)


def _resolve_transport(transport: str, leaves: Leaves) -> str:
    ids = set()
    for v, s in zip(leaves.values, leaves.shardings, strict=True):
        ids.update(d.id for d in v.sharding.device_set)
        ids.update(d.id for d in s.device_set)
    me = jax.process_index()
    devices = [d for d in jax.devices() if d.id in ids]
    one_process = all(d.process_index == me for d in devices)
    platforms = {d.platform for d in devices}
    if transport in ("device_put", "memcpy") and not one_process:
        raise ValueError(
            f"transport={transport!r} needs every source and destination device in this process; "
            "use transport='collective' (or 'auto') under jax.distributed."
        )
    if transport == "memcpy" and platforms != {"cpu"}:
        raise ValueError(
            f"transport='memcpy' copies host buffers and needs CPU devices, got {sorted(platforms)}; "
            "use 'auto', 'device_put' or 'collective'."
        )
    if transport == "auto":
        backend = platforms.pop() if len(platforms) == 1 else None
        return _AUTO_ONE_PROCESS.get(backend, "collective") if one_process else "collective"
    return transport
