"""The wire protocol over each transport, in one process (ranks are threads): rank 0 sends, ranks 1 and 2
receive. The same protocol tests run over the gloo transport, shared memory and the queue test double
(``tests/bridge/queue_transport.py``); faults on the queue's wire give every rank a ``SyncError`` within
the deadline, and leave every receiver's weights and version unchanged."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import bridge
from bridge.wire.gloo import GlooTransport, check_transport
from bridge.wire.transport import Transport
from jreshard import Layout
from tests.bridge.queue_transport import Fault, Hub, QueueTransport, run_ranks
from tests.bridge.wire_worker import send, sender

TIMEOUT = 2.0  # every sync's deadline after its handshake
PROMPT = 1.0  # seconds past the deadline by which every rank has raised
RECEIVERS = (1, 2)
TRANSPORTS = ("gloo", "shm", "queue")
MODES = {"held": {}, "swap": {"swap": True}, "inplace": {"atomic": False}}


def make_plan() -> tuple[bridge.BridgePlan, dict[str, np.ndarray]]:
    mesh = bridge.trainer_mesh((2,), "fsdp", [0], 2)
    src = bridge.Source({"w": Layout((64, 48), mesh, ("fsdp",), "float32"),
                         "v": Layout((48,), mesh, (), "float32")})
    rules = [bridge.Rule("w", "linear.weight", transpose=True, dim=0), bridge.Rule("v", "norm.weight")]
    plan = bridge.BridgePlan(src, bridge.tp_param_map(src, rules, list(RECEIVERS), dtype="bfloat16"),
                             bucket_bytes=1024)
    rng = np.random.default_rng(0)
    return plan, {"w": rng.standard_normal((64, 48), dtype=np.float32), "v": rng.standard_normal(48, dtype=np.float32)}


PLAN, ARRAYS = make_plan()


def scaled(version: int) -> dict[str, np.ndarray]:
    return {k: a * version for k, a in ARRAYS.items()}


def exact(rank: int, params: dict[str, torch.Tensor], version: int) -> bool:
    want = PLAN.reference(scaled(version))[rank]
    return all(torch.equal(params[n].float(), torch.from_numpy(want[n].astype(np.float32))) for n in params)


class Rank:
    """One rank of the in-process group: its receiver (ranks 1, 2) and a transport per sync."""

    def __init__(self, rank: int, group, kind: str, hub: Hub, **receiver) -> None:
        self.rank, self.group, self.kind, self.hub = rank, group, kind, hub
        self.params = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16) for p in PLAN.param_map.for_rank(rank)}
        self.rec = None if rank == 0 else bridge.Receiver(PLAN, self.params, rank=rank, timeout=TIMEOUT,
                                                          ready_timeout=30, **receiver)

    def transport(self, fault: Fault | None = None) -> Transport | str:
        return QueueTransport(self.hub, self.rank, fault) if self.kind == "queue" else self.kind

    def sync(self, version: int, *, pack=None, fault: Fault | None = None, checksum: bool = False) -> dict:
        """One sync; what happened (``ok``, the error, the seconds it took, whether the weights changed)."""
        before = {k: v.clone() for k, v in self.params.items()}
        t0 = time.perf_counter()
        try:
            if self.rec is None:
                send(PLAN, pack or sender(PLAN, scaled(version), 0.0), version=version, timeout=TIMEOUT,
                     group=self.group, checksum=checksum, transport=self.transport(fault))
            else:
                self.rec.sync(self.group, transport=self.transport(fault))
            return {"ok": True, "exact": self.rec is None or exact(self.rank, self.params, version)}
        except bridge.SyncError as e:
            return {"ok": False, "message": str(e), "seconds": time.perf_counter() - t0,
                    "version": None if self.rec is None else self.rec.version,
                    "unchanged": all(torch.equal(before[k], self.params[k]) for k in self.params)}


def _check(results: list) -> list:
    for r, got in enumerate(results):
        if isinstance(got, BaseException):
            raise AssertionError(f"rank {r} raised {type(got).__name__}: {got}") from got
    return results


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_sync_is_exact_over_each_transport(kind, mode):
    hub = Hub()

    def rank_main(rank, group):
        me = Rank(rank, group, kind, hub, **MODES[mode])
        first = me.sync(1)
        stats = me.rec.last_stats if me.rec is not None else None
        return first, me.sync(2), stats

    for r, (first, again, stats) in enumerate(_check(run_ranks(3, rank_main))):
        assert first == again == {"ok": True, "exact": True}, (r, first, again)
        if stats is not None:
            moved = dict(stats.transport_bytes)
            if kind == "shm":  # receives into the params themselves (swap's shadow, in place) go over gloo
                assert sum(moved.values()) == stats.received_bytes and moved["shm"] > 0, moved
            else:
                assert moved == {kind: stats.received_bytes} and stats.received_bytes > 0, moved
            assert stats.delivery == "direct" and "commit" in stats.step_seconds


# fault -> what every rank's SyncError says (each in bucket 2, announced in the vote after it)
BETWEEN_VOTES = {
    "pack_error": "rank 0 failed in bucket 2/",
    "truncate": "sender rank 0 would send a message of the wrong size to rank",
    "unpack_error": "rank 1 failed in bucket 2/",
}


def _faulty_pack(fault: str, version: int):
    pack = sender(PLAN, scaled(version), 0.0, fault)
    return pack if fault != "unpack_error" else None


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_failure_between_votes_fails_every_rank_and_the_group_syncs_again(kind):
    hub = Hub()

    def rank_main(rank, group):
        me = Rank(rank, group, kind, hub, swap=True)
        out = {"first": me.sync(1)}
        for fault in BETWEEN_VOTES:
            if fault == "unpack_error" and me.rec is not None and rank == 1:
                real = me.rec.strategy.unpack  # a SwapCommit unpacks as buckets arrive

                def failing(m, buf, real=real):
                    if m.bucket == 1:
                        raise RuntimeError("injected unpacking failure")
                    real(m, buf)

                me.rec.strategy.unpack = failing
                out[fault] = me.sync(2)
                me.rec.strategy.unpack = real
            else:
                out[fault] = me.sync(2, pack=_faulty_pack(fault, 2) if rank == 0 else None)
        out["again"] = me.sync(3)
        return out

    for r, out in enumerate(_check(run_ranks(3, rank_main))):
        assert out["first"] == out["again"] == {"ok": True, "exact": True}, (r, out)
        for fault, says in BETWEEN_VOTES.items():
            got = out[fault]
            assert got["ok"] is False and says in got["message"], (r, fault, got)
            assert "nothing was committed" in got["message"] and got["seconds"] < TIMEOUT, (r, fault, got)
            if r != 0:
                assert got["unchanged"] is True and got["version"] == 1, (r, fault, got)


@pytest.mark.parametrize("fault", ["drop", "delay"])
def test_a_fault_on_the_wire_fails_every_rank_within_the_deadline(fault):
    hub = Hub()
    broken = Fault(fault, post=2, seconds=TIMEOUT + 1.0)

    def rank_main(rank, group):
        me = Rank(rank, group, "queue", hub)
        first = me.sync(1)
        return first, me.sync(2, fault=broken if rank == 0 else None)

    # A collective left pending by a rank that gave up holds its thread until the group's own timeout.
    for r, (first, got) in enumerate(_check(run_ranks(3, rank_main, group_timeout=TIMEOUT + 1.5))):
        assert first == {"ok": True, "exact": True}, (r, first)
        assert got["ok"] is False and got["message"].startswith(f"rank {r}: "), (r, got)
        assert got["seconds"] < TIMEOUT + PROMPT, (r, got)
        if r != 0:
            assert got["unchanged"] is True and got["version"] == 1, (r, got)


WRONG_LENGTH = "refused a message of the wrong length from sender rank 0 in bucket 2/"
CORRUPT = "received corrupt data from sender rank 0 in bucket 2/"
# In-transit fault -> what every rank's SyncError may say. Lengths are checked whatever the checksum
# setting; a flipped byte or swapped messages of one length only by the digests (checksums on, the default).
IN_TRANSIT = [("truncate", True, (WRONG_LENGTH,)), ("truncate", False, (WRONG_LENGTH,)),
              ("extend", True, (WRONG_LENGTH,)), ("extend", False, (WRONG_LENGTH,)),
              ("oversize", True, (WRONG_LENGTH,)), ("oversize", False, (WRONG_LENGTH,)),
              ("flip", True, (CORRUPT,)), ("reorder", True, (CORRUPT, WRONG_LENGTH))]


@pytest.mark.parametrize(("fault", "checksum", "says"), IN_TRANSIT)
def test_damage_in_transit_fails_every_rank_commits_nothing_and_the_group_syncs_again(fault, checksum, says):
    hub = Hub()

    def rank_main(rank, group):
        me = Rank(rank, group, "queue", hub)
        first = me.sync(1, checksum=checksum)
        got = me.sync(2, fault=Fault(fault, post=2) if rank == 0 else None, checksum=checksum)
        return first, got, me.sync(3, checksum=checksum)

    for r, (first, got, again) in enumerate(_check(run_ranks(3, rank_main))):
        assert first == again == {"ok": True, "exact": True}, (r, first, again)
        assert got["ok"] is False and any(s in got["message"] for s in says), (r, got)
        assert "nothing was committed" in got["message"] and got["seconds"] < TIMEOUT, (r, got)
        if r != 0:
            assert got["unchanged"] is True and got["version"] == 1, (r, got)


def test_a_slow_link_within_the_deadline_still_syncs():
    hub = Hub()
    slow = Fault("delay", post=1, seconds=0.2)

    def rank_main(rank, group):
        me = Rank(rank, group, "queue", hub)
        return me.sync(1, fault=slow if rank == 0 else None)

    assert _check(run_ranks(3, rank_main)) == [{"ok": True, "exact": True}] * 3


def test_transports_implement_the_protocol():
    assert isinstance(GlooTransport(), Transport) and isinstance(QueueTransport(Hub(), 0), Transport)
    with pytest.raises(TypeError, match="transport must be 'auto', 'shm', 'gloo' or implement"):
        check_transport(object())
    with pytest.raises(ValueError, match="transport='nccl' is not built yet"):
        check_transport("nccl")
    with pytest.raises(ValueError, match="transport must be one of"):
        check_transport("tcp")
    with pytest.raises(ValueError, match="kind must be one of"):
        Fault("lose")
