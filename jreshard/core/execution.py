"""What one execution of a plan did: the record every executor returns (``jreshard.transfer``, the
bridge's ``Sender`` and ``Receiver``, the engines' reports).

Pure data: executors fill it from what they counted, callers read it; no executor keeps a
dict of its own beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jreshard.core.domains import Domains

__all__ = ["ExecutionStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class ExecutionStats:
    """One execution of a plan as one process (``jreshard.transfer``) or one rank (the bridge) counted it.

    Attributes:
      seconds: wall time of the whole execution on this process or rank.
      sent_bytes: payload bytes this process's devices (or this rank) sent to another device or rank.
      received_bytes: payload bytes received from another device or rank (0 where the executor
        counts only its senders, as ``transfer`` does).
      cross_domain_sent_bytes: the part of ``sent_bytes`` that crossed a domain boundary.
      cross_domain_received_bytes: the part of ``received_bytes`` that crossed a domain boundary.
      delivery: ``"direct"`` or ``"hierarchical"`` (two-stage delivery).
      transports: the transport of each stage (``transfer``: ``"collective"``, ``"device_put"``,
        ``"memcpy"``; the bridge: the transports of its peers, e.g. ``"gloo"``).
      transport_bytes: bytes sent plus received per transport.
      step_seconds: seconds spent in each step of the executor (the bridge: ``handshake``, ``pack``,
        ``vote``, ``post``, ``wait``, ``check``, ``unpack``, ``commit``).
      link_bytes: bytes sent per (sender, receiver) device id or rank, both stages together.
      domains: the domains the cross-domain bytes were counted over (``transfer``: its ``domains=``,
        by default the devices of each JAX process); ``None`` where the executor does not say.

    Example:
      >>> from jreshard.core.execution import ExecutionStats
      >>> s = ExecutionStats(seconds=0.5, sent_bytes=3 << 20, step_seconds={"pack": 0.25})
      >>> s.step_seconds["pack"], s.received_bytes, s.gbps
      (0.25, 0, 0.00629145...)
    """

    seconds: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0
    cross_domain_sent_bytes: int = 0
    cross_domain_received_bytes: int = 0
    delivery: str = "direct"
    transports: tuple[str, ...] = ()
    transport_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    step_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    link_bytes: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    domains: Domains | None = None

    def __post_init__(self) -> None:
        for name in ("transport_bytes", "step_seconds", "link_bytes"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @property
    def cross_domain_bytes(self) -> int:
        """Bytes sent across a domain boundary (what the plan's lower bound counts for the sender side)."""
        return self.cross_domain_sent_bytes

    @property
    def gbps(self) -> float:
        """Payload bytes sent and received per second, in GB/s (10**9 bytes)."""
        return (self.sent_bytes + self.received_bytes) / max(self.seconds, 1e-12) / 1e9
