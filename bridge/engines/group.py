"""The sync's own process group: trainer and inference ranks on a new gloo store (torch only).

vLLM workers already own torch.distributed's default group (their tensor-parallel
world), and trainer processes may own another or none. A sync therefore never uses
the default group: every member opens a group of its own on a new ``TCPStore`` that
trainer rank 0 hosts, and names its rank in it explicitly (trainers ``0 .. T-1``,
inference workers ``T ..``). The group is registered with torch.distributed so that
its point-to-point calls translate ranks (the bridge's ranks are this group's ranks).
Small control messages (the handshake's plain-data descriptions, the workers'
reports) travel as JSON bytes over ``all_gather``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from bridge.wire import alarm as _alarm

__all__ = ["open_group", "close_group", "all_gather_json", "all_gather_ints", "wire_seconds"]

_STORES: dict[dist.ProcessGroup, dist.TCPStore] = {}

# The wire's steps a rank reports per sync (``bridge.wire.session.run_sync``'s stats, in seconds).
_WIRE_STEPS = ("handshake", "pack", "vote", "post", "wait")


def wire_seconds(stats: dict[str, float]) -> dict[str, float]:
    """The seconds a ``Sender``'s or ``Receiver``'s last sync spent in each wire step, as a sync reports them.

    Example:
      >>> from bridge.engines.group import wire_seconds
      >>> wire_seconds({"pack": 0.5, "wait": 0.25, "sent": 4096.0})  # byte counts are left out
      {'handshake': 0.0, 'pack': 0.5, 'vote': 0.0, 'post': 0.0, 'wait': 0.25}
    """
    return {k: float(stats.get(k, 0.0)) for k in _WIRE_STEPS}


def open_group(host: str, port: int, rank: int, world_size: int, *, timeout: float,
               name: str = "jreshard") -> dist.ProcessGroup:
    """Joins (rank 0: hosts) a gloo group of ``world_size`` ranks on ``host:port``.

    Blocks until every rank joined or ``timeout`` seconds passed. The group is not the
    default group: pass it as ``group=`` to the bridge's ``Sender``/``Receiver``.
    """
    for arg, v in (("rank", rank), ("world_size", world_size), ("port", port)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{arg} must be a non-negative int, got {v!r}.")
    if not rank < world_size:
        raise ValueError(f"rank {rank} must be below world_size {world_size}.")
    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=delta, wait_for_workers=False)
    prefix = dist.PrefixStore(f"{name}/", store)
    pg = dist.ProcessGroup(prefix, rank, world_size)
    gloo = dist.ProcessGroupGloo(prefix, rank, world_size, timeout=delta)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    # The bridge names peers by their rank in this group; registering an identity map lets
    # torch.distributed's P2POp and get_process_group_ranks translate them without a default group.
    c10d._world.pg_group_ranks[pg] = {r: r for r in range(world_size)}
    _STORES[pg] = store  # rank 0's store server lives as long as the group
    _alarm.register_store(pg, prefix)  # a sync on this group can raise its alarm (bridge.wire.alarm)
    return pg


def close_group(pg: dist.ProcessGroup | None) -> None:
    """Forgets a group from ``open_group`` and shuts its connections down (best effort)."""
    if pg is None:
        return
    c10d._world.pg_group_ranks.pop(pg, None)
    _STORES.pop(pg, None)
    _alarm.forget_store(pg)
    with contextlib.suppress(RuntimeError, AttributeError):  # already broken by a dead peer, or an older torch
        pg.shutdown()


def _wait(work: Any, timeout: float, what: str) -> None:
    from bridge.wire.session import SyncError

    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as e:  # gloo reports a dead peer or a timeout as RuntimeError
        raise SyncError(f"{what} failed within {timeout:g} s: {e}") from e


def all_gather_ints(values: list[int], pg: dist.ProcessGroup, *, timeout: float, what: str) -> list[list[int]]:
    """Every rank's list of ints (all lists have the same length)."""
    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(pg.size())]
    _wait(dist.all_gather(out, mine, group=pg, async_op=True), timeout, what)
    return [t.tolist() for t in out]


def all_gather_json(data: Any, pg: dist.ProcessGroup, *, timeout: float, what: str) -> list[Any]:
    """Every rank's JSON-ready ``data``, in rank order (plain data: no pickles cross the wire)."""
    raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    sizes = all_gather_ints([len(raw)], pg, timeout=timeout, what=what)
    longest = max(s[0] for s in sizes)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if raw:
        padded[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(padded) for _ in range(pg.size())]
    _wait(dist.all_gather(out, padded, group=pg, async_op=True), timeout, what)
    return [json.loads(t[:s[0]].numpy().tobytes().decode()) for t, s in zip(out, sizes, strict=True)]
