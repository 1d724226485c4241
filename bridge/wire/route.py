"""Which transport carries the payload between each pair of ranks: the modes a user asks for, where a
rank's tensors live (``Place``), and the choice per pair that both ranks of the pair make alike.

Every rank announces its ``Place`` and the mode it asks for in the handshake
(``bridge.wire.handshake``), so each rank computes every pair's route from the same table (a pair
takes shared memory only where both of its ranks allow it):

==============  ====================================================================================
mode            route of a pair of ranks that exchange payload
==============  ====================================================================================
``"auto"``      ``"shm"`` where both ranks are processes of one host (same boot id, host name, PID
                and network namespaces: the nodes that ``benchmarks/cluster.py`` simulates with
                network namespaces are hosts apart) with their tensors in host memory; ``"gloo"``
                otherwise
``"shm"``       the same, but a pair on two hosts, or with a CUDA side, is refused before any
                payload moves
``"gloo"``      ``"gloo"`` for every pair (``torch.distributed`` point to point on the sync's group)
==============  ====================================================================================

``"cuda_ipc"`` and ``"nccl"`` are named by the protocol but not built yet: asking for them is
refused with a message that says so. A rank that passes a ``Transport`` object carries its side of
every pair with it; its peers use gloo with it (a wrapper of ``GlooTransport``, as fault-injection
tests use, or a test double that every rank passes).

  >>> from bridge.wire.route import Mode, Place, routes
  >>> a, b = Place(host=7, pid=100, device="cpu"), Place(host=7, pid=200, device="cpu")
  >>> auto = {0: Mode.AUTO, 1: Mode.AUTO}
  >>> routes(auto, {0: a, 1: b}, pairs=[(0, 1)], rank=0)
  {1: 'shm'}
  >>> routes(auto, {0: a, 1: b._replace(host=8)}, pairs=[(0, 1)], rank=0)
  {1: 'gloo'}
  >>> routes({0: Mode.AUTO, 1: Mode.GLOO}, {0: a, 1: b}, pairs=[(0, 1)], rank=0)
  {1: 'gloo'}
"""

from __future__ import annotations

import enum
import functools
import os
import socket
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import xxhash

from bridge.errors import SyncError

__all__ = ["Mode", "Place", "here", "routes", "MODES", "ROUTES"]

ROUTES = ("gloo", "shm")  # the routes a pair can take today


class Mode(enum.IntEnum):
    """The transport a rank asks for (its value travels in the handshake)."""

    CUSTOM = 0  # a Transport object the caller built
    AUTO = 1
    GLOO = 2
    SHM = 3
    CUDA_IPC = 4
    NCCL = 5

    @classmethod
    def parse(cls, name: str) -> Mode:
        """The mode named ``name`` (``"auto"``, ``"gloo"``, ``"shm"``); raises naming the argument otherwise."""
        mode = MODES.get(name)
        if mode is None:
            raise ValueError(f"transport must be one of {sorted(MODES)} or a bridge.wire.transport.Transport, "
                             f"got {name!r}.")
        if mode in (cls.CUDA_IPC, cls.NCCL):
            raise ValueError(f"transport={name!r} is not built yet; use 'auto', 'shm' or 'gloo' (CPU tensors), or "
                             "'gloo' on an NCCL process group (docs/bridge.md, 'Transports').")
        return mode

    @property
    def label(self) -> str:
        return next((k for k, v in MODES.items() if v == self), "a Transport object")


MODES = {"auto": Mode.AUTO, "gloo": Mode.GLOO, "shm": Mode.SHM, "cuda_ipc": Mode.CUDA_IPC, "nccl": Mode.NCCL}


class Place(NamedTuple):
    """Where a rank's tensors live: its host (a 63-bit digest of boot id, host name, PID and network
    namespaces), its process id, and ``"cpu"`` or ``"cuda"``."""

    host: int
    pid: int
    device: str


@functools.cache
def _host() -> int:
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path, encoding="ascii") as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("no boot id")
    # Processes of two PID namespaces cannot open each other's /proc/<pid>/fd; two network namespaces
    # stand for two hosts (a container's own network, a simulated node).
    for ns in ("pid", "net"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append(f"no {ns} namespace")
    return xxhash.xxh3_64_intdigest("\0".join(parts).encode()) & ((1 << 63) - 1)


def here(device: str) -> Place:
    """This process's place, its tensors on a device of type ``device`` (``"cpu"``, ``"cuda"``, ...)."""
    return Place(_host(), os.getpid(), "cpu" if device == "cpu" else "cuda")


def routes(modes: Mapping[int, Mode], places: Mapping[int, Place], *, pairs: Iterable[tuple[int, int]],
           rank: int) -> dict[int, str]:
    """The route to every peer that ``rank`` exchanges payload with (``pairs``: (sender, receiver) ranks),
    from what both ranks of each pair asked for (``modes``) and where they are (``places``): gloo where
    either asked for gloo or brought a ``Transport`` object of its own (which carries its side of every
    pair), shared memory where both asked for ``"shm"`` or ``"auto"`` and the pair can share memory.

    Raises ``SyncError`` where a rank asked for ``"shm"`` and a pair of it cannot share memory (every
    rank checks every pair, so all of them raise alike, before any payload moves).
    """
    out: dict[int, str] = {}
    for s, d in sorted(pairs):
        if s == d:
            continue
        a, b = places[s], places[d]
        local = a.host == b.host and a.device == b.device == "cpu"
        asked = {modes[s], modes[d]}
        if Mode.SHM in asked and not local:
            why = "on two hosts" if a.host != b.host else "not both in host memory"
            raise SyncError(f"rank {rank}: transport='shm' but ranks {s} and {d} are {why}; pass transport='auto' "
                            "(shared memory where it can be used, gloo elsewhere) or 'gloo'.")
        if rank in (s, d):
            shared = asked <= {Mode.AUTO, Mode.SHM} and local
            out[d if rank == s else s] = "shm" if shared else "gloo"
    return out
