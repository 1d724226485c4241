"""FP8 param maps: weight and scale targets against a NumPy quantizer and vLLM's slicing, written here.

Pure (no jax, no torch): each plan's NumPy execution (``BridgePlan.reference``) of the
quantized tree must equal, bit for bit, quantizing the full Hugging Face weights with
the quantizer below (float32 scalars, one block at a time) and slicing weights and
scales as vLLM's TP layers do (tests/bridge/_common.vllm_shards).
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import bridge
from bridge.plan.fp8 import QUANTIZE_LINEAR, scale_leaf, scale_source_layout
from jreshard import Layout
from jreshard.core.fp8 import Fp8Format, quantize
from jreshard.nn import LlamaConfig, param_shapes
from tests.bridge import _common as C
from tests.helpers import hf_state

FP8 = ml_dtypes.float8_e4m3fn


def bits(a: np.ndarray) -> np.ndarray:
    """FP8 arrays as their bytes, so that equality is bit for bit (NaN, -0); other arrays as they are."""
    return a.view(np.uint8) if a.dtype == FP8 else a


def ref_quantize(w: np.ndarray, bn: int | None, bk: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``[out, in]`` -> (FP8 weight, float32 scale_inv), one block at a time as vLLM's per_block_cast_to_fp8."""
    out, inn = w.shape
    bn, bk = bn or out, bk or inn
    q = np.zeros(w.shape, FP8)
    s = np.zeros((-(-out // bn), -(-inn // bk)), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].astype(np.float32)
            amax = max(np.float32(np.abs(blk).max()), np.float32(1e-4))
            scale = np.float32(amax / np.float32(448.0))
            s[i, j] = scale
            factor = np.float32(np.float32(1.0) / scale)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk * factor).astype(FP8)
    return q, s


def config(**kw) -> LlamaConfig:
    return LlamaConfig.load("llama-tiny", intermediate_size=512, num_hidden_layers=2, **kw)


def arrays(cfg: LlamaConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for p, s in sorted(param_shapes(cfg).items()):
        a = rng.standard_normal(s, dtype=np.float32) * rng.uniform(0.01, 3.0)
        if p.endswith("q_proj/kernel"):
            a[:64, :64] = 0.0  # an all-zero block: the amax floor
            a[64, 64:70] = [1e-40, -1e-41, 448.0, -3e38, 3e38, 0.0]  # denormals and float32 extremes
        out[p] = a
    return out


def expected(cfg: LlamaConfig, flat: dict[str, np.ndarray], tp: int, block, fused: bool) -> list[dict]:
    """Every rank's params: the full HF weights quantized here, then weights and scales sliced as vLLM does."""
    bn, bk = block
    weights, scales = dict(flat), dict(flat)
    for p, a in flat.items():
        if p.endswith("_proj/kernel"):
            q, s = ref_quantize(a.T, bn, bk)  # the HF weight [out, in]
            weights[p], scales[p] = q.T, s.T  # back to the leaf's [in, out], as vllm_shards transposes
    w_ranks = C.vllm_shards(weights, cfg, tp, fused=fused, vocab_pad=64)
    s_ranks = C.vllm_shards(scales, cfg, tp, fused=fused, vocab_pad=64)
    for w, s in zip(w_ranks, s_ranks, strict=True):
        for name in list(w):
            if name.endswith("_proj.weight"):
                w[name + "_scale_inv"] = s[name]
    return w_ranks


def sent_tree(fp8: bridge.Fp8ParamMap, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The quantized tree the trainer sends, computed with the core quantizer in each leaf's own dims."""
    out = dict(flat)
    for leaf, fmt in fp8.formats.items():
        q = quantize(flat[leaf], fmt)
        out[leaf], out[scale_leaf(leaf)] = q.weight, q.scale_inv
    return out


CASES = [  # (tp, block (block_n, block_k), fused, trainer mesh)
    (1, (128, 128), False, "fsdp4"),
    (2, (64, 128), True, "fsdp4"),
    (2, (64, 128), False, "fsdp2x2"),
    (4, (32, 64), True, "fsdp4"),
]


def _source(cfg, mesh: str) -> bridge.Source:
    if mesh == "fsdp4":
        return C.source_for(cfg)
    # FSDP over 2 x a second axis on the other dim: shards cut blocks in both dims.
    return C.source_for(cfg, mesh_shape=(2, 2), axes=("fsdp", "tp"),
                        spec=lambda p, s: ("fsdp", "tp") if len(s) == 2 else (None,) * len(s))


@pytest.mark.parametrize("tp,block,fused,mesh", CASES, ids=[f"tp{c[0]}-{c[1][0]}x{c[1][1]}-{'fused' if c[2] else 'hf'}"
                                                           f"-{c[3]}" for c in CASES])
def test_weights_and_scales_equal_vllm_slices_of_the_reference(tp, block, fused, mesh):
    cfg = config()
    source = _source(cfg, mesh)
    ranks = list(range(2, 2 + tp))  # trainer processes are torch ranks 0 and 1
    fp8 = bridge.fp8_param_map(source, bridge.llama_param_map(cfg, source, ranks, fused=fused, vocab_pad=64),
                               Fp8Format(block=block))
    flat = arrays(cfg)
    got = bridge.BridgePlan(fp8.source, fp8.param_map).reference(sent_tree(fp8, flat))
    want = expected(cfg, flat, tp, block, fused)
    for r in ranks:
        assert sorted(got[r]) == sorted(want[r - 2])
        for name, w in want[r - 2].items():
            g = got[r][name]
            assert g.dtype == (FP8 if name.endswith("_proj.weight") else np.float32), name
            np.testing.assert_array_equal(bits(g), bits(w.astype(g.dtype)), err_msg=f"rank {r} {name}")
    # Leaves are quantized in their own dims: the block of a kernel [in, out] is (block_k, block_n).
    assert fp8.formats["layers_0/attn/q_proj/kernel"].block == (block[1], block[0])
    # Only the linear layers are quantized; embeddings, lm_head and norms keep the model's dtype.
    assert {p.name for p in fp8.param_map.params if p.dtype == "float8_e4m3fn"} == {
        p.name for p in fp8.param_map.params if p.name.endswith("_proj.weight")}
    assert fp8.param_map.for_rank(2)[0].name == "lm_head.weight" and fp8.param_map.for_rank(2)[0].dtype == "float32"


def test_fp8_bytes_are_about_half_of_bfloat16():
    cfg = config()
    source = C.source_for(cfg)
    fmt = Fp8Format(block=(64, 128))
    bf16 = bridge.BridgePlan(source, bridge.llama_param_map(cfg, source, [2, 3], fused=True, dtype="bfloat16"))
    fp8 = bridge.fp8_param_map(source, bridge.llama_param_map(cfg, source, [2, 3], fused=True, dtype="bfloat16"), fmt)
    plan = bridge.BridgePlan(fp8.source, fp8.param_map)
    linear = sum(math.prod(p.shape) for p in fp8.param_map.params if p.name in fp8.weights)
    scales = sum(math.prod(p.shape) for p in fp8.param_map.params if p.name.endswith("_scale_inv"))
    assert plan.network_bytes == bf16.network_bytes - linear + 4 * scales  # 2 -> 1 byte per linear element


@pytest.mark.parametrize("shape,block,want", [
    ((256, 512), (128, 128), ((), ())),          # 64-row shards cut 128-row blocks: every holder knows the scale
    ((512, 256), (128, 128), (("fsdp",), ())),   # 128-row shards hold whole blocks: scales split as the weight
    ((256, 512), (64, None), (("fsdp",), ())),   # one scale per 64 rows and the whole row
    ((6, 512), (2, 128), ((), ())),              # uneven shards: replicated
])
def test_scale_source_layout_follows_the_trainer_quantizer(shape, block, want):
    mesh = bridge.trainer_mesh((4,), "fsdp", [0, 1], 2)
    got = scale_source_layout(Layout(shape, mesh, ("fsdp",)), Fp8Format(block=block))
    assert got.dim_axes == want
    assert got.shape == Fp8Format(block=block).scale_shape(shape) and got.dtype == "float32"


def test_per_channel_and_per_tensor_scales():
    cfg = config()
    source = C.source_for(cfg)
    hf = bridge.llama_param_map(cfg, source, [2, 3], vocab_pad=64)
    flat = arrays(cfg)
    for block in ((1, None), (None, None)):
        fp8 = bridge.fp8_param_map(source, hf, Fp8Format(block=block))
        got = bridge.BridgePlan(fp8.source, fp8.param_map).reference(sent_tree(fp8, flat))
        for r in (0, 1):
            rank = r + 2
            for leaf, name, col in (("q_proj", "self_attn.q_proj", True), ("o_proj", "self_attn.o_proj", False)):
                w = flat[f"layers_1/attn/{leaf}/kernel"].T
                q, s = ref_quantize(w, *block)
                n = w.shape[0] // 2 if col else w.shape[0]
                k = w.shape[1] if col else w.shape[1] // 2
                qs = q[r * n:(r + 1) * n] if col else q[:, r * k:(r + 1) * k]
                ss = s[r * n:(r + 1) * n] if col and block[0] == 1 else s  # a row-parallel split shares its scales
                np.testing.assert_array_equal(bits(got[rank][f"model.layers.1.{name}.weight"]), bits(qs))
                np.testing.assert_array_equal(got[rank][f"model.layers.1.{name}.weight_scale_inv"], ss)


def _fused(block, tp=2, **kw):
    cfg = config(**kw)
    source = C.source_for(cfg)
    return source, bridge.llama_param_map(cfg, source, list(range(2, 2 + tp)), fused=True), Fp8Format(block=block)


@pytest.mark.parametrize("args,exc,match", [
    (_fused((128, 128)), ValueError,
     r"qkv_proj.weight.*cuts the FP8 blocks of 128.*vLLM refuses this split too \(output_partition_size = 64 is "
     r"not divisible by block_n = 128\)"),
    (_fused((32, 128), tp=4), ValueError,
     r"o_proj.weight.*input_size_per_partition = 64 is not divisible by block_k = 128"),
    (_fused((None, None)), ValueError, r"_proj.weight.*a whole-dim block \(None\).*a fused param"),
    ((*_fused((64, 64))[:2], (64, 64)), TypeError, r"fmt must be a jreshard.core.fp8.Fp8Format"),
    ((*_fused((64, 64))[:2], Fp8Format(block=(64, 64), dtype="float8_e5m2")), ValueError,
     r"fmt.dtype 'float8_e5m2' is not a dtype the wire carries"),
], ids=["fused-part-cuts-block", "row-parallel-cuts-block", "per-tensor-fused", "fmt-type", "fmt-dtype"])
def test_refusals(args, exc, match):
    with pytest.raises(exc, match=match):
        bridge.fp8_param_map(*args)


def test_plan_refuses_fp8_params_from_unquantized_leaves():
    """The sender does not quantize: an FP8 param must read FP8 leaves, as ``fp8.source`` declares them."""
    source, pm, fmt = _fused((64, 64))
    fp8 = bridge.fp8_param_map(source, pm, fmt)
    unquantized = bridge.Source({path: lay.with_dtype("float32") if path in fp8.formats else lay
                                 for path, lay in fp8.source.items()})
    with pytest.raises(ValueError, match=r"down_proj.weight' on rank 2 is float8_e4m3fn but its leaf "
                                         r"'layers_0/mlp/down_proj/kernel' is float32; the sender does not quantize"):
        bridge.BridgePlan(unquantized, fp8.param_map)
    assert bridge.BridgePlan(fp8.source, fp8.param_map).network_bytes > 0


def test_refusals_of_quantize():
    source, pm, fmt = _fused((64, 64), tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"no param matches quantize"):
        bridge.fp8_param_map(source, pm, fmt, quantize=r"nothing")
    with pytest.raises(ValueError, match=r"leaf 'embed/embedding' fills the quantized param.*unquantized"):
        bridge.fp8_param_map(source, pm, Fp8Format(block=(64, 64)), quantize=r"lm_head\.weight")
    with pytest.raises(TypeError, match=r"quantize must be"):
        bridge.fp8_param_map(source, pm, fmt, quantize=3)


def quantize_full(full: dict[str, np.ndarray], bn: int, bk: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The linear tensors of ``full`` quantized here, one matrix (expert) at a time: (tensors, their scales)."""
    quantized, scales = dict(full), {}
    for name, w in full.items():
        if re.fullmatch(QUANTIZE_LINEAR, name):
            pairs = [ref_quantize(m, bn, bk) for m in w.reshape(-1, *w.shape[-2:])]
            quantized[name] = np.stack([q for q, _ in pairs]).reshape(w.shape)
            scales[name] = np.stack([s for _, s in pairs]).reshape(*w.shape[:-2], *pairs[0][1].shape)
    return quantized, scales


@pytest.mark.parametrize("tp_ranks,ep", [([2, 3], 1), ([2, 3], 2)], ids=["tp2", "ep2"])
def test_moe_experts_quantized_per_expert_and_block(tp_ranks, ep):
    """Stacked experts ``[E, H, I]`` into vLLM's ``w13_weight``/``w2_weight`` with their scales."""
    import dataclasses

    from bridge.recipes.qwen3_moe import qwen3_moe_param_map
    from tests.bridge import test_moe_rules as M

    cfg = M._config(decoder_sparse_step=2)
    b = 8  # blocks of 8 x 8: the 16-wide expert MLP splits into whole blocks over TP2
    arrays = M._arrays(param_shapes(cfg), "float32")
    source = bridge.Source.build(param_shapes(cfg), M.TRAINERS, M._spec)
    fp8 = bridge.fp8_param_map(source, qwen3_moe_param_map(cfg, source, tp_ranks, ep=ep, vocab_pad=64),
                               Fp8Format(block=(b, b)))
    assert fp8.formats["layers_1/mlp/experts/gate_proj"].block == (1, b, b)
    got = bridge.BridgePlan(fp8.source, fp8.param_map).reference(sent_tree(fp8, arrays))
    quantized, scales = quantize_full(hf_state(arrays, cfg, experts="vllm"), b, b)
    small = dataclasses.replace(cfg, moe_intermediate_size=cfg.moe_intermediate_size // b)  # the scale grid's sizes
    for k, rank in enumerate(tp_ranks):
        c, er, ec = (k, 0, k) if ep == 1 else (k, k, 0)
        etp = len(tp_ranks) // ep
        want = M._oracle(quantized, cfg, len(tp_ranks), c, ep, er, etp, ec, 64, True)
        want |= {n + "_scale_inv": s for n, s in M._oracle(scales, small, len(tp_ranks), c, ep, er, etp, ec, 64,
                                                          True).items()}
        assert sorted(got[rank]) == sorted(want)
        assert {"model.layers.1.mlp.experts.w13_weight_scale_inv", "model.layers.1.mlp.experts.w2_weight_scale_inv",
                "model.layers.0.mlp.gate_up_proj.weight_scale_inv"} <= set(want)
        for name, w in want.items():
            g = got[rank][name]
            np.testing.assert_array_equal(bits(g), bits(w.astype(g.dtype)), err_msg=f"{rank} {name}")
