"""Expert-parallel layouts of the presets against a NumPy slicing oracle written from first principles.

The oracle shares nothing with the presets: it reads a device's coordinates off its
id (training: ``(edp, ep, fsdp, etp)`` with etp innermost in each pipeline stage;
inference: ``(edp, ep, etp)``, or ``(dp, tp)`` when experts follow tp), derives the
expert range and intermediate range the frameworks give that coordinate, and slices
the full tensor with them. The presets' shard of every device must equal that slice.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

import jreshard
from jreshard import Mesh
from jreshard.fleet import catalog, presets
from jreshard.fleet.presets import InferParallel, TrainParallel
from jreshard.nn import LlamaConfig, MoeConfig, fsdp_spec, param_shapes
from tests.helpers import assert_plan_ok

E, INTER, H = 8, 12, 16  # experts, intermediate, hidden
MOE = catalog.load_config({"model_type": "qwen3_moe", "name": "moe-oracle", "vocab_size": 64, "hidden_size": H,
                           "moe_intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 4, "num_experts": E, "dtype": "float32"})
# DeepSeek-V3's layer shape scaled down: many experts, small dims, a dense first layer and a shared expert.
DSV3_MINI = catalog.load_config({
    "model_type": "deepseek_v3", "name": "dsv3-mini", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "n_routed_experts": 64, "n_shared_experts": 1, "dtype": "bfloat16"})
PROJ = ("gate_proj", "up_proj", "down_proj")


def chunk(n: int, k: int, i: int) -> slice:
    """Part ``i`` of ``n`` split ``k`` ways as ``torch.chunk`` does."""
    c = -(-n // k)
    return slice(min(i * c, n), min((i + 1) * c, n))


def full(shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape).astype(ml_dtypes.bfloat16
                                                                                  if dtype == "bfloat16" else dtype)


def shard(layout: jreshard.Layout, x: np.ndarray, device: int) -> np.ndarray:
    return x[tuple(slice(s.start, s.stop) for s in layout.shard_box(device))]


def train_coords(i: int, par: TrainParallel, stage_size: int) -> tuple[int, int, int]:
    """(ep rank, fsdp rank, etp rank) of local device ``i`` of a training stage."""
    local = i % stage_size
    return (local // (par.expert_tp * par.fsdp)) % par.ep, (local // par.expert_tp) % par.fsdp, local % par.expert_tp


def stacked_oracle(x: np.ndarray, proj: str, experts: slice, inner: slice) -> np.ndarray:
    """HF-oriented stacked experts: gate/up ``[E, I, H]``, down ``[E, H, I]`` (``I`` is ``INTER``)."""
    return x[experts, inner, :] if proj != "down_proj" else x[experts, :, inner]


TRAIN = [TrainParallel(ep=8), TrainParallel(ep=4, fsdp=2), TrainParallel(ep=2, expert_tp=4),
         TrainParallel(ep=2, fsdp=2, expert_tp=2), TrainParallel(ep=4, expert_tp=2, pp=2),
         TrainParallel(fsdp=2, tp=2, dp=2), TrainParallel(ep=2, tp=2, dp=2, fsdp=2, expert_tp=2)]


@pytest.mark.parametrize("par", TRAIN, ids=str)
def test_training_stacked_experts(par):
    gpus = 8 * par.pp if par.pp > 1 else 8
    lay = presets.train_layouts(catalog.tensors(MOE, experts="stacked"), par, range(gpus))
    stage = gpus // par.pp
    for layer, proj in itertools.product(range(2), PROJ):
        name = f"model.layers.{layer}.mlp.experts.{proj}.weight"
        x = full(lay[name].shape)
        first = (layer * par.pp // 2) * stage  # 2 layers: one per stage when pp=2
        for d in range(first, first + stage):
            ep_r, fsdp_r, etp_r = train_coords(d, par, stage)
            want = stacked_oracle(x, proj, chunk(E, par.ep * par.fsdp, ep_r * par.fsdp + fsdp_r),
                                  chunk(INTER, par.expert_tp, etp_r))
            np.testing.assert_array_equal(shard(lay[name], x, d), want, err_msg=f"{name} device {d}")
        assert set(lay[name].mesh.device_ids) == set(range(first, first + stage))


@pytest.mark.parametrize("par", TRAIN, ids=str)
def test_training_one_leaf_per_expert(par):
    gpus = 8 * par.pp if par.pp > 1 else 8
    lay = presets.train_layouts(catalog.tensors(MOE), par, range(gpus))
    stage = gpus // par.pp
    for layer, e, proj in itertools.product(range(2), range(E), PROJ):
        name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
        x = full(lay[name].shape)
        first = (layer * par.pp // 2) * stage
        for d in range(first, first + stage):
            ep_r, fsdp_r, etp_r = train_coords(d, par, stage)
            if e // (E // par.ep) != ep_r:
                assert d not in lay[name].mesh, f"{name} on device {d} of ep rank {ep_r}"
                continue
            if proj == "down_proj":  # [H, I]: H over fsdp (leading dim), I over etp
                want = x[chunk(H, par.fsdp, fsdp_r), chunk(INTER, par.expert_tp, etp_r)]
            else:  # [I, H]: I over fsdp (major) and etp (minor)
                want = x[chunk(INTER, par.fsdp * par.expert_tp, fsdp_r * par.expert_tp + etp_r), :]
            np.testing.assert_array_equal(shard(lay[name], x, d), want, err_msg=f"{name} device {d}")


def vllm_w13(gate: np.ndarray, up: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """vLLM's ``w13_weight`` of one rank, loaded from the fused Hugging Face ``gate_up_proj [E, 2I, H]``."""
    gate_up = np.concatenate([gate, up], axis=1)
    n = INTER // tp
    rows = np.r_[rank * n:(rank + 1) * n, INTER + rank * n:INTER + (rank + 1) * n]  # this rank's gate, then up rows
    return gate_up[:, rows]


@pytest.mark.parametrize("tp, dp", [(1, 8), (2, 4), (4, 2)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inference_tp_is_fused_w13(tp, dp, dtype):
    lay = presets.infer_layouts(catalog.tensors(MOE, experts="stacked"), InferParallel(tp=tp, dp=dp),
                                range(8, 16), dtype=dtype)
    gate, up, down = (full(lay[f"model.layers.0.mlp.experts.{p}.weight"].shape, dtype) for p in PROJ)
    names = [f"model.layers.0.mlp.experts.{p}.weight" for p in PROJ]
    assert {lay[n].dtype for n in names} == {dtype}
    for d in range(8, 16):
        rank = (d - 8) % tp
        w13 = np.concatenate([shard(lay[names[0]], gate, d), shard(lay[names[1]], up, d)], axis=1)
        np.testing.assert_array_equal(w13, vllm_w13(gate, up, tp, rank))  # [E, 2I/tp, H]
        np.testing.assert_array_equal(shard(lay[names[2]], down, d), down[:, :, chunk(INTER, tp, rank)])  # w2


@pytest.mark.parametrize("par", [InferParallel(tp=2, dp=4, ep=2), InferParallel(tp=4, dp=2, ep=8),
                                 InferParallel(tp=4, dp=2, ep=2, expert_tp=2), InferParallel(tp=2, dp=4, ep=4),
                                 InferParallel(tp=4, dp=2, expert_tp=4)], ids=str)
@pytest.mark.parametrize("experts", ["stacked", "separate"])
def test_inference_ep_linear_placement(par, experts):
    lay = presets.infer_layouts(catalog.tensors(MOE, experts=experts), par, range(8, 16))
    for d in range(8, 16):
        i = d - 8
        ep_r, etp_r = (i // par.expert_tp) % par.ep, i % par.expert_tp
        mine = range(ep_r * E // par.ep, (ep_r + 1) * E // par.ep)  # rank r holds [r*E/ep, (r+1)*E/ep)
        inner = chunk(INTER, par.expert_tp, etp_r)
        for proj in PROJ:
            if experts == "stacked":
                name = f"model.layers.1.mlp.experts.{proj}.weight"
                x = full(lay[name].shape)
                want = stacked_oracle(x, proj, slice(mine.start, mine.stop), inner)
                np.testing.assert_array_equal(shard(lay[name], x, d), want, err_msg=f"{name} device {d}")
                continue
            for e in range(E):
                name = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
                if e not in mine:
                    assert d not in lay[name].mesh
                    continue
                x = full(lay[name].shape)
                want = x[inner, :] if proj != "down_proj" else x[:, inner]
                np.testing.assert_array_equal(shard(lay[name], x, d), want, err_msg=f"{name} device {d}")


@pytest.mark.parametrize("shape, names", [((2, 2, 2), ("ep", "fsdp", "tp")), ((4, 2), ("ep", "tp")),
                                          ((2, 4), ("ep", "fsdp")), ((8,), ("ep",)), ((2, 2, 2), ("dp", "ep", "tp"))])
def test_nn_moe_tree(shape, names):
    cfg = MoeConfig.load("qwen3-moe-tiny")  # experts [8, 128, 64] and [8, 64, 128]
    devices = np.arange(8).reshape(shape)
    lay = presets.nn_layouts(cfg, Mesh(devices, names))
    size = dict(zip(names, shape, strict=True))
    ep, fsdp, tp = (size.get(a, 1) for a in ("ep", "fsdp", "tp"))
    n_exp, inner = cfg.num_experts, cfg.moe_intermediate_size
    for d in range(8):
        coord = dict(zip(names, np.argwhere(devices == d)[0].tolist(), strict=True))
        experts = chunk(n_exp, ep * fsdp, coord.get("ep", 0) * fsdp + coord.get("fsdp", 0))
        cols = chunk(inner, tp, coord.get("tp", 0))
        for proj in PROJ:
            name = f"layers_1/mlp/experts/{proj}"
            x = full(lay[name].shape)
            want = x[experts, :, cols] if proj != "down_proj" else x[experts, cols, :]  # flax: [E, H, I], [E, I, H]
            np.testing.assert_array_equal(shard(lay[name], x, d), want, err_msg=f"{name} device {d}")
        router = lay["layers_1/mlp/router/kernel"]  # [H, E]: fsdp on the leading dim, never split by tp or ep
        assert router.shard_box(d)[1] == slice(0, n_exp)


def test_nn_dense_tree_matches_the_flax_fsdp_rule():
    cfg = LlamaConfig.load("llama-tiny")
    lay = presets.nn_layouts(cfg, Mesh(np.arange(4).reshape(2, 2), ("fsdp", "tp")))
    assert lay["layers_0/attn/q_proj/kernel"].spec == ("fsdp", "tp")
    assert lay["layers_0/attn/o_proj/kernel"].spec[0] == ("fsdp", "tp")  # row parallel: tp minor on dim 0
    assert lay["layers_0/mlp/down_proj/kernel"].shard_box(1) == (slice(172, 344), slice(0, 256))  # [688, 256]
    assert lay["final_norm/scale"].replication == 4
    only_fsdp = presets.nn_layouts(cfg, Mesh(np.arange(4), ("fsdp",)))
    for path, shape in param_shapes(cfg).items():
        assert only_fsdp[path].dim_axes == tuple(() if a is None else (a,) for a in fsdp_spec(path, shape)), path


@pytest.mark.parametrize("mesh, match", [
    (Mesh(np.arange(8).reshape(1, 8), ("ep", "tp")), "mesh axis 'tp' on leaf 'layers_0/attn/q_proj/kernel'.*4 heads"),
    (Mesh(np.arange(16), ("ep",)), "leaf 'layers_0/mlp/experts/gate_proj' dim 0 of size 8 does not split evenly"),
])
def test_nn_layouts_refuse(mesh, match):
    with pytest.raises(ValueError, match=match):
        presets.nn_layouts(MoeConfig.load("qwen3-moe-tiny"), mesh)


def test_nn_layouts_wants_a_config():
    with pytest.raises(TypeError, match="config must be a jreshard.nn LlamaConfig or MoeConfig"):
        presets.nn_layouts({"hidden_size": 4}, Mesh([0], "fsdp"))


@pytest.mark.parametrize("train, infer", [
    (TrainParallel(ep=8), InferParallel(tp=2, dp=4)),
    (TrainParallel(ep=4, fsdp=2), InferParallel(tp=2, dp=4)),
    (TrainParallel(ep=2, fsdp=2, expert_tp=2), InferParallel(tp=4, dp=2, ep=2, expert_tp=2)),
    (TrainParallel(ep=8), InferParallel(tp=4, dp=2, ep=8)),
], ids=str)
@pytest.mark.parametrize("experts", ["stacked", "separate"])
def test_plan_ep_training_to_tp_inference_meets_the_lower_bound(train, infer, experts):
    infos = catalog.tensors(DSV3_MINI, experts=experts)
    src = presets.train_layouts(infos, train, range(8))
    dst = presets.infer_layouts(infos, infer, range(8, 16))
    layer = [t.name for t in infos if t.layer == 1 and t.is_expert]
    assert len(layer) == (3 if experts == "stacked" else 3 * 64)
    p = jreshard.plan({n: src[n] for n in layer}, {n: dst[n] for n in layer})
    p.check()
    s = p.stats()
    assert s.network_bytes == s.lower_bound_bytes == (8 // infer.expert_tp // infer.ep if infer.splits_experts
                                                      else 8 // infer.tp) * 64 * 3 * 32 * 64 * 2
    for n in layer[:3] + layer[-3:]:
        assert_plan_ok(p[n])
    back = jreshard.plan({n: dst[n] for n in layer}, {n: src[n] for n in layer})  # inference -> training
    back.check()
    assert back.stats().network_bytes == back.stats().lower_bound_bytes
