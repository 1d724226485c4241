"""Fault injection over processes (torch only): every surviving rank raises a SyncError before the
deadline plus a margin, receivers keep their weights, and a later sync succeeds bit-exact.

One launch of tests/bridge/fault_worker.py per fault (rank 0 sends, ranks 1 and 2 receive).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bridge import _common as C

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).parent / "fault_worker.py"
LIMIT = 120  # seconds for one launch, relaunch included

# fault -> (the rank that dies, if any; what every surviving rank's message must say)
FAULTS = {
    "flip": (None, "received corrupt data from sender rank 0 in bucket 2/"),
    "truncate": (None, "sender rank 0 would send a message of the wrong size"),
    "extend": (None, "sender rank 0 would send a message of the wrong size"),
    "drop": (None, "sender rank 0 would send a message of the wrong size"),
    "extra": (None, "sender rank 0 would send a message of the wrong size"),
    "pack_error": (None, "rank 0 failed in bucket 2/"),
    "kill_sender_setup": (0, ""),
    "kill_sender_mid": (0, ""),
    "kill_sender_ack": (0, ""),
    "kill_receiver_setup": (2, ""),
    "kill_receiver_mid": (2, ""),
    "kill_receiver_ack": (2, ""),
    "stall_sender": (None, "deadline"),
    "stall_ack": (None, "deadline"),
}
def _launch(rank: int, fault: str, out: Path, ports: list[str], restart: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--rank", str(rank), "--port", ports[0], "--port2", ports[1],
           "--fault", fault, "--out", str(out)]
    with open(out / f"fault{rank}{'_restart' if restart else ''}.log", "w") as log:
        return subprocess.Popen(cmd + (["--restart"] if restart else []), env=C.worker_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _run(fault: str, out: Path) -> dict:
    dead, _ = FAULTS[fault]
    ports = [str(C.free_port()), str(C.free_port())]
    procs = {r: _launch(r, fault, out, ports) for r in range(3)}
    extra = []
    deadline = time.monotonic() + LIMIT
    try:
        if dead is not None:
            procs[dead].wait(LIMIT)
            extra.append(_launch(dead, fault, out, ports, restart=True))
        for p in [*procs.values(), *extra]:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        C.kill_all([*procs.values(), *extra])
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("*.log")))
    events = {}
    for f in out.glob("fault*.json"):
        events[f.stem.removeprefix("fault")] = json.loads(f.read_text())
    return {"events": events, "logs": logs, "rc": {r: p.returncode for r, p in procs.items()},
            "rc_restart": [p.returncode for p in extra]}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault(fault, tmp_path):
    from tests.bridge.fault_worker import TIMEOUT, needs_rebuild

    dead, says = FAULTS[fault]
    run = _run(fault, tmp_path)
    ev, logs = run["events"], run["logs"]
    if dead is not None:
        assert run["rc"][dead] == -signal.SIGKILL, logs
        assert run["rc_restart"] == [0], logs
        assert ev[f"{dead}_restart"]["recovery"]["exact"] is True, logs
    for r in range(3):
        if r == dead:
            continue
        assert run["rc"][r] == 0, (r, logs)
        assert ev[str(r)]["first"]["exact"] is True, (r, logs)
        got = ev[str(r)]["fault"]
        assert got["ok"] is False and got["error"] == "SyncError", (r, got, logs)
        assert says in got["message"], (r, got)
        if fault in ("flip", "truncate", "extend", "drop", "extra"):  # the sender, the bucket and the tensor
            assert "sender rank 0" in got["message"] and "in bucket 2/" in got["message"], got
            assert "param 'linear.weight'" in got["message"] or "param 'norm.weight'" in got["message"], got
        # Every survivor gives up by the deadline (plus a generous margin for a loaded machine).
        assert got["seconds"] < TIMEOUT + C.SLACK, (r, got)
        if not needs_rebuild(fault):  # found by a vote: raised at once, not at the deadline
            assert got["seconds"] < TIMEOUT, (r, got)
        if r != 0:
            assert got["unchanged"] is True and got["version"] == 1, (r, got)
        assert ev[str(r)]["recovery"]["exact"] is True, (r, logs)
        if r != 0:
            assert ev[str(r)]["recovery"]["version"] == 3
