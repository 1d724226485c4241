"""The wire protocol on its own (torch only, two processes): success (swap commit), a stalled peer, in-place sync."""

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
    ports = [str(C.free_port()), str(C.free_port())]
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


def test_stalled_sender_fails_the_receiver_in_time_without_touching_weights(events):
    from tests.bridge.wire_worker import STALL_TIMEOUT

    ev = events[1]["stall"]
    assert ev["ok"] is False and ev["error"] == "SyncError", ev
    # It waited for the stalled sender its timeout, and gave up within a second of that deadline (long
    # before the sender's own timeout or the group's, 30 s, would have ended the sync).
    assert STALL_TIMEOUT - 0.5 < ev["seconds"] < STALL_TIMEOUT + 1.0, ev
    assert "timeout" in ev["message"] or "Timed out" in ev["message"], ev
    assert ev["unchanged"] is True and ev["version"] == 1
    assert events[0]["stall"]["ok"] is False and events[0]["stall"]["error"] == "SyncError"


def test_in_place_sync_after_recreating_the_group(events):
    assert events[1]["inplace"] == {"version": 3, "consistent": True, "exact": True}
