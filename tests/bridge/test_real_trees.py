"""Rules for real JAX trees: scanned layers, heads as their own dims, named permutations, errors that name the rule."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import bridge
from bridge.recipes.maxtext import maxtext_param_map, maxtext_shapes
from jreshard import Layout
from jreshard.nn import LlamaConfig
from tests.bridge import _common as C

# MaxText leaf -> (flax leaf of jreshard.nn's Llama, the unscanned MaxText dims' sizes from the config)
_FLAX = {
    "self_attention/query/kernel": "attn/q_proj/kernel",
    "self_attention/key/kernel": "attn/k_proj/kernel",
    "self_attention/value/kernel": "attn/v_proj/kernel",
    "self_attention/out/kernel": "attn/o_proj/kernel",
    "mlp/wi_0/kernel": "mlp/gate_proj/kernel",
    "mlp/wi_1/kernel": "mlp/up_proj/kernel",
    "mlp/wo/kernel": "mlp/down_proj/kernel",
    "pre_self_attention_layer_norm/scale": "input_norm/scale",
    "post_self_attention_layer_norm/scale": "post_attention_norm/scale",
}


def _to_maxtext(flat: dict[str, np.ndarray], cfg: LlamaConfig, scan_axis: int) -> dict[str, np.ndarray]:
    """The flax Llama's arrays written as a MaxText scanned tree, by NumPy reshapes and stacking."""
    out = {"token_embedder/embedding": flat["embed/embedding"], "decoder/decoder_norm/scale": flat["final_norm/scale"],
           "decoder/logits_dense/kernel": flat["lm_head/kernel"]}
    for mt, fx in _FLAX.items():
        per_layer = []
        for i in range(cfg.num_hidden_layers):
            w = flat[f"layers_{i}/{fx}"]
            if mt.startswith("self_attention/out"):
                w = w.reshape(cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size)  # [heads, hd, emb]
            elif mt.startswith("self_attention"):
                w = w.reshape(cfg.hidden_size, -1, cfg.head_dim)  # [emb, heads, hd]
            per_layer.append(w)
        out[f"decoder/layers/{mt}"] = np.stack(per_layer, axis=scan_axis)
    return out


CASES = [  # name, scan axis, trainer mesh shape and axes, spec of a scanned leaf, TP ranks
    ("scan1-fsdp4-tp2", 1, (4,), ("fsdp",), lambda path, shape: ("fsdp",), [4, 5]),
    ("scan0-fsdp4-tp4-kv-replicated", 0, (4,), ("fsdp",), lambda path, shape: (None, "fsdp"), [4, 5, 6, 7]),
    # pipeline stages: the layer axis itself is sharded over 'stage'
    ("scan1-stage2xfsdp2-tp2", 1, (2, 2), ("stage", "fsdp"),
     lambda path, shape: ("fsdp", "stage") if len(shape) > 2 and "layers" in path else ("fsdp",), [[4, 5], [6, 7]]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_maxtext_tree_matches_vllm_slicing(case, dtype):
    _, scan_axis, mshape, axes, spec, tp_ranks = case
    cfg = LlamaConfig.load("llama-tiny", vocab_size=1000, num_hidden_layers=4, num_key_value_heads=2)
    arrays = C.make_arrays(cfg, seed=3)
    if dtype == "bfloat16":
        arrays = {k: v.astype(ml_dtypes.bfloat16) for k, v in arrays.items()}
    mt = _to_maxtext(arrays, cfg, scan_axis)
    shapes = maxtext_shapes(cfg, scan_axis=scan_axis)
    assert {k: v.shape for k, v in mt.items()} == shapes
    mesh = bridge.trainer_mesh(mshape, axes, [0, 1], 2)
    source = bridge.Source.build(shapes, mesh, lambda p, s: spec(p, s) if len(s) > 1 else (), dtype=dtype)
    m = maxtext_param_map(cfg, source, tp_ranks, scan_axis=scan_axis, vocab_pad=64, dtype=dtype)
    got = bridge.BridgePlan(source, m, bucket_bytes=64 << 10).reference(mt)
    grid = np.atleast_2d(np.asarray(tp_ranks))
    want = C.vllm_shards(arrays, cfg, grid.shape[1], fused=False, vocab_pad=64)
    for row in grid:
        for c, rank in enumerate(row):
            assert sorted(got[rank]) == sorted(want[c])
            for name, w in want[c].items():
                np.testing.assert_array_equal(got[rank][name], w.astype(got[rank][name].dtype), err_msg=name)


def _source(shapes: dict[str, tuple[int, ...]], spec=None) -> bridge.Source:
    mesh = bridge.trainer_mesh((2,), "x", [0], 2)
    return bridge.Source({k: Layout(s, mesh, spec or (), "float32") for k, s in shapes.items()})


def test_a_stacked_axis_at_any_position_selects_one_layer():
    src = _source({"w": (5, 3, 4)}, (None, None, "x"))  # [in, L, out]: layers on dim 1
    m = bridge.tp_param_map(src, [bridge.Rule("w", "l{L}.weight", dims="i L o -> o i", dim="o")], [7, 8])
    x = np.arange(60, dtype=np.float32).reshape(5, 3, 4)
    got = bridge.BridgePlan(src, m).reference({"w": x})
    for layer in range(3):
        full = x[:, layer, :].T  # [out, in]
        np.testing.assert_array_equal(got[7][f"l{layer}.weight"], full[:2])
        np.testing.assert_array_equal(got[8][f"l{layer}.weight"], full[2:])


def test_a_split_dim_fills_a_merged_param_dim():
    src = _source({"q": (6, 4, 2)})  # [emb, heads, hd] -> [(heads hd), emb], TP2 splits whole heads
    rule = bridge.Rule("q", "q_proj.weight", dims="emb heads hd -> (heads hd) emb", dim="heads", heads=4)
    x = np.arange(48, dtype=np.float32).reshape(6, 4, 2)
    got = bridge.BridgePlan(src, bridge.tp_param_map(src, [rule], [3, 4])).reference({"q": x})
    full = x.reshape(6, 8).T
    np.testing.assert_array_equal(got[3]["q_proj.weight"], full[:4])
    np.testing.assert_array_equal(got[4]["q_proj.weight"], full[4:])


def test_a_merged_leaf_dim_fills_split_param_dims():
    src = _source({"o": (8, 6)})  # [(heads hd), emb] as one leaf dim -> a [heads, hd, emb] param
    rule = bridge.Rule("o", "o.weight", transpose=(0, 1))
    x = np.arange(48, dtype=np.float32).reshape(8, 6)
    m = bridge.tp_param_map(src, [rule], [3])
    param = m.for_rank(3)[0]
    region = bridge.Region(param.regions[0].leaf, param.regions[0].box, (0, 0), (0, 1), view=(8, 6))
    m2 = bridge.ParamMap([bridge.Param("o.weight", 3, (4, 2, 6), "float32", (region,))])
    got = bridge.BridgePlan(src, m2).reference({"o": x})
    np.testing.assert_array_equal(got[3]["o.weight"], x.reshape(4, 2, 6))


def test_transpose_true_on_a_stacked_leaf_is_refused():
    src = _source({"layers/mlp/wi": (2, 4, 6)})
    with pytest.raises(ValueError, match=r"Rule 'layers/mlp/wi': transpose=True on a 3-dim leaf is ambiguous"):
        bridge.tp_param_map(src, [bridge.Rule("layers/mlp/wi", "w", transpose=True)], [3])


def test_a_missing_name_group_names_the_rule():
    src = _source({"layers_0/w": (4, 4)})
    pattern = r"layers_(\d+)/w"
    want = re.escape(f"Rule {pattern!r}: its name 'l{{1}}.{{2}}' cannot be filled for leaf 'layers_0/w'")
    with pytest.raises(ValueError, match=want + r".*the pattern's groups are \('0',\)"):
        bridge.tp_param_map(src, [bridge.Rule(pattern, "l{1}.{2}")], [3])


@pytest.mark.parametrize("kw, match", [
    ({"dims": "a b"}, r"dims must read 'leaf dims -> param dims'"),
    ({"dims": "a b -> (b a"}, r"unbalanced '\('"),
    ({"dims": "a a -> a"}, r"names \['a'\] twice on the leaf side"),
    ({"dims": "a b -> b a", "dim": "c"}, r"dim='c' is not a param dim"),
    ({"dims": "a -> a e"}, r"puts the new dim 'e' last"),
    ({"dims": "a -> e a"}, r"a new param dim in dims and at= go together"),
    ({"dims": "a b -> b a", "transpose": True}, r"give dims or transpose, not both"),
    ({"dim": "a"}, r"dim names a dim; name the dims with dims="),
])
def test_bad_dims_name_the_rule(kw, match):
    with pytest.raises(ValueError, match=r"Rule 'w'.*" + match):
        bridge.Rule("w", "w", **kw)


def test_dims_must_name_every_leaf_dim():
    with pytest.raises(ValueError, match=r"Rule 'w': dims 'a b -> b a' names 2 leaf dims, but the leaf has 3"):
        bridge.tp_param_map(_source({"w": (2, 3, 4)}), [bridge.Rule("w", "w", dims="a b -> b a")], [3])
