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

import torch.distributed as dist

from bridge.wire.group import all_gather_bytes, forget_gloo_group, gloo_group
from jreshard.core.args import check_int
from jreshard.core.execution import ExecutionStats

__all__ = ["CLOSED_KEY", "host_store", "owner_open", "open_group", "close_group", "all_gather_json", "wire_seconds"]

_STORES: dict[dist.ProcessGroup, dist.Store] = {}

# Trainer rank 0 sets this key in its store (outside every group's name) when it lets the workers go.
CLOSED_KEY = "jreshard.closed"

# The wire's steps a rank reports per sync (``ExecutionStats.step_seconds`` of a Sender's or Receiver's sync).
_WIRE_STEPS = ("handshake", "pack", "vote", "post", "wait")


def wire_seconds(stats: ExecutionStats) -> dict[str, float]:
    """The seconds a ``Sender``'s or ``Receiver``'s last sync (its ``last_stats``) spent in each wire step.

    Example:
      >>> from bridge.engines.group import wire_seconds
      >>> from jreshard.core.execution import ExecutionStats
      >>> wire_seconds(ExecutionStats(sent_bytes=4096, step_seconds={"pack": 0.5, "wait": 0.25}))
      {'handshake': 0.0, 'pack': 0.5, 'vote': 0.0, 'post': 0.0, 'wait': 0.25}
    """
    return {k: float(stats.step_seconds.get(k, 0.0)) for k in _WIRE_STEPS}


def host_store(host: str, port: int, world_size: int, *, timeout: float) -> dist.TCPStore:
    """The store server a sync group's rank 0 hosts on ``host:port`` (binds the port until dropped).

    Trainer rank 0 keeps one for as long as it syncs and opens every group on it under a new
    name (``open_group(..., store=...)``): a group that failed may live on in a traceback until
    Python's garbage collector runs, but it never holds the port the next group needs.
    """
    port = check_int("port", port, maximum=65535)
    world_size = check_int("world_size", world_size, minimum=1)
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout),
                             wait_for_workers=False)
    except RuntimeError as e:  # torch's DistNetworkError: the port is taken
        raise ValueError(f"port {port} on {host} cannot be bound ({e}); another TrainerSync (or another process) "
                         "holds it: close() that one, or give another port.") from None


def open_group(host: str, port: int, rank: int, world_size: int, *, timeout: float,
               name: str = "jreshard", store: dist.Store | None = None) -> dist.ProcessGroup:
    """Joins (rank 0: hosts) a gloo group of ``world_size`` ranks on ``host:port``.

    Blocks until every rank joined or ``timeout`` seconds passed. The group is not the
    default group: pass it as ``group=`` to the bridge's ``Sender``/``Receiver``. ``store``:
    the store to open the group on (rank 0's from ``host_store``, kept across groups; each
    group then needs a ``name`` of its own); default: a new one (rank 0 hosts it).
    """
    rank = check_int("rank", rank)
    world_size = check_int("world_size", world_size, minimum=1)
    port = check_int("port", port, maximum=65535)
    if not rank < world_size:
        raise ValueError(f"rank {rank} must be below world_size {world_size}.")
    delta = datetime.timedelta(seconds=timeout)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=delta, wait_for_workers=False)
    pg = gloo_group(dist.PrefixStore(f"{name}/", store), rank, world_size, timeout)
    _STORES[pg] = store  # rank 0's store server lives as long as the group
    return pg


def close_group(pg: dist.ProcessGroup | None) -> None:
    """Forgets a group from ``open_group`` and shuts its connections down (best effort)."""
    if pg is None:
        return
    forget_gloo_group(pg)
    _STORES.pop(pg, None)
    with contextlib.suppress(RuntimeError, AttributeError):  # already broken by a dead peer, or an older torch
        pg.shutdown()


def owner_open(pg: dist.ProcessGroup | None) -> bool:
    """Whether the trainer that hosts ``pg``'s store still holds it: reachable, and not closed (``CLOSED_KEY``)."""
    store = _STORES.get(pg) if pg is not None else None
    if store is None:
        return False
    try:
        return not store.check([CLOSED_KEY])
    except Exception:  # the store's host exited: nobody holds the workers
        return False


def _wait(work: Any, timeout: float, what: str) -> None:
    from bridge.errors import SyncError

    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as e:  # gloo reports a dead peer or a timeout as RuntimeError
        raise SyncError(f"{what} failed within {timeout:g} s: {e}") from e


def all_gather_json(data: Any, pg: dist.ProcessGroup, *, timeout: float, what: str) -> list[Any]:
    """Every rank's JSON-ready ``data``, in rank order (plain data: no pickles cross the wire)."""
    raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    out = all_gather_bytes(raw, pg, pg.size(), lambda work: _wait(work, timeout, what))
    return [json.loads(r.decode()) for r in out]
