"""The pure layer of the bridge: param maps, plan reduction, buckets, fingerprints (no processes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import bridge
from jreshard import Layout, Mesh
from jreshard.core.schedule import ALIGN
from jreshard.nn import LlamaConfig, fsdp_spec
from tests.bridge import _common as C
from tests.bridge._common import source_for as _source
from tests.test_package import BLOCKER


def _coverage_ok(p: bridge.BridgePlan) -> None:
    """Every param element is written at most once, every region fully, and only from a shard that holds it."""
    counts = {(q.rank, q.name): np.zeros(q.shape, np.int32) for q in p.param_map.params}
    for t in p.moves:
        src = p.src_region(t)
        shard = p.source.layout(t.leaf).shard_shape(t.src)
        assert all(0 <= s.start <= s.stop <= n for s, n in zip(src, shard, strict=True)), (t, shard)
        box, _ = p.dst_region(t)
        counts[(t.dst, t.param)][box] += 1
    for q in p.param_map.params:
        c = counts[(q.rank, q.name)]
        assert c.max(initial=0) <= 1, q.name
        assert c.sum() == sum(int(np.prod(r.shape)) for r in q.regions), q.name
        for r in q.regions:
            assert (c[tuple(slice(o, o + n) for o, n in zip(r.offset, r.shape, strict=True))] == 1).all()


CASES = [
    # name, config overrides, trainer mesh (shape, axes, ranks, per process), spec, tp groups, fused, pad
    ("fsdp4-tp2-fused-padded", {"vocab_size": 1000}, ((4,), ("fsdp",), (0, 1), 2), fsdp_spec, [2, 3], True, 64),
    ("fsdp4-tp2-plain", {}, ((4,), ("fsdp",), (0, 1), 2), fsdp_spec, [2, 3], False, 64),
    ("fsdp4-tp4-fused", {"vocab_size": 1000}, ((4,), ("fsdp",), (0, 1), 2), fsdp_spec, [4, 5, 6, 7], True, 64),
    ("fsdp2x-replica2-tp1", {}, ((2, 2), ("replica", "fsdp"), (0, 1), 2), lambda p, s: fsdp_spec(p, s), [9], True, 64),
    ("fsdp3-uneven-tp2x2-replicas", {"vocab_size": 1000, "intermediate_size": 690},
     ((3,), ("fsdp",), (0, 1, 2), 1), fsdp_spec, [[3, 4], [5, 6]], False, 128),
    ("fsdp4-tp8-kv-heads-replicated", {"vocab_size": 1000}, ((4,), ("fsdp",), (0, 1), 2), fsdp_spec,
     list(range(4, 12)), True, 64),
    ("fsdp4-tp8-kv-heads-replicated-plain", {}, ((4,), ("fsdp",), (0, 1), 2), fsdp_spec, list(range(4, 12)), False,
     64),
    ("tp-sharded-trainer", {"vocab_size": 1000}, ((2, 2), ("fsdp", "tp"), (0, 1), 2),
     lambda p, s: (("fsdp", "tp") + (None,) * (len(s) - 2)) if len(s) >= 2 else (None,) * len(s), [2, 3], True, 64),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_matches_vllm_slicing(case, dtype):
    _, over, (mshape, axes, ranks, per), spec, tp_groups, fused, pad = case
    cfg = LlamaConfig.load("llama-tiny", num_hidden_layers=2, **over)
    src = _source(cfg, mshape, axes, ranks, per, spec)
    if cfg.intermediate_size == 690:  # the 3-way FSDP case: 1000 vocabulary rows shard unevenly
        down = src.layout("layers_0/mlp/down_proj/kernel")
        assert [down.shard_shape(d)[0] for d in down.mesh.device_ids] == [230, 230, 230]
        embed = src.layout("embed/embedding")
        assert [embed.shard_shape(d)[0] for d in embed.mesh.device_ids] == [334, 334, 332]
    m = bridge.llama_param_map(cfg, src, tp_groups, fused=fused, vocab_pad=pad, dtype=dtype)
    p = bridge.BridgePlan(src, m, bucket_bytes=256 << 10)
    _coverage_ok(p)
    arrays = C.make_arrays(cfg, seed=5)
    got = p.reference(arrays)
    groups = np.atleast_2d(np.asarray(tp_groups))
    want = C.vllm_shards(arrays, cfg, groups.shape[1], fused=fused, vocab_pad=pad)
    for group in groups:
        for i, r in enumerate(group):
            assert sorted(got[r]) == sorted(want[i])
            for name, w in want[i].items():
                np.testing.assert_array_equal(got[r][name].astype(np.float32),
                                              w.astype(got[r][name].dtype).astype(np.float32), err_msg=name)


def test_plain_tp_uses_regular_layouts_and_padding_uses_cells():
    cfg = C.small_config()
    p = bridge.BridgePlan(_source(cfg), bridge.llama_param_map(cfg, _source(cfg), [2, 3], fused=True))
    cells = {j.name.split(":")[1].split("#")[0] for j in p.jobs if "@" in j.name}
    assert cells == {"model.embed_tokens.weight", "lm_head.weight"}  # 1000 rows padded: not a JAX split
    q = next(j for j in p.jobs if j.name.endswith("layers.0.self_attn.qkv_proj.weight#0"))
    assert q.dst.spec_str == "P(None, 'd1')" and q.dst.mesh.device_ids == (2, 3)
    # The planner sends each receiver exactly its slice: no byte beyond the lower bound.
    s = p.plan.stats()
    assert s.network_bytes == s.lower_bound_bytes == p.network_bytes


def test_replicated_trainer_shards_are_balanced_across_processes():
    cfg = C.small_config()
    src = _source(cfg, (2, 2), ("replica", "fsdp"), (0, 1), 2)  # process 0 and 1 each hold a full copy
    p = bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [2, 3], fused=True))
    send = p.rank_bytes()["send"]
    assert set(send) == {0, 1} and abs(send[0] - send[1]) / max(send.values()) < 0.1, send


@pytest.mark.parametrize("cap", [16 << 10, 100_000, 1 << 30])
def test_buckets_cap_staging_memory(cap):
    cfg = C.small_config()
    src = _source(cfg)
    p = bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [2, 3], fused=True), bucket_bytes=cap)
    _coverage_ok(p)
    for b in range(p.num_buckets):
        for r in (0, 1, 2, 3):
            assert sum(m.nbytes for m in p.sends(r, b)) <= max(cap, ALIGN)
            assert sum(m.nbytes for m in p.recvs(r, b)) <= max(cap, ALIGN)
    for m in p.messages:  # pieces are aligned and packed without overlap
        offs = [off for _, off in m.pieces]
        assert all(o % ALIGN == 0 for o in offs) and offs == sorted(offs)
    assert p.network_bytes == sum(int(np.prod(t.box.shape)) * 4 for t in p.moves)


def _consecutive(shape, box) -> bool:
    flat = np.arange(int(np.prod(shape))).reshape(shape)[tuple(box)].ravel()
    return bool(np.all(np.diff(flat) == 1))


@pytest.mark.parametrize("fused", [True, False])
def test_segments_partition_messages_and_flag_contiguous_pieces(fused):
    cfg = C.small_config()
    src = _source(cfg)
    p = bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [2, 3], fused=fused), bucket_bytes=100_000)
    kinds = set()
    for m in p.messages:
        segs = p.segments(m)
        assert segs[0].start == 0 and all(prev.stop <= nxt.start for prev, nxt in zip(segs, segs[1:], strict=False))
        covered = []
        for seg in segs:
            # Recomputed here from offsets, not read back from plan.segment_pieces.
            pieces = ([m.pieces[seg.piece]] if seg.piece is not None
                      else [q for q in m.pieces if seg.start <= q.offset < seg.stop])
            assert pieces and pieces[0].offset == seg.start
            assert pieces[-1].offset + p.moves[pieces[-1].move].nbytes == seg.stop
            covered += pieces
            for i, _ in pieces:  # the flags say exactly whether the piece is one block on each side
                t = p.moves[i]
                box, perm = p.dst_region(t)
                shard = src.layout(t.leaf).shard_box(t.src)
                region = p.src_region(t)
                s_ok = _consecutive([shard[d].stop - shard[d].start for d in perm], [region[d] for d in perm])
                d_ok = _consecutive(p.param(t.param, t.dst).shape, box)
                direct = seg.piece is not None
                assert (seg.src_direct, seg.dst_direct) == ((s_ok, d_ok) if direct else (False, False))
                assert direct or not (s_ok or d_ok)
                kinds.add((s_ok, d_ok))
        assert covered == list(m.pieces)
        assert p.segment_pieces(m) == [[m.pieces[s.piece]] if s.piece is not None
                                       else [q for q in m.pieces if s.start <= q.offset < s.stop] for s in segs]
    assert len(kinds) >= 3, kinds  # the plan exercises direct and packed pieces


def test_fingerprint_is_deterministic_and_covers_every_input():
    cfg = C.small_config()

    def fp(**kw):
        src = _source(cfg, ranks=kw.pop("ranks", (0, 1)))
        recv = kw.pop("recv", [2, 3])
        bucket = kw.pop("bucket", 1 << 20)
        return bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, recv, **kw), bucket_bytes=bucket).fingerprint

    base = fp(fused=True)
    assert fp(fused=True) == base
    variants = [fp(fused=False), fp(fused=True, dtype="bfloat16"), fp(fused=True, vocab_pad=96),
                fp(fused=True, recv=[3, 2]), fp(fused=True, bucket=1 << 19), fp(fused=True, ranks=(1, 0))]
    assert len({base, *variants}) == len(variants) + 1


def test_dtensor_params_match_torch_chunking():
    torch = pytest.importorskip("torch")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    src = bridge.Source({"w": Layout((7, 5), bridge.trainer_mesh((2,), "x", [0], 2), ("x",), "float32")})
    ranks = np.arange(4, 10).reshape(2, 3)
    for placements in ([Shard(0), Shard(0)], [Shard(1), Shard(0)], [Replicate(), Shard(1)], [Shard(0), Replicate()]):
        m = bridge.dtensor_params("w", src, "w", ranks, placements, transpose=True)
        for q in m.params:
            mesh = DeviceMesh("cpu", torch.from_numpy(ranks), _init_backend=False, _rank=q.rank)
            shape, offset = compute_local_shape_and_global_offset((5, 7), mesh, placements)
            assert q.shape == tuple(shape), (placements, q.rank)
            if q.regions:
                box = q.regions[0].box  # leaf coordinates: the torch dims reversed
                assert (box[1].start, box[0].start) == tuple(offset), (placements, q.rank)


def _bad_cases():
    cfg = C.small_config()
    src = _source(cfg)
    tiny = bridge.Source({"w": Layout((6, 4), bridge.trainer_mesh((2,), "x", [0], 2), ("x",), "float32")})
    return [
        ("rule regex", lambda: bridge.Rule("(", "x"), ValueError, "not a regular expression"),
        ("duplicate tp ranks", lambda: bridge.llama_param_map(cfg, src, [2, 2]), ValueError, "distinct"),
        ("tp ranks not ints", lambda: bridge.llama_param_map(cfg, src, ["a"]), TypeError, "tp_ranks"),
        ("uneven split", lambda: bridge.tp_param_map(tiny, [bridge.Rule("w", "w", dim=0)], [1, 2, 3, 4]),
         ValueError, "does not split evenly"),
        ("unmatched leaf", lambda: bridge.tp_param_map(tiny, [bridge.Rule("v", "v")], [1]), ValueError,
         "matches no rule"),
        ("trainer is receiver", lambda: bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [1, 2])),
         ValueError, "both trainer and inference"),
        ("tiny bucket", lambda: bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [2, 3]), bucket_bytes=8),
         ValueError, "bucket_bytes"),
        ("placements per mesh dim", lambda: bridge.dtensor_params("w", tiny, "w", [1, 2], ["replicate", "replicate"]),
         ValueError, "one per mesh dim"),
        ("placement kind", lambda: bridge.dtensor_params("w", tiny, "w", [1, 2], ["partial"]), TypeError,
         "Shard"),
        ("missing leaf", lambda: bridge.dtensor_params("w", tiny, "nope", [1], ["replicate"]), ValueError,
         "no trainer leaf"),
        ("torch rank as source", lambda: bridge.Source({"w": Layout((2,), Mesh([0, 1], "x"), ())}), ValueError,
         "SOURCE_BASE"),
        ("source id range", lambda: bridge.source_id(0, 1000), ValueError, "local"),
        ("config", lambda: LlamaConfig.load("llama-tiny", num_key_value_heads=3), ValueError, "multiple"),
        ("tp cuts a head", lambda: bridge.llama_param_map(LlamaConfig.load("llama-tiny", num_attention_heads=12,
                                                                           num_key_value_heads=4, hidden_size=384),
                                                        _source(LlamaConfig.load("llama-tiny", num_attention_heads=12,
                                                                                 num_key_value_heads=4,
                                                                                 hidden_size=384)),
                                                        list(range(2, 10))), ValueError, "a head would be cut"),
        ("kv heads not replicable", lambda: bridge.tp_param_map(
            tiny, [bridge.Rule("w", "w", dim=0, heads=2, replicate_heads=True)], [1, 2, 3]), ValueError,
         "replicated evenly"),
        ("more tp ranks than q heads", lambda: bridge.llama_param_map(cfg, src, list(range(2, 18))), ValueError,
         "16 tensor-parallel ranks for 8 heads"),
        ("replicate without heads", lambda: bridge.Rule("w", "w", dim=0, replicate_heads=True), ValueError,
         "needs heads"),
        ("heads without dim", lambda: bridge.Rule("w", "w", heads=2), ValueError, "needs a split dim"),
        ("heads not int", lambda: bridge.Rule("w", "w", dim=0, heads=0), ValueError, "positive int"),
        ("model name", lambda: LlamaConfig.load("no-such-model"), ValueError, "llama-tiny"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_errors(case):
    _, fn, exc, match = case
    with pytest.raises(exc, match=match):
        fn()


def test_import_bridge_and_plan_without_jax_or_torch():
    code = BLOCKER + textwrap.dedent(
        """
        import bridge
        from jreshard.nn import LlamaConfig, param_shapes, fsdp_spec
        cfg = LlamaConfig.load('llama-tiny')
        src = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh((4,), 'fsdp', [0, 1], 2), fsdp_spec)
        print(bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [2, 3], fused=True)).num_buckets)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_receiver_rejects_wrong_params():
    torch = pytest.importorskip("torch")
    cfg = C.small_config()
    src = _source(cfg)
    p = bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [2, 3], fused=True))
    params = {q.name: torch.zeros(q.shape) for q in p.param_map.for_rank(2)}
    bridge.Receiver(p, params, rank=2)  # accepted
    wrong = dict(params, **{"lm_head.weight": torch.zeros(500, 256)})
    with pytest.raises(ValueError, match=r"lm_head.weight.*\(500, 256\).*\(512, 256\)"):
        bridge.Receiver(p, wrong, rank=2)
    with pytest.raises(ValueError, match="params lacks 'model.norm.weight'"):
        bridge.Receiver(p, {k: v for k, v in params.items() if k != "model.norm.weight"}, rank=2)
    half = dict(params, **{"model.norm.weight": torch.zeros(256, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="bfloat16"):
        bridge.Receiver(p, half, rank=2)
    with pytest.raises(ValueError, match="no params"):
        bridge.Receiver(p, params, rank=7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_atomic_receiver_holds_each_received_element_once_and_commits_every_covered_element_once(dtype):
    """An atomic receiver (no swap) holds the sync's bytes until the final ack, then unpacks them: the
    held memory is at most the params' bytes (plus alignment per message), and its copies write every
    element the param map's regions cover exactly once and the rest (padded rows) never."""
    torch = pytest.importorskip("torch")
    cfg = C.small_config()
    src = _source(cfg)
    p = bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [2, 3], fused=True, dtype=dtype),
                          bucket_bytes=64 << 10)
    for rank in (2, 3):
        mine = p.param_map.for_rank(rank)
        params = {q.name: torch.zeros(q.shape, dtype=getattr(torch, dtype)) for q in mine}
        from bridge.wire.commit import HeldCommit, InPlaceCommit, SwapCommit

        rec = bridge.Receiver(p, params, rank=rank)
        assert isinstance(rec.strategy, HeldCommit)
        assert isinstance(bridge.Receiver(p, params, rank=rank, swap=True).strategy, SwapCommit)
        assert isinstance(bridge.Receiver(p, params, rank=rank, atomic=False).strategy, InPlaceCommit)
        held = rec.strategy.held
        end = max(h.base + h.nbytes for h in held.values())
        assert end <= sum(v.numel() * v.element_size() for v in params.values()) + ALIGN * len(held)
        written = {q.name: np.zeros(q.shape, dtype=np.int64) for q in mine}
        for h in held.values():
            assert h.base % ALIGN == 0
            for u in h.unpacks:
                assert u.offset >= 0 and u.offset + u.nbytes <= h.nbytes
                written[u.param].reshape(u.view)[u.box] += 1
        for q in mine:
            covered = np.zeros(q.shape, dtype=np.int64)
            for r in q.regions:
                covered.reshape(r.view_shape(q.shape))[tuple(
                    slice(o, o + n) for o, n in zip(r.offset, r.shape, strict=True))] += 1
            np.testing.assert_array_equal(written[q.name], covered, err_msg=q.name)
            assert covered.max() == 1


HIER_CASES = [
    # name, config overrides, tp groups, nodes (inference ranks sharing fast links)
    ("tp2x4-replicas-two-nodes", {"vocab_size": 1000}, [[2, 3], [4, 5], [6, 7], [8, 9]], [[2, 3, 4, 5], [6, 7, 8, 9]]),
    ("tp8-kv-heads-replicated", {}, list(range(4, 12)), [[4, 5, 6, 7], [8, 9, 10, 11]]),
    ("replicas-split-across-nodes", {"vocab_size": 1000}, [[2, 3], [4, 5], [6, 7]], [[2, 3, 4], [5, 6, 7]]),
]


@pytest.mark.parametrize("case", HIER_CASES, ids=[c[0] for c in HIER_CASES])
def test_two_stage_plans_are_exact_stay_inside_nodes_and_reach_the_lower_bound(case):
    _, over, tp_groups, nodes = case
    cfg = LlamaConfig.load("llama-tiny", num_hidden_layers=1, **over)
    src = _source(cfg)
    m = bridge.llama_param_map(cfg, src, tp_groups, fused=True, vocab_pad=64, dtype="bfloat16")
    direct = bridge.BridgePlan(src, m, bucket_bytes=64 << 10, hierarchical="never", domains=nodes)
    two = bridge.BridgePlan(src, m, bucket_bytes=64 << 10, hierarchical="always", domains=nodes)
    assert two.two_stage and not direct.two_stage
    assert bridge.BridgePlan(src, m, bucket_bytes=64 << 10, domains=nodes).fingerprint == two.fingerprint  # auto
    assert not bridge.BridgePlan(src, m, bucket_bytes=64 << 10).two_stage  # no domains given: direct
    arrays = C.make_arrays(cfg, seed=7)
    got, want = two.reference(arrays), direct.reference(arrays)
    for r in want:
        for name in want[r]:
            np.testing.assert_array_equal(got[r][name], want[r][name], err_msg=f"{name} on rank {r}")
    # Every element written once; a stage-2 move forwards only what its sender got in stage 1, inside a node.
    written = {(q.rank, q.name): np.zeros(q.shape, np.int32) for q in m.params}
    stage1 = {(q.rank, q.name): np.zeros(q.shape, bool) for q in m.params}
    node_of = {r: k for k, node in enumerate(nodes) for r in node}
    for t in sorted(two.moves, key=lambda t: t.stage):
        box, _ = two.dst_region(t)
        written[(t.dst, t.param)].reshape(two.dst_view(t))[box] += 1
        if t.stage == 1:
            stage1[(t.dst, t.param)].reshape(two.dst_view(t))[box] = True
        else:
            assert node_of[t.src] == node_of[t.dst], t
            assert stage1[(t.src, t.param)].reshape(two.view_of(t, t.src))[two.param_box(t, t.src)].all(), t
    for q in m.params:
        covered = np.zeros(q.shape, np.int32)
        for r in q.regions:
            covered.reshape(r.view_shape(q.shape))[tuple(slice(o, o + n) for o, n in zip(r.offset, r.shape,
                                                                                          strict=True))] = 1
        np.testing.assert_array_equal(written[(q.rank, q.name)], covered, err_msg=q.name)
    # Bytes into nodes: each needed element once per node where whole replicas share a node.
    lower = C.cross_node_lower_bound(two, nodes, 2)
    assert direct.cross_domain_bytes == direct.network_bytes > two.cross_domain_bytes >= lower
    if all(all(node_of[r] == node_of[g[0]] for r in g) for g in np.atleast_2d(tp_groups)):
        assert two.cross_domain_bytes == lower
    # Stage-2 segments flag pieces contiguous in the forwarding rank's param (packed otherwise).
    for msg in [x for x in two.messages if two.moves[x.pieces[0].move].stage == 2]:
        for seg, members in zip(two.segments(msg), two.segment_pieces(msg), strict=True):
            t = two.moves[members[0].move]
            ok = _consecutive(two.view_of(t, t.src), two.param_box(t, t.src))
            assert seg.src_direct == (seg.piece is not None and ok)


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"hierarchical": "sometimes"}, ValueError, "hierarchical must be .auto., .always. or .never."),
    ({"domains": "nodes"}, ValueError, "domains must be 'local'"),
    ({"domains": [[2, 3], [3]]}, ValueError, "domains .*device 3 is in groups"),
    ({"domains": 2.5}, TypeError, "domains"),
])
def test_hierarchical_bad_arguments(kw, exc, match):
    cfg = C.small_config()
    src = _source(cfg)
    with pytest.raises(exc, match=match):
        bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [2, 3]), **kw)


def test_docs_hierarchical_snippet_runs(capsys):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "bridge.md").read_text()
    blocks = [b.split("```")[0] for b in text.split("```python\n")[1:]]
    (snippet,) = [b for b in blocks if 'hierarchical="always"' in b]
    scope: dict = {}
    exec(compile(snippet, "docs/bridge.md", "exec"), scope)
    lower = C.cross_node_lower_bound(scope["two"], scope["nodes"], 2)
    assert capsys.readouterr().out.split("#")[0].split() == [str(lower), str(scope["direct"].network_bytes)]
