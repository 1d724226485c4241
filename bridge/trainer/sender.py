"""The trainer side: export addressable JAX shards (DLPack) and send each rank its slices.

Import this module in trainer processes only: it imports jax (lazily, on first
use). Each trainer process is one torch rank; its JAX devices are source ids
``bridge.source_id(rank, local)`` with ``local`` the device's position among the
process's devices in device-id order.

Example (every trainer process):

    group = bridge.init_group(rank, world_size, port=port)
    source = describe(params, trainer_ranks=[0, 1])      # or Source.build(...) from the config
    plan = bridge.BridgePlan(source, bridge.llama_param_map(cfg, source, tp_ranks=[2, 3], fused=True))
    sender = Sender(plan, rank=rank)
    sender.sync(params, version=step)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from bridge.plan.bridge_plan import BridgePlan, Message
from bridge.plan.source import Source, source_id, split_source_id
from bridge.wire.bucket import Arena, Side
from bridge.wire.gloo import check_transport
from bridge.wire.group import check_plan_and_rank
from bridge.wire.handshake import Role
from bridge.wire.session import SyncSession, reject_sync, torch_dtype
from bridge.wire.transport import Transport
from jreshard.core.args import check_flag, check_int, check_seconds
from jreshard.core.execution import ExecutionStats
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh

__all__ = ["Sender", "describe", "flatten_params"]

log = logging.getLogger("bridge")


def flatten_params(params: Any) -> dict[str, Any]:
    """``{path: leaf}`` of a jax pytree, each path as ``keystr(path, simple=True, separator='/')`` prints it."""
    import jax

    keystr = jax.tree_util.keystr
    return {keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


class _ShardKey(NamedTuple):
    """A shard as the sender packs it: a leaf's shard on a source id, permuted, cast by XLA to ``dtype``.

    ``dtype`` is ``None`` where the shard is read as it is (a zero-copy DLPack view, cast while packing).
    """

    leaf: str
    src: int
    perm: tuple[int, ...]
    dtype: str | None


class _PackPiece(NamedTuple):
    """Copy ``shard[region]`` (a ``_ShardKey``) to bytes ``[offset, offset + nbytes)`` as ``dtype``."""

    shard: _ShardKey
    region: tuple[slice, ...]
    offset: int
    nbytes: int
    dtype: torch.dtype


class _PackSegment(NamedTuple):
    """One send: bytes ``[start, stop)`` of the buffer, or straight from the shard when ``direct``."""

    start: int
    stop: int
    direct: bool
    pieces: list[_PackPiece]


@functools.cache
def _cast_transpose(perm: tuple[int, ...], dtype: str, devices: tuple[Any, ...]) -> tuple[Any, Callable[[Any], Any]]:
    """One jitted cast-then-transpose per (permutation, dtype, devices), shared by every Sender, and the sharding
    of its input.

    It runs over equal shards on ``devices`` taken together as one process-local array (split along
    dim 0, one shard per device; no copy), and gives each device the transpose of its own shard. XLA
    then compiles once per shard shape and set of devices, where a program per shard compiled once
    per shape and device: on a first sync of 4 devices, 20 compiles (1.9 s of its 2.7 s) became 5.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("shards",))
    out = NamedSharding(mesh, PartitionSpec(*("shards" if p == 0 else None for p in perm)))
    fn = jax.jit(lambda a: jnp.transpose(a.astype(dtype), perm), out_shardings=out)
    return NamedSharding(mesh, PartitionSpec("shards")), fn


def _source_ids(trainer_ranks: Sequence[int]) -> dict[int, int]:
    """JAX device id -> source id, for every device of every process."""
    import jax

    by_process: dict[int, list[int]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d.id)
    if len(by_process) != len(trainer_ranks):
        raise ValueError(
            f"trainer_ranks {list(trainer_ranks)} names {len(trainer_ranks)} processes but JAX has "
            f"{len(by_process)}; give one torch rank per JAX process, in process-index order."
        )
    out = {}
    for p, ids in by_process.items():
        for local, dev in enumerate(sorted(ids)):
            out[dev] = source_id(int(trainer_ranks[p]), local)
    return out


def describe(params: Any, trainer_ranks: Sequence[int]) -> Source:
    """The ``Source`` of a pytree of sharded jax arrays (NamedSharding leaves).

    Args:
      params: the trainer's parameters.
      trainer_ranks: the torch rank of each JAX process, in ``jax.process_index()`` order.
    """
    ids = _source_ids(trainer_ranks)
    leaves = {}
    for path, x in flatten_params(params).items():
        sharding = getattr(x, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if sharding is None or mesh is None or not hasattr(sharding, "spec"):
            raise TypeError(f"params leaf {path!r} must be a jax.Array with a NamedSharding, got {type(x).__name__}.")
        mesh_ids = Mesh(np.vectorize(lambda d: ids[d.id], otypes=[np.int64])(mesh.devices), tuple(mesh.axis_names))
        leaves[path] = Layout(tuple(x.shape), mesh_ids, tuple(sharding.spec), x.dtype.name)
    return Source(leaves)


class Sender:
    """Sends syncs from this trainer process's JAX shards.

    Args:
      plan: the sync plan (the same on every rank).
      rank: this process's global torch rank (default: ``torch.distributed.get_rank()``).
      timeout: seconds a sync may take once every rank joined (one deadline for every bucket
        and the final ack).
      ready_timeout: seconds to wait for every rank to join a sync (the handshake; also bounded
        by the process group's timeout).
      progress: show a tqdm bar (``None``: for syncs over 1 GiB on a terminal).
      checksum: send an xxh3-64 digest of every piece after its bucket's payload (a weighted word
        sum for a piece on an accelerator), which receivers check before anything is committed; in
        a two-stage plan the forwarding receivers send digests too. Off by default: on
        ``benchmarks/bridge_bench.py`` it costs about 17% of the sync time on the loaded 2-core
        test machine (docs/reliability.md), above the 10% allowed for a default. Without it,
        lengths are still checked (by the sender, the votes and the receiver's transport), but a
        flipped byte, or two messages of one length swapped, is committed unnoticed.

    Attributes:
      last_stats: the ``jreshard.core.execution.ExecutionStats`` of the last sync (also a failed
        one): bytes sent, those across a domain boundary, per transport and per link, and seconds
        per step (``handshake``, ``pack``, ``vote``, ``post``, ``wait``, ``check``, ``unpack``).
    """

    def __init__(self, plan: BridgePlan, *, rank: int | None = None, timeout: float = 60.0,
                 ready_timeout: float = 600.0, progress: bool | None = None, checksum: bool = False) -> None:
        rank = check_plan_and_rank(plan, rank)
        if rank not in plan.source.ranks:
            raise ValueError(f"rank {rank} holds no trainer shards in the plan (trainer ranks {plan.source.ranks}).")
        self.progress = check_flag("progress", progress, none=True)
        self.checksum = check_flag("checksum", checksum)
        self.plan, self.rank = plan, rank
        self.timeout = check_seconds("timeout", timeout)
        self.ready_timeout = check_seconds("ready_timeout", ready_timeout)
        # Pieces travel in torch dim order. A piece that is contiguous in its shard once cast and
        # transposed is sent from there without packing: XLA casts and transposes the shard once
        # (much faster than a strided copy on the CPU). Other pieces are block copies (+ cast) into
        # the bucket buffer.
        steps: dict[tuple[int, int], list[_PackSegment]] = {}
        last_use: dict[_ShardKey, tuple[int, int]] = {}
        for m in plan.messages:
            if m.src != rank:
                continue
            out = []
            for seg, members in zip(plan.segments(m), plan.segment_pieces(m), strict=True):
                pieces = []
                for i, off in members:
                    t = plan.moves[i]
                    _, perm = plan.dst_region(t)
                    region = plan.src_region(t)
                    dtype = plan.param(t.param, t.dst).dtype
                    identity = perm == tuple(range(len(perm)))
                    xla = not identity or (seg.src_direct and dtype != plan.source.layout(t.leaf).dtype)
                    key = _ShardKey(t.leaf, t.src, perm, dtype if xla else None)
                    pieces.append(_PackPiece(key, tuple(region[p] for p in perm), off, t.nbytes, torch_dtype(dtype)))
                    last_use[key] = (m.bucket, m.dst)
                out.append(_PackSegment(seg.start, seg.stop, seg.src_direct, pieces))
            steps[(m.bucket, m.dst)] = out
        self._pack_plan = steps
        self._xla_keys: dict[int, list[_ShardKey]] = {}  # per bucket, the shards XLA casts or transposes
        for (b, _), packed in steps.items():
            for pseg in packed:
                for piece in pseg.pieces:
                    if piece.shard.dtype is not None and piece.shard not in self._xla_keys.setdefault(b, []):
                        self._xla_keys[b].append(piece.shard)
        # Shards XLA casts or transposes alike, of one leaf on this process's devices: one program runs them
        # together (``_cast_transpose``), the first time a bucket reads any of them.
        together: dict[tuple, list[_ShardKey]] = {}
        for key in sorted({k for keys in self._xla_keys.values() for k in keys}, key=lambda k: k.src):
            shape = plan.source.layout(key.leaf).shard_box(key.src).shape
            together.setdefault((key.leaf, key.perm, key.dtype, shape), []).append(key)
        self._together = {k: tuple(keys) for keys in together.values() for k in keys}
        self._release: dict[tuple[int, int], list[_ShardKey]] = {}
        for key, where in last_use.items():
            self._release.setdefault(where, []).append(key)
        self._arena = Arena()  # bucket buffers, reused across syncs
        # Per (leaf, source id) of this process: the box its shard must hold (checked on every sync).
        self._boxes = {(path, d): plan.source.layout(path).shard_box(d) for path in plan.source.paths
                       for d in plan.source.layout(path).mesh.device_ids if split_source_id(d)[0] == rank}
        self.last_stats = ExecutionStats()

    def _shards(self, params: Any) -> dict[tuple[str, int], Any]:
        """This process's single-device shards, keyed by (leaf path, source id); checks their layouts."""
        import jax

        from jreshard.jax_executor.adapter import check_concrete

        flat = flatten_params(params)
        missing = [p for p in self.plan.source.paths if p not in flat]
        if missing:
            raise ValueError(f"params lacks trainer leaves {missing[:5]} that the plan reads; pass the whole tree.")
        local = sorted(jax.local_devices(), key=lambda d: d.id)
        sid = {d.id: source_id(self.rank, i) for i, d in enumerate(local)}
        out = {}
        for path in self.plan.source.paths:
            x, layout = flat[path], self.plan.source.layout(path)
            check_concrete(f"params[{path!r}]", x, "Sender.sync")
            if not isinstance(x, jax.Array):
                raise TypeError(
                    f"params[{path!r}] must be a jax.Array (sharded as the plan's source says), got "
                    f"{type(x).__module__}.{type(x).__name__}; place it with jax.device_put(x, sharding)."
                )
            if tuple(x.shape) != layout.shape or (layout.dtype and x.dtype.name != layout.dtype):
                raise ValueError(
                    f"params[{path!r}] is {tuple(x.shape)} {x.dtype}, but the plan's source says "
                    f"{layout.shape} {layout.dtype}; build the Source from these params "
                    "(bridge.trainer.sender.describe)."
                )
            for shard in x.addressable_shards:
                dev = sid[shard.device.id]
                want = self._boxes.get((path, dev))
                if want is None:  # a device outside the leaf's mesh
                    continue
                got = tuple(slice(*s.indices(n)[:2]) for s, n in zip(shard.index, layout.shape, strict=True))
                if want != got:
                    raise ValueError(
                        f"params[{path!r}]: device {shard.device} (source id {dev}) holds {got}, but the plan's "
                        f"source layout {layout!r} gives it {want}; describe the source from the live arrays."
                    )
                out[(path, dev)] = shard.data
        return out

    def _dispatch(self, shards: dict, cache: dict, done: set, bucket: int) -> None:
        """Starts XLA's cast/transpose of the shards ``bucket`` reads (with the shards of their leaf cast alike).

        Asynchronous: XLA computes them while this thread posts and waits for the previous
        bucket's sends. ``done`` holds the groups of shards started this sync.
        """
        import jax

        for key in self._xla_keys.get(bucket, ()):
            group = self._together[key]
            if group in done:
                continue
            done.add(group)
            arrays = [shards[(k.leaf, k.src)] for k in group]
            first = arrays[0]
            if first.ndim == 0:  # nothing to stack (a scalar leaf)
                for k, a in zip(group, arrays, strict=True):
                    cache[k] = a.astype(k.dtype)
                continue
            sharding, fn = _cast_transpose(key.perm, key.dtype, tuple(a.device for a in arrays))
            whole = jax.make_array_from_single_device_arrays(
                (len(arrays) * first.shape[0], *first.shape[1:]), sharding, arrays)
            by_device = {s.device: s.data for s in fn(whole).addressable_shards}
            for k, a in zip(group, arrays, strict=True):
                cache[k] = by_device[a.device]

    def _view(self, shards: dict, cache: dict, key: _ShardKey) -> torch.Tensor:
        hit = cache.get(key)
        if hit is None:  # no transpose: a zero-copy view, cast by copy_ while packing
            hit = cache[key] = torch.from_dlpack(shards[(key.leaf, key.src)])
        elif not isinstance(hit, torch.Tensor):  # XLA's result (cast then transposed in one pass)
            hit = cache[key] = torch.from_dlpack(hit)
        return hit

    def _pack(self, shards: dict, cache: dict, done: set, m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
        self._dispatch(shards, cache, done, m.bucket)
        self._dispatch(shards, cache, done, m.bucket + 1)  # computed while this bucket is on the wire
        sends = []
        for seg in self._pack_plan[(m.bucket, m.dst)]:
            for piece in seg.pieces:
                src = self._view(shards, cache, piece.shard)[piece.region]
                if seg.direct:  # already cast and contiguous: sent as it is (the list keeps it alive)
                    sends.append((src if src.is_contiguous() else src.contiguous()).view(-1).view(torch.uint8))
                else:  # copy_ casts while packing, so only the param dtype's bytes cross the wire
                    buf[piece.offset:piece.offset + piece.nbytes].view(piece.dtype).view(src.shape).copy_(src)
            if not seg.direct:
                sends.append(buf[seg.start:seg.stop])
        for key in self._release.get((m.bucket, m.dst), ()):
            cache.pop(key, None)  # a transposed shard lives only until its last piece is sent
        return sends

    def sync(self, params: Any, version: int, group: dist.ProcessGroup | None = None, *,
             transport: Transport | str = "auto") -> int:
        """Sends one sync of ``params`` tagged ``version`` (the training step); returns it.

        ``transport`` moves the payload: ``"auto"`` (shared memory with receivers on this host, gloo with
        the others), ``"shm"``, ``"gloo"`` (``bridge.wire.route``), or a ``Transport`` object; every rank
        passes the same.

        Raises:
          PlanMismatchError: the ranks' plans differ (nothing moved).
          SyncError: a peer died, stalled past ``timeout`` or failed; recreate the group, then retry.
        """
        error: Exception | None = None
        shards: dict = {}
        try:
            version = check_int("version", version)
            transport = check_transport(transport)
            shards = self._shards(params)
        except Exception as e:  # announced to every rank before raising here
            error = e
        if error is not None:
            # Join the handshake so every rank learns this one rejected the sync, then raise the cause.
            reject_sync(self.plan, rank=self.rank, group=group, ready_timeout=self.ready_timeout)
            try:
                raise error
            finally:  # the error's traceback holds this frame: no cycle that keeps the group alive
                del error
        cache: dict = {}
        done: set = set()
        side = Side(Role.SENDER, pack=lambda m, buf: self._pack(shards, cache, done, m, buf),
                    device=_torch_device(shards))
        session = SyncSession(self.plan, self.rank, group, side, version=version, timeout=self.timeout,
                              ready_timeout=self.ready_timeout, checksum=self.checksum, progress=self.progress,
                              arena=self._arena, transport=transport)
        try:
            return session.run()
        finally:
            self.last_stats = session.stats


def _torch_device(shards: dict) -> torch.device:
    """Where this process's shards live, as a torch device (staging buffers go there too)."""
    for x in shards.values():
        return torch.from_dlpack(x).device
    return torch.device("cpu")

