"""A test double of ``bridge.wire.transport.Transport``: in-process queues between the ranks (threads) of one
process, with faults injected on the wire, and the in-process sync groups that carry the control traffic.

``Hub`` holds one FIFO per (sender, receiver) pair; each rank's ``QueueTransport`` copies a send's bytes
into its pair's FIFO when posted, and a receive takes the next message of its pair when waited for (into
the receive's own buffer: the "straight into the staging" path of the protocol). A rank that gives up
(``abort``) is marked gone, so its peers' waits fail at once, as gloo's closed pairs make them.

Faults (``Fault``), applied from this rank's ``post``-th ``post`` call on (1-based, its first send), below
the sender's own checks (after packing and digests, as the bytes go on the wire):

  drop      the send never arrives
  delay     every send from then on arrives ``seconds`` late, in order (a slow link)
  truncate  the send arrives 8 bytes short
  extend    the send arrives 8 bytes long
  oversize  the send arrives with 1 MiB more
  flip      a byte of the send arrives flipped (its length unchanged)
  reorder   the send arrives after the next send to the same peer

Lengths: a receive takes the next message of its pair and keeps its bytes only if the length is the
receive's; a message of another length is taken off the queue and dropped, and ``wait`` raises
``WrongLength`` once the other receives completed (the rule of ``bridge.wire.transport``).

``run_ranks`` runs one function per rank in threads, each on a gloo group of its own over one shared
``HashStore`` (registered as ``bridge.engines.group.open_group`` registers its groups, so the sync's
alarm works in-process too).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from bridge.errors import SyncError
from bridge.wire.alarm import SyncAlarm, wait_failure
from bridge.wire.group import forget_gloo_group, gloo_group
from bridge.wire.transport import Kind, Op, WrongLength
from jreshard.core.args import check_int, check_seconds

FAULTS = ("drop", "delay", "truncate", "extend", "oversize", "flip", "reorder")
POLL = 0.01  # seconds between two looks at a pair's queue while waiting


class Hub:
    """The wires of one in-process group: one FIFO of byte tensors per (sender, receiver) pair."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pairs: dict[tuple[int, int], queue.SimpleQueue[torch.Tensor]] = {}
        self.gone: set[int] = set()

    def pair(self, src: int, dst: int) -> queue.SimpleQueue[torch.Tensor]:
        with self._lock:
            return self._pairs.setdefault((src, dst), queue.SimpleQueue())


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    post: int = 2
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"kind must be one of {FAULTS}, got {self.kind!r}.")
        check_int("post", self.post, minimum=1)
        if self.kind == "delay":
            check_seconds("seconds", self.seconds)


class QueueTransport:
    """Rank ``rank``'s end of ``hub`` (see the module docstring)."""

    name = "queue"

    def __init__(self, hub: Hub, rank: int, fault: Fault | None = None) -> None:
        self.hub, self.rank, self.fault = hub, rank, fault
        self.posts = 0
        self._held: dict[int, torch.Tensor] = {}  # reorder: a send held back until the next one to its peer
        self._slow: queue.SimpleQueue[tuple[float, int, torch.Tensor]] | None = None

    def post(self, ops: Sequence[Op]) -> list[Op | None]:
        self.posts += 1
        hit = self.fault is not None and self.posts == self.fault.post
        handles: list[Op | None] = []
        for op in ops:
            if op.kind == Kind.RECV:
                handles.append(op)
                continue
            data = op.buf.contiguous().view(-1).view(torch.uint8).clone()
            if hit:
                hit = False
                data = self._hit(op.peer, data)
            if data is not None:
                self._deliver(op.peer, data)
            handles.append(None)  # a send is done once queued
        return handles

    def _hit(self, peer: int, data: torch.Tensor) -> torch.Tensor | None:
        """The first send of the faulty post, as the fault leaves it (``None``: nothing to deliver now)."""
        assert self.fault is not None
        kind = self.fault.kind
        if kind == "drop":
            return None
        if kind == "truncate":
            return data[:-8]
        if kind in ("extend", "oversize"):
            return torch.cat([data, torch.zeros(8 if kind == "extend" else 1 << 20, dtype=torch.uint8)])
        if kind == "flip":
            data[0] ^= 0xFF
            return data
        if kind == "reorder":
            self._held[peer] = data
            return None
        self._slow = queue.SimpleQueue()  # delay: this send and every later one go through a slow link
        threading.Thread(target=self._slow_link, args=(self._slow,), daemon=True).start()
        return data

    def _deliver(self, peer: int, data: torch.Tensor) -> None:
        if self._slow is not None:
            assert self.fault is not None
            self._slow.put((time.monotonic() + self.fault.seconds, peer, data))
        else:
            self.hub.pair(self.rank, peer).put(data)
        held = self._held.pop(peer, None)
        if held is not None:
            self.hub.pair(self.rank, peer).put(held)

    def _slow_link(self, link: queue.SimpleQueue[tuple[float, int, torch.Tensor]]) -> None:
        while True:
            due, peer, data = link.get()
            time.sleep(max(0.0, due - time.monotonic()))
            self.hub.pair(self.rank, peer).put(data)

    def wait(self, handles: Sequence[Op | None], *, deadline: float, alarm: SyncAlarm, what: str, rank: int) -> None:
        recvs = [h for h in handles if h is not None]
        left = max(deadline - time.monotonic(), 0.001)

        def job() -> None:
            refused = [e for op in recvs if (e := self._receive(op, deadline, left, f"{what} with peer rank {op.peer}",
                                                                rank)) is not None]
            if refused:
                raise refused[0]

        if recvs:
            alarm.run(job, what)

    def _receive(self, op: Op, deadline: float, left: float, what: str, rank: int) -> WrongLength | None:
        pair = self.hub.pair(op.peer, self.rank)
        while True:
            try:
                data = pair.get(timeout=POLL)
                break
            except queue.Empty:
                if op.peer in self.hub.gone:
                    raise SyncError(f"rank {rank}: {what} failed: the peer gave up (its end of the queue "
                                    "closed)") from None
                if time.monotonic() >= deadline:
                    raise wait_failure(TimeoutError("nothing arrived"), deadline, left, what, rank) from None
        if data.numel() != op.nbytes:  # dropped: none of its bytes land
            return WrongLength(op.peer, f"{op.nbytes} bytes", f"{data.numel()} bytes")
        op.buf.view(-1).view(torch.uint8).copy_(data)
        return None

    def abort(self) -> None:
        self.hub.gone.add(self.rank)

    def close(self) -> None:
        self._slow = None


def run_ranks(size: int, fn: Callable[[int, dist.ProcessGroup], Any], *, timeout: float = 60.0,
              group_timeout: float = 15.0) -> list[Any]:
    """``fn(rank, group)`` for every rank, each in a thread with a group of its own; returns what each
    returned (or the exception it raised)."""
    store = dist.HashStore()
    out: list[Any] = [None] * size
    groups: list[dist.ProcessGroup | None] = [None] * size

    def one(rank: int) -> None:
        try:
            groups[rank] = gloo_group(dist.PrefixStore("sync/", store), rank, size, group_timeout)
            out[rank] = fn(rank, groups[rank])
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    for pg in groups:
        if pg is not None:
            forget_gloo_group(pg)
    if alive:
        raise TimeoutError(f"ranks {alive} still run after {timeout} s")
    return out
