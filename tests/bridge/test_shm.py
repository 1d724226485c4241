"""Shared memory between the processes of one host (``bridge.wire.shm``) and the choice of route per pair
(``bridge.wire.route``): segments are sealed, nameless and bounded, a sender writes only where a receiver
credited it, and every pair's route is the same on both of its ranks."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

import bridge
from bridge.errors import SyncError
from bridge.wire import shm
from bridge.wire.route import Mode, Place, routes
from tests.bridge.queue_transport import run_ranks
from tests.bridge.test_transport import PLAN, Rank, _check

A, B = Place(host=7, pid=100, device="cpu"), Place(host=7, pid=200, device="cpu")


def _other_process_view(seg: shm.Segment) -> int:
    """An fd on ``seg`` opened as a sender in another process opens it (through /proc)."""
    return os.open(f"/proc/{os.getpid()}/fd/{seg.fd}", os.O_RDWR)


def test_a_segment_is_sealed_nameless_and_bounded():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    t = shm.staging(4096)
    fd = _other_process_view(shm.find(t)[0])
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 20)  # no sender can grow the receiver's memory
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 16)  # nor shrink it under the receiver
        with pytest.raises(ValueError):
            mmap.mmap(fd, 1 << 20, flags=mmap.MAP_SHARED)  # nor map past its end
        assert os.fstat(fd).st_size == shm.HEAD + 4096
    finally:
        os.close(fd)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after == before  # nothing named that another job could open or that could leak


def test_find_locates_views_and_nothing_else():
    t = shm.staging(1000)
    seg = shm.find(t)[0]
    assert seg.ptr == t.data_ptr() and seg.nbytes == 1000
    assert shm.find(t[10:20]) == (seg, 10)
    assert shm.find(t[990:]) == (seg, 990)
    assert shm.find(torch.empty(10, dtype=torch.uint8)) is None


def test_a_segment_lives_while_any_tensor_on_its_memory_does():
    # A view or a .data (what a Receiver keeps of the tensors it is given) keeps the segment registered
    # after the tensor staging returned is gone; a worker's staging then still takes bytes by shared memory.
    t = shm.staging(100)
    seg = shm.find(t)[0]
    kept = t.data[:48].view(torch.int32)
    del t
    gc.collect()
    assert shm.find(kept) == (seg, 0)
    staged = shm.tensors({"w": ((4, 8), torch.float32)})["w"]
    data = staged.data
    del staged
    gc.collect()
    assert shm.find(data) is not None
    del kept, data
    gc.collect()
    assert seg.ptr not in shm._SEGMENTS


def test_a_segment_goes_with_its_tensor():
    t = shm.staging(100)
    fd, ptr = shm.find(t)[0].fd, t.data_ptr()
    target = os.readlink(f"/proc/self/fd/{fd}")
    assert "memfd:jreshard-staging" in target
    del t
    gc.collect()
    assert ptr not in shm._SEGMENTS
    assert not os.path.exists(f"/proc/self/fd/{fd}") or os.readlink(f"/proc/self/fd/{fd}") != target


def test_a_sender_writes_only_inside_the_credited_region():
    t = shm.staging(256)
    seg = shm.find(t)[0]
    maps = shm._Maps()
    inside = maps.region(1, os.getpid(), shm._Slot(seg.fd, seg.token, 64, 128))
    inside.fill_(7)
    assert int(t[64:192].sum()) == 7 * 128 and int(t[:64].sum()) == 0 and int(t[192:].sum()) == 0
    for offset, nbytes in ((200, 128), (-8, 16), (256, 1)):
        with pytest.raises(SyncError, match="credited bytes"):
            maps.region(1, os.getpid(), shm._Slot(seg.fd, seg.token, offset, nbytes))
    with pytest.raises(SyncError, match="wrong token"):
        maps.region(1, os.getpid(), shm._Slot(seg.fd, seg.token ^ 1, 0, 8))
    with pytest.raises(SyncError, match="cannot map the staging of rank 1"):
        maps.region(1, os.getpid(), shm._Slot(987654, 0, 0, 8))


ROUTE_CASES = {
    # name: (modes of ranks 0 and 1, place of rank 1, route)
    "auto-same-host": ((Mode.AUTO, Mode.AUTO), B, "shm"),
    "auto-other-host": ((Mode.AUTO, Mode.AUTO), B._replace(host=8), "gloo"),
    "auto-cuda": ((Mode.AUTO, Mode.AUTO), B._replace(device="cuda"), "gloo"),
    "shm-and-auto": ((Mode.SHM, Mode.AUTO), B, "shm"),
    "gloo-wins": ((Mode.AUTO, Mode.GLOO), B, "gloo"),
    "custom-is-gloo": ((Mode.CUSTOM, Mode.AUTO), B, "gloo"),
}


@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_both_ranks_of_a_pair_choose_the_same_route(case):
    (m0, m1), b, want = ROUTE_CASES[case]
    places = {0: A, 1: b}
    got0 = routes({0: m0, 1: m1}, places, pairs=[(0, 1)], rank=0)
    got1 = routes({0: m0, 1: m1}, places, pairs=[(0, 1)], rank=1)
    assert got0 == {1: want} and got1 == {0: want}


def test_shm_across_hosts_is_refused_on_every_rank():
    places = {0: A, 1: B, 2: B._replace(host=9)}
    modes = {0: Mode.SHM, 1: Mode.SHM, 2: Mode.SHM}
    for rank in (0, 1, 2):  # rank 1 is in no bad pair, and raises too: no rank waits for the others
        with pytest.raises(SyncError, match="transport='shm' but ranks 0 and 2 are on two hosts"):
            routes(modes, places, pairs=[(0, 1), (0, 2)], rank=rank)


@pytest.mark.parametrize("name", ["cuda_ipc", "nccl"])
def test_transports_not_built_say_so(name):
    with pytest.raises(ValueError, match=f"transport='{name}' is not built yet"):
        Mode.parse(name)


def test_receives_outside_shared_memory_travel_over_gloo_and_are_counted_so():
    """atomic=False receives straight into the params (not shared): those pieces go over gloo, the rest
    (bucket buffers) through shared memory, and the statistics count each as placed."""

    def rank_main(rank, group):
        me = Rank(rank, group, "shm", None, atomic=False)
        out = me.sync(1)
        stats = (me.rec.last_stats if me.rec is not None else None)
        return out, stats

    for r, (out, stats) in enumerate(_check(run_ranks(3, rank_main))):
        assert out == {"ok": True, "exact": True}, (r, out)
        if stats is not None:
            moved = dict(stats.transport_bytes)
            # norm.weight (48 bfloat16) lands straight in its param; linear.weight's rows in bucket buffers
            assert moved["gloo"] == 96 and moved["shm"] == stats.received_bytes - 96, moved


def test_the_default_receiver_lands_in_shared_memory():
    """The default atomic Receiver's held bytes are a segment: same-host trainers write into them."""
    params = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16) for p in PLAN.param_map.for_rank(1)}
    rec = bridge.Receiver(PLAN, params, rank=1)
    side = rec.strategy.begin(torch.device("cpu"), shm.staging)
    m = next(m for m in PLAN.messages if m.dst == 1)
    bufs = side.recv(m, torch.empty(0, dtype=torch.uint8))
    assert bufs and all(shm.find(b) is not None for b in bufs)
