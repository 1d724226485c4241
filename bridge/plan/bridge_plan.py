"""The sync plan: param moves planned by jreshard, cut to fit buckets, packed into messages.

``bridge.plan.reduce`` turns every region group into Layout pairs; ``jreshard.plan_layouts``
plans all of them at once, so replicated trainer shards are balanced across the
whole model. Each planned move into a param region becomes one or more
``ParamMove``s (cut to fit ``bucket_bytes``), each placed as a ``Piece`` at an
aligned offset of a ``Message``: the bytes of one bucket from one sender rank to
one receiver rank. With hierarchical delivery (``hierarchical=``, ``domains=``) the
region groups are first cut by ``bridge.plan.reduce.two_stage``: stage-1 moves bring each
byte into each node once, stage-2 moves (``stage=2``, sent by inference ranks) complete
the replicas inside nodes, sharing buckets with later stage-1 messages once what they forward
has arrived (``STAGE2_LAG``). Nothing here touches torch or jax: both sides build the same
``BridgePlan`` and compare its ``fingerprint``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from bridge.plan.param_map import Param, ParamMap
from bridge.plan.reduce import Job, jobs, two_stage
from bridge.plan.source import SOURCE_BASE, Source, split_source_id
from jreshard.core.args import check_flag, check_int
from jreshard.core.box import Box, split_box
from jreshard.core.domains import Domains
from jreshard.core.dtypes import numpy_dtype
from jreshard.core.hierarchical import check_hierarchical
from jreshard.core.planner import plan_layouts
from jreshard.core.schedule import ALIGN, ordered_buckets, pack

__all__ = ["ParamMove", "Piece", "Message", "Segment", "BridgePlan", "FORMAT_VERSION", "WIRE_DTYPES",
           "STAGE2_LAG", "bridge_domains"]

FORMAT_VERSION = 4  # 4: stage-2 moves share buckets with stage 1's
# The param dtypes the wire carries: each has a torch dtype of the same name and itemsize.
WIRE_DTYPES = ("float32", "bfloat16", "float16", "float64", "int32", "int64", "int8", "uint8", "bool",
               "float8_e4m3fn")
# A stage-2 move goes in bucket b only if every stage-1 move that brings part of its box to its
# sender lies in a bucket <= b - STAGE2_LAG: ``bridge.wire.session.SyncSession`` packs bucket b once buckets
# up to b - 2 are received and unpacked (bucket b - 1 is then still on the wire).
STAGE2_LAG = 2
# Two-stage plans cut moves into pieces of at least bucket_bytes / MAX_SPLIT (a rank's stage-2 share
# of a bucket is at most 1 - 1/MAX_SPLIT of it).
MAX_SPLIT = 8


@dataclasses.dataclass(frozen=True, slots=True)
class ParamMove:
    """Send ``leaf[box]`` from ``src`` into region ``region`` of ``param`` on ``dst``.

    In ``stage`` 1 ``src`` is a trainer device (a source id); in stage 2 of hierarchical
    delivery it is an inference rank of ``dst``'s domain that received the box in stage 1
    (into its own copy of ``param``). A planned move cut to fit ``bucket_bytes``; placed in a
    message it is a ``Piece``.
    """

    src: int
    dst: int
    leaf: str
    box: Box
    param: str
    region: int
    nbytes: int
    stage: int = 1

    @property
    def src_rank(self) -> int:
        """The torch rank that sends: the trainer process holding ``src``, or ``src`` itself in stage 2."""
        return split_source_id(self.src)[0] if self.src >= SOURCE_BASE else self.src




class Piece(NamedTuple):
    """Move number ``move`` of the plan at byte ``offset`` of its message (a multiple of ``ALIGN``)."""

    move: int
    offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """The bytes of ``bucket`` from rank ``src`` to rank ``dst``: one buffer of pieces."""

    bucket: int
    src: int
    dst: int
    nbytes: int
    pieces: tuple[Piece, ...]



class Segment(NamedTuple):
    """Bytes ``[start, stop)`` of a message, sent by one point-to-point operation.

    ``piece`` is the index in ``Message.pieces`` of a piece that travels alone because it is
    one contiguous block of the sender's (cast, transposed) shard (``src_direct``) or of the
    receiver's param (``dst_direct``); ``None`` for a run of pieces packed together.
    """

    start: int
    stop: int
    piece: int | None
    src_direct: bool
    dst_direct: bool


def _check_wire_dtypes(param_map: ParamMap, source: Source) -> None:
    for p in param_map.params:
        if p.dtype not in WIRE_DTYPES:
            raise ValueError(
                f"param {p.name!r} on rank {p.rank} has dtype {p.dtype}, which the wire cannot carry; "
                f"give the param map one of {list(WIRE_DTYPES)} (the trainer casts at the sender)."
            )
        # A cast to FP8 without a scale loses the weights: FP8 params take FP8 leaves only.
        if p.dtype.startswith("float8"):
            for r in p.regions:
                if str(source.layout(r.leaf).dtype) != p.dtype:
                    raise ValueError(
                        f"param {p.name!r} on rank {p.rank} is {p.dtype} but its leaf {r.leaf!r} is "
                        f"{source.layout(r.leaf).dtype}; the sender does not quantize: build the map with "
                        "bridge.fp8_param_map and send bridge.trainer.fp8.quantize_params(params, fp8).")


class BridgePlan:
    """Who sends which box to whom, in which bucket and at which byte offset.

    Args:
      source: the trainer leaves and their Layouts over source ids.
      param_map: every torch rank's params.
      bucket_bytes: the most bytes one rank sends, or receives, per bucket (its staging memory; the
        default atomic ``Receiver`` holds a whole sync instead, its params' bytes at most, plus 64 per message).
      balance: balance replicated trainer shards across senders (see ``jreshard.plan``).
      hierarchical: ``"always"``: two-stage delivery wherever a domain holds two replicas of a
        region (stage 1 sends each byte into each domain once, spread over its replicas;
        stage 2 completes every replica with point-to-point sends inside the domain);
        ``"never"``: every rank receives its regions straight from the trainers; ``"auto"``
        (default): two stages when they carry fewer bytes across domain boundaries than
        direct delivery, which they do exactly when a domain holds two replicas of a region
        that its ranks receive from outside it.
      domains: which ranks share fast links (a node): a ``jreshard.core.domains.Domains``, a
        list of rank lists, an int (blocks of that many consecutive global ranks) or
        ``"local"`` (blocks of ``LOCAL_WORLD_SIZE`` ranks, torchrun's ranks per node). Ranks
        left out are domains of their own. Default ``None``: one rank per domain, so
        ``"auto"`` delivers directly; the environment is read only with ``"local"`` (vLLM sets
        ``LOCAL_WORLD_SIZE`` in its own workers, so a default taken from it could differ
        between a trainer and its inference ranks).

    Raises:
      TypeError: ``source``, ``param_map`` or ``domains`` is of the wrong kind.
      ValueError: a region leaves its leaf, a rank is both trainer and receiver, a param's
        dtype cannot travel on the wire, ``bucket_bytes`` is below ``ALIGN``, or
        ``hierarchical`` is not one of ``jreshard.core.hierarchical.HIERARCHICAL``.

    Example:
      >>> from bridge import BridgePlan, Rule, Source, tp_param_map, trainer_mesh
      >>> from jreshard import Layout
      >>> src = Source({"w": Layout((4, 6), trainer_mesh((2,), "fsdp", [0], 2), ("fsdp",), "float32")})
      >>> m = tp_param_map(src, [Rule("w", "linear.weight", transpose=True, dim=0)], tp_ranks=[1, 2])
      >>> p = BridgePlan(src, m)
      >>> [(t.src, t.dst, str(t.box)) for t in p.moves]  # doctest: +NORMALIZE_WHITESPACE
      [(1000000, 1, '[0:2, 0:3]'), (1000001, 1, '[2:4, 0:3]'),
       (1000000, 2, '[0:2, 3:6]'), (1000001, 2, '[2:4, 3:6]')]
      >>> p.network_bytes, p.num_buckets, len(p.fingerprint)
      (96, 1, 32)

      Two nodes of two ranks, each rank holding a replicated norm: each node receives it once.

      >>> m = tp_param_map(src, [Rule("w", "norm.weight")], tp_ranks=[[1], [2], [3], [4]])
      >>> h = BridgePlan(src, m, hierarchical="always", domains=[[1, 2], [3, 4]])
      >>> h.two_stage, h.cross_domain_bytes, BridgePlan(src, m, hierarchical="never").cross_domain_bytes
      (True, 192, 384)
      >>> sorted({(t.stage, t.src_rank, t.dst) for t in h.moves if t.stage == 2})
      [(2, 1, 2), (2, 2, 1), (2, 3, 4), (2, 4, 3)]
    """

    def __init__(self, source: Source, param_map: ParamMap, *, bucket_bytes: int = 16 << 20,
                 balance: bool = True, hierarchical: str = "auto",
                 domains: Domains | Sequence[Sequence[int]] | int | str | None = None) -> None:
        if not isinstance(source, Source):
            raise TypeError(f"source must be a bridge.Source, got {type(source).__name__}.")
        if not isinstance(param_map, ParamMap):
            raise TypeError(f"param_map must be a bridge.ParamMap, got {type(param_map).__name__}.")
        bucket_bytes = check_int("bucket_bytes", bucket_bytes, minimum=ALIGN)
        balance = check_flag("balance", balance)
        param_map.check(source)
        _check_wire_dtypes(param_map, source)
        clash = set(param_map.ranks) & set(source.ranks)
        if clash:
            raise ValueError(
                f"ranks {sorted(clash)} are both trainer and inference ranks; a process either sends "
                "(JAX trainer) or receives (torch inference)."
            )
        hierarchical = check_hierarchical(hierarchical)
        self.source, self.param_map, self.bucket_bytes, self.balance = source, param_map, bucket_bytes, balance
        self.hierarchical = hierarchical
        self.domains = bridge_domains(domains, (*source.ranks, *param_map.ranks))
        self._params = {(p.name, p.rank): p for p in param_map.params}
        direct: list[Job] = jobs(source, param_map)
        first, second = two_stage(direct, self.domains) if hierarchical != "never" else (direct, [])
        self.jobs = first if second else direct
        self.plan = plan_layouts([(j.name, j.src, j.dst) for j in self.jobs], balance=balance)
        later = plan_layouts([(j.name, j.src, j.dst) for j in second], balance=balance) if second else None
        # Two stages share buckets: each receiving rank's stage-2 share of a bucket, and pieces
        # small enough that a stage-1 piece fits beside it.
        self._share, piece = self._shares(self.plan, self.jobs, later, second)
        self.moves = self._moves(self.jobs, self.plan, 1, piece)
        if second and hierarchical == "auto":
            flat = plan_layouts([(j.name, j.src, j.dst) for j in direct], balance=balance)
            flat_moves = self._moves(direct, flat, 1, self.bucket_bytes)
            if self._crossing(flat_moves) <= self._crossing(self.moves):
                self.jobs, self.plan, self.moves, second, later = direct, flat, flat_moves, [], None
                self._share = {}
        #: the stage-2 jobs (region groups completed inside domains), ``[]`` for direct delivery
        self.stage2_jobs: list[Job] = second
        self.stage2_plan = later
        if self.stage2_plan is not None:
            self.moves += self._moves(second, self.stage2_plan, 2, piece)
        self.messages, self.num_buckets = self._bucket()
        self._segments: dict[Message, tuple[Segment, ...]] = {}
        self.fingerprint = self._fingerprint()
        sends: dict[tuple[int, int], list[Message]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[Message]] = defaultdict(list)
        for m in self.messages:
            sends[(m.src, m.bucket)].append(m)
            recvs[(m.dst, m.bucket)].append(m)
        self._sends, self._recvs = dict(sends), dict(recvs)

    # ---------------------------------------------------------------- construction
    def _moves(self, jobs: list[Job], plan: Any, stage: int, piece: int) -> tuple[ParamMove, ...]:
        """The moves of ``plan``'s jobs in ``stage``, cut into parts of at most ``piece`` bytes."""
        out = []
        for job in jobs:
            tp = plan[job.name]
            origin = np.array(job.origin, dtype=np.int64)
            for s, d, lo, hi in zip(tp.move_src, tp.move_dst, tp.move_lo, tp.move_hi, strict=True):
                if s == d:  # stage 2: a rank's own stage-1 slice is already in place
                    continue
                ref = job.regions[int(d)]
                box = Box.from_bounds((lo + origin).tolist(), (hi + origin).tolist())
                for part in split_box(box, tp.itemsize, piece):
                    n = part.size * tp.itemsize
                    if n:
                        out.append(ParamMove(int(s), int(d), job.leaf, part, ref.param, ref.region, n, stage))
        return tuple(out)

    def _shares(self, plan: Any, jobs: list[Job], later: Any, second: list[Job]) -> tuple[dict[int, int], int]:
        """({receiving rank: bytes of a bucket stage 2 may take first}, the most bytes of a piece).

        A rank's share is the fraction of its bytes that stage 2 brings (at most ``1 - 1/MAX_SPLIT``),
        in multiples of ``ALIGN``; pieces are cut to the smallest room a share leaves, so a stage-1
        piece fits beside every rank's share. Direct delivery: no shares, pieces of a bucket.
        """
        cap = self.bucket_bytes
        if later is None:
            return {}, cap
        got = [plan.stats().recv_bytes, later.stats().recv_bytes]  # bytes each rank gets from another one
        share = {d: min(cap * n // (got[0].get(d, 0) + n), cap - cap // MAX_SPLIT) // ALIGN * ALIGN
                 for d, n in got[1].items()}
        return share, max(ALIGN, (cap - max(share.values(), default=0)) // ALIGN * ALIGN)

    def _crossing(self, moves: Sequence[ParamMove]) -> int:
        """Bytes of ``moves`` whose sending and receiving ranks lie in different domains."""
        return sum(t.nbytes for t in moves if self.domain_of(t.src_rank) != self.domain_of(t.dst))

    def _bucket(self) -> tuple[tuple[Message, ...], int]:
        """Places every move in a bucket, under ``bucket_bytes`` sent and received per rank and bucket.

        ``jreshard.core.schedule.ordered_buckets``: stage-1 moves fill buckets in plan order, as in
        direct delivery; a stage-2 move is ready for bucket ``b`` once every stage-1 move that brings
        part of its box to its sender lies in a bucket ``<= b - STAGE2_LAG`` (``_ready_after``), and
        takes at most its receiving rank's share of a bucket before stage 1 (``_shares``). So the
        sends inside domains travel beside the network's stage 1. Each message packs its moves in
        plan order (``jreshard.core.schedule.pack``).
        """
        first = [i for i, t in enumerate(self.moves) if t.stage == 1]
        sends = [(t.src_rank, t.dst, t.nbytes) for t in self.moves]
        bucket_of, count = ordered_buckets(sends, first, self._ready_after(first), cap=self.bucket_bytes,
                                           share=self._share, lag=STAGE2_LAG)
        members: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for i, (s, d, _) in enumerate(sends):
            members[(bucket_of[i], s, d)].append(i)
        messages = []
        for (b, s, d), idx in sorted(members.items()):
            offsets, end = pack([self.moves[i].nbytes for i in idx])
            messages.append(Message(b, s, d, end, tuple(Piece(i, o) for i, o in zip(idx, offsets, strict=True))))
        return tuple(messages), count

    def _ready_after(self, first: list[int]) -> dict[int, int]:
        """For every stage-2 move: the position in ``first`` (the stage-1 moves, in plan order) of the
        last stage-1 move that brings part of its box to its sender (``-1``: none)."""
        into: dict[tuple[int, str, int], list[int]] = defaultdict(list)
        for k, i in enumerate(first):
            t = self.moves[i]
            into[(t.dst, t.param, t.region)].append(k)
        out = {}
        for i, t in enumerate(self.moves):
            if t.stage == 2:
                out[i] = max((k for k in into.get((t.src, t.param, t.region), ())
                              if not self.moves[first[k]].box.intersect(t.box).empty), default=-1)
        return out

    def _fingerprint(self) -> bytes:
        body = repr((FORMAT_VERSION, self.source.key(), self.param_map.key(), self.bucket_bytes, self.balance,
                     self.delivery, tuple(dataclasses.astuple(t) for t in self.moves)))
        return hashlib.sha256(body.encode()).digest()

    # ---------------------------------------------------------------- queries
    @property
    def two_stage(self) -> bool:
        """Whether this plan delivers hierarchically (stage-2 moves inside domains)."""
        return self.stage2_plan is not None

    @property
    def delivery(self) -> str:
        """How the plan delivers, as the fingerprint and plan comparisons see it."""
        return f"two stages over {self.domains!r}" if self.two_stage else "direct"

    def domain_of(self, rank: int) -> int:
        """The domain (node) of a torch rank."""
        return int(self.domains.of([rank])[0])

    @property
    def cross_domain_bytes(self) -> int:
        """Bytes the plan sends between ranks of different domains (stage 2 sends none)."""
        return self._crossing(self.moves)



    def param(self, name: str, rank: int) -> Param:
        """The param ``name`` on ``rank``."""
        return self._params[(name, rank)]

    def sends(self, rank: int, bucket: int) -> list[Message]:
        """The messages ``rank`` sends in ``bucket``, in plan order."""
        return self._sends.get((rank, bucket), [])

    def recvs(self, rank: int, bucket: int) -> list[Message]:
        """The messages ``rank`` receives in ``bucket``, in plan order."""
        return self._recvs.get((rank, bucket), [])

    def segments(self, m: Message) -> tuple[Segment, ...]:
        """How message ``m`` travels: one point-to-point operation per segment, in order.

        A piece that is contiguous in the sender's (cast, transposed) shard or in the
        receiver's param is a segment of its own and skips the packing on that side; the
        other pieces are packed together, runs of them forming one segment. Both sides
        derive the same segments from the plan.
        """
        hit = self._segments.get(m)
        if hit is not None:
            return hit
        out: list[Segment] = []
        for k, (i, off) in enumerate(m.pieces):
            t = self.moves[i]
            box, perm = self.dst_region(t)
            if t.stage == 1:  # from the trainer's shard, cast and transposed to the param's dim order
                region = self.src_region(t)
                shard = self.source.layout(t.leaf).shard_box(t.src)
                src_direct = _contiguous([region[p] for p in perm], [shard[p].stop - shard[p].start for p in perm])
            else:  # from the sending rank's own copy of the param
                src_direct = _contiguous(self.param_box(t, t.src), self.view_of(t, t.src))
            dst_direct = _contiguous(box, self.dst_view(t))
            if src_direct or dst_direct:
                out.append(Segment(off, off + t.nbytes, k, src_direct, dst_direct))
            elif out and out[-1].piece is None:
                out[-1] = out[-1]._replace(stop=off + t.nbytes)  # extend the packed run
            else:
                out.append(Segment(off, off + t.nbytes, None, False, False))
        hit = self._segments[m] = tuple(out)
        return hit

    def segment_pieces(self, m: Message) -> list[list[Piece]]:
        """The pieces of each of ``segments(m)``, in order."""
        return [[m.pieces[s.piece]] if s.piece is not None else [p for p in m.pieces if s.start <= p.offset < s.stop]
                for s in self.segments(m)]

    def src_region(self, t: ParamMove) -> tuple[slice, ...]:
        """The move's box in the coordinates of its source device's shard (stage 1)."""
        return t.box.relative_to(self.source.layout(t.leaf).shard_box(t.src))

    def view_of(self, t: ParamMove, rank: int) -> tuple[int, ...]:
        """The shape in which ``rank``'s copy of the move's param holds the move's region (its view)."""
        param = self.param(t.param, rank)
        return param.regions[t.region].view_shape(param.shape)

    def dst_view(self, t: ParamMove) -> tuple[int, ...]:
        """The shape of the param's local tensor in which ``dst_region``'s box lies (its region's view)."""
        return self.view_of(t, t.dst)

    def param_box(self, t: ParamMove, rank: int) -> tuple[slice, ...]:
        """The move's box in ``rank``'s copy of its param seen as ``view_of(t, rank)``, in torch dim order."""
        region = self.param(t.param, rank).regions[t.region]
        return tuple(slice(o + t.box[p].start - region.box[p].start, o + t.box[p].stop - region.box[p].start)
                     for o, p in zip(region.offset, region.transpose, strict=True))

    def dst_region(self, t: ParamMove) -> tuple[tuple[slice, ...], tuple[int, ...]]:
        """(the box in the param's local tensor seen as ``dst_view(t)``, the permutation leaf dims -> torch dims)."""
        return self.param_box(t, t.dst), self.param(t.param, t.dst).regions[t.region].transpose

    @property
    def network_bytes(self) -> int:
        return sum(t.nbytes for t in self.moves)

    def rank_bytes(self) -> dict[str, dict[int, int]]:
        """Bytes each torch rank sends and receives."""
        send: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        for t in self.moves:
            send[t.src_rank] += t.nbytes
            recv[t.dst] += t.nbytes
        return {"send": dict(send), "recv": dict(recv)}

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
        """The NumPy oracle: every rank's params filled from global leaf arrays (zeros elsewhere)."""
        out: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
        for p in self.param_map.params:
            out[p.rank][p.name] = np.zeros(p.shape, dtype=numpy_dtype(p.dtype))
        for t in self.moves:
            box, perm = self.dst_region(t)
            piece = np.asarray(arrays[t.leaf])[t.box]
            dst = out[t.dst][t.param].reshape(self.dst_view(t))  # a view: the param is C-contiguous
            dst[box] = piece.transpose(perm).astype(dst.dtype)
        return dict(out)

    def __repr__(self) -> str:
        stages = f", {self.delivery}" if self.two_stage else ""
        return (f"BridgePlan({len(self.source)} leaves -> {len(self.param_map)} params, {len(self.moves)} "
                f"moves, {self.network_bytes:,} B in {self.num_buckets} buckets{stages}, "
                f"fingerprint {self.fingerprint.hex()[:12]})")


def bridge_domains(domains: Any, ranks: Sequence[int]) -> Domains:
    """``domains`` as a ``Domains`` over torch ranks in which every rank of ``ranks`` has a domain.

    ``None``: one rank per domain. ``"local"``: blocks of ``LOCAL_WORLD_SIZE`` consecutive global
    ranks (torchrun's ranks per node). An int: blocks of that many ranks. A list of rank lists
    or a ``Domains`` from groups: those groups, each rank of ``ranks`` left out in a domain of
    its own.

    Example:
      >>> from bridge.plan.bridge_plan import bridge_domains
      >>> bridge_domains([[2, 3], [4, 5]], ranks=[0, 1, 2, 3, 4, 5])
      Domains.from_groups([[2, 3], [4, 5], [0], [1]])
    """
    if domains is None:
        domains = 1
    elif domains == "local":
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if not (local.isdigit() and int(local) > 0):
            raise ValueError(f"domains='local' reads LOCAL_WORLD_SIZE (ranks per node), which is {local!r} here; "
                             "set it on every process, or pass domains= as rank lists or ranks per node.")
        domains = int(local)
    elif isinstance(domains, str):
        raise ValueError(f"domains must be 'local', rank lists, an int or a Domains, got {domains!r}.")
    try:
        if isinstance(domains, int) and not isinstance(domains, bool):
            return Domains.contiguous(domains)
        if not isinstance(domains, Domains):
            domains = Domains.from_groups(domains)
    except (TypeError, ValueError) as e:
        raise type(e)(f"domains (ranks sharing fast links): {e}") from None
    if domains.block is not None:
        return domains
    listed = {r for g in domains.groups for r in g}
    return Domains.from_groups([*domains.groups, *([r] for r in sorted(set(ranks) - listed))])


def _contiguous(box: Any, shape: Any) -> bool:
    """Whether ``box`` (slices) is one contiguous block of a C-contiguous array of ``shape``."""
    ext = [sl.stop - sl.start for sl in box]
    i = 0
    while i < len(ext) - 1 and ext[i] == 1:
        i += 1
    return all(ext[j] == shape[j] for j in range(i + 1, len(ext)))
