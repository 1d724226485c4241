"""The wire protocol on its own (torch only, two processes): success (swap commit), failures between votes,
a stalled peer, in-place sync."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bridge import _common as C

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "wire_worker.py"


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    out = tmp_path_factory.mktemp("wire")
    ports = [str(p) for p in C.free_ports(2)]
    env = C.worker_env()
    procs = []
    for r in (0, 1):
        with open(out / f"wire{r}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--port", ports[0],
                                           "--port2", ports[1], "--out", str(out)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    try:
        for p in procs:
            p.wait(120)
    finally:
        C.kill_all(procs)
    logs = "\n".join((out / f"wire{r}.log").read_text()[-2000:] for r in (0, 1))
    assert [p.returncode for p in procs] == [0, 0], logs
    return [json.loads((out / f"wire{r}.json").read_text()) for r in (0, 1)]


def test_sync_is_exact_and_versioned(events):
    assert events[1]["ok"] == {"version": 1, "exact": True, "swapped": True}
    assert events[0]["buckets"] > 1  # several buckets: the double-buffered path runs
    assert events[1]["jax_imported"] is False
    assert events[0]["ok"]["gathers"] == 2  # no digests: the handshake and the final ack, no vote per bucket


# fault -> what both ranks' SyncError says (every fault is in bucket 2, announced in the final ack)
SAYS = {
    "pack_error": "rank 0 failed in bucket 2/",
    "truncate": "sender rank 0 would send a message of the wrong size to rank 1 in bucket 2/",
    "unpack_error": "rank 1 failed in bucket 2/",
}


def test_a_failure_between_votes_fails_every_rank_at_the_next_vote(events):
    for fault, says in SAYS.items():
        for r in (0, 1):
            ev = events[r][fault]
            assert ev["ok"] is False and ev["error"] == "SyncError", (fault, r, ev)
            assert says in ev["message"], (fault, r, ev)
            assert "nothing was committed" in ev["message"], (fault, r, ev)
        assert events[1][fault]["unchanged"] is True and events[1][fault]["version"] == 1, fault
    assert "injected" in events[0]["unpack_error"]["message"]
    assert "param 'linear.weight'" in events[1]["truncate"]["message"]  # the tensor is named
    assert events[0]["truncate"]["gathers"] == 2  # found by the sender, told in the final ack
    assert events[1]["again"] == {"version": 2, "exact": True}  # the same group syncs again


def test_stalled_sender_fails_the_receiver_in_time_without_touching_weights(events):
    from tests.bridge.wire_worker import STALL_TIMEOUT

    ev = events[1]["stall"]
    assert ev["ok"] is False and ev["error"] == "SyncError", ev
    # It waited for the stalled sender its timeout, and gave up within a second of that deadline (long
    # before the sender's own timeout or the group's, 30 s, would have ended the sync).
    assert STALL_TIMEOUT - 0.5 < ev["seconds"] < STALL_TIMEOUT + 1.0, ev
    assert "timeout" in ev["message"] or "Timed out" in ev["message"], ev
    assert ev["unchanged"] is True and ev["version"] == 2
    assert events[0]["stall"]["ok"] is False and events[0]["stall"]["error"] == "SyncError"


def test_in_place_sync_after_recreating_the_group(events):
    assert events[1]["inplace"] == {"version": 3, "consistent": True, "exact": True}


def test_a_survivor_with_no_operation_pending_with_the_dead_rank_hears_the_alarm(tmp_path):
    from tests.bridge.wire_worker import ALARM_TIMEOUT

    port, env = str(C.free_port()), C.worker_env()
    procs = []
    for r in (0, 1, 2):
        with open(tmp_path / f"alarm{r}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--port", port, "--out",
                                           str(tmp_path), "--alarm"], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    try:
        C.wait_all(procs, 60)
    finally:
        C.kill_all(procs)
    logs = C.read_logs(tmp_path)
    assert [p.returncode for p in procs] == [0, -9, 0], logs
    sender, survivor = (json.loads((tmp_path / f"alarm{r}.json").read_text()) for r in (0, 2))
    assert sender["first_to_2"] > 1, sender  # rank 0 gives up before it sends anything to rank 2
    assert sender["ok"] is False and "killed" in sender, sender
    assert survivor["ok"] is False and survivor["unchanged"] is True, survivor
    # gloo tells rank 2 nothing once the sync's payload moves (its only peer, rank 0, is alive), so it hears of the
    # failure through the alarm, before its deadline (without the alarm it raises at the deadline, saying so). Where
    # the kill comes while rank 2 still waits in the handshake's all_gather (a loaded machine), gloo reports rank 1's
    # closed connection instead: which of the two comes first is a race, and either is a prompt failure.
    said = survivor["message"]
    assert "raised the sync's alarm (rank 0: " in said or "a peer's connection closed" in said, survivor
    assert survivor["seconds"] < ALARM_TIMEOUT, survivor
