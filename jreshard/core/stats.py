"""Plan statistics: traffic per device, against the lower bound and gather-then-broadcast."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["PlanStats", "format_amount", "plan_stats"]


def format_amount(n: float, unit: str = "bytes") -> str:
    """``1.50 MiB`` for bytes (binary prefixes), ``1,024 elements`` for any other unit.

    Example:
      >>> from jreshard.core.stats import format_amount
      >>> format_amount(3 << 19), format_amount(512), format_amount(2048, "elements")
      ('1.50 MiB', '512 B', '2,048 elements')
    """
    if unit != "bytes":
        return f"{int(n):,} elements"
    for scale, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {name}"
    return f"{int(n)} B"


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStats:
    """Traffic of a plan. Bytes are elements when the layouts carry no dtype.

    ``lower_bound_bytes`` is, per destination device, what its destination shards
    hold that its source shards do not; ``naive_bytes`` is what gather-then-
    broadcast moves (every destination device receives each full tensor it holds a
    non-empty piece of). ``mean_send_bytes`` averages over devices that send.
    ``messages`` counts distinct (sender, receiver) pairs, ``moves`` network boxes.
    """

    network_bytes: int
    local_bytes: int
    lower_bound_bytes: int
    naive_bytes: int
    moves: int
    local_moves: int
    messages: int
    max_send_bytes: int
    mean_send_bytes: float
    max_recv_bytes: int
    mean_recv_bytes: float
    send_bytes: dict[int, int]
    recv_bytes: dict[int, int]
    unit: str = "bytes"

    @property
    def send_imbalance(self) -> float:
        """Largest sender load over the mean sender load (1.0 is perfect)."""
        return self.max_send_bytes / self.mean_send_bytes if self.mean_send_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["send_imbalance"] = self.send_imbalance
        return d

    def __str__(self) -> str:
        u = self.unit
        lines = [
            f"network {format_amount(self.network_bytes, u)} (lower bound {format_amount(self.lower_bound_bytes, u)}), "
            f"local {format_amount(self.local_bytes, u)}, gather-then-broadcast {format_amount(self.naive_bytes, u)}",
            f"{self.moves} network moves in {self.messages} sender->receiver pairs, {self.local_moves} local copies",
            f"per sender: max {format_amount(self.max_send_bytes, u)}, mean {format_amount(self.mean_send_bytes, u)} "
            f"(imbalance {self.send_imbalance:.3f}); per receiver: max {format_amount(self.max_recv_bytes, u)}, "
            f"mean {format_amount(self.mean_recv_bytes, u)}",
        ]
        return "\n".join(lines)


def plan_stats(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, lower: int, naive: int, unit: str,
               count: np.ndarray | None = None) -> PlanStats:
    """Statistics of move rows (sender, receiver, bytes); ``count`` says how many moves a row stands for."""
    net = src != dst
    ns, nd, nb = src[net], dst[net], nbytes[net]
    n_net = int(net.sum()) if count is None else int(count[net].sum())
    n_local = int((~net).sum()) if count is None else int(count[~net].sum())
    if len(ns):
        top = int(max(ns.max(), nd.max())) + 1
        # Device ids are ranks: dense tables (bincount) beat sorting millions of moves.
        if top * top <= 1 << 26:
            pairs = int(np.count_nonzero(np.bincount(ns * top + nd, minlength=top * top)))
        else:
            pairs = len(np.unique(ns * top + nd))
        sids, sent = _sum_ints(ns, nb, top)
        rids, recv = _sum_ints(nd, nb, top)
    else:
        pairs = 0
        sids = sent = rids = recv = np.zeros(0, np.int64)
    return PlanStats(
        network_bytes=int(nb.sum()),
        local_bytes=int(nbytes[~net].sum()),
        lower_bound_bytes=int(lower),
        naive_bytes=int(naive),
        moves=n_net,
        local_moves=n_local,
        messages=int(pairs),
        max_send_bytes=int(sent.max()) if len(sent) else 0,
        mean_send_bytes=float(sent.mean()) if len(sent) else 0.0,
        max_recv_bytes=int(recv.max()) if len(recv) else 0,
        mean_recv_bytes=float(recv.mean()) if len(recv) else 0.0,
        send_bytes={int(d): int(b) for d, b in zip(sids, sent, strict=True)},
        recv_bytes={int(d): int(b) for d, b in zip(rids, recv, strict=True)},
        unit=unit,
    )


def _sum_ints(ids: np.ndarray, weights: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids, exact int64 sum of weights per id), ids sorted."""
    # float64 sums are exact below 2**53 bytes per device.
    if top <= 1 << 24:
        count = np.bincount(ids, minlength=top)
        uniq = np.nonzero(count)[0]
        return uniq, np.bincount(ids, weights=weights, minlength=top)[uniq].astype(np.int64)
    uniq, inv = np.unique(ids, return_inverse=True)
    return uniq, np.bincount(inv.ravel(), weights=weights, minlength=len(uniq)).astype(np.int64)
