"""The sync's own group: the wire names its ranks without a default process group (torch only)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from bridge.engines.group import all_gather_json, close_group, open_group
from bridge.errors import SyncError
from bridge.wire.alarm import Alarm, store_of
from bridge.wire.gloo import direct_group
from bridge.wire.group import group_ranks

SECRET = b"a test's secret of 32 bytes ...."


@pytest.fixture
def no_default_group():
    if dist.is_initialized():
        pytest.skip("this process already has a default group")
    yield
    assert not dist.is_initialized()


def test_a_group_from_open_group_needs_no_default_group(no_default_group):
    pg = open_group("127.0.0.1", 0, 0, 1, secret=SECRET, timeout=10)  # port 0: the store picks a free one
    try:
        assert group_ranks(pg) == [0]
        assert all_gather_json({"rank": 0}, pg, timeout=10, what="a test") == [{"rank": 0}]
    finally:
        close_group(pg)


def test_a_group_from_open_group_is_posted_to_directly(no_default_group):
    # Outside torch.distributed's registry (dist.get_backend refuses it), still a gloo group: the
    # wire posts to its send/recv, with each peer's rank in the group.
    pg = open_group("127.0.0.1", 0, 0, 1, secret=SECRET, timeout=10)
    try:
        with pytest.raises(ValueError):
            dist.get_backend(pg)
        assert direct_group(pg) is pg
    finally:
        close_group(pg)


def test_a_group_from_open_group_has_an_alarm_until_closed(no_default_group):
    pg = open_group("127.0.0.1", 0, 0, 1, secret=SECRET, timeout=10)
    try:
        store = store_of(pg)
        assert store is not None
        alarm = Alarm(store, 0, 1)
        assert not alarm.heard()
        alarm.ring("a test")
        assert alarm.heard()
        assert not Alarm(store, 0, 1).heard()  # the next sync has a key of its own
    finally:
        close_group(pg)
    assert store_of(pg) is None


def test_an_unregistered_group_is_refused_before_any_wait(no_default_group):
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                         dist.ProcessGroupGloo(store, 0, 1))
    with pytest.raises(ValueError, match="not registered with torch.distributed.*new_group"):
        group_ranks(pg)


def test_no_group_and_no_default_group(no_default_group):
    with pytest.raises(SyncError, match="no group was given; pass group="):
        group_ranks(None)


def test_the_secret_reaches_the_workers_through_the_init_call_as_hex_and_is_never_shown():
    pytest.importorskip("vllm")
    from bridge.engines.vllm.engine import JReshardInitInfo
    from bridge.engines.vllm.trainer import ClientControl
    from bridge.engines.worker import GroupInfo

    class Client:
        def __getattr__(self, name):
            return lambda *args: self.calls.append((name, args))

        def __init__(self):
            self.calls = []

    client = Client()
    info = GroupInfo("10.0.0.1", 29600, 2, 4, 30.0, 120.0, "jreshard/3", secret=SECRET)
    ClientControl(client).connect(info)
    (method, (init_info,)), = client.calls
    assert method == "init_weight_transfer_engine"
    json.dumps(init_info)  # plain data: any control plane (HTTP included) carries it
    got = JReshardInitInfo(**init_info)
    assert got.group_info() == info and got.group_info().secret == SECRET
    for shown in (repr(info), repr(got)):
        assert SECRET.hex() not in shown and "secret" not in shown, shown
    with pytest.raises(ValueError, match="secret must be the job's secret as hex.*not hex"):
        JReshardInitInfo(**{**init_info, "secret": "not hex"}).group_info()
    with pytest.raises(ValueError, match="secret must hold at least 16 bytes"):
        JReshardInitInfo(**{**init_info, "secret": ""}).group_info()  # a trainer that sends none
