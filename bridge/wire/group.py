"""The sync's process group: creating it, rebuilding it after a failure, naming its ranks (torch only)."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from bridge.errors import SyncError
from bridge.plan.bridge_plan import BridgePlan
from bridge.wire import alarm
from jreshard.core.args import check_int, check_seconds

__all__ = ["init_group", "rebuild_group", "group_ranks", "check_plan_and_rank", "all_gather_bytes", "gloo_group",
           "forget_gloo_group", "tcp_store"]


def init_group(rank: int, world_size: int, *, port: int, host: str = "127.0.0.1", backend: str = "gloo",
               timeout: float = 60.0) -> dist.ProcessGroup:
    """Creates the default process group of trainer and inference processes (TCP rendezvous).

    Rank 0 hosts the rendezvous store, listening on ``host``'s interface only (``tcp_store``).
    ``timeout`` (seconds) bounds every collective. Returns ``torch.distributed.group.WORLD``.
    The group checks no membership (anyone who reaches the port may join): run it on a network
    the job owns, or use ``bridge.engines.group.open_group``, which admits holders of a secret only.
    """
    rank = check_int("rank", rank)
    world_size = check_int("world_size", world_size, minimum=1)
    port = check_int("port", port, minimum=1, maximum=65535)
    timeout = check_seconds("timeout", timeout)
    if not isinstance(host, str) or not host:
        raise TypeError(f"host must be a non-empty str (a host name or address), got {host!r}.")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")
    if not rank < world_size:
        raise ValueError(f"rank {rank} must be below world_size {world_size}.")
    store = tcp_store(host, port, world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    world = dist.group.WORLD
    if world is None:
        raise SyncError("torch.distributed.init_process_group returned without a default group.")
    return world


def tcp_store(host: str, port: int, world_size: int, *, is_master: bool, timeout: float) -> dist.TCPStore:
    """A ``TCPStore`` on ``host:port`` whose server (``is_master``) listens on ``host``'s interface only.

    torch's own server listens on every interface whatever ``host`` says; this one binds a socket
    to ``host:port`` and hands it to the store (``port`` 0: a free one, ``store.port`` names it).

    Raises:
      OSError: the server's port cannot be bound (taken, or ``host`` is not this machine's).
    """
    delta = datetime.timedelta(seconds=timeout)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=delta)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        return dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, timeout=delta,
                             wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True)
    except BaseException:
        listener.close()
        raise
    finally:
        listener.detach()  # the store owns the descriptor now (a no-op after close)


def rebuild_group(rank: int, world_size: int, *, port: int, host: str = "127.0.0.1", backend: str = "gloo",
                  timeout: float = 60.0) -> dist.ProcessGroup:
    """Destroys the default process group (if any) and creates a new one: what a sync needs after a timeout
    or a dead peer. Every rank calls it with a fresh ``port`` (a replacement process for a dead one too)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    return init_group(rank, world_size, port=port, host=host, backend=backend, timeout=timeout)


def check_plan_and_rank(plan: BridgePlan, rank: int | None) -> int:
    """Validates a Sender's or Receiver's plan; returns ``rank`` (default: this process's global rank)."""
    if not isinstance(plan, BridgePlan):
        raise TypeError(f"plan must be a bridge.BridgePlan, got {type(plan).__name__}.")
    if rank is None:
        if not dist.is_initialized():
            raise ValueError("rank is None and torch.distributed is not initialised; pass rank=.")
        return dist.get_rank()
    return check_int("rank", rank)


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The ranks of ``group`` in its own order, as the plan names them.

    A group given explicitly needs no default group: a process may hold only the sync's
    own group (a JAX trainer), or a default group of its own that the sync must not use
    (a vLLM worker). Its ranks are those torch.distributed registered for it: global ranks
    for a group from ``new_group``, ``0 .. size-1`` for one registered with an identity map
    (``bridge.engines.group.open_group``). Point-to-point calls translate peers through the
    same registry, so an unregistered group is refused here, before any rank waits.
    """
    if group is not None and group is not dist.group.WORLD:
        try:
            return dist.get_process_group_ranks(group)
        except KeyError:
            raise ValueError(
                f"group {group!r} is not registered with torch.distributed, so its peers cannot be named; "
                "create it with torch.distributed.new_group(...) or bridge.engines.group.open_group(...)."
            ) from None
    if not dist.is_initialized():
        raise SyncError("torch.distributed is not initialised and no group was given; pass group= "
                        "or call bridge.init_group(...) or torch.distributed.init_process_group(...) first.")
    return dist.get_process_group_ranks(dist.group.WORLD)


def all_gather_bytes(data: bytes, group: Any, size: int, wait: Callable[[Any], None]) -> list[bytes]:
    """Every rank's ``data`` (of any length), in the group's rank order: two ``all_gather``s, lengths then
    bytes padded to the longest. ``wait(work)`` waits for each collective (under the caller's deadline or
    alarm) and raises on failure. The one variable-length exchange of the bridge's control traffic (the
    wire's plan-key comparison, the engines' JSON hellos and reports)."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    wait(dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group, async_op=True))
    lengths = [int(n.item()) for n in sizes]
    padded = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)
    if data:
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(padded) for _ in range(size)]
    wait(dist.all_gather(out, padded, group=group, async_op=True))
    return [t[:n].numpy().tobytes() for t, n in zip(out, lengths, strict=True)]


def gloo_group(store: Any, rank: int, size: int, timeout: float, *, bind: str | None = None) -> dist.ProcessGroup:
    """Rank ``rank``'s gloo group of ``size`` ranks over ``store``, outside torch.distributed's default group.

    The group is registered with an identity rank map, so that point-to-point calls and
    ``get_process_group_ranks`` name peers by their rank in it without a default group, and its store
    is given to the sync's alarm (``bridge.wire.alarm.register_store``). ``bind``: the address of the
    interface gloo's sockets listen on (default: gloo's choice, the address this machine's name resolves to).
    """
    delta = datetime.timedelta(seconds=timeout)
    pg = dist.ProcessGroup(store, rank, size)
    if bind is None:
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout=delta)
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs lack it
        options._timeout = delta
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
        gloo = dist.ProcessGroupGloo(store, rank, size, options)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    c10d._world.pg_group_ranks[pg] = {r: r for r in range(size)}
    alarm.register_store(pg, store)
    return pg


def forget_gloo_group(pg: dist.ProcessGroup) -> None:
    """Undoes ``gloo_group``'s registrations (its rank map and its alarm store)."""
    c10d._world.pg_group_ranks.pop(pg, None)
    alarm.forget_store(pg)
