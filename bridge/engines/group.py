"""The sync's own process group: trainer and inference ranks on a new gloo store (torch only).

vLLM workers already own torch.distributed's default group (their tensor-parallel
world), and trainer processes may own another or none. A sync therefore never uses
the default group: every member opens a group of its own on a new ``TCPStore`` that
trainer rank 0 hosts, and names its rank in it explicitly (trainers ``0 .. T-1``,
inference workers ``T ..``). The group is registered with torch.distributed so that
its point-to-point calls translate ranks (the bridge's ranks are this group's ranks).
Small control messages (the handshake's plain-data descriptions, the workers'
reports) travel as JSON bytes over ``all_gather``.

Only the job's processes get in: every member holds the job's secret and proves it when it
joins (``bridge.engines.membership``), and the store and gloo listen on the interface of the
address the group is opened on, never on every interface (``host="127.0.0.1"`` keeps the whole
group on this machine).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
from typing import Any

import torch.distributed as dist

from bridge.engines.membership import check_secret, claim_rank, group_prefix, open_verifier, prove_members
from bridge.errors import SyncError
from bridge.wire.group import all_gather_bytes, forget_gloo_group, gloo_group, tcp_store
from jreshard.core.args import check_int
from jreshard.core.execution import ExecutionStats

__all__ = ["CLOSED_KEY", "host_store", "local_address", "owner_open", "open_group", "close_group", "all_gather_json",
           "wire_seconds"]

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

    It listens on ``host``'s interface only (a socket bound here, given to the store). Trainer
    rank 0 keeps one for as long as it syncs and opens every group on it under a new name
    (``open_group(..., store=...)``): a group that failed may live on in a traceback until
    Python's garbage collector runs, but it never holds the port the next group needs.
    """
    port = check_int("port", port, maximum=65535)
    world_size = check_int("world_size", world_size, minimum=1)
    try:
        return tcp_store(host, port, world_size, is_master=True, timeout=timeout)
    except OSError as e:
        raise ValueError(f"port {port} on {host} cannot be bound ({e}); another TrainerSync (or another process) "
                         "holds it: close() that one, or give another port.") from None


def local_address(host: str, port: int) -> str:
    """The address of this machine's interface that reaches ``host:port``: where its gloo sockets listen.

    A UDP socket connected to ``host`` (no packet is sent) learns the source address the
    routing table gives: ``127.0.0.1`` for a group on this machine, the right interface for a
    trainer elsewhere.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return str(s.getsockname()[0])


def open_group(host: str, port: int, rank: int, world_size: int, *, secret: bytes | str, timeout: float,
               name: str = "jreshard", store: dist.Store | None = None) -> dist.ProcessGroup:
    """Joins (rank 0: hosts) a gloo group of ``world_size`` ranks on ``host:port``, for holders of ``secret``.

    Blocks until every rank joined or ``timeout`` seconds passed. The group is not the
    default group: pass it as ``group=`` to the bridge's ``Sender``/``Receiver``. ``store``:
    the store to open the group on (rank 0's from ``host_store``, kept across groups; each
    group then needs a ``name`` of its own); default: a new one (rank 0 hosts it). ``secret``:
    the job's secret, the same on every rank (``bridge.engines.membership``).

    Raises:
      MembershipError: this process's secret is not rank 0's, its rank is taken, or a member
        could not prove the secret once the group formed (every rank raises; nothing was sent).
      SyncError: a rank did not join within ``timeout``.
    """
    rank = check_int("rank", rank)
    world_size = check_int("world_size", world_size, minimum=1)
    port = check_int("port", port, maximum=65535)
    secret = check_secret("secret", secret)
    if not rank < world_size:
        raise ValueError(f"rank {rank} must be below world_size {world_size}.")
    if store is None:
        store = (host_store(host, port, world_size, timeout=timeout) if rank == 0 else
                 tcp_store(host, port, world_size, is_master=False, timeout=timeout))
    where = f"{host}:{store.port if isinstance(store, dist.TCPStore) else port}"
    open_verifier(store, secret, name, rank, where)
    claim_rank(store, secret, name, rank)
    try:
        pg = gloo_group(dist.PrefixStore(group_prefix(secret, name) + "gloo/", store), rank, world_size, timeout,
                        bind=local_address(host, port))
    except RuntimeError as e:  # gloo's rendezvous timed out, or a peer's connection failed
        raise SyncError(f"rank {rank}: group {name!r} on {where} did not form within {timeout:g} s: {e}") from None
    _STORES[pg] = store  # rank 0's store server lives as long as the group
    try:
        prove_members(pg, secret, name, rank, world_size, lambda work: _wait(work, timeout, "the members' proofs"))
    except BaseException:
        close_group(pg)
        raise
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
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as e:  # gloo reports a dead peer or a timeout as RuntimeError
        raise SyncError(f"{what} failed within {timeout:g} s: {e}") from e


def all_gather_json(data: Any, pg: dist.ProcessGroup, *, timeout: float, what: str) -> list[Any]:
    """Every rank's JSON-ready ``data``, in rank order (plain data: no pickles cross the wire)."""
    raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    out = all_gather_bytes(raw, pg, pg.size(), lambda work: _wait(work, timeout, what))
    return [json.loads(r.decode()) for r in out]
