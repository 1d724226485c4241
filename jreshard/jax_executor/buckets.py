"""Running the buckets of a schedule with the ``collective`` and ``device_put`` transports.

Per bucket, every sender packs its messages, the transport moves them, and every
receiver unpacks them into its destination shards; the bucket finishes before the
next one starts, which bounds staging memory. Packing and unpacking are compiled
programs (``programs.py``), or on backends whose device buffers are host memory,
NumPy copies into kept host buffers (``host.py``). Under ``jax.distributed``
each process packs and unpacks for its own devices only and all run the same
collective.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jreshard.core.schedule import ALIGN, Bucket, Message, Piece
from jreshard.jax_executor import host, programs
from jreshard.jax_executor.launch import Launch, launches
from jreshard.jax_executor.shards import Destinations, SourceShards

__all__ = ["Transport", "BucketRunner"]

# (leaf, device) -> destination shard: host memory (NumPy packing), placed per leaf by the executor
Results = dict[tuple[int, int], jax.Array | np.ndarray]


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """One sender's part of a bucket."""

    leaves: tuple[int, ...]  # whose source shards it reads
    messages: tuple[tuple[Message, int], ...]  # with the width of its buffer


@dataclasses.dataclass(frozen=True, slots=True)
class Receive:
    """One receiver's part of a bucket."""

    carried: tuple[int, ...]  # leaves an earlier bucket started writing
    fresh: tuple[int, ...]  # leaves first written in this bucket
    messages: tuple[Message, ...]
    local: tuple[Piece, ...]  # copies from its own source shards
    local_leaves: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class BucketProgram:
    """A bucket as this process runs it: its own devices' sends and receives, and the collective."""

    rounds: tuple[tuple[Message, ...], ...]
    widths: tuple[int, ...]  # per round, the widest message (ppermute needs one shape)
    sends: Mapping[int, Send]
    receives: Mapping[int, Receive]
    packs: tuple[Launch, ...]  # compiled packing only
    unpacks: tuple[Launch, ...]
    comm: Callable[..., Any] | None  # collective only
    link_bytes: Mapping[tuple[int, int], int]  # payload bytes this process's devices send, per (sender, receiver)


@dataclasses.dataclass(frozen=True, slots=True)
class Transport:
    """How messages move: ``ppermute`` over a 1-D mesh of every device, or ``device_put``."""

    kind: str  # "collective" or "device_put"
    devices: Mapping[int, Any]  # id -> jax device
    local_ids: frozenset[int]  # the devices of this process
    mesh: jax.sharding.Mesh | None  # collective only: every device of the transfer, in `union` order
    host_packing: bool

    def send(self, prog: BucketProgram, packed: Mapping[tuple[int, int], jax.Array]) -> tuple[dict, list]:
        """Moves the packed buffers; returns the received ones and arrays ready once every send is done."""
        if not prog.rounds:
            return {}, []
        if self.kind == "device_put":
            received = {key: jax.device_put(buf, self.devices[key[1]]) for key, buf in packed.items()}
            return received, list(received.values())
        assert self.mesh is not None and prog.comm is not None  # built together for the collective
        sharding = NamedSharding(self.mesh, P(programs.AXIS))
        inputs = []
        for msgs, width in zip(prog.rounds, prog.widths, strict=True):
            by_src = {m.src: packed[(m.src, m.dst)] for m in msgs if m.src in self.local_ids}
            devices: list[Any] = list(sharding.addressable_devices)
            arrays = [by_src[d.id] if d.id in by_src else self._idle(d, width) for d in devices]
            inputs.append(jax.make_array_from_single_device_arrays((width * self.mesh.size,), sharding, arrays))
        outs = prog.comm(*inputs)
        received = {}
        for msgs, o in zip(prog.rounds, outs, strict=True):
            got = {s.device.id: s.data for s in o.addressable_shards}
            received.update({(m.src, m.dst): got[m.dst] for m in msgs if m.dst in self.local_ids})
        return received, list(outs)

    def _idle(self, device: Any, width: int) -> jax.Array:
        """The input of a device that sends nothing in a round (ppermute takes one from every device)."""
        if self.host_packing:  # a view of kept zeros, adopted without a copy
            return jax.device_put(host.STAGING.zeros(device.id, width), device)
        return jnp.zeros((width,), jnp.uint8, device=device)


def build_programs(buckets: Sequence[Bucket], dests: Destinations, transport: Transport,
                   src_dtypes: Sequence[np.dtype], src_shape: Callable[[int, int], tuple[int, ...]]
                   ) -> list[BucketProgram]:
    """This process's part of every bucket, with compiled programs unless it packs on the host.

    ``src_shape(leaf, device)``: the shape of the device's source shard.
    """
    position = {d: k for k, d in enumerate(dests.union)}
    last: dict[tuple[int, int], int] = {}  # (leaf, device) -> the last bucket that writes it
    for b, bucket in enumerate(buckets):
        for msgs in bucket.rounds:
            last.update(((p.leaf, m.dst), b) for m in msgs for p in m.pieces)
        last.update(((p.leaf, d), b) for d, ps in bucket.local.items() for p in ps)
    started: dict[int, set[int]] = defaultdict(set)  # device -> leaves written by earlier buckets
    compiled = not transport.host_packing
    out = []
    for b, bucket in enumerate(buckets):
        collective = transport.kind == "collective"
        widths = tuple(max(m.nbytes for m in msgs) for msgs in bucket.rounds)
        sent: dict[int, list[tuple[Message, int]]] = defaultdict(list)
        got: dict[int, list[Message]] = defaultdict(list)
        round_of: dict[Message, int] = {}
        for r, (msgs, width) in enumerate(zip(bucket.rounds, widths, strict=True)):
            for m in msgs:
                sent[m.src].append((m, width if collective else m.nbytes))
                got[m.dst].append(m)
                round_of[m] = r
        # Messages in the order of what they carry, not of rounds: devices that do the same
        # work then pass the same program arguments, and share one launch.
        for outgoing in sent.values():
            outgoing.sort(key=lambda mw: [(p.leaf, p.src_box) for p in mw[0].pieces])
        for incoming in got.values():
            incoming.sort(key=lambda m: [(p.leaf, p.dst_box) for p in m.pieces])
        sends, packs = {}, {}
        for s, outgoing in sent.items():
            if s in transport.local_ids:
                leaves = tuple(sorted({p.leaf for m, _ in outgoing for p in m.pieces}))
                sends[s] = Send(leaves, tuple(outgoing))
                shapes = tuple(src_shape(i, s) for i in leaves)
                packs[s] = (programs.PackArgs.of(leaves, outgoing, src_dtypes, dests.dtypes), shapes,
                            all(shapes))
        receives, unpacks = {}, {}
        for d in sorted((set(got) | set(bucket.local)) & transport.local_ids):
            local = bucket.local.get(d, ())
            touched = sorted({p.leaf for m in got[d] for p in m.pieces} | {p.leaf for p in local})
            carried = tuple(i for i in touched if i in started[d])
            fresh = tuple(i for i in touched if i not in started[d])
            started[d].update(touched)
            local_leaves = tuple(sorted({p.leaf for p in local}))
            receives[d] = Receive(carried, fresh, tuple(got[d]), tuple(local), local_leaves)
            finish = frozenset(i for i in touched if last[(i, d)] == b)
            out_shapes = {i: dests.shape(i, d) for i in touched}
            passed = (tuple(widths[round_of[m]] if collective else m.nbytes for m in got[d]),
                      tuple(src_shape(i, d) for i in local_leaves))
            unpacks[d] = (programs.UnpackArgs.of(carried, fresh, got[d], local, local_leaves, out_shapes, src_dtypes,
                                                 dests.dtypes, finish), passed,
                          all(out_shapes.values()) and all(passed[1]))
        comm = None
        if collective and bucket.rounds:
            assert transport.mesh is not None
            perms = tuple(tuple((position[m.src], position[m.dst]) for m in msgs) for msgs in bucket.rounds)
            comm = programs.make_comm(transport.mesh, perms)
        link_bytes: Counter[tuple[int, int]] = Counter()
        for s, send in sends.items():
            for m, _ in send.messages:
                link_bytes[(s, m.dst)] += sum(p.nbytes for p in m.pieces)
        out.append(BucketProgram(bucket.rounds, widths, sends, receives,
                                 launches(packs, transport.devices) if compiled else (),
                                 launches(unpacks, transport.devices) if compiled else (), comm, link_bytes))
    return out


class BucketRunner:
    """Runs bucket programs, one bucket after another, for one executor."""

    def __init__(self, progs: list[BucketProgram], dests: Destinations, transport: Transport) -> None:
        self.progs = progs
        self.dests = dests
        self.transport = transport
        # Payload bytes sent by this process's devices in the last call, per (sender, receiver).
        self.link_bytes: Counter[tuple[int, int]] = Counter()
        self.total_bytes = sum(sum(p.link_bytes.values()) for p in progs)
        self.progress: Any = None  # a tqdm-like bar for the next call (update(nbytes)), or None

    def __call__(self, shards: SourceShards) -> Results:
        self.link_bytes = Counter()
        return self._on_host(shards) if self.transport.host_packing else self._compiled(shards)

    def _sent(self, prog: BucketProgram) -> None:
        """Counts a bucket's sends once the transport has moved them."""
        self.link_bytes.update(prog.link_bytes)
        if self.progress is not None:
            self.progress.update(sum(prog.link_bytes.values()))

    def _compiled(self, shards: SourceShards) -> Results:
        results: Results = {}
        last: list[tuple[int, int]] = []  # what the previous bucket wrote
        for prog in self.progs:
            jax.block_until_ready([results[k] for k in last])  # bounds staging memory
            packed: dict[tuple[int, int], jax.Array] = {}
            for launch in prog.packs:
                sends = [prog.sends[s] for s in launch.devices]
                outs = launch([tuple(shards.get(i, s) for i in send.leaves)
                               for s, send in zip(launch.devices, sends, strict=True)])
                for send, out in zip(sends, outs, strict=True):
                    packed.update(((m.src, m.dst), o) for (m, _), o in zip(send.messages, out, strict=True))
            received, _ = self.transport.send(prog, packed)
            self._sent(prog)
            last = []
            for launch in prog.unpacks:
                receives = [prog.receives[d] for d in launch.devices]
                outs = launch([(tuple(results.pop((i, d)) for i in r.carried),
                                tuple(received[(m.src, m.dst)] for m in r.messages),
                                tuple(shards.get(i, d) for i in r.local_leaves))
                               for d, r in zip(launch.devices, receives, strict=True)])
                for d, r, out in zip(launch.devices, receives, outs, strict=True):
                    for i, o in zip(r.carried + r.fresh, out, strict=True):
                        results[(i, d)] = o
                        last.append((i, d))
        return results

    def _on_host(self, shards: SourceShards) -> Results:
        """Packing and unpacking as NumPy copies into kept, aligned host buffers."""
        dests = self.dests
        outs: dict[tuple[int, int], np.ndarray] = {}
        host.OUTPUTS.reserve(dests.output_bytes)
        for prog in self.progs:
            self._host_bucket(prog, shards, outs)
        return {(i, d): out.view(dests.dtypes[i]) for (i, d), out in outs.items()}

    def _host_bucket(self, prog: BucketProgram, shards: SourceShards, outs: dict[tuple[int, int], np.ndarray]) -> None:
        """One bucket with host packing: fills ``outs`` (as uint), allocating the shards it starts."""
        dests = self.dests
        views = shards.host_views([(p.leaf, s) for s, send in prog.sends.items() for m, _ in send.messages
                                   for p in m.pieces] +
                                  [(p.leaf, d) for d, r in prog.receives.items() for p in r.local])
        tasks = [(s, m, width) for s, send in prog.sends.items() for m, width in send.messages]
        buffers = _arena_slices(tasks)

        def pack(task: tuple[int, Message, int]) -> np.ndarray:
            s, m, _ = task
            buf = buffers[(m.src, m.dst)]
            for p, off in zip(m.pieces, m.offsets, strict=True):
                dst = buf[off:off + p.nbytes].view(host.uint_dtype(dests.dtypes[p.leaf].itemsize))
                shards.casts.sink(p.leaf, dst.reshape(p.shape))[...] = views[(p.leaf, s)][p.src_box]
            return buf

        filled = host.parallel_map(pack, tasks)
        placed = jax.device_put(filled, [self.transport.devices[s] for s, _, _ in tasks])
        received, done = self.transport.send(prog, {(m.src, m.dst): x
                                                    for (_, m, _), x in zip(tasks, placed, strict=True)})
        jax.block_until_ready(done)  # the arenas are free again once the sends are done
        self._sent(prog)
        for d, r in prog.receives.items():  # allocate in this thread, fill on the copy threads
            for i in r.carried + r.fresh:
                if (i, d) not in outs:
                    outs[(i, d)] = host.OUTPUTS.take(dests.shape(i, d), host.uint_dtype(dests.dtypes[i].itemsize))

        def unpack(item: tuple[int, Receive]) -> None:
            d, r = item
            for m in r.messages:
                raw = np.asarray(received[(m.src, m.dst)])
                for p, off in zip(m.pieces, m.offsets, strict=True):
                    uint = host.uint_dtype(dests.dtypes[p.leaf].itemsize)
                    outs[(p.leaf, d)][p.dst_box] = raw[off:off + p.nbytes].view(uint).reshape(p.shape)
            for p in r.local:
                shards.casts.sink(p.leaf, outs[(p.leaf, d)])[p.dst_box] = views[(p.leaf, d)][p.src_box]

        host.parallel_map(unpack, prog.receives.items())


def _arena_slices(tasks: Sequence[tuple[int, Message, int]]) -> dict[tuple[int, int], np.ndarray]:
    """Each message's buffer: a slice of its sender's staging arena (grown as needed)."""
    starts: dict[tuple[int, int], tuple[int, int, int]] = {}
    size: dict[int, int] = defaultdict(int)
    for s, m, width in tasks:
        starts[(m.src, m.dst)] = (s, size[s], width)
        size[s] += -(-width // ALIGN) * ALIGN
    arenas = {s: host.STAGING.arena(s, n) for s, n in size.items()}
    return {key: arenas[s][start:start + width] for key, (s, start, width) in starts.items()}
