"""One process of the fault-injection tests (torch only): rank 0 sends, ranks 1 and 2 receive (TP2).

Run by tests/bridge/test_faults.py: one launch runs a list of faults in sequence (``--faults a,b,...``).
Every rank syncs version 1 (must succeed), then, for fault ``k``, version ``2k+2`` with the fault
injected and version ``2k+3``, which must succeed again: on the same group after a fault the votes
catch, on a rebuilt group (the next port of ``--ports``) after a death or a stall. A killed rank is
replaced by a standby process started with the others (``--standby k``): it waits until the victim
of fault ``k`` died, joins the rebuilt group and goes on with the faults after ``k``, so start-ups
overlap. Results go to ``fault{rank}.json`` (``fault{rank}_standby{k}.json`` for a standby): per
fault the error, the seconds from the start of the sync call to the error and the time of the
error; a victim writes the time of its death to ``dead{k}`` just before it dies.

Every sync runs over ``--transport`` (``gloo``, or ``shm``: shared memory, bridge.wire.shm). Faults are
injected by ``_fault`` below, for the faulty sync only: it wraps the sender's pack, the transport's
``post`` (a fault on the wire or a death while posting: ``Faulty`` wraps the gloo transport, and with shm
``ShmTransport.post`` is wrapped for that sync), or ``torch.distributed.all_gather`` (the control
traffic: the handshake, the votes). Names:

  flip               rank 0 flips a byte of a packed message after its digest was taken (bucket 2)
  wire_{damage}      in transit, below the sender's own checks (the bytes of bucket 2 as they go to the
                     transport, after packing and digests): ``truncate`` / ``extend`` the first message
                     8 bytes, ``oversize`` it by 1 MiB, ``reorder`` (swap) the first two messages to one
                     peer; with checksums on, or off where the name ends in ``_off``
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
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import bridge  # noqa: E402
from bridge.wire import shm  # noqa: E402
from bridge.wire.gloo import GlooTransport  # noqa: E402
from bridge.wire.transport import Kind, Op  # noqa: E402
from bridge.wire.vote import vote_every  # noqa: E402
from jreshard import Layout  # noqa: E402
from tests.bridge.wire_worker import send, sender as wire_sender  # noqa: E402

TIMEOUT = 4.0  # the deadline of every sync after its handshake
STALL = TIMEOUT + 1.5  # a stalled rank sleeps past every other rank's deadline
WORLD = 3
VICTIMS = {"sender": 0, "receiver": 2}


def make_plan() -> tuple[bridge.BridgePlan, dict[str, np.ndarray]]:
    mesh = bridge.trainer_mesh((2,), "fsdp", [0], 2)
    src = bridge.Source({"w": Layout((64, 48), mesh, ("fsdp",), "float32"),
                         "v": Layout((48,), mesh, (), "float32")})
    rules = [bridge.Rule("w", "linear.weight", transpose=True, dim=0), bridge.Rule("v", "norm.weight")]
    plan = bridge.BridgePlan(src, bridge.tp_param_map(src, rules, [1, 2], dtype="bfloat16"), bucket_bytes=1024)
    rng = np.random.default_rng(0)
    return plan, {"w": rng.standard_normal((64, 48), dtype=np.float32), "v": rng.standard_normal(48, dtype=np.float32)}


def victim(fault: str) -> int | None:
    """The rank that ``fault`` kills, if any."""
    return VICTIMS[fault.split("_")[1]] if fault.startswith("kill_") else None


def needs_rebuild(fault: str) -> bool:
    return fault.startswith(("kill_", "stall_"))


def checksum(fault: str) -> bool:
    """Whether the sync of ``fault`` runs with checksums (the default) or without."""
    return not fault.endswith("_off")


def _damage(fault: str, ops: list[Op]) -> list[Op]:
    """``ops`` as an in-transit ``wire_*`` fault leaves them (the first send, or the first two to one peer)."""
    first = next(k for k, op in enumerate(ops) if op.kind == Kind.SEND)
    op = ops[first]
    data = op.buf.reshape(-1).view(torch.uint8)
    damage = fault.removeprefix("wire_").removesuffix("_off")
    if damage == "truncate":
        ops[first] = Op(op.kind, op.peer, data[:-8])
    elif damage in ("extend", "oversize"):
        ops[first] = Op(op.kind, op.peer, torch.cat([data, torch.zeros(8 if damage == "extend" else 1 << 20,
                                                                       dtype=torch.uint8)]))
    elif damage == "reorder":
        second = next(k for k in range(first + 1, len(ops)) if ops[k].kind == Kind.SEND and ops[k].peer == op.peer)
        ops[first], ops[second] = ops[second], ops[first]
    return ops


def stalled(fault: str) -> int | None:
    """The rank that ``fault`` stalls, if any."""
    return {"stall_sender": 0, "stall_ack": 2}.get(fault)


class Faulty(GlooTransport):
    """The gloo transport, with ``on_post(n, ops)`` called before its ``n``-th post (1-based)."""

    def __init__(self, on_post) -> None:
        super().__init__(None)
        self.on_post, self.posts = on_post, 0

    def post(self, ops):
        self.posts += 1
        return super().post(self.on_post(self.posts, list(ops)))


def _fault(fault: str, rank: int, plan: bridge.BridgePlan, pack, dead: Path, kind: str):
    """Installs ``fault`` for this process's next sync over transport ``kind``; returns the (possibly wrapped)
    pack, the transport and an undo."""
    real_gather = dist.all_gather
    calls = {"gather": 0}
    every = vote_every(plan)  # the handshake, a vote every ``every`` buckets, then the final ack
    final_gather = 2 + sum(b % every == 0 for b in range(1, plan.num_buckets))
    mine = victim(fault) == rank

    def die() -> None:
        dead.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def on_post(n, ops):
        if n == 2:
            if fault == "flip" and rank == 0:
                t = next(op.buf for op in ops if op.kind == Kind.SEND)
                t[0] = t[0] ^ 0xFF
            if fault.startswith("wire_") and rank == 0:
                ops = _damage(fault, ops)
            if mine and fault.endswith("_mid"):
                die()
        return ops

    def gather(*args, **kwargs):
        calls["gather"] += 1
        n = calls["gather"]
        if mine and ((n == 1 and fault.endswith("_setup")) or (n == final_gather and fault.endswith("_ack"))):
            die()
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

    dist.all_gather = gather
    real_post = shm.ShmTransport.post
    posts = {"n": 0}

    def post(self, ops):
        posts["n"] += 1
        return real_post(self, on_post(posts["n"], list(ops)))

    if kind == "shm":
        shm.ShmTransport.post = post  # type: ignore[method-assign]

    def undo():
        dist.all_gather = real_gather
        shm.ShmTransport.post = real_post  # type: ignore[method-assign]

    return wrapped, (Faulty(on_post) if kind == "gloo" else "shm"), undo


def mapped_dead() -> list[int]:
    """The ended processes whose shared memory this one still maps (none: their memory is freed)."""
    return sorted(p for p in shm._MAPS.pids() if not shm._alive(p))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--ports", required=True, help="comma-separated: the first group's, then one per rebuild")
    ap.add_argument("--faults", required=True, help="comma-separated fault names, run in this order")
    ap.add_argument("--out", required=True)
    ap.add_argument("--standby", type=int, default=-1, help="replace the victim of fault k once it died")
    ap.add_argument("--transport", choices=("gloo", "shm"), default="gloo")
    args = ap.parse_args()
    plan, arrays = make_plan()
    rank, faults, out = args.rank, args.faults.split(","), Path(args.out)
    ports = [int(p) for p in args.ports.split(",")]
    events: dict = {"faults": {}, "recovery": {}}
    name = out / f"fault{rank}{f'_standby{args.standby}' if args.standby >= 0 else ''}.json"

    def save():
        name.write_text(json.dumps(events))

    params = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16) for p in plan.param_map.for_rank(rank)}
    rec = None if rank == 0 else bridge.Receiver(plan, params, rank=rank, timeout=TIMEOUT, ready_timeout=60)

    def sync(version: int, pack=None, transport: object = args.transport, digests: bool = True) -> None:
        if rank == 0:
            scaled = {k: a * version for k, a in arrays.items()}
            send(plan, pack or wire_sender(plan, scaled, 0.0), version=version, timeout=TIMEOUT, ready_timeout=60,
                 checksum=digests, transport=transport)
        else:
            assert rec is not None
            rec.sync(transport=transport)

    def exact(version: int) -> bool:
        want = plan.reference({k: a * version for k, a in arrays.items()})[rank]
        return all(torch.equal(params[n].float(), torch.from_numpy(want[n].astype(np.float32))) for n in params)

    def group(k: int) -> int:
        """The port of the group that the recovery sync after fault ``k`` runs on."""
        return ports[sum(needs_rebuild(f) for f in faults[:k + 1])]

    if args.standby >= 0:  # ready before the victim dies; joins the group rebuilt after its death
        deadline = time.monotonic() + 240
        while not (out / f"dead{args.standby}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        bridge.rebuild_group(rank, WORLD, port=group(args.standby), timeout=60)
        start = args.standby
    else:
        bridge.init_group(rank, WORLD, port=ports[0], timeout=60)
        sync(1)
        events["first"] = {"exact": rank == 0 or exact(1)}
        save()
        start = -1
    for k, fault in enumerate(faults):
        if k < start:
            continue
        if k > start:
            v = 2 * k + 2
            scaled = {key: a * v for key, a in arrays.items()}
            before = {key: t.clone() for key, t in params.items()}
            pack, transport, undo = _fault(fault, rank, plan, wire_sender(plan, scaled, 0.0), out / f"dead{k}",
                                           args.transport)
            # Every rank starts its sync together, so the time the test bounds is this sync's and not another
            # rank's lateness to the handshake (which the sync's deadline does not count).
            dist.barrier()
            t0 = time.perf_counter()
            try:
                sync(v, pack, transport, checksum(fault))
                events["faults"][fault] = {"ok": True}
            except bridge.SyncError as e:
                events["faults"][fault] = {
                    "ok": False, "error": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - t0,
                    "at": time.time(), "unchanged": all(torch.equal(before[key], params[key]) for key in params),
                    "version": None if rec is None else rec.version}
            undo()
            save()
            if needs_rebuild(fault):
                bridge.rebuild_group(rank, WORLD, port=group(k), timeout=60)
        sync(2 * k + 3)
        events["recovery"][fault] = {"exact": rank == 0 or exact(2 * k + 3),
                                     "version": None if rec is None else rec.version, "mapped_dead": mapped_dead(),
                                     "transport": None if rec is None else dict(rec.last_stats.transport_bytes)}
        save()
    dist.destroy_process_group()
    # Every result is written. A rank 0 that hosted the stores of groups whose peers were killed aborts, now
    # and then, in torch's own teardown at interpreter exit ("terminate called without an active exception",
    # no Python frame: about one launch in eight here; docs/reliability.md), so this process ends here.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
