"""Parallelism presets: framework conventions on small cases, checked against the oracle."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import jreshard
from jreshard.fleet import catalog, presets
from jreshard.fleet.presets import InferParallel, TrainParallel
from tests.helpers import assert_plan_ok

TINY = catalog.tensors("llama-tiny")
Q = "model.layers.{}.self_attn.q_proj.weight"
O_PROJ = "model.layers.{}.self_attn.o_proj.weight"

TINY_MOE = catalog.load_config({"model_type": "qwen3_moe", "name": "tiny-moe", "vocab_size": 64, "hidden_size": 16,
                                "moe_intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 4, "num_experts": 4, "dtype": "float32"})

ODD_MOE = catalog.load_config({**dict(TINY_MOE.params), "name": "odd-moe", "moe_intermediate_size": 6})


def box(layout, device):
    return tuple((s.start, s.stop) for s in layout.shard_box(device))


def test_megatron_tp_pp_dp_rank_order():
    src = presets.train_layouts(TINY, TrainParallel(tp=2, pp=2, dp=2), range(8))
    q0 = src[Q.format(0)]  # [256, 256]; stage 0 = devices 0-3 as (dp, fsdp, cp, tp), tp innermost
    assert q0.mesh.axis_names == ("dp", "fsdp", "cp", "tp") and q0.mesh.device_ids == (0, 1, 2, 3)
    assert [box(q0, d) for d in range(4)] == [((0, 128), (0, 256)), ((128, 256), (0, 256))] * 2
    o3 = src[O_PROJ.format(3)]  # row parallel, last stage
    assert o3.mesh.device_ids == (4, 5, 6, 7)
    assert box(o3, 5) == ((0, 256), (128, 256))
    assert set(src["model.embed_tokens.weight"].mesh.device_ids) == {0, 1, 2, 3}
    assert set(src["lm_head.weight"].mesh.device_ids) == {4, 5, 6, 7}
    assert src["model.norm.weight"].dim_axes == ((),) and src["model.norm.weight"].mesh.device_ids[0] == 4
    assert box(src["lm_head.weight"], 7) == ((512, 1024), (0, 256))  # vocab parallel


def test_pipeline_stages_are_consecutive_and_even():
    assert presets.stage_of_layers(61, 8) == sorted(presets.stage_of_layers(61, 8))
    counts = np.bincount(presets.stage_of_layers(61, 8))
    assert counts.max() - counts.min() <= 1 and counts.sum() == 61
    with pytest.raises(ValueError, match="pp=9"):
        presets.stage_of_layers(4, 9)


def test_fsdp_leading_dim_major_tp_minor_not_collapsed():
    # JAX-style FSDP x TP: fsdp (outer axis) shards dim 0 major, tp (inner axis) minor.
    src = presets.train_layouts(TINY, TrainParallel(fsdp=2, tp=2), range(4))
    q = src[Q.format(0)]
    assert q.spec[0] == ("fsdp", "tp")
    # Device 1 is (fsdp 0, tp 1): the second quarter; device 2 is (fsdp 1, tp 0): the third.
    assert [box(q, d)[0] for d in range(4)] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    o = src[O_PROJ.format(0)]
    assert box(o, 1) == ((0, 128), (128, 256)) and box(o, 2) == ((128, 256), (0, 128))
    norm = src["model.norm.weight"]
    assert box(norm, 1) == ((0, 128),) and box(norm, 2) == ((128, 256),)


def test_vllm_tp_dp_engines():
    dst = presets.infer_layouts(TINY, InferParallel(tp=4, dp=2), range(8, 16))
    q = dst[Q.format(1)]
    assert q.mesh.devices.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert box(q, 9) == box(q, 13) == ((64, 128), (0, 256))
    assert dst["model.layers.0.input_layernorm.weight"].replication == 8


def test_experts_ep_and_expert_tp():
    infos = catalog.tensors(TINY_MOE)
    src = presets.train_layouts(infos, TrainParallel(tp=2, ep=2, expert_tp=2, pp=2), range(8))
    # Stage 1 = devices 4-7 as (edp=1, ep=2, etp=2): expert 3 lives on ep rank 1 = devices 6, 7.
    e3 = src["model.layers.3.mlp.experts.3.gate_proj.weight"]
    assert e3.mesh.device_ids == (6, 7) and box(e3, 7) == ((4, 8), (0, 16))
    down = src["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert down.mesh.device_ids == (0, 1) and box(down, 1) == ((0, 16), (4, 8))
    stacked = presets.train_layouts(catalog.tensors(TINY_MOE, experts="stacked"),
                                    TrainParallel(tp=2, ep=2, expert_tp=2, pp=2), range(8))
    st = stacked["model.layers.0.mlp.experts.up_proj.weight"]  # [4, 8, 16]
    assert box(st, 3) == ((2, 4), (4, 8), (0, 16))
    inf = presets.infer_layouts(infos, InferParallel(tp=2, dp=2, ep=4), range(8, 12))
    assert inf["model.layers.0.mlp.experts.2.up_proj.weight"].mesh.device_ids == (10,)
    inf_tp = presets.infer_layouts(infos, InferParallel(tp=2, dp=2), range(8, 12))
    assert box(inf_tp["model.layers.0.mlp.experts.2.down_proj.weight"], 9) == ((0, 16), (4, 8))


def test_tp4_dp8_fleet_receives_each_tensor_eight_times():
    src = presets.train_layouts(TINY, TrainParallel(tp=2, pp=2, dp=2), range(8))
    dst = presets.infer_layouts(TINY, InferParallel(tp=4, dp=8), range(8, 40))
    p = jreshard.plan(src, dst)
    for t in TINY:
        # tp-split tensors reach each of the 8 engines once; replicated ones (norms) all 32 devices.
        copies = 32 if t.role == "replicated" else 8
        assert p[t.name].stats().network_bytes == copies * t.size * 4, t.name
    s = p.stats()
    sharded = sum(t.size * 4 for t in TINY if t.role != "replicated")
    assert s.network_bytes == s.lower_bound_bytes == 8 * sharded + 32 * (catalog.num_params(TINY) * 4 - sharded)


@pytest.mark.parametrize("train, infer, devices", [
    (TrainParallel(tp=2, pp=2, dp=2), InferParallel(tp=4, dp=2), range(8, 16)),
    (TrainParallel(fsdp=4, tp=2), InferParallel(tp=2, dp=4), range(4, 12)),  # overlapping devices
    (TrainParallel(tp=4, pp=2), InferParallel(tp=1, dp=8), range(0, 8)),  # colocated
])
def test_whole_model_bit_exact(train, infer, devices):
    src = presets.train_layouts(TINY, train, range(8))
    dst = presets.infer_layouts(TINY, infer, devices)
    p = jreshard.plan(src, dst)
    for name in (Q.format(0), O_PROJ.format(3), "lm_head.weight", "model.norm.weight",
                 "model.layers.2.mlp.down_proj.weight"):
        assert_plan_ok(p[name])
    s = p.stats()
    assert s.network_bytes == s.lower_bound_bytes


def test_moe_bit_exact():
    infos = catalog.tensors(TINY_MOE)
    src = presets.train_layouts(infos, TrainParallel(tp=2, ep=2, expert_tp=2, pp=2), range(8))
    dst = presets.infer_layouts(infos, InferParallel(tp=2, dp=2, ep=2), range(8, 12))
    p = jreshard.plan(src, dst)
    for name in ("model.layers.3.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.0.down_proj.weight",
                 "model.layers.1.mlp.gate.weight"):
        assert_plan_ok(p[name])


def test_kv_heads_replicated_whole_when_tp_exceeds_them():
    # llama-tiny: 8 query heads, 4 KV heads of 32 rows. At TP8 vLLM puts KV head r // 2 on rank r.
    dst = presets.infer_layouts(TINY, InferParallel(tp=8, dp=2), range(16, 32))
    k = dst["model.layers.0.self_attn.k_proj.weight"]  # [128, 256]
    assert k.mesh.axis_names == ("dp", "tp", "tp_replica") and k.mesh.shape == (2, 4, 2)
    assert [box(k, d)[0] for d in range(16, 24)] == [(0, 32), (0, 32), (32, 64), (32, 64), (64, 96), (64, 96),
                                                     (96, 128), (96, 128)]
    assert box(k, 24) == box(k, 16) and box(k, 31) == ((96, 128), (0, 256))
    q = dst[Q.format(0)]  # 8 query heads at TP8: one head a rank, not replicated
    assert q.mesh.shape == (2, 8) and [box(q, d)[0] for d in (16, 17, 23)] == [(0, 32), (32, 64), (224, 256)]
    src = presets.train_layouts(TINY, TrainParallel(tp=2, dp=2), range(4))
    st = jreshard.plan(src, dst)["model.layers.0.self_attn.k_proj.weight"].stats()
    assert st.network_bytes == 16 * 32 * 256 * 4  # each of 16 ranks receives one whole head


def test_heads_agree_with_the_bridge_rule():
    bridge = pytest.importorskip("bridge")
    from bridge.plan.source import trainer_mesh
    from jreshard import Layout

    # The bridge's Rule for 4 KV heads at TP8 reads the same rows as the preset's layout.
    leaf = Layout((128, 256), trainer_mesh((1,), "x", [0], 1), (), "float32")
    rule = bridge.Rule("k", "k_proj.weight", dim=0, heads=4, replicate_heads=True)
    mapping = bridge.tp_param_map(bridge.Source({"k": leaf}), [rule], list(range(8)))
    k = presets.infer_layouts(TINY, InferParallel(tp=8), range(8))["model.layers.0.self_attn.k_proj.weight"]
    for rank in range(8):
        (target,) = [t for t in mapping.params if t.rank == rank]
        region = tuple((b.start, b.stop) if isinstance(b, slice) else tuple(b) for b in target.regions[0].box)
        assert region == box(k, rank), rank


@pytest.mark.parametrize("infos, par, match", [
    # llama-tiny: 8 query heads, 4 KV heads, intermediate size 688, 4 layers, no experts.
    (TINY, InferParallel(tp=16), "tp=16 on model.layers.0.self_attn.q_proj.weight: 16 tensor-parallel ranks for "
                                 "8 heads, which are not replicated; use a TP degree dividing 8"),
    (TINY, TrainParallel(tp=8), "tp=8 on model.layers.0.self_attn.k_proj.weight: 8 tensor-parallel ranks for 4 heads"),
    (TINY, InferParallel(tp=3), "tp=3 on model.layers.0.self_attn.q_proj.weight: .*a head would be cut"),
    (TINY, InferParallel(ep=2), "ep=2 but the model has no routed experts; use ep=1"),
    (TINY, TrainParallel(pp=5), "pp=5 stages exceed the model's 4 layers; use pp <= 4"),
    (catalog.tensors(TINY_MOE), TrainParallel(ep=3), "ep=3 does not divide the model's 4 routed experts; make ep a "
                                                     "divisor of 4"),
    (catalog.tensors(TINY_MOE), TrainParallel(expert_tp=3), "expert_tp=3 on model.layers.0.mlp.experts.0.gate_proj"
                                                           ".weight: dim 0 of size 8 does not split evenly"),
    (catalog.tensors(ODD_MOE, experts="stacked"), InferParallel(tp=4), "tp=4 on .*experts.gate_proj.weight: dim 1 "
                                                                       "of size 6 .*make tp a divisor of 6"),
    ([catalog.TensorInfo("w", (10, 4), "float32", "column")], InferParallel(tp=4), "w: dim 0 of size 10"),
])
def test_check_degrees_refuses(infos, par, match):
    with pytest.raises(ValueError, match=match):
        presets.check_degrees(infos, par)


def test_check_degrees_accepts_what_presets_lay_out():
    presets.check_degrees(TINY, InferParallel(tp=8))  # KV heads replicated
    presets.check_degrees(TINY, TrainParallel(tp=4, pp=3))  # uneven stages: 2, 1, 1 layers
    presets.check_degrees(catalog.tensors(TINY_MOE), InferParallel(tp=4, ep=4))  # experts whole on their ep rank
    with pytest.raises(TypeError, match="TrainParallel or an InferParallel"):
        presets.check_degrees(TINY, {"tp": 2})


@pytest.mark.parametrize("text, kind, kwargs, exc, match", [
    ("tp=x", "train", {}, ValueError, "cannot read 'tp=x'"),
    ("tp=0", "infer", {}, ValueError, "positive ints"),
    ("tp=2,tp=4", "infer", {}, ValueError, "tp is given twice"),
    ("pp=2", "infer", {}, ValueError, r"names from \['tp', 'dp', 'ep', 'expert_tp'\]"),
    ("gpus=8", "infer", {}, ValueError, "cannot read 'gpus=8'"),
    ("tp=2", "serve", {}, ValueError, "kind must be 'train' or 'infer'"),
    (4, "train", {}, TypeError, "train degrees must be a string"),
])
def test_parse_degrees_errors(text, kind, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        presets.parse_degrees(text, kind, **kwargs)


def test_parse_degrees_with_gpus():
    assert presets.parse_degrees(" gpus=8 , tp=4,", "infer", gpus=True) == {"gpus": 8, "tp": 4}


@pytest.mark.parametrize("call, exc, match", [
    (lambda: presets.train_layouts(TINY, TrainParallel(tp=2, pp=2), range(6)), ValueError, "multiply|cannot hold"),
    (lambda: presets.train_layouts(TINY, TrainParallel(pp=3), range(8)), ValueError, "pp=3"),
    (lambda: presets.infer_layouts(TINY, InferParallel(tp=2, dp=2), range(8)), ValueError, "tp\\*dp = 4"),
    (lambda: TrainParallel(tp=0), ValueError, "TrainParallel.tp"),
    (lambda: presets.train_layouts(catalog.tensors(TINY_MOE), TrainParallel(ep=3), range(3)), ValueError, "ep=3"),
    (lambda: presets.train_layouts(TINY, InferParallel(), range(1)), TypeError, "TrainParallel"),
    (lambda: presets.parse_parallel("tp=x", "train"), ValueError, "tp=x"),
    (lambda: presets.train_layouts(catalog.tensors(TINY_MOE), TrainParallel(ep=2, fsdp=2), range(2)), ValueError,
     "a pipeline stage of 2 devices cannot hold ep\\*fsdp\\*expert_tp = 4"),
    (lambda: presets.infer_layouts(catalog.tensors(ODD_MOE), InferParallel(tp=2, dp=2, expert_tp=4), range(4)),
     ValueError, "expert_tp=4 on .*experts.0.gate_proj.weight: dim 0 of size 6 does not split evenly over 4"),
])
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_experts_whole_under_ep_need_not_split_by_tp():
    # ODD_MOE's intermediate dim (6) does not split 4 ways; with ep the experts stay whole on their rank.
    dst = presets.infer_layouts(catalog.tensors(ODD_MOE), InferParallel(tp=4, ep=4), range(4))
    gate = dst["model.layers.0.mlp.experts.1.gate_proj.weight"]
    assert gate.mesh.device_ids == (1,) and box(gate, 1) == ((0, 6), (0, 16))


def test_parse_parallel_and_docstrings():
    assert presets.parse_parallel("tp=4, pp=2", "train") == TrainParallel(tp=4, pp=2)
    assert presets.parse_parallel("tp=8,dp=2,ep=16", "infer") == InferParallel(tp=8, dp=2, ep=16)
    result = doctest.testmod(presets)
    assert result.attempted > 0 and result.failed == 0


def test_many_layers_balance_over_replicas():
    # 80 layers: each replica class holds hundreds of rows (the planner's vectorised
    # assignment path); the plan stays exact and the senders even.
    deep = catalog.load_config({"model_type": "llama", "name": "deep-tiny", "vocab_size": 64, "hidden_size": 16,
                                "intermediate_size": 24, "num_hidden_layers": 80, "num_attention_heads": 2,
                                "dtype": "float32"})
    infos = catalog.tensors(deep)
    src = presets.train_layouts(infos, TrainParallel(tp=2, dp=4), range(8))
    dst = presets.infer_layouts(infos, InferParallel(tp=2, dp=4), range(8, 16))
    p = jreshard.plan(src, dst)
    for name in (Q.format(0), Q.format(79), O_PROJ.format(40), "model.layers.7.input_layernorm.weight"):
        assert_plan_ok(p[name])
    s = p.stats()
    assert s.network_bytes == s.lower_bound_bytes and s.send_imbalance < 1.05
    assert len(s.send_bytes) == 8  # every replica sends


def test_huge_replica_class_is_balanced_and_exact():
    # 2,000 small replicated tensors to 16 devices: one replica class of 32,000 rows,
    # which the planner fills level by level in receiver order (vectorised).
    from jreshard import Layout, Mesh

    src_mesh, dst_mesh = Mesh([[0, 1], [2, 3]], ("dp", "tp")), Mesh(np.arange(4, 20), "dp")
    src = {f"n{i:04d}": Layout((6 + i % 5,), src_mesh, (), "float32") for i in range(2000)}
    dst = {k: Layout(v.shape, dst_mesh, (), "float32") for k, v in src.items()}
    p = jreshard.plan(src, dst)
    for name in ("n0000", "n0999", "n1998"):
        assert_plan_ok(p[name])
    s = p.stats()
    assert s.network_bytes == s.lower_bound_bytes and s.send_imbalance < 1.01
    assert s.messages <= 16 + 3  # contiguous runs: about one sender per receiver


def _random_model(rng: np.random.Generator) -> tuple[dict, dict]:
    """Several tensors of one shape over two source and two destination meshes with shuffled
    ids (the planner groups such tensors by mesh pair)."""
    from jreshard import Layout, Mesh

    def mesh(ids):
        ids = rng.permutation(ids)
        return Mesh(ids.reshape(2, -1), ("a", "b")) if len(ids) % 2 == 0 and rng.random() < 0.5 else Mesh(ids, ("a",))

    def spec(m, rank):
        out = [None] * rank
        for axis in rng.permutation(m.axis_names):
            if rng.random() < 0.6:
                d = int(rng.integers(rank))
                out[d] = (out[d] or ()) + (str(axis),)
        return tuple(out)

    pool = rng.permutation(12)
    ns, nd = int(rng.choice([1, 2, 4, 6])), int(rng.choice([1, 2, 4, 6]))
    s_ids, d_ids = pool[:ns], (pool[:nd] if rng.random() < 0.3 else pool[ns:ns + nd])
    smeshes, dmeshes = [mesh(s_ids) for _ in range(2)], [mesh(d_ids) for _ in range(2)]
    shape = tuple(int(x) for x in rng.integers(1, 9, size=int(rng.integers(1, 3))))
    src, dst = {}, {}
    for t in range(int(rng.integers(1, 10))):
        sm, dm = smeshes[int(rng.integers(2))], dmeshes[int(rng.integers(2))]
        dt = ("float32", "int16")[int(rng.integers(2))]
        src[f"t{t}"] = Layout(shape, sm, spec(sm, len(shape)), dt)
        dst[f"t{t}"] = Layout(shape, dm, spec(dm, len(shape)), dt)
    return src, dst


@pytest.mark.parametrize("seed", range(40))
def test_shared_mesh_pytrees_rows_and_totals_agree(seed):
    src, dst = _random_model(np.random.default_rng(seed))
    for balance in (True, False):
        p = jreshard.plan(src, dst, balance=balance)
        sent, pairs, moves = {}, set(), 0
        for tp in p.tensors.values():
            assert_plan_ok(tp)
            keys = [(int(d), int(s), tuple(lo)) for s, d, lo in zip(tp.move_src, tp.move_dst, tp.move_lo, strict=True)]
            assert keys == sorted(keys)  # moves sorted by (dst, src, box)
            for m, b in zip(tp.moves, tp.move_bytes, strict=True):
                if not m.is_local:
                    sent[m.src] = sent.get(m.src, 0) + int(b)
                    pairs.add((m.src, m.dst))
                    moves += 1
        s = p.stats()
        assert s.network_bytes == s.lower_bound_bytes == sum(sent.values())
        assert (s.send_bytes, s.messages, s.moves) == (sent, len(pairs), moves)
