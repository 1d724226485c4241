"""The wire protocol on its own (torch only, two processes): success (swap commit), a stalled peer, in-place sync."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bridge.test_bridge_multiprocess import free_port

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "wire_worker.py"


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    out = tmp_path_factory.mktemp("wire")
    ports = [str(free_port()), str(free_port())]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
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
    assert STALL_TIMEOUT - 0.5 < ev["seconds"] < STALL_TIMEOUT + 3, ev
    assert "timeout" in ev["message"] or "Timed out" in ev["message"], ev
    assert ev["unchanged"] is True and ev["version"] == 1
    assert events[0]["stall"]["ok"] is False and events[0]["stall"]["error"] == "SyncError"


def test_in_place_sync_after_recreating_the_group(events):
    assert events[1]["inplace"] == {"version": 3, "consistent": True, "exact": True}
