"""A sync's handshake: one ``all_gather`` of a small header per rank, and on a fingerprint mismatch
the exchange of what each rank's plan covers (``bridge.plan.key``), so the error says what differs.

The header is int64 words: magic, role (``Role``), status (``HandshakeStatus``), version, whether
the rank asks for digests, the plan's 32-byte fingerprint (four words), then the transport the rank
asks for (``bridge.wire.route.Mode``) and where its tensors live (``Place``: host, pid, device), from
which every rank computes every pair's route alike.

Example (the header of a sender announcing version 7, no digests, asking for the automatic choice):
  >>> from bridge.wire.handshake import HandshakeStatus, Role, header
  >>> from bridge.wire.route import Mode, Place
  >>> header(Role.SENDER, HandshakeStatus.OK, 7, False, bytes(32), Mode.AUTO, Place(5, 42, "cpu")).tolist()
  [1785881971, 1, 0, 7, 0, 0, 0, 0, 0, 1, 5, 42, 0]
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from bridge.errors import PlanMismatchError, SyncError
from bridge.plan.bridge_plan import BridgePlan
from bridge.plan.key import decode, describe_difference, encode, plan_key
from bridge.wire.alarm import SyncAlarm
from bridge.wire.group import all_gather_bytes
from bridge.wire.route import Mode, Place

__all__ = ["MAGIC", "Role", "HandshakeStatus", "Agreement", "header", "handshake"]

MAGIC = 0x6A72_6573  # "jres"


class Role(enum.IntEnum):
    """How a rank joins a sync (its value travels in the header)."""

    SENDER = 1
    RECEIVER = 2


class HandshakeStatus(enum.IntEnum):
    """Whether a rank can take part in a sync (its value travels in the header)."""

    OK = 0
    REJECTED = 1  # its own checks failed (``reject_sync``): every rank fails before any data moves


class Agreement(NamedTuple):
    """What the handshake settled: the trainers' version, whether every rank announces digests, the
    transport each rank asked for, and where each rank's tensors live."""

    version: int
    digests: bool
    modes: dict[int, Mode]
    places: dict[int, Place]


_DEVICES = ("cpu", "cuda")


def header(role: Role, status: HandshakeStatus, version: int, digests: bool, fingerprint: bytes, mode: Mode,
           place: Place) -> torch.Tensor:
    fp = np.frombuffer(fingerprint, dtype=np.int64)
    return torch.tensor([MAGIC, int(role), int(status), version, int(digests), *fp.tolist(), int(mode), place.host,
                         place.pid, _DEVICES.index(place.device)], dtype=torch.int64)


def handshake(plan: BridgePlan, rank: int, ranks: list[int], group: Any, alarm: SyncAlarm, mine: torch.Tensor,
              deadline: float) -> Agreement:
    """Gathers every rank's header ``mine``; raises on a mismatch, else returns the agreement."""
    out = [torch.empty_like(mine) for _ in ranks]
    alarm.wait_for(dist.all_gather(out, mine, group=group, async_op=True), deadline, "the handshake")
    rows = {r: t.tolist() for r, t in zip(ranks, out, strict=True)}
    bad = [r for r, h in rows.items() if h[0] != MAGIC]
    if bad:
        raise PlanMismatchError(f"rank {rank}: ranks {bad} do not speak the bridge protocol (wrong header).")
    failed = [r for r, h in rows.items() if h[2] != HandshakeStatus.OK]
    if failed:
        raise SyncError(f"rank {rank}: ranks {failed} rejected the sync before any data moved; see their errors.")
    prints: dict[bytes, list[int]] = {}
    for r, h in rows.items():
        prints.setdefault(np.array(h[5:9], dtype=np.int64).tobytes(), []).append(r)
    if len(prints) > 1:
        _mismatch(plan, rank, ranks, group, alarm, prints, deadline)
    versions = {h[3] for h in rows.values() if h[1] == Role.SENDER}
    if len(versions) != 1:
        raise PlanMismatchError(f"rank {rank}: the trainer ranks sent different versions {sorted(versions)}.")
    roles = {r: h[1] for r, h in rows.items()}
    for r in plan.source.ranks:
        if roles.get(r) != Role.SENDER:
            raise PlanMismatchError(f"rank {rank}: rank {r} holds trainer shards but did not join as a sender.")
    for r in plan.param_map.ranks:
        if roles.get(r) != Role.RECEIVER:
            raise PlanMismatchError(f"rank {rank}: rank {r} has params but did not join as a receiver.")
    modes = {r: Mode(h[9]) for r, h in rows.items()}
    places = {r: Place(h[10], h[11], _DEVICES[h[12]]) for r, h in rows.items()}
    return Agreement(versions.pop(), any(h[4] for h in rows.values()), modes, places)


def _mismatch(plan: BridgePlan, rank: int, ranks: list[int], group: Any, alarm: SyncAlarm,
              prints: dict[bytes, list[int]], deadline: float) -> None:
    """Raises the error of ranks whose fingerprints differ, saying what their plans' keys differ in."""
    groups = "; ".join(f"ranks {rs}: {fp.hex()[:16]}" for fp, rs in prints.items())
    keys = _exchange_keys(plan, ranks, group, alarm, deadline)
    firsts = [rs[0] for rs in prints.values()]

    def like(r: int) -> list[int]:  # the ranks whose fingerprint equals rank r's
        return next(rs for rs in prints.values() if r in rs)

    differences = "; ".join(f"ranks {like(r)} against ranks {like(firsts[0])}: "
                            f"{describe_difference(keys[r], keys[firsts[0]])}" for r in firsts[1:])
    raise PlanMismatchError(
        f"rank {rank}: the ranks computed different sync plans ({groups}); nothing was sent. {differences}. "
        "Build the Source, ParamMap and bucket_bytes from the same model config, mesh and ranks on every process."
    )


def _exchange_keys(plan: BridgePlan, ranks: list[int], group: Any, alarm: SyncAlarm,
                   deadline: float) -> dict[int, dict]:
    """Every rank's ``plan_key``; every rank calls it, since all see the same mismatch in the handshake."""
    keys = all_gather_bytes(encode(plan_key(plan)), group, len(ranks),
                            lambda work: alarm.wait_for(work, deadline, "the plan comparison"))
    return {r: decode(k) for r, k in zip(ranks, keys, strict=True)}
