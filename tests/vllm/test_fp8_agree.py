"""The hellos of an FP8 engine: the agreed plan fills vLLM's block-FP8 parameters, bit for bit.

The workers' hellos carry the engine params of vLLM 0.32's ``Fp8LinearMethod`` with block
scales (``tests/bridge/test_fp8_vllm.engine_params``: ``weight`` float8_e4m3fn ``[out/tp, in]``,
``weight_scale_inv`` float32 ``[ceil(out/tp/n), ceil(in/k)]``, norms and embeddings in
bfloat16) plus the FP8 entry a worker of a block-FP8 model adds. The delivery is checked
with the plan's NumPy execution against a NumPy quantizer and vLLM's slicing
(``tests/bridge/test_fp8_rules.expected``), bit for bit. Pure: no jax, no vLLM (a live FP8
engine is synced in ``tests/vllm/test_fp8_live.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from bridge import BridgePlan
from bridge.engines.agree import agree, plan_from_hellos
from bridge.engines.fp8 import fp8_hello
from bridge.engines.hello import EngineShape, build_param_map
from bridge.errors import PlanMismatchError
from bridge.recipes import Recipe
from tests.bridge import _common as B
from tests.bridge.test_fp8_rules import arrays, bits, expected, sent_tree
from tests.bridge.test_fp8_vllm import QUANT, config, engine_params
from tests.vllm.test_hello import hellos

BLOCK = (32, 128)


def fp8_hellos(cfg, tp: int, quant=QUANT) -> list[dict]:
    engine = EngineShape((tuple(range(2, 2 + tp)),), False, "bfloat16")
    out = hellos(B.source_for(cfg), Recipe.llama(cfg, vocab_pad=64), engine,
                 {r: engine_params(cfg, tp, BLOCK) for r in engine.ranks[0]})
    for h in out[2:]:
        h.update(fp8_hello(quant))
    return out


@pytest.mark.parametrize("tp,heads,kv_heads", [(1, 8, 2), (2, 16, 4)])
def test_an_fp8_engine_agrees_on_fp8_weights_and_scales_equal_to_vllms_slices(tp, heads, kv_heads):
    cfg = config(heads, kv_heads)
    got = agree(fp8_hellos(cfg, tp))
    assert got.fp8 is not None and got.fp8.fmt.block == BLOCK and got.plan.source == got.fp8.source
    ranks = list(range(2, 2 + tp))
    want_params = engine_params(cfg, tp, BLOCK)
    for r in ranks:
        assert sorted((p.name, p.shape, p.dtype) for p in got.plan.param_map.for_rank(r)) == sorted(
            (t.name, t.shape, t.dtype) for t in want_params)
    flat = arrays(cfg)
    delivered = got.plan.reference(sent_tree(got.fp8, flat))
    want = expected(cfg, flat, tp, BLOCK, fused=True)
    for oracle in want:  # the oracle slices no q/k norms: whole on every rank
        oracle.update({f"model.layers.{i}.self_attn.{x}_norm.weight": flat[f"layers_{i}/attn/{x}_norm/scale"]
                       for i in range(cfg.num_hidden_layers) for x in "qk"})
    for r in ranks:
        assert sorted(delivered[r]) == sorted(want[r - 2])
        for name, w in want[r - 2].items():
            g = delivered[r][name]
            np.testing.assert_array_equal(bits(g), bits(w.astype(g.dtype)), err_msg=f"rank {r} {name}")
    # Only FP8 bytes and float32 scales replace the bfloat16 linear weights on the wire.
    assert got.plan.network_bytes < BridgePlan(B.source_for(cfg), build_param_map(
        B.source_for(cfg), Recipe.llama(cfg, vocab_pad=64), EngineShape((tuple(ranks),), False, "bfloat16"))
    ).network_bytes


def test_an_engine_that_is_not_fp8_keeps_its_hello_and_plan():
    assert fp8_hello(None) == {} and fp8_hello({"quant_method": "awq"}) == {}
    cfg = config()
    plain = fp8_hellos(cfg, 1, quant=None)
    assert all("fp8" not in h for h in plain)
    bf16 = [dict(h, params=[[n, s, "bfloat16"] for n, s, d in h["params"] if not n.endswith("_scale_inv")])
            if h["role"] == "worker" else h for h in plain]
    got = agree(bf16)
    source, engine = B.source_for(cfg), EngineShape(((2,),), False, "bfloat16")
    before = BridgePlan(source, build_param_map(source, Recipe.llama(cfg, vocab_pad=64), engine), bucket_bytes=1 << 20)
    assert got.fp8 is None and got.plan.fingerprint == plan_from_hellos(bf16).fingerprint == before.fingerprint
    assert {p.dtype for p in got.plan.param_map.params} == {"bfloat16"}


@pytest.mark.parametrize("case,match", [
    ("per-tensor", r"do not fit the engine: .*per-tensor FP8 \(no weight_block_size\)"),
    ("disagree", r"the engine's workers disagree on the FP8 format"),
    ("cut", r"do not fit the FP8 engine .*input_size_per_partition = 192 is not divisible by block_k = 128"),
    ("bf16-engine-params", r"do not match the engine; nothing was sent: rank 2: .*weight_scale_inv"),
], ids=lambda x: x if x in ("per-tensor", "disagree", "cut", "bf16-engine-params") else "")
def test_fp8_refusals_reach_every_rank_as_a_plan_mismatch(case, match):
    tp = 2 if case in ("cut", "disagree") else 1
    hs = fp8_hellos(config(), tp)  # TP2 of 8 heads: o_proj's 192 inputs a rank cut 128-wide blocks
    if case == "per-tensor":
        for h in hs[2:]:
            h.update(fp8_hello({"quant_method": "fp8", "activation_scheme": "dynamic"}))
    elif case == "disagree":
        hs[3].update(fp8_hello({**QUANT, "weight_block_size": [128, 128]}))
    elif case == "bf16-engine-params":  # an FP8 hello over engine params without scales
        hs[2]["params"] = [t for t in hs[2]["params"] if not t[0].endswith("_scale_inv")]
    with pytest.raises(PlanMismatchError, match=match):
        agree(hs)
