"""A torch-only pair of processes for the wire-protocol test (no jax): rank 0 sends, rank 1 receives.

Rank 0 drives ``bridge.wire.session.SyncSession`` directly with a NumPy-backed pack (standing in for the
JAX Sender), so the protocol's failure handling is tested in seconds. Phases:

  ok       a sync succeeds, bit-exact, committed by swapping storage (swap=True), with no vote
           but the final ack (no digests: the buckets fit between two votes)
  FAULTS   on the same group, no digests, each fault in bucket 2 of several, announced only in the
           final ack: the sender's pack raises, gives a segment 8 bytes short, or the receiver's
           unpack raises; every rank raises SyncError naming it, the weights unchanged
  again    on the same group, a sync succeeds again, bit-exact
  stall    the sender joins, then stalls past the receiver's timeout: the receiver fails in time,
           its weights and version unchanged
  inplace  after recreating the group, an in-place (atomic=False) sync succeeds

With ``--alarm`` three processes run one sync instead: rank 0 sends to receivers 1 and 2 (rank 2's
messages come in later buckets). While packing bucket 2 the sender kills rank 1, then gives up (its
operation with the dead rank fails) before it sends rank 2 anything, and stays alive. Rank 2 never had
an operation with rank 1, and rank 0's connections stay open, so gloo tells rank 2 nothing: only the
sync's alarm does (``bridge.wire.alarm``), long before its deadline (``ALARM_TIMEOUT``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import bridge  # noqa: E402
from bridge.wire.bucket import Side  # noqa: E402
from bridge.wire.handshake import Role  # noqa: E402
from bridge.wire.session import SyncSession  # noqa: E402
from jreshard import Layout  # noqa: E402

STALL_TIMEOUT = 2.0
FAULTS = ("pack_error", "truncate", "unpack_error")  # each in bucket 2 (index 1)
ALARM_TIMEOUT = 8.0


def make_plan(receivers: tuple[int, ...] = (1,)) -> tuple[bridge.BridgePlan, dict[str, np.ndarray]]:
    mesh = bridge.trainer_mesh((2,), "fsdp", [0], 2)
    src = bridge.Source({"w": Layout((64, 48), mesh, ("fsdp",), "float32"),
                         "v": Layout((48,), mesh, (), "float32")})
    rules = [bridge.Rule("w", "linear.weight", transpose=True, dim=None), bridge.Rule("v", "norm.weight")]
    plan = bridge.BridgePlan(src, bridge.tp_param_map(src, rules, list(receivers), dtype="bfloat16"), bucket_bytes=2048)
    rng = np.random.default_rng(0)
    return plan, {"w": rng.standard_normal((64, 48), dtype=np.float32), "v": rng.standard_normal(48, dtype=np.float32)}


def sender(plan, arrays, stall: float, fault: str = ""):
    def pack(m, buf):
        if stall:
            time.sleep(stall)
        if fault == "pack_error" and m.bucket == 1:
            raise RuntimeError("injected packing failure")
        for i, off in m.pieces:
            t = plan.moves[i]
            _, perm = plan.dst_region(t)
            piece = torch.from_numpy(arrays[t.leaf][t.box]).permute(perm)
            buf[off:off + t.nbytes].view(torch.bfloat16).view(piece.shape).copy_(piece)
        segs = [buf[seg.start:seg.stop] for seg in plan.segments(m)]  # everything packed
        return [segs[0][:-8], *segs[1:]] if fault == "truncate" and m.bucket == 1 else segs

    return pack


def send(plan, pack, *, version: int, timeout: float, ready_timeout: float = 30, group=None, checksum: bool = False,
         transport=None, rank: int = 0) -> SyncSession:
    """One sync of ``rank`` as a sender with ``pack``; returns the session (its ``stats``)."""
    session = SyncSession(plan, rank, group, Side(Role.SENDER, pack=pack), version=version, timeout=timeout,
                          ready_timeout=ready_timeout, checksum=checksum, transport=transport)
    session.run()
    return session


def alarm_main(rank: int, port: int, out: str) -> None:
    """Rank 0 kills rank 1 while packing bucket 2; rank 2 hears of it through the alarm."""
    plan, arrays = make_plan((1, 2))
    if rank == 1:
        with open(os.path.join(out, "victim.pid"), "w") as f:
            f.write(str(os.getpid()))
    bridge.init_group(rank, 3, port=port, timeout=30)
    events: dict = {"buckets": plan.num_buckets,  # the first bucket with a message to rank 2
                    "first_to_2": min(b for b in range(plan.num_buckets) if 2 in [m.dst for m in plan.sends(0, b)])}
    t0 = time.perf_counter()
    try:
        if rank == 0:
            pack = sender(plan, arrays, 0.0)

            def killing(m, buf):
                if m.bucket == 1 and "killed" not in events:
                    with open(os.path.join(out, "victim.pid")) as f:
                        os.kill(int(f.read()), 9)
                    events["killed"] = time.time()
                    time.sleep(0.5)  # the dead rank's connections are closed by now
                return pack(m, buf)

            send(plan, killing, version=1, timeout=ALARM_TIMEOUT)
        else:
            params = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16) for p in plan.param_map.for_rank(rank)}
            bridge.Receiver(plan, params, rank=rank, timeout=ALARM_TIMEOUT).sync()
        events["ok"] = True
    except bridge.SyncError as e:
        events.update(ok=False, message=str(e), raised=time.time(), seconds=time.perf_counter() - t0,
                      unchanged=rank == 0 or all(not t.any() for t in params.values()))
    with open(os.path.join(out, f"alarm{rank}.json"), "w") as f:
        json.dump(events, f)
    # Rank 0 stays alive, its connections open, until rank 2 is done (a trainer that gave up goes on).
    while rank == 0 and time.perf_counter() - t0 < ALARM_TIMEOUT + 5 and not os.path.exists(
            os.path.join(out, "alarm2.json")):
        time.sleep(0.05)
    os._exit(0)  # the group is broken: nothing to shut down cleanly


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--port2", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--alarm", action="store_true")
    args = ap.parse_args()
    if args.alarm:
        return alarm_main(args.rank, args.port, args.out)
    plan, arrays = make_plan()
    events: dict = {"buckets": plan.num_buckets}
    bridge.init_group(args.rank, 2, port=args.port, timeout=30)
    if args.rank == 0:
        gathers = []
        real_gather = dist.all_gather

        def counted(*a, **k):
            gathers[-1] += 1
            return real_gather(*a, **k)

        dist.all_gather = counted
        phases = [("ok", 1, 0.0), *((f, 2, 0.0) for f in FAULTS), ("again", 2, 0.0), ("stall", 3, STALL_TIMEOUT + 3)]
        for phase, version, stall in phases:
            t0 = time.perf_counter()
            gathers.append(0)
            try:
                send(plan, sender(plan, arrays, stall, phase), version=version, timeout=STALL_TIMEOUT + 8)
                events[phase] = {"ok": True}
            except bridge.SyncError as e:
                events[phase] = {"ok": False, "error": type(e).__name__, "message": str(e),
                                 "seconds": time.perf_counter() - t0}
            events[phase]["gathers"] = gathers[-1]
        dist.all_gather = real_gather
        dist.destroy_process_group()
        bridge.init_group(0, 2, port=args.port2, timeout=30)
        send(plan, sender(plan, {k: v * 2 for k, v in arrays.items()}, 0.0), version=3, timeout=10)
        events["inplace"] = {"ok": True}
    else:
        params = {p.name: torch.full(p.shape, 7.0, dtype=torch.bfloat16) for p in plan.param_map.for_rank(1)}
        rec = bridge.Receiver(plan, params, rank=1, timeout=STALL_TIMEOUT, swap=True)
        ptrs = {n: t.data_ptr() for n, t in params.items()}
        events["ok"] = {"version": rec.sync()}
        # swap=True: the same tensor objects now hold the received storage (no commit copy)
        events["ok"]["swapped"] = all(t.data_ptr() != ptrs[n] for n, t in params.items())
        want = plan.reference(arrays)[1]
        events["ok"]["exact"] = all(torch.equal(params[n].float(), torch.from_numpy(want[n].astype(np.float32)))
                                    for n in params)
        real_unpack = rec.strategy.unpack  # a SwapCommit: it unpacks as buckets arrive

        def failing(m, buf):
            if m.bucket == 1:
                raise RuntimeError("injected unpacking failure")
            real_unpack(m, buf)

        for phase in (*FAULTS, "stall"):
            before = {k: v.clone() for k, v in params.items()}
            rec.strategy.unpack = failing if phase == "unpack_error" else real_unpack
            t0 = time.perf_counter()
            try:
                rec.sync()
                events[phase] = {"ok": True}
            except bridge.SyncError as e:
                events[phase] = {"ok": False, "error": type(e).__name__, "message": str(e),
                                 "seconds": time.perf_counter() - t0, "version": rec.version,
                                 "unchanged": all(torch.equal(before[k], params[k]) for k in params)}
            if phase == FAULTS[-1]:
                rec.strategy.unpack = real_unpack
                events["again"] = {"version": rec.sync(), "exact": all(
                    torch.equal(params[n].float(), torch.from_numpy(want[n].astype(np.float32))) for n in params)}
        dist.destroy_process_group()
        bridge.init_group(1, 2, port=args.port2, timeout=30)
        inplace = bridge.Receiver(plan, params, rank=1, atomic=False, timeout=10, progress=True)
        events["inplace"] = {"version": inplace.sync(), "consistent": inplace.consistent}
        want = plan.reference({k: v * 2 for k, v in arrays.items()})[1]
        events["inplace"]["exact"] = all(
            torch.equal(params[n].float(), torch.from_numpy(want[n].astype(np.float32))) for n in params)
        events["jax_imported"] = "jax" in sys.modules
    with open(os.path.join(args.out, f"wire{args.rank}.json"), "w") as f:
        json.dump(events, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
