"""What one rank counts during a sync, turned into ``jreshard.core.execution.ExecutionStats`` at its end."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from bridge.wire.transport import Kind, Op
from jreshard.core.execution import ExecutionStats

__all__ = ["STEPS", "Tally"]

# The steps a sync times (seconds), in the order they are reported; ``commit`` is the Receiver's.
STEPS = ("handshake", "pack", "vote", "post", "wait", "check", "unpack", "commit")


class Tally:
    """Bytes per direction, domain crossing, transport and link, and seconds per step, of one sync of one rank.

      >>> import torch
      >>> from bridge.wire.tally import Tally
      >>> from bridge.wire.transport import Kind, Op
      >>> t = Tally(rank=0, transport="gloo", delivery="direct")
      >>> t.count(Op(Kind.SEND, 1, torch.zeros(8, dtype=torch.uint8)), away=True)
      >>> s = t.stats(seconds=1.0)
      >>> s.sent_bytes, s.cross_domain_sent_bytes, dict(s.transport_bytes), dict(s.link_bytes)
      (8, 8, {'gloo': 8}, {(0, 1): 8})
    """

    def __init__(self, rank: int, transport: str, delivery: str) -> None:
        self.rank, self.transport, self.delivery = rank, transport, delivery
        self.bytes = {Kind.SEND: 0, Kind.RECV: 0}
        self.cross = {Kind.SEND: 0, Kind.RECV: 0}
        self.links: dict[tuple[int, int], int] = {}
        self.routes: dict[str, int] = {}  # bytes sent and received per route
        self.seconds = dict.fromkeys(STEPS[:-1], 0.0)

    def count(self, op: Op, *, away: bool, via: str | None = None) -> None:
        """Counts an operation posted (``away``: with a peer in another domain; ``via``: the route that
        carries it, default the sync's transport)."""
        n = op.nbytes
        self.bytes[op.kind] += n
        route = via if via is not None else self.transport
        self.routes[route] = self.routes.get(route, 0) + n
        if away:
            self.cross[op.kind] += n
        link = (self.rank, op.peer) if op.kind == Kind.SEND else (op.peer, self.rank)
        self.links[link] = self.links.get(link, 0) + n

    @contextlib.contextmanager
    def timing(self, step: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] += time.perf_counter() - t0

    def stats(self, seconds: float, moved: dict[str, int] | None = None) -> ExecutionStats:
        """The sync's statistics; ``moved``: bytes per route as the transport placed them (default: as posted)."""
        moved = dict(moved or self.routes) or {self.transport: 0}
        return ExecutionStats(
            seconds=seconds, sent_bytes=self.bytes[Kind.SEND], received_bytes=self.bytes[Kind.RECV],
            cross_domain_sent_bytes=self.cross[Kind.SEND], cross_domain_received_bytes=self.cross[Kind.RECV],
            delivery=self.delivery, transports=tuple(moved), transport_bytes=moved,
            step_seconds=self.seconds, link_bytes=self.links)
