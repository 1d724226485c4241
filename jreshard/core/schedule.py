"""The memory-capped schedule of a plan: pieces, buckets, rounds and messages.

Pure (NumPy and the standard library); both executors can run it. Words as in
docs/glossary.md:

1. *Pieces*: each move of the plan becomes one piece, or several when it is
   larger than the cap (``split_box``, outer dims first). A piece knows where its
   box lies in the source shard and in the destination shard.
2. *Buckets*: network pieces are packed first fit, largest first, so that per
   bucket the bytes of the pieces any device sends plus those it receives stay
   under the cap. Local pieces (a device that already holds the box) are copies in the
   first bucket. An executor finishes one bucket before it starts the next, which
   is what bounds staging memory.
3. *Rounds*: within a bucket the (sender, receiver) pairs get a bipartite edge
   colouring, so that in each round every device sends to at most one device and
   receives from at most one, in as many rounds as the most peers of any device.
4. *Messages*: what one sender sends one receiver in a bucket, its pieces back to
   back in one buffer, each on a 64-byte boundary.

Example:
  >>> from jreshard import Layout, Mesh, plan
  >>> from jreshard.core.schedule import schedule
  >>> src = Layout((8, 4), Mesh([0, 1], ("x",)), ("x",), "float32")      # rows over 0, 1
  >>> dst = Layout((8, 4), Mesh([2, 3], ("x",)), (None, "x"), "float32")  # columns over 2, 3
  >>> def pairs(bucket):
  ...     return [[(m.src, m.dst, m.nbytes) for m in r] for r in bucket.rounds]
  >>> [pairs(b) for b in schedule([plan(src, dst)], itemsizes=[4], cap=64)]  # one bucket, two rounds
  [[[(0, 3, 32), (1, 2, 32)], [(0, 2, 32), (1, 3, 32)]]]
  >>> [pairs(b) for b in schedule([plan(src, dst)], itemsizes=[4], cap=48)]  # two buckets
  [[[(0, 2, 32), (1, 3, 32)]], [[(0, 3, 32), (1, 2, 32)]]]
  >>> piece = schedule([plan(src, dst)], itemsizes=[4], cap=64)[0].rounds[0][0].pieces[0]
  >>> str(piece.src_box), str(piece.dst_box)  # device 0's rows 0:4, columns 2:4 -> device 3's columns 0:2
  ('[0:4, 2:4]', '[0:4, 0:2]')
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

from jreshard.core.box import Box, split_box
from jreshard.core.plans import TensorPlan

__all__ = ["Piece", "Message", "Bucket", "schedule", "pieces", "edge_colouring", "ALIGN", "aligned", "pack",
           "ordered_buckets"]

ALIGN = 64  # bytes: where each piece starts in a message


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """A move of one leaf, or a part of one cut to fit the cap, placed in its two devices' shards."""

    leaf: int
    src: int  # the device that sends it
    dst: int  # the device that receives it (``src`` for a local copy)
    src_box: Box  # where it lies in ``src``'s source shard (shard coordinates)
    dst_box: Box  # where it lies in ``dst``'s destination shard
    nbytes: int  # in the output dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src_box.shape


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """The pieces ``src`` sends ``dst`` in one bucket, back to back in one buffer."""

    src: int
    dst: int
    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...]  # byte offset of each piece in the buffer
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
    """The pieces sent together under the cap: messages in rounds, and local copies."""

    rounds: tuple[tuple[Message, ...], ...]  # per round, messages with distinct senders and receivers
    local: Mapping[int, tuple[Piece, ...]]  # device -> pieces it copies from its own source shard


def schedule(tplans: Sequence[TensorPlan], *, itemsizes: Sequence[int], cap: int,
             skip_leaves: Collection[int] = (), skip_shards: Collection[tuple[int, int]] = ()) -> list[Bucket]:
    """The buckets that run ``tplans`` with at most ``cap`` bytes sent plus received per device and bucket.

    Args:
      tplans: one TensorPlan per leaf; a leaf is its index here.
      itemsizes: per leaf, the bytes of one element as it travels (the output dtype).
      cap: per device and bucket, the most bytes sent plus received; at least the
        largest itemsize.
      skip_leaves: leaves to leave out entirely (nothing of them moves).
      skip_shards: ``(leaf, device)`` destination shards to leave out (an executor
        reuses them as they are).
    """
    network: list[Piece] = []
    local: dict[int, list[Piece]] = defaultdict(list)
    for p in pieces(tplans, itemsizes=itemsizes, cap=cap, skip_leaves=skip_leaves, skip_shards=skip_shards):
        if p.src == p.dst:
            local[p.dst].append(p)
        else:
            network.append(p)
    members = _first_fit(network, cap)
    if not members and local:
        members.append([])
    buckets = []
    for b, idx in enumerate(members):
        by_pair: dict[tuple[int, int], list[Piece]] = defaultdict(list)
        for i in sorted(idx):  # plan order inside each message
            by_pair[(network[i].src, network[i].dst)].append(network[i])
        pairs = sorted(by_pair)
        colours = edge_colouring(pairs)
        rounds: list[list[Message]] = [[] for _ in range(max(colours, default=-1) + 1)]
        for (s, d), c in zip(pairs, colours, strict=True):
            rounds[c].append(_message(s, d, by_pair[(s, d)]))
        buckets.append(Bucket(tuple(tuple(r) for r in rounds),
                              {d: tuple(ps) for d, ps in local.items()} if b == 0 else {}))
    return buckets


def pieces(tplans: Sequence[TensorPlan], *, itemsizes: Sequence[int], cap: int | None = None,
           skip_leaves: Collection[int] = (),
           skip_shards: Collection[tuple[int, int]] = ()) -> list[Piece]:
    """Every move of ``tplans`` as pieces, in plan order.

    A network move larger than ``cap`` bytes is cut into pieces that fit (none is
    cut when ``cap`` is None); a local move stays whole. Arguments as for ``schedule``.
    """
    out = []
    skipped = frozenset(skip_shards)
    for leaf, tp in enumerate(tplans):
        if leaf in skip_leaves:
            continue
        for s, d, src_box, dst_box, nbytes in _parts(_Moves.of(tp), itemsizes[leaf], cap):
            if (leaf, d) not in skipped:
                out.append(Piece(leaf, s, d, src_box, dst_box, nbytes))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _Moves:
    """A tensor plan's moves, equal for equal layouts and moves (a model's layers share one)."""

    key: tuple
    plan: TensorPlan = dataclasses.field(compare=False)

    @classmethod
    def of(cls, tp: TensorPlan) -> _Moves:
        arrays = (tp.move_src, tp.move_dst, tp.move_lo, tp.move_hi)
        return cls((tp.src, tp.dst, *(a.tobytes() for a in arrays), tp.move_lo.shape), tp)


@functools.lru_cache(maxsize=1024)
def _parts(moves: _Moves, itemsize: int, cap: int | None) -> tuple[tuple[int, int, Box, Box, int], ...]:
    """(sender, receiver, box in the source shard, box in the destination shard, bytes) of each piece.

    Cached: cutting and placing the boxes of hundreds of equal leaves one by one
    was most of a first sync's set-up.
    """
    tp = moves.plan
    src_shards, dst_shards = tp.src.shards(), tp.dst.shards()
    out = []
    for s, d, lo, hi in zip(tp.move_src.tolist(), tp.move_dst.tolist(), tp.move_lo.tolist(),
                            tp.move_hi.tolist(), strict=True):
        box = Box.from_bounds(lo, hi)
        for part in [box] if s == d or cap is None else split_box(box, itemsize, cap):
            out.append((s, d, part.relative_to(src_shards[s]), part.relative_to(dst_shards[d]), part.size * itemsize))
    return tuple(out)


def _first_fit(network: list[Piece], cap: int) -> list[list[int]]:
    """Indices of ``network`` per bucket: largest first, into the first bucket where both ends still fit.

    The cap bounds the bytes of the pieces; a message adds at most ``ALIGN - 1``
    bytes of alignment gap after each piece but its last.
    """
    order = sorted(range(len(network)), key=lambda i: -network[i].nbytes)
    loads: list[dict[int, int]] = []
    members: list[list[int]] = []
    for i in order:
        s, d = network[i].src, network[i].dst
        cost = network[i].nbytes
        b = next((k for k, load in enumerate(loads)
                  if load.get(s, 0) + cost <= cap and load.get(d, 0) + cost <= cap), len(loads))
        if b == len(loads):
            loads.append({})
            members.append([])
        loads[b][s] = loads[b].get(s, 0) + cost
        loads[b][d] = loads[b].get(d, 0) + cost
        members[b].append(i)
    return members


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``: where the next piece of a message may start."""
    return -(-nbytes // ALIGN) * ALIGN


def pack(sizes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """(the offset of each piece in a message, the aligned end): pieces back to back, each on ``ALIGN``.

    Example:
      >>> from jreshard.core.schedule import pack
      >>> pack([10, 64, 1])
      ((0, 64, 128), 192)
    """
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end = aligned(end + n)
    return tuple(offsets), end


def _message(src: int, dst: int, pieces: list[Piece]) -> Message:
    offsets, _ = pack([p.nbytes for p in pieces])
    return Message(src, dst, tuple(pieces), offsets, offsets[-1] + pieces[-1].nbytes)


def ordered_buckets(sends: Sequence[tuple[int, int, int]], first: Sequence[int], after: Mapping[int, int], *,
                    cap: int, share: Mapping[int, int], lag: int) -> tuple[list[int], int]:
    """(the bucket of each send, the number of buckets): plan order, and a second stage pipelined behind it.

    Unlike ``schedule`` (largest first), sends keep their order, the one the bridge's receivers
    unpack in. ``sends[i]`` is ``(sender, receiver, bytes)``. The sends ``first`` fill buckets in
    order: a bucket closes at the first one that would take a device past ``cap`` bytes sent or
    received, counted ``aligned`` (a send always fits an empty bucket). Every other send
    forwards what a first-stage send delivered: ``after[i]`` is the position in ``first`` of the
    last one it waits for (``-1``: none); it is ready for bucket ``b`` once that one lies in a
    bucket ``<= b - lag``. Each bucket first takes ready sends while each receiver stays within
    its ``share`` of ``cap``, then first-stage sends, then ready sends again while they fit; a
    bucket is left empty where the first stage is done and nothing is ready yet.

    Example:
      >>> from jreshard.core.schedule import ordered_buckets
      >>> sends = [(0, 1, 64), (0, 2, 64), (1, 3, 64)]  # 1 forwards to 3 what 0 sent it
      >>> ordered_buckets(sends, [0, 1], {2: 0}, cap=64, share={3: 64}, lag=2)
      ([0, 1, 2], 3)
    """
    waiting = sorted(after, key=lambda i: (after[i], i))  # second-stage sends by the send they wait for
    bucket_of = [-1] * len(sends)
    ready: list[int] = []
    k1 = k2 = bucket = 0
    send: dict[int, int] = defaultdict(int)  # bytes each device sends, receives in the bucket being filled
    recv: dict[int, int] = defaultdict(int)

    def place(i: int, recv_cap: int) -> bool:
        s, d, n = sends[i]
        if (send or recv) and (send[s] + n > cap or recv[d] + n > recv_cap):
            return False
        send[s] += aligned(n)
        recv[d] += aligned(n)
        bucket_of[i] = bucket
        return True

    while k1 < len(first) or k2 < len(waiting) or ready:
        send.clear()
        recv.clear()
        while k2 < len(waiting) and (after[waiting[k2]] < 0 or (
                after[waiting[k2]] < k1 and bucket_of[first[after[waiting[k2]]]] <= bucket - lag)):
            ready.append(waiting[k2])
            k2 += 1
        ready = [i for i in ready if not place(i, share[sends[i][1]])]
        while k1 < len(first) and place(first[k1], cap):
            k1 += 1
        ready = [i for i in ready if not place(i, cap)]
        bucket += 1
    return bucket_of, bucket


def edge_colouring(pairs: Sequence[tuple[int, int]]) -> list[int]:
    """A colour (round) per (sender, receiver) pair, no device twice on one side of a round.

    Uses as many colours as the largest degree (König's theorem for bipartite
    graphs): a pair whose two ends lack a common free colour swaps two colours
    along a Kempe chain first.

    Example:
      >>> from jreshard.core.schedule import edge_colouring
      >>> edge_colouring([(0, 1), (0, 2), (3, 1)])  # sender 0 and receiver 1 have two peers
      [1, 0, 0]
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
