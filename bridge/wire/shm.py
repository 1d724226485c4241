"""Shared memory between the processes of one host: staging that senders write into, and ``ShmTransport``.

A receiver's staging (the held bytes of the default atomic ``Receiver``, the bucket buffers, an
engine worker's staging tensors) is allocated with ``staging``: a ``memfd`` segment, sealed
against resizing, mapped in the receiver and registered by address. No name exists in
``/dev/shm`` or anywhere else, so nothing can leak when a process dies (the kernel frees the
memory with the last mapping) and no other job can guess or open one by name; a sender opens
it through ``/proc/<receiver pid>/fd/<fd>``, which the kernel allows only to processes that may
read the receiver's memory anyway (same user, same PID namespace). Senders map each segment
once and keep the mapping while syncs write into it (those a sync did not write are dropped at its
end, and ``SENDER_MAPS`` at most are kept).

Per bucket and pair (receiver-posted buffers, as RDMA rendezvous protocols do), over the sync's
gloo group:

1. the receiver posts a *credit* on ``CREDIT_TAG``: per receive of the bucket, in posting order,
   where it lands (segment fd and token, offset, bytes), or ``-1`` where it lands outside shared
   memory (a digest, a param received in place), which then travels over gloo as usual;
2. the sender takes the credit (its helper thread), checks each length against its own
   operation, copies the bytes into the receiver's memory (only inside the credited region:
   offsets are checked against the segment's sealed size, and the mapping ends there), then
   sends the bucket's header (``bridge.wire.gloo.frame``) on ``HEADER_TAG``, then the gloo
   part of the payload;
3. the receiver's helper takes the header: equal to the plan's lengths, the shared receives
   are complete (the copies happened before the header was sent) and it posts the gloo ones;
   different, it raises ``WrongLength`` (the sender wrote nothing and sent no payload, so the
   pair stays in step and the group usable).

A dead peer breaks its gloo connections, which fails the other side's wait for a credit or a
header at once; a stalled one fails at the sync's deadline, like gloo. Votes, digests, the alarm
and the atomic commit are the session's and unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import math
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from bridge.errors import REBUILD_GROUP, SyncError
from bridge.wire.alarm import Waiter
from bridge.wire.gloo import HEADER_TAG, HEADER_WORDS, MAGIC, GlooTransport, _describe, _Framed, frame
from bridge.wire.transport import Kind, Op, WrongLength

__all__ = ["Segment", "staging", "tensors", "find", "ShmTransport", "CREDIT_TAG", "SENDER_MAPS"]

CREDIT_TAG = 2
CREDIT_MAGIC = 0x4A52_4352_4544_4954  # "JRCREDIT"
SEGMENT_MAGIC = 0x4A52_5348_4D53_4731  # "JRSHMSG1"
HEAD = 64  # bytes before a segment's payload: magic, token
SENDER_MAPS = 64
MAX_OPS = 1 << 20  # the most receives one credit may list
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault every page in at once, not one by one on first touch


class Segment(NamedTuple):
    """A shared-memory segment of this process (made by ``staging``): its sealed memfd ``fd``, the random
    ``token`` its header holds (a sender checks it), and where its payload is mapped here (``ptr``,
    ``nbytes``). It stays registered (``find``) and its fd open while any tensor on its memory lives,
    whichever view or ``.data`` of the tensor ``staging`` returned holds it; then both go.

      >>> from bridge.wire.shm import find, staging
      >>> t = staging(1000)
      >>> seg, offset = find(t.data[100:200])
      >>> offset, seg.nbytes, seg.ptr == t.data_ptr()
      (100, 1000, True)
    """

    fd: int
    token: int
    ptr: int
    nbytes: int


# Segments by payload address, while their memory is mapped. Dict operations are atomic: the finalizer
# that removes an entry may run inside any allocation (the garbage collector), so nothing here takes a
# lock, and ``find`` iterates a copy.
_SEGMENTS: dict[int, Segment] = {}


def _release(seg: Segment) -> None:
    """Called as the segment's mapping is freed (no tensor on it is left): unregisters it and closes its fd."""
    if _SEGMENTS.get(seg.ptr) is seg:
        _SEGMENTS.pop(seg.ptr, None)
    with contextlib.suppress(OSError):
        os.close(seg.fd)


def staging(nbytes: int) -> torch.Tensor:
    """``nbytes`` (at least 1) of uint8 host memory that same-host senders can write into: a ``Segment`` of
    its own, which lives as long as any tensor on this memory (the mapping is the tensors' storage)."""
    nbytes = max(int(nbytes), 1)
    fd = os.memfd_create("jreshard-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, HEAD + nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, HEAD + nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    except BaseException:
        os.close(fd)
        raise
    token = secrets.randbits(63)
    np.frombuffer(mm, dtype=np.int64, count=2)[:] = (SEGMENT_MAGIC, token)
    tensor = torch.frombuffer(mm, dtype=torch.uint8, offset=HEAD, count=nbytes)  # its storage keeps ``mm``
    seg = Segment(fd, token, tensor.data_ptr(), nbytes)
    _SEGMENTS[seg.ptr] = seg
    weakref.finalize(mm, _release, seg)  # runs as the last tensor on the mapping goes
    return tensor


def tensors(specs: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Zeroed tensors of the given shapes and dtypes by name, each in a segment of its own (so each has
    a storage of its own, as ``torch.zeros`` gives): an engine worker's staging that same-host senders
    write into.

      >>> import torch
      >>> from bridge.wire.shm import find, tensors
      >>> t = tensors({"a": ((2, 3), torch.float32), "b": ((5,), torch.bfloat16)})
      >>> t["a"].shape, find(t["b"])[1]
      (torch.Size([2, 3]), 0)
    """
    out = {}
    for n, (shape, dtype) in specs.items():
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        out[n] = staging(size)[:size].view(dtype).view(tuple(shape))
    return out


def find(t: torch.Tensor) -> tuple[Segment, int] | None:
    """The segment ``t``'s bytes lie in, and their offset in its payload; ``None`` outside every segment."""
    if t.device.type != "cpu":
        return None
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    for s in _SEGMENTS.copy().values():
        if s.ptr <= lo and hi <= s.ptr + s.nbytes:
            return s, lo - s.ptr
    return None


class _Slot(NamedTuple):
    """Where one receive lands: a segment (``fd``, ``token``) and bytes ``[offset, offset + nbytes)``; ``fd``
    -1: outside shared memory (over gloo)."""

    fd: int
    token: int
    offset: int
    nbytes: int


def _credit(seq: int, ops: Sequence[Op]) -> tuple[torch.Tensor, torch.Tensor, list[_Slot]]:
    slots = []
    for op in ops:
        got = find(op.buf)
        slots.append(_Slot(-1, 0, 0, op.nbytes) if got is None else _Slot(got[0].fd, got[0].token, got[1], op.nbytes))
    body = torch.tensor([list(s) for s in slots], dtype=torch.int64).reshape(-1)
    head = torch.tensor([CREDIT_MAGIC, seq, len(slots), 0, 0, 0, 0, 0], dtype=torch.int64)
    return head, body, slots


class _Maps:
    """A sender's mappings of receivers' segments, by (pid, fd, token), least recently used dropped, and
    those of processes that ended dropped when a transport is built (their memory lives while mapped)."""

    def __init__(self) -> None:
        self._maps: collections.OrderedDict[tuple[int, int, int], torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()

    def pids(self) -> set[int]:
        """The processes whose segments are mapped here."""
        with self._lock:
            return {key[0] for key in self._maps}

    def keep_only(self, pids: set[int], used: set[tuple[int, int, int]]) -> None:
        """Of the segments of ``pids``, unmaps those not in ``used`` (a receiver freed or replaced them:
        their memory would live on in the mapping)."""
        with self._lock:
            for key in [k for k in self._maps if k[0] in pids and k not in used]:
                del self._maps[key]

    def drop(self, pids: set[int] | None = None) -> None:
        """Unmaps the segments of ``pids`` (default: of processes that ended)."""
        gone = pids if pids is not None else {p for p in self.pids() if not _alive(p)}
        with self._lock:
            for key in [k for k in self._maps if k[0] in gone]:
                del self._maps[key]

    def region(self, peer: int, pid: int, slot: _Slot) -> torch.Tensor:
        key = (pid, slot.fd, slot.token)
        with self._lock:
            seg = self._maps.get(key)
            if seg is not None:
                self._maps.move_to_end(key)
        if seg is None:
            seg = self._open(peer, pid, slot)
            with self._lock:
                self._maps[key] = seg
                while len(self._maps) > SENDER_MAPS:
                    self._maps.popitem(last=False)
        if not (slot.offset >= 0 and slot.offset + slot.nbytes <= seg.numel()):
            raise SyncError(f"rank {peer} credited bytes [{slot.offset}, {slot.offset + slot.nbytes}) of a segment of "
                            f"{seg.numel()}; nothing was written.", advice=REBUILD_GROUP)
        return seg[slot.offset:slot.offset + slot.nbytes]

    @staticmethod
    def _open(peer: int, pid: int, slot: _Slot) -> torch.Tensor:
        try:
            fd = os.open(f"/proc/{pid}/fd/{slot.fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
            finally:
                os.close(fd)
        except OSError as e:
            raise SyncError(f"cannot map the staging of rank {peer} (pid {pid}): {e}; its shared memory is out of "
                            "this process's reach: pass transport='gloo'.", advice=REBUILD_GROUP) from e
        magic, token = np.frombuffer(mm, dtype=np.int64, count=2).tolist()
        if (magic, token) != (SEGMENT_MAGIC, slot.token) or size < HEAD:
            raise SyncError(f"the staging of rank {peer} (pid {pid}, fd {slot.fd}) is not the segment it credited "
                            "(wrong token); nothing was written.", advice=REBUILD_GROUP)
        return torch.frombuffer(mm, dtype=torch.uint8, offset=HEAD, count=size - HEAD)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_MAPS = _Maps()


class ShmTransport(GlooTransport):
    """The payload of a sync through shared memory with the peers routed ``"shm"`` (``routes``: peer ->
    route; ``pids``: peer -> its process id), over gloo with the others (see the module docstring)."""

    name = "shm"

    def __init__(self, group: dist.ProcessGroup | None, routes: dict[int, str], pids: dict[int, int]) -> None:
        super().__init__(group)
        self.routes, self.pids = routes, pids
        self._senders: dict[int, Waiter] = {}  # per peer sent to through shared memory
        self._keep: list[torch.Tensor] = []  # credits and headers until the transport closes
        self.moved: dict[str, int] = {}  # bytes sent and received per route, as they were placed
        self._used: set[tuple[int, int, int]] = set()  # the receivers' segments written in this sync
        self._count = threading.Lock()
        _MAPS.drop()

    def _moved(self, route: str, nbytes: int) -> None:
        with self._count:
            self.moved[route] = self.moved.get(route, 0) + nbytes

    def route(self, peer: int) -> str:
        """``"shm"`` or ``"gloo"``: how payload with ``peer`` travels (a receive outside shared memory goes
        over gloo either way)."""
        return self.routes.get(peer, "gloo")

    def post(self, ops: Sequence[Op]) -> list[Any]:
        self._resolve()
        pg = self._direct
        if pg is None:
            raise SyncError("transport 'shm' needs a gloo process group for its credits and headers; pass a gloo "
                            "group or transport='gloo'.")
        shared: dict[tuple[Kind, int], list[Op]] = {}
        rest = []
        for op in ops:
            if self.route(op.peer) == "shm":
                shared.setdefault((op.kind, op.peer), []).append(op)
            else:
                rest.append(op)
        handles = super().post(rest) if rest else []
        for op in rest:
            self._moved("gloo", op.nbytes)
        for (kind, peer), mine in shared.items():
            seq, gpeer = self._next_seq(kind, peer), self._peer(pg, peer)
            if kind == Kind.SEND:
                job = functools.partial(self._deliver, pg, gpeer, seq, mine, peer)
                handles.append(_Framed(self._thread(self._senders, peer).submit(job), peer))
                continue
            chead, body, slots = _credit(seq, mine)
            for slot in slots:
                self._moved("gloo" if slot.fd < 0 else "shm", slot.nbytes)
            works = [pg.send([chead], gpeer, CREDIT_TAG), pg.send([body], gpeer, CREDIT_TAG)]
            head = torch.empty(HEADER_WORDS, dtype=torch.int64)
            hwork = pg.recv([head], gpeer, HEADER_TAG)
            self._keep += [chead, body, head]
            job = functools.partial(self._take, pg, gpeer, seq, head, hwork, mine, slots, works, peer)
            handles.append(_Framed(self._thread(self._helpers, peer).submit(job), peer))
        return handles

    @staticmethod
    def _thread(threads: dict[int, Waiter], peer: int) -> Waiter:
        w = threads.get(peer)
        if w is None:
            w = threads[peer] = Waiter()
        return w

    def _deliver(self, pg: dist.ProcessGroup, gpeer: int, seq: int, ops: list[Op],
                 peer: int) -> tuple[list[Any], Exception | None]:
        """In the sender's helper: takes the credit, copies the bytes it places, then sends the header and the
        rest over gloo; where the credited lengths differ, only the header (the receiver refuses it)."""
        try:
            return self._write(pg, gpeer, seq, ops, peer)
        except SyncError as e:  # a credit out of step, a segment out of reach: this rank fails, nothing written
            return [], e

    def _write(self, pg: dist.ProcessGroup, gpeer: int, seq: int, ops: list[Op],
               peer: int) -> tuple[list[Any], Exception | None]:
        slots = self._take_credit(pg, gpeer, seq, peer)
        lengths = [op.nbytes for op in ops]
        head = frame(seq, lengths)
        self._keep.append(head)
        if [s.nbytes for s in slots] != lengths:
            return [pg.send([head], gpeer, HEADER_TAG)], None
        later = []
        for op, slot in zip(ops, slots, strict=True):
            if slot.fd < 0:
                later.append(op.buf)
            else:
                _MAPS.region(peer, self.pids[peer], slot).copy_(op.buf.reshape(-1).view(torch.uint8))
                self._used.add((self.pids[peer], slot.fd, slot.token))
            self._moved("gloo" if slot.fd < 0 else "shm", slot.nbytes)
        return [pg.send([head], gpeer, HEADER_TAG)] + [pg.send([b], gpeer, 0) for b in later], None

    def _take_credit(self, pg: dist.ProcessGroup, gpeer: int, seq: int, peer: int) -> list[_Slot]:
        head = torch.empty(8, dtype=torch.int64)
        pg.recv([head], gpeer, CREDIT_TAG).wait()
        magic, got, n = head.tolist()[:3]
        if magic != CREDIT_MAGIC or got != seq or not 0 < n <= MAX_OPS:
            raise SyncError(f"a credit from rank {peer} is not the one expected (magic {magic:#x}, sequence {got}, "
                            f"{n} receives; expected sequence {seq}): the pair is out of step.", advice=REBUILD_GROUP)
        body = torch.empty(4 * n, dtype=torch.int64)
        pg.recv([body], gpeer, CREDIT_TAG).wait()
        return [_Slot(*row) for row in body.reshape(n, 4).tolist()]

    def _take(self, pg: dist.ProcessGroup, gpeer: int, seq: int, head: torch.Tensor, hwork: Any, ops: list[Op],
              slots: list[_Slot], works: list[Any], peer: int) -> tuple[list[Any], Exception | None]:
        """In the receiver's helper: waits for the header, then posts the receives that travel over gloo."""
        hwork.wait()
        got, want = head.tolist(), frame(seq, [op.nbytes for op in ops]).tolist()
        if got[0] != MAGIC or got[1] != seq:
            return works, SyncError(f"a bucket header from rank {peer} is not the one expected (magic {got[0]:#x}, "
                                    f"sequence {got[1]}, expected {seq}): the pair is out of step.",
                                    advice=REBUILD_GROUP)
        if got != want:  # the sender wrote nothing and sends nothing more: the pair stays in step
            return works, WrongLength(peer, _describe(want), _describe(got))
        return works + [pg.recv([op.buf], gpeer, 0) for op, s in zip(ops, slots, strict=True) if s.fd < 0], None

    def abort(self) -> None:
        """This rank gave up: the mappings of its peers' segments go too (a peer may be gone)."""
        _MAPS.drop({self.pids[p] for p, r in self.routes.items() if r == "shm"})

    def close(self) -> None:
        """Ends the transport; of its receivers' segments, only those this sync wrote stay mapped."""
        if self._used:
            _MAPS.keep_only({self.pids[p] for p, r in self.routes.items() if r == "shm"}, self._used)
        super().close()
        for w in self._senders.values():
            w.close()
        self._senders.clear()
        self._keep.clear()
