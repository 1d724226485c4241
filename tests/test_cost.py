"""Cost model arithmetic on toy topologies; hierarchical plans checked against the oracle."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import itertools

import numpy as np
import pytest

import jreshard
from jreshard import Layout, Mesh
from jreshard.core import reference
from jreshard.fleet import cost, layer
from jreshard.fleet.cost import Topology, Traffic

# 2 GPUs per domain, NVLink 100 GB/s, network 10 GB/s per direction.
TOPO = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=0)


def test_alpha_beta_arithmetic():
    topo = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=1)
    t = Traffic.zeros(0)
    t.add_edges(np.array([0, 0, 3]), np.array([1, 2, 3]), np.array([1e9, 1e9, 5e9]), np.array([1, 1, 1]), topo)
    assert t.nvl_out[0] == 1e9 and t.net_out[0] == 1e9 and t.net_in[2] == 1e9 and t.nvl_in[1] == 1e9
    # The local copy on device 3 loads no link and sends no message (nor copies: copies=False).
    assert t.net_out[3] == t.net_in[3] == t.nvl_out[3] == t.msg_out[3] == t.msg_in[3] == t.copied.sum() == 0
    p = cost.predict(t, topo)
    assert p.seconds == pytest.approx(1e9 / 10e9 + 2 * 1e-6)  # device 0: network send plus two messages
    assert p.bottleneck == "device 0 network send"
    assert (p.network_bytes, p.nvlink_bytes, p.max_network_in_bytes) == (int(1e9), int(1e9), int(1e9))
    both = p + p
    assert both.seconds == pytest.approx(2 * p.seconds) and both.stages == (p.seconds, p.seconds)


def test_copies_are_charged_at_copy_GBps_after_the_links():
    t = Traffic.zeros(0)
    t.add_edges(np.array([0, 0, 3]), np.array([1, 2, 3]), np.array([1e9, 1e9, 5e9]), np.array([1, 1, 1]), TOPO,
                copies=True)
    assert t.copied.tolist() == [2e9, 1e9, 1e9, 5e9]  # packed (sent), unpacked (received), or moved to itself
    free = cost.predict(t, TOPO)
    assert free.seconds == pytest.approx(0.1)  # copies uncharged (copy_GBps=None): device 0's network send
    slow = cost.predict(t, dataclasses.replace(TOPO, copy_GBps=20))
    assert slow.seconds == pytest.approx(5e9 / 20e9)  # device 3's local copy (device 0: 0.1 + 2e9 / 20e9)
    fast = cost.predict(t, dataclasses.replace(TOPO, copy_GBps=1000))
    assert fast.seconds == pytest.approx(0.1 + 2e9 / 1000e9)  # device 0: its link, then packing its 2 GB
    # Through a plan: device 0 packs 1000 bytes, devices 2 and 3 unpack 500 each.
    src = Layout((1000,), Mesh([0], "x"), (), dtype="uint8")
    dst = Layout((1000,), Mesh([2, 3], "tp"), ("tp",), dtype="uint8")
    tr = cost.plan_traffic(jreshard.plan(src, dst), TOPO)
    assert tr.copied.tolist() == [1000, 0, 500, 500]
    # A device keeping its own shard copies it: replicated on [0, 1] -> sharded on [0, 1].
    keep = cost.plan_traffic(jreshard.plan(Layout((8,), Mesh([0, 1], "x"), (), dtype="uint8"),
                                           Layout((8,), Mesh([0, 1], "x"), ("x",), dtype="uint8")), TOPO)
    assert keep.copied.tolist() == [4, 4] and keep.nvl_out.sum() == keep.net_out.sum() == 0
    # Gather-then-broadcast writes into the tensors (one collective each): no copies charged.
    src2 = {"w": Layout((1000,), Mesh([0, 1], "tp"), ("tp",), dtype="uint8")}
    dst2 = {"w": Layout((1000,), Mesh([2, 3], "dp"), (), dtype="uint8")}
    for baseline in (cost.gather_broadcast, cost.pipelined_tree):
        assert baseline(src2, dst2, dataclasses.replace(TOPO, copy_GBps=1e-3)) == baseline(src2, dst2, TOPO)


def test_plan_prediction_coalesces_messages_per_pair():
    src = Layout((1000,), Mesh([0], "x"), (), dtype="uint8")
    dst = Layout((1000,), Mesh([2, 3], "tp"), ("tp",), dtype="uint8")
    topo = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=1, bucket_bytes=200)
    tr = cost.plan_traffic(jreshard.plan(src, dst), topo)
    assert tr.msg_out[0] == 6  # two receivers, 500 bytes each in 200-byte buckets
    assert cost.predict(tr, topo).seconds == pytest.approx(1000 / 10e9 + 6e-6)


def test_gather_broadcast_through_one_rank_in_series():
    # Two tensors on two stages: both gather into device 0 (one rank), then broadcast in series.
    src = {"a": Layout((1000,), Mesh([0, 1], "tp"), ("tp",), dtype="uint8"),
           "b": Layout((1000,), Mesh([2], "x"), (), dtype="uint8")}
    dst = {k: Layout((1000,), Mesh([4, 5, 6, 7], "dp"), (), dtype="uint8") for k in src}
    topo = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=1, bucket_bytes=1000)
    p = cost.gather_broadcast(src, dst, topo, overlap=False)
    gather = 500 / 100e9 + 1000 / 10e9 + 2e-6  # a: 500 B over NVLink; b: 1000 B over the network; two collectives
    bcast = 2 * 1000 / 10e9 + (2 + 4) * 1e-6  # both tensors at the NIC rate, a launch per bucket, the chain's depth
    assert p.stages == pytest.approx((gather, bcast)) and p.seconds == pytest.approx(gather + bcast)
    assert p.network_bytes == 1000 + 2 * 2 * 1000  # the gather of b, and each tensor into two other domains
    assert cost.gather_broadcast(src, dst, topo).seconds == pytest.approx(max(gather, bcast) + min(gather, bcast) / 2)


def test_pipelined_tree_by_hand():
    src = {"w": Layout((1000,), Mesh([0, 1], "tp"), ("tp",), dtype="uint8")}
    dst = {"w": Layout((1000,), Mesh([2, 3, 4, 5], "dp"), (), dtype="uint8")}
    p = cost.pipelined_tree(src, dst, TOPO)
    # Gather: device 1 sends 500 B to root 0 over NVLink. Broadcast chain 0 -> 2 -> 3 -> 4 -> 5:
    # every network hop carries 1000 B at 10 GB/s, the NVLink hops are faster.
    assert p.stages == pytest.approx((500 / 100e9, 1000 / 10e9))
    assert p.network_bytes == 500 * 0 + 2000


def test_flat_direct_versus_balanced():
    src = {"w": Layout((1000,), Mesh([0, 1], "dp"), (), dtype="uint8")}
    dst = {"w": Layout((1000,), Mesh([2, 3, 4, 5], "tp"), ("tp",), dtype="uint8")}
    assert cost.flat_direct(src, dst, TOPO).seconds == pytest.approx(1000 / 10e9)  # all from device 0
    assert cost.predict_plan(jreshard.plan(src, dst), TOPO).seconds == pytest.approx(500 / 10e9)


def _full(shape):
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


CASES = {
    # dp=4 x tp=2 fleet, 4 GPUs per domain: two replicas per domain.
    "tp2dp4": (Layout((8, 6), Mesh([0, 1], "fsdp"), ("fsdp",), "float32"),
               Layout((8, 6), Mesh(np.arange(8, 16).reshape(4, 2), ("dp", "tp")), (None, "tp"), "float32")),
    "uneven": (Layout((7, 5), Mesh([0, 1, 2], "fsdp"), ("fsdp",), "float32"),
               Layout((7, 5), Mesh(np.arange(8, 16).reshape(4, 2), ("dp", "tp")), ("tp",), "float32")),
    "replicated": (Layout((5,), Mesh([0, 1], "x"), ("x",), "float32"),
                   Layout((5,), Mesh(np.arange(8, 16).reshape(4, 2), ("dp", "tp")), (), "float32")),
    "scalar": (Layout((), Mesh([0], "x"), (), "float32"),
               Layout((), Mesh(np.arange(8, 16).reshape(4, 2), ("dp", "tp")), (), "float32")),
    "spanning": (Layout((8, 8), Mesh([0], "x"), (), "float32"),  # tp=8 spans two domains: direct
                 Layout((8, 8), Mesh(np.arange(8, 24).reshape(2, 8), ("dp", "tp")), ("tp",), "float32")),
    # tp outer, dp inner: each replica is devices {8+r, 12+r}, across both domains: direct.
    "dp-not-outer": (Layout((6, 4), Mesh([0, 1], "fsdp"), ("fsdp",), "float32"),
                     Layout((6, 4), Mesh(np.arange(8, 16).reshape(2, 4), ("tp", "dp")), ("tp",), "float32")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hierarchical_plan_is_exact(case):
    src, dst = CASES[case]
    topo = Topology(gpus_per_domain=4, nvlink_GBps=100, network_GBps=10, latency_us=0)
    tsp = cost.hierarchical_plan({"w": src}, {"w": dst}, topo)
    full = _full(src.shape)
    got: dict[int, np.ndarray] = {}
    for name, tp1 in tsp.stage1.items():
        tp1.check()
        out1 = reference.execute(tp1, reference.shard(full, src))
        if tsp.stage2 is not None and name in tsp.stage2.tensors:
            tp2 = tsp.stage2[name]
            tp2.check()
            assert (topo.domain(tp2.move_src) == topo.domain(tp2.move_dst)).all()  # fan-out stays inside
            out1 = reference.execute(tp2, out1)
        got.update(out1)
    assert sorted(got) == sorted(dst.mesh.device_ids)
    for device, box in dst.shards().items():
        np.testing.assert_array_equal(got[device], full[box], err_msg=f"{case} device {device}")
    direct = jreshard.plan(src, dst).stats().network_bytes
    s1 = tsp.stage1.stats().network_bytes
    if case in ("spanning", "dp-not-outer"):
        assert tsp.stage2 is None and s1 == direct
    else:
        # Each byte enters each of the two domains once instead of once per replica.
        assert s1 * (dst.replication // 2) == direct


def test_compare_decides():
    src = {"w": Layout((4096, 64), Mesh([0, 1], "fsdp"), ("fsdp",), "float32")}
    dst = {"w": Layout((4096, 64), Mesh(np.arange(8, 16).reshape(4, 2), ("dp", "tp")), ("tp",), "float32")}
    slow_net = Topology(gpus_per_domain=4, nvlink_GBps=900, network_GBps=10, latency_us=10)
    c = cost.compare(src, dst, slow_net)
    assert c.delivery == "hierarchical" and c.hierarchical.seconds < c.direct.seconds
    assert c.seconds()["jreshard"] == c.hierarchical.seconds
    # One GPU per domain: no two replicas share a domain, so delivery is direct.
    c1 = cost.compare(src, dst, Topology(gpus_per_domain=1, nvlink_GBps=900, network_GBps=10, latency_us=10))
    assert c1.delivery == "direct" and c1.hierarchical is None
    assert cost.compare(src, dst, slow_net, hierarchical="never").delivery == "direct"
    # NVLink slower than the network: the fan-out costs more than it saves.
    odd = Topology(gpus_per_domain=4, nvlink_GBps=1, network_GBps=100, latency_us=0)
    assert cost.compare(src, dst, odd).delivery == "direct"
    assert cost.compare(src, dst, odd, hierarchical="always").delivery == "hierarchical"


def test_overlapped_stages_take_the_longer_one_plus_the_drain():
    # Device 0 sends 16 MiB into domain 1 (devices 2, 3: two replicas); each then forwards its 8 MiB half.
    src = {"w": Layout((16 << 20,), Mesh([0], "x"), (), "uint8")}
    dst = {"w": Layout((16 << 20,), Mesh([2, 3], "dp"), (), "uint8")}
    topo = Topology(gpus_per_domain=2, nvlink_GBps=1, network_GBps=10, latency_us=0, bucket_bytes=1 << 20)
    tsp = cost.hierarchical_plan(src, dst, topo)
    t1, t2 = (16 << 20) / 10e9, (8 << 20) / 1e9  # here stage 2 (slow NVLink) is the longer one
    serial = cost.predict_two_stage(tsp, topo)
    assert serial.stages == pytest.approx((t1, t2)) and serial.seconds == pytest.approx(t1 + t2)
    assert cost.predict_two_stage(tsp, topo, overlap=0) == serial
    # Each device receives 8 MiB in each stage: 16 buckets of 1 MiB; the drain is 2 (or 3) of them.
    for lag in (2, 3):
        piped = cost.predict_two_stage(tsp, topo, overlap=lag)
        assert piped.seconds == pytest.approx(max(t1, t2) + lag / 16 * t2)
        assert (piped.network_bytes, piped.nvlink_bytes, piped.stages) == (
            serial.network_bytes, serial.nvlink_bytes, serial.stages)
    # One bucket holds everything: the pipeline is the stages in a row.
    whole = dataclasses.replace(topo, bucket_bytes=64 << 20)
    assert cost.predict_two_stage(tsp, whole, overlap=2).seconds == pytest.approx(t1 + t2)
    # compare and decide pass it on; the default stays the stages in a row (jreshard.transfer's).
    c, c2 = cost.compare(src, dst, topo, hierarchical="always"), cost.compare(src, dst, topo, overlap=2)
    assert c.hierarchical.seconds == pytest.approx(t1 + t2)
    assert c2.hierarchical.seconds == pytest.approx(max(t1, t2) + t2 / 8) and c2.direct == c.direct
    with pytest.raises(ValueError, match="overlap must be an int >= 0"):
        cost.predict_two_stage(tsp, topo, overlap=-1)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="overlap must be an int, got"):
            cost.predict_two_stage(tsp, topo, overlap=bad)


def test_hardware_and_topology_errors():
    assert cost.load_hardware("dgx-h100").gpus_per_domain == 8
    assert Topology.from_hardware("gb200-nvl72", 4).gpus_per_domain == 4
    with pytest.raises(ValueError, match="gpus_per_domain"):
        cost.load_hardware({"gpus_per_domain": 0, "nvlink_GBps_per_direction": 1,
                            "network_GBps_per_gpu_per_direction": 1, "latency_us": 1})
    with pytest.raises(ValueError, match="latency_us"):
        cost.load_hardware({"gpus_per_domain": 8, "nvlink_GBps_per_direction": 1,
                            "network_GBps_per_gpu_per_direction": 1})
    with pytest.raises(ValueError, match="neither a known name"):
        cost.load_hardware("abacus")
    links = {"gpus_per_domain": 8, "nvlink_GBps_per_direction": 1, "network_GBps_per_gpu_per_direction": 1,
             "latency_us": 1}
    assert cost.load_hardware(links).copy_GBps is None  # optional: copies uncharged
    assert Topology.from_hardware({**links, "copy_GBps": 5}).copy_GBps == 5.0
    with pytest.raises(ValueError, match="'copy_GBps' must be a positive number"):
        cost.load_hardware({**links, "copy_GBps": 0})
    with pytest.raises(ValueError, match="copy_GBps must be positive, or None"):
        Topology(gpus_per_domain=8, nvlink_GBps=1, network_GBps=1, latency_us=0, copy_GBps=-1)
    with pytest.raises(ValueError, match="network_GBps"):
        Topology(gpus_per_domain=8, nvlink_GBps=1, network_GBps=0, latency_us=0)
    with pytest.raises(ValueError, match="hierarchical"):
        cost.compare({}, {}, TOPO, hierarchical="sometimes")
    with pytest.raises(ValueError, match="same tensor names"):
        cost.flat_direct({"a": CASES["scalar"][0]}, {"b": CASES["scalar"][1]}, TOPO)


@pytest.mark.parametrize("module", ["cost", "hardware", "traffic", "hierarchical", "baselines", "layer", "calibration"])
def test_docstring_examples(module):
    mod = importlib.import_module(f"jreshard.fleet.{module}")
    result = doctest.testmod(mod)
    assert result.attempted > 0 and result.failed == 0


def test_public_names_listed():
    names = ["Hardware", "Topology", "Traffic", "Prediction", "TwoStagePlan", "Comparison", "load_hardware",
             "hardware_names", "predict", "sender_load_bound", "predict_plan", "predict_two_stage", "plan_traffic",
             "hierarchical_plan", "gather_broadcast", "pipelined_tree", "flat_direct", "compare"]
    assert set(names) <= set(cost.__all__)
    assert all(getattr(cost, name) is not None for name in cost.__all__)


def test_stage_layouts_are_cached_per_layout():
    from jreshard.fleet.hierarchical import stage_parts

    dst = CASES["tp2dp4"][1]
    again = Layout(dst.shape, Mesh(np.arange(8, 16).reshape(4, 2), ("dp", "tp")), dst.dim_axes, dst.dtype)
    assert stage_parts(dst, 4) is stage_parts(again, 4)  # equal layouts share their stage parts
    assert [p.part for p in stage_parts(dst, 4)] == ["domain2", "domain3"]
    assert stage_parts(dst, 1) == (("direct", dst, None),)  # one GPU per domain: nothing to fan out


def test_sender_load_bound():
    u8 = "uint8"
    src = {"a": Layout((100,), Mesh([0, 1], "dp"), (), u8), "b": Layout((60,), Mesh([2], "x"), (), u8),
           "c": Layout((40,), Mesh([1, 4], "dp"), (), u8)}
    dst = {k: Layout(v.shape, Mesh([9], "y"), (), u8) for k, v in src.items()}
    s = jreshard.plan(src, dst).stats()
    # Devices 0, 1, 4 share replicas and must send 140 bytes between them: at least 46.7 each.
    # Device 2 alone holds "b": 60 bytes, which bounds the largest load.
    assert cost.sender_load_bound(src, s) == pytest.approx(60)
    assert s.max_send_bytes == 60  # reached: device 1 passes "c" to device 4, then takes half of "a"
    assert cost.sender_load_bound({"a": src["a"]}, jreshard.plan({"a": src["a"]}, {"a": dst["a"]}).stats()) == 50


def test_predict_layer_deepseek_v3_on_nvl72():
    p = layer.predict_layer("dsv3-ep16pp8-to-tp8dp16", 3)
    # The layer's 256 routed experts, each gate, up [2048, 7168] and down [7168, 2048] in bfloat16.
    assert len(p.names) == 3 * 256 and all(".mlp.experts." in n and n.startswith("model.layers.3.") for n in p.names)
    assert p.nbytes == 256 * 3 * 2048 * 7168 * 2
    c = p.comparison
    assert c.delivery == "hierarchical" and c.jreshard is c.hierarchical
    assert c.jreshard.seconds < c.flat_direct.seconds
    # Stage 0 holds each expert once (ep=16 on 16 devices); 16 TP8 engines sit in 3 NVLink domains of 72.
    assert p.network_copies() == (3.0, 16.0)
    assert p.published == layer.PublishedLayer(0.0098, 0.0773)
    text = layer.format_layer(p)
    assert "9.8 ms" in text and "77.3 ms" in text and f"{c.jreshard.seconds * 1e3:,.1f} ms" in text
    assert "16.0 times" in text and "3.0 times" in text


def test_predict_layer_errors():
    with pytest.raises(ValueError, match="layer 0 of deepseek-v3 holds no routed experts; layers 3 to 61 do"):
        layer.predict_layer("dsv3-ep16pp8-to-tp8dp16", 0)
    with pytest.raises(TypeError, match="layer must be an int, got str"):
        layer.predict_layer("dsv3-ep16pp8-to-tp8dp16", "3")
    dense = {"model": "llama-tiny", "train": {"gpus": 2, "fsdp": 2}, "infer": {"gpus": 2, "tp": 2},
             "hardware": "dgx-h100"}
    with pytest.raises(ValueError, match="layer 1 of llama-tiny holds no routed experts; the model has none"):
        layer.predict_layer(dense, 1)


# --- FP8 delivery -------------------------------------------------------------------------------------

def _fp8_pair():
    from jreshard.fleet.catalog import TensorInfo

    infos = [TensorInfo("w", (16, 8), "float32", "column", quantize=True),
             TensorInfo("n", (8,), "float32", "replicated")]
    src = {"w": Layout((16, 8), Mesh([0, 1, 2, 3], "fsdp"), ("fsdp",), "float32"),  # 4 rows a shard: blocks of 8 cut
           "n": Layout((8,), Mesh([0, 1, 2, 3], "fsdp"), (), "float32")}
    dst = {"w": Layout((16, 8), Mesh([4, 5], "tp"), ("tp",), "float32"),
           "n": Layout((8,), Mesh([4, 5], "tp"), (), "float32")}
    return infos, src, dst


def test_fp8_layouts_exchange_and_summary_by_hand():
    from jreshard.core.fp8 import Fp8Format
    from jreshard.core.fp8_blocks import quant_plan
    from jreshard.fleet.fp8 import amax_exchange, fp8_layouts

    infos, src, dst = _fp8_pair()
    fmt = Fp8Format(block=(8, 4))
    src8, dst8 = fp8_layouts(infos, src, dst, fmt)
    assert list(dst8) == ["w", "w_scale_inv", "n"] and list(src8) == list(dst8)
    assert dst8["w"].dtype == "float8_e4m3fn" and dst8["n"].dtype == "float32" and src8["w"].dtype == "float32"
    assert dst8["w_scale_inv"].shape == (2, 2) and dst8["w_scale_inv"].shard_shape(5) == (1, 2)
    traffic, summary = amax_exchange(infos, src8, fmt, TOPO)
    # Rows 0-4 | 4-8 | 8-12 | 12-16 against blocks 0-8 | 8-16: every block has two parts, two blocks a row.
    assert (summary.quantized, summary.kept, summary.fp8_bytes, summary.scale_bytes, summary.kept_bytes) == (
        1, 1, 128, 16, 32)
    assert summary.cut_blocks == 4 and summary.nbytes == 4 * 2 * 4 and summary.messages == 4
    assert summary.nbytes == 4 * len(quant_plan(src["w"], fmt).exchange().src)
    assert traffic.nvl_out[1] == 4 * 2 and traffic.msg_out[1] == 1  # device 1 sends its 2 amaxes to device 0


def test_fp8_exchange_is_a_first_stage_and_scales_ride_with_weights():
    from jreshard.core.fp8 import Fp8Format
    from jreshard.fleet.fp8 import fp8_costs, fp8_layouts

    topo = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=1)
    infos, src, dst = _fp8_pair()
    fmt = Fp8Format(block=(8, 4))
    src8, dst8 = fp8_layouts(infos, src, dst, fmt)
    costs, _ = fp8_costs(infos, src8, fmt, topo)
    assert dict(costs.scales) == {"w_scale_inv": "w"}
    plain = cost.compare(src8, dst8, topo, hierarchical="never")
    with_fp8 = cost.compare(src8, dst8, topo, hierarchical="never", fp8=costs)
    first = cost.predict(costs.exchange, topo)
    assert first.seconds == pytest.approx(8 / 100e9 + 1e-6)  # each device: 8 bytes over NVLink in one message
    assert with_fp8.direct.stages == pytest.approx((first.seconds, plain.direct.seconds))
    assert with_fp8.flat_direct.seconds == pytest.approx(first.seconds + plain.flat_direct.seconds)
    # Gather-then-broadcast sends each scale in its weight's collective: fewer messages, same bytes moved on.
    gb = with_fp8.pipelined_tree
    assert gb.seconds < plain.pipelined_tree.seconds
    assert with_fp8.gather_broadcast.network_bytes == plain.gather_broadcast.network_bytes  # scales in its buckets
    before = plain.pipelined_tree
    assert gb.network_bytes + gb.nvlink_bytes == before.network_bytes + before.nvlink_bytes - 8  # device 1's scale row
    assert gb.stages == pytest.approx((before.stages[0] - 1e-6, before.stages[1] - 1e-6))  # one message fewer each


def test_fp8_inference_split_cutting_a_block_names_the_tensor():
    from jreshard.core.fp8 import Fp8Format
    from jreshard.fleet.fp8 import fp8_layouts, parse_block

    infos, src, dst = _fp8_pair()
    with pytest.raises(ValueError, match=r"FP8 delivery of w \(float8_e4m3fn with 16x8 blocks\): layout splits dim 0 "
                                         r"\(size 16\) into shards of 8"):
        fp8_layouts(infos, src, dst, Fp8Format(block=(16, 8)))
    assert parse_block("128x64") == (128, 64) and parse_block("128") == (128, 128) and parse_block([4, 2]) == (4, 2)
    assert parse_block("tensor") == (None, None) and parse_block("Channel") == (1, None)
    for bad in ("0x128", "128x", [128], "x"):
        with pytest.raises(ValueError, match="fp8_block must be two positive block sizes"):
            parse_block(bad)
    with pytest.raises(TypeError, match=r"fp8_block\[0\] must be an int, got bool"):
        parse_block([True, 4])
    with pytest.raises(ValueError, match=r"fp8_block\[1\] must be a positive int, got 0"):
        parse_block([4, 0])


def test_predict_layer_under_fp8():
    p = layer.predict_layer({"model": "qwen3-moe-tiny", "train": {"gpus": 8, "ep": 8},
                             "infer": {"gpus": 8, "tp": 2, "dp": 4}, "hardware": "dgx-h100",
                             "dtype": "float8_e4m3fn", "fp8_block": [8, 8]}, 1)
    # 8 experts x 3 projections of 64 x 128: one FP8 byte each, and (8 x 16) float32 scales
    assert len(p.names) == 48 and p.nbytes == 24 * (64 * 128 + 8 * 16 * 4)
    assert p.network_copies() == pytest.approx((4.0, 4.0))


def _mixed_model():
    """Tensors of a few classes (replicated sources, so balancing chooses), interleaved by name."""
    train = Mesh(np.arange(8).reshape(2, 2, 2), ("dp", "pp", "tp"))
    serve = Mesh(np.arange(8, 24).reshape(4, 4), ("dp", "tp"))
    kinds = [(Layout((64, 32), train, ("tp",), "bfloat16"), Layout((64, 32), serve, ("tp",), "bfloat16")),
             (Layout((32, 64), train, (None, "tp"), "bfloat16"), Layout((32, 64), serve, (None, "tp"), "bfloat16")),
             (Layout((48,), train, (), "float32"), Layout((48,), serve, (), "float32")),
             (Layout((40, 8), train, ("pp",), "bfloat16"), Layout((40, 8), serve, ("tp",), "float8_e4m3fn"))]
    names = [f"t{i:03d}" for i in range(41)]
    return ({n: kinds[(i * 7) % 4][0] for i, n in enumerate(names)},
            {n: kinds[(i * 7) % 4][1] for i, n in enumerate(names)})


def test_predictions_by_class_equal_the_plans():
    """compare predicts hierarchical delivery by class (no two-stage plan): the same figures as the plans give."""
    src, dst = _mixed_model()
    topo = Topology(gpus_per_domain=8, nvlink_GBps=900, network_GBps=50, latency_us=5, bucket_bytes=1024)
    for overlap in (0, 2):
        planned = cost.decide(src, dst, topo, overlap=overlap)
        by_class = cost.decide(src, dst, topo, overlap=overlap, plans=False)
        assert planned.two_stage is not None and by_class.two_stage is None and planned.hierarchical is not None
        assert by_class.hierarchical == planned.hierarchical and by_class.direct == planned.direct
    flat = cost.flat_direct(src, dst, topo)
    assert flat == cost.predict_plan(jreshard.plan(src, dst, balance=False), topo)


def test_plan_classes_is_the_plan_of_the_tensors_in_order():
    src, dst = _mixed_model()
    names = sorted(src)
    pairs, of = [], []
    for n in names:
        if (src[n], dst[n]) not in pairs:
            pairs.append((src[n], dst[n]))
        of.append(pairs.index((src[n], dst[n])))
    got = jreshard.core.planner.plan_classes(pairs, of)
    want = jreshard.plan_layouts([(n, src[n], dst[n]) for n in names]).move_arrays()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="order of their first tensor"):
        jreshard.core.planner.plan_classes(pairs, [1, 0] + of)


def test_traffic_of_rows_in_parts_equals_that_of_the_rows_joined():
    """Flat direct sends sum their classes' rows part by part: the loads, copies and messages are those
    of the joined rows, with sends of one pair in two parts coalesced and local rows copied once."""
    from jreshard.fleet.traffic import parts_traffic, rows_traffic

    topo = Topology(gpus_per_domain=2, nvlink_GBps=100, network_GBps=10, latency_us=1, bucket_bytes=300)
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 6, 40), rng.integers(0, 6, 40)
    nb = rng.integers(1, 1000, 40)
    joined = rows_traffic(src, dst, nb, topo)
    cuts = [0, 7, 7, 25, 40]  # an empty part among them
    parts = parts_traffic([(src[a:b], dst[a:b], nb[a:b]) for a, b in itertools.pairwise(cuts)], topo)
    for field in ("net_out", "net_in", "nvl_out", "nvl_in", "msg_out", "msg_in", "copied"):
        np.testing.assert_array_equal(getattr(parts, field), getattr(joined, field), err_msg=field)
