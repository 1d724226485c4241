"""Expert rules (vLLM FusedMoE, transformers names, EP and TP) against an independent NumPy slicing oracle."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import bridge
from bridge.recipes.qwen3_moe import qwen3_moe_param_map
from jreshard.nn import MoeConfig, fsdp_spec, param_shapes
from tests.helpers import hf_state

TRAINERS = bridge.trainer_mesh((2, 2), ("ep", "fsdp"), [0, 1], 2)  # EP2 x FSDP2 over 2 processes


def _config(**kw) -> MoeConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=16, decoder_sparse_step=1)
    return MoeConfig(**{**base, **kw})


def _per_expert(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The same tree with one ``[H, I]`` (gate, up) or ``[I, H]`` (down) leaf per expert."""
    out = {}
    for path, shape in shapes.items():
        head, _, proj = path.rpartition("/experts/")
        if not head:
            out[path] = shape
            continue
        for e in range(shape[0]):
            out[f"{head}/experts_{e}/{proj}/kernel"] = shape[1:]
    return out


def _spec(path: str, shape: tuple[int, ...]) -> tuple:
    if "/experts/" in path:  # stacked experts: E over ep, then I over fsdp
        return ("ep", None, "fsdp") if "down" not in path else ("ep", "fsdp", None)
    return fsdp_spec(path, shape, ("ep", "fsdp"))


def _arrays(shapes: dict[str, tuple[int, ...]], dtype: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {p: rng.standard_normal(s, dtype=np.float32).astype(np.dtype(dtype)) for p, s in sorted(shapes.items())}


def _unstack(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for path, a in arrays.items():
        head, _, proj = path.rpartition("/experts/")
        if head:
            out.update({f"{head}/experts_{e}/{proj}/kernel": a[e] for e in range(a.shape[0])})
        else:
            out[path] = a
    return out


def _oracle(full: dict[str, np.ndarray], cfg: MoeConfig, tp: int, c: int, ep: int, r: int, etp: int, ec: int,
            pad: int, fused: bool) -> dict[str, np.ndarray]:
    """One rank's params: TP rank ``c`` of ``tp`` for the dense parts, EP rank ``r`` / expert-TP rank ``ec``."""
    out = {}
    e_lo, e_n = r * cfg.num_experts // ep, cfg.num_experts // ep
    i_n = cfg.moe_intermediate_size // etp
    kv = cfg.num_key_value_heads
    for name, w in full.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            s = -(-cfg.vocab_size // pad) * pad // tp
            local = np.zeros((s, w.shape[1]), w.dtype)
            rows = w[c * s:(c + 1) * s]
            local[:len(rows)] = rows
        elif name.endswith(("experts.w13_weight", "experts.gate_up_proj")):
            m = cfg.moe_intermediate_size
            rows = np.r_[ec * i_n:(ec + 1) * i_n, m + ec * i_n:m + (ec + 1) * i_n]
            local = w[e_lo:e_lo + e_n][:, rows]
        elif "experts" in name:  # w2 / down_proj [E, H, I]
            local = w[e_lo:e_lo + e_n, :, ec * i_n:(ec + 1) * i_n]
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            local = np.split(w, tp, axis=1)[c]
        elif name.endswith(("k_proj.weight", "v_proj.weight")) and tp > kv:
            local = np.split(w, kv, axis=0)[c // (tp // kv)]
        elif name.endswith("proj.weight"):
            local = np.split(w, tp, axis=0)[c]
        else:
            local = w
        out[name] = local
    if fused:
        for i in range(cfg.num_hidden_layers):
            q = f"model.layers.{i}."
            out[q + "self_attn.qkv_proj.weight"] = np.concatenate([out.pop(q + f"self_attn.{n}_proj.weight")
                                                                   for n in "qkv"])
            if not cfg.is_sparse(i):
                out[q + "mlp.gate_up_proj.weight"] = np.concatenate([out.pop(q + f"mlp.{n}_proj.weight")
                                                                     for n in ("gate", "up")])
    return out


LAYOUTS = [  # name, tp_ranks, ep
    ("tp1", [2], 1),
    ("tp2", [2, 3], 1),
    ("tp4-kv-replicated", [2, 3, 4, 5], 1),
    ("ep2", [2, 3], 2),
    ("ep2xtp2", [[2, 3], [4, 5]], 2),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("experts", ["stacked", "per-expert"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_expert_params_match_slicing(layout, experts, dtype):
    _, tp_ranks, ep = layout
    cfg = _config(decoder_sparse_step=2 if experts == "stacked" else 1)
    shapes = param_shapes(cfg)
    arrays = _arrays(shapes, "float32" if dtype == "float32" else ml_dtypes.bfloat16)
    src_arrays = arrays if experts == "stacked" else _unstack(arrays)
    src_shapes = shapes if experts == "stacked" else _per_expert(shapes)
    source = bridge.Source.build(src_shapes, TRAINERS, _spec, dtype=dtype)
    m = qwen3_moe_param_map(cfg, source, tp_ranks, ep=ep, vocab_pad=64, dtype=dtype)
    got = bridge.BridgePlan(source, m, bucket_bytes=4096).reference(src_arrays)
    full = hf_state(arrays, cfg, experts="vllm")
    grid = np.atleast_2d(np.asarray(tp_ranks))
    flat = grid.ravel().tolist()
    egrid = grid if ep == 1 else grid.reshape(ep, -1)
    for rank in flat:
        (c,), (er, ec) = np.argwhere(grid == rank)[0][1:], np.argwhere(egrid == rank)[0]
        want = _oracle(full, cfg, grid.shape[1], int(c), ep, int(er) if ep > 1 else 0,
                       egrid.shape[1], int(ec), 64, True)
        assert sorted(got[rank]) == sorted(want), rank
        for name, w in want.items():
            assert got[rank][name].dtype == w.dtype, name
            np.testing.assert_array_equal(got[rank][name], w, err_msg=f"{name} on rank {rank}")


@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[4]], ids=[LAYOUTS[1][0], LAYOUTS[4][0]])
def test_transformers_names_and_custom_templates(layout):
    _, tp_ranks, ep = layout
    cfg = _config()
    source = bridge.Source.build(param_shapes(cfg), TRAINERS, _spec)
    arrays = _arrays(param_shapes(cfg), "float32")
    names = {"w13": "model.layers.{layer}.mlp.experts.gate_up_proj"}  # the target's own, given explicitly
    m = qwen3_moe_param_map(cfg, source, tp_ranks, ep=ep, target="hf", names=names)
    got = bridge.BridgePlan(source, m).reference(arrays)
    full = hf_state(arrays, cfg, experts="hf")
    grid = np.atleast_2d(np.asarray(tp_ranks))
    egrid = grid if ep == 1 else grid.reshape(ep, -1)
    for rank in grid.ravel().tolist():
        c = int(np.argwhere(grid == rank)[0][1])
        er, ec = (int(v) for v in np.argwhere(egrid == rank)[0])
        want = _oracle(full, cfg, grid.shape[1], c, ep, er if ep > 1 else 0, egrid.shape[1], ec, 64, False)
        assert sorted(got[rank]) == sorted(want)
        for name, w in want.items():
            np.testing.assert_array_equal(got[rank][name], w, err_msg=f"{name} on rank {rank}")
    vllm = qwen3_moe_param_map(cfg, source, tp_ranks, ep=ep,
                               names={"w13": "model.layers.{layer}.mlp.experts.routed_experts.w13_weight"})
    assert "model.layers.1.mlp.experts.routed_experts.w13_weight" in vllm.names()


@pytest.mark.parametrize("kw, match", [
    ({"target": "sglang"}, r"target must be 'vllm' \(FusedMoE names\) or 'hf'"),
    ({"names": {"w1": "x.{layer}"}}, r"names has key 'w1'; give templates for \['router', 'w13', 'w2'\]"),
    ({"names": {"w13": "experts.w13"}}, r"names\['w13'\] must be a str with '\{layer\}' in it"),
    ({"ep": 3}, r"ep=3 does not divide the 2 inference ranks"),
    ({"ep": 0}, r"ep must be a positive int"),
])
def test_recipe_arguments_are_checked(kw, match):
    cfg = _config()
    source = bridge.Source.build(param_shapes(cfg), TRAINERS, _spec)
    with pytest.raises(ValueError, match=match):
        qwen3_moe_param_map(cfg, source, [2, 3], **kw)


def test_experts_that_do_not_split_over_ep_are_refused():
    cfg = _config(num_experts=6)
    source = bridge.Source.build(param_shapes(cfg), TRAINERS, lambda p, s: ())
    with pytest.raises(ValueError, match=r"dim 'e'.*size 6.*does not split evenly over 4 ranks"):
        qwen3_moe_param_map(cfg, source, [2, 3, 4, 5], ep=4)
