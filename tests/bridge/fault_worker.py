"""One process of the fault-injection tests (torch only): rank 0 sends, ranks 1 and 2 receive (TP2).

Run by tests/bridge/test_faults.py, one launch of three processes per fault. Every rank runs
three syncs: version 1 (must succeed), version 2 with the fault injected, version 3 (must
succeed again: on the same group after a fault the votes catch, on a rebuilt group, port2,
after a death or a stall; a killed rank is relaunched with --restart and joins version 3 only).
Results go to ``fault{rank}.json`` (``fault{rank}_restart.json`` for a relaunched rank).

Faults are injected by ``_fault`` below, a test-only hook: it wraps the sender's pack, or
``torch.distributed``'s calls in this process, for the faulty sync only. Names:

  flip               rank 0 flips a byte of a packed message after its digest was taken (bucket 2)
  truncate / extend  rank 0's pack gives a segment 8 bytes short / long (bucket 2)
  drop               rank 0's pack leaves out the last segment of a message (bucket 2)
  extra              rank 0's pack gives one segment more than the plan has (64 bytes, bucket 2): a
                     rogue sender whose message the receivers never posted a receive for
  pack_error         rank 0's pack raises (bucket 2)
  kill_{who}_{when}  who = sender (rank 0) or receiver (rank 2) dies with SIGKILL at ``setup`` (before
                     the handshake), ``mid`` (posting bucket 2) or ``ack`` (before the final ack)
  stall_sender       rank 0 stalls past the timeout while packing bucket 2
  stall_ack          rank 2 stalls past the timeout before the final ack
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import bridge  # noqa: E402
from bridge._wire import SENDER, run_sync  # noqa: E402
from jreshard import Layout  # noqa: E402
from tests.bridge.wire_worker import sender as wire_sender  # noqa: E402

TIMEOUT = 4.0  # the data deadline of every sync
STALL = TIMEOUT + 3.0
FAULTY = 2  # the version synced with the fault
WORLD = 3


def make_plan() -> tuple[bridge.BridgePlan, dict[str, np.ndarray]]:
    mesh = bridge.trainer_mesh((2,), "fsdp", [0], 2)
    src = bridge.Source({"w": Layout((64, 48), mesh, ("fsdp",), "float32"),
                         "v": Layout((48,), mesh, (), "float32")})
    rules = [bridge.Rule("w", "linear.weight", transpose=True, shard=0), bridge.Rule("v", "norm.weight")]
    plan = bridge.BridgePlan(src, bridge.tp_param_map(src, rules, [1, 2], dtype="bfloat16"), bucket_bytes=1024)
    rng = np.random.default_rng(0)
    return plan, {"w": rng.standard_normal((64, 48), dtype=np.float32), "v": rng.standard_normal(48, dtype=np.float32)}


def packer(plan: bridge.BridgePlan, arrays: dict[str, np.ndarray]):
    """The sender's pack, standing in for the JAX Sender: every piece packed into the message buffer."""
    return wire_sender(plan, arrays, 0.0)


def _fault(fault: str, rank: int, plan: bridge.BridgePlan, pack):
    """Installs ``fault`` for this process's next sync; returns the (possibly wrapped) pack and an undo."""
    real_batch, real_gather = dist.batch_isend_irecv, dist.all_gather
    calls = {"batch": 0, "gather": 0}
    final_gather = plan.num_buckets + 2  # the handshake, one vote per bucket, then the final ack

    def batch(ops):
        calls["batch"] += 1
        if calls["batch"] == 2:
            if fault == "flip" and rank == 0:
                t = next(op.tensor for op in ops if op.op is dist.isend)
                t[0] = t[0] ^ 0xFF
            if fault in (f"kill_{_who(rank)}_mid",):
                os.kill(os.getpid(), signal.SIGKILL)
        return real_batch(ops)

    def gather(*args, **kwargs):
        calls["gather"] += 1
        n = calls["gather"]
        who = _who(rank)
        if (n == 1 and fault == f"kill_{who}_setup") or (n == final_gather and fault == f"kill_{who}_ack"):
            os.kill(os.getpid(), signal.SIGKILL)
        if n == final_gather and fault == "stall_ack" and rank == 2:
            time.sleep(STALL)
        return real_gather(*args, **kwargs)

    def wrapped(m, buf):
        segs = pack(m, buf)
        if rank != 0 or m.bucket != 1:
            return segs
        if fault == "truncate":
            return [segs[0][:-8], *segs[1:]]
        if fault == "extend":
            return [torch.cat([segs[0], torch.zeros(8, dtype=torch.uint8)]), *segs[1:]]
        if fault == "drop":
            return segs[:-1] if len(segs) > 1 else []
        if fault == "extra":
            return [*segs, torch.zeros(64, dtype=torch.uint8)]
        if fault == "pack_error":
            raise RuntimeError("injected packing failure")
        if fault == "stall_sender":
            time.sleep(STALL)
        return segs

    dist.batch_isend_irecv, dist.all_gather = batch, gather

    def undo():
        dist.batch_isend_irecv, dist.all_gather = real_batch, real_gather

    return wrapped, undo


def _who(rank: int) -> str:
    return "sender" if rank == 0 else "receiver" if rank == 2 else "bystander"


def needs_rebuild(fault: str) -> bool:
    return fault.startswith(("kill_", "stall_"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--port2", type=int, required=True)
    ap.add_argument("--fault", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--restart", action="store_true")
    args = ap.parse_args()
    plan, arrays = make_plan()
    rank, events = args.rank, {}
    name = os.path.join(args.out, f"fault{rank}{'_restart' if args.restart else ''}.json")

    def save():
        with open(name, "w") as f:
            json.dump(events, f)

    scaled = {v: {k: a * v for k, a in arrays.items()} for v in (1, 2, 3)}
    params = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16) for p in plan.param_map.for_rank(rank)}
    rec = None if rank == 0 else bridge.Receiver(plan, params, rank=rank, timeout=TIMEOUT, ready_timeout=60)

    def sync(version: int, pack=None) -> None:
        if rank == 0:
            run_sync(plan, 0, None, role=SENDER, version=version, status=0, timeout=TIMEOUT, ready_timeout=60,
                     pack=pack or packer(plan, scaled[version]), recv=None, unpack=None, checksum=True)
        else:
            assert rec is not None
            rec.sync()

    def exact(version: int) -> bool:
        want = plan.reference(scaled[version])[rank]
        return all(torch.equal(params[n].float(), torch.from_numpy(want[n].astype(np.float32))) for n in params)

    if not args.restart:
        bridge.init_group(rank, WORLD, port=args.port, timeout=60)
        sync(1)
        events["first"] = {"exact": rank == 0 or exact(1)}
        save()
        before = {k: v.clone() for k, v in params.items()}
        pack, undo = _fault(args.fault, rank, plan, packer(plan, scaled[FAULTY]))
        t0 = time.perf_counter()
        try:
            sync(FAULTY, pack)
            events["fault"] = {"ok": True}
        except bridge.SyncError as e:
            events["fault"] = {"ok": False, "error": type(e).__name__, "message": str(e),
                               "seconds": time.perf_counter() - t0,
                               "unchanged": all(torch.equal(before[k], params[k]) for k in params),
                               "version": None if rec is None else rec.version}
        undo()
        save()
    if args.restart or needs_rebuild(args.fault):
        bridge.rebuild_group(rank, WORLD, port=args.port2, timeout=60)
    sync(3)
    events["recovery"] = {"exact": rank == 0 or exact(3), "version": None if rec is None else rec.version}
    save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
