"""The hellos' plain data and the plan every rank agrees on, without an engine (numpy and torch only)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bridge import Source, trainer_mesh
from bridge.engines.hello import (
    EngineParam,
    EngineShape,
    build_param_map,
    check_engine_params,
    engine_params_of,
    engine_shape,
    resolve_names,
    source_from_data,
    source_to_data,
    trainer_hello,
    worker_hello,
    worker_rank,
)
from bridge.recipes import Recipe
from jreshard import Layout, Mesh
from jreshard.nn import MoeConfig, fsdp_spec, param_shapes
from tests.vllm import _common as C

TP2 = EngineShape(((2, 3),), False, "float32")


def dense_source() -> Source:
    return Source.build(param_shapes(C.qwen3_config()), trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)


def params_of(param_map, ranks=(2, 3)) -> dict[int, list[EngineParam]]:
    return {r: [EngineParam(p.name, p.shape, p.dtype) for p in param_map.for_rank(r)] for r in ranks}


def hellos(source: Source, recipe: Recipe, engine: EngineShape, params: dict[int, list[EngineParam]]) -> list[dict]:
    out = [trainer_hello(0, source=source, recipe=recipe, bucket_bytes=1 << 20), trainer_hello(1)]
    for d, group in enumerate(engine.ranks):
        for t, rank in enumerate(group):
            out.append(worker_hello(rank=rank, replica=d, tp_rank=t, tp=engine.tp, replicas=len(engine.ranks),
                                    expert_parallel=engine.expert_parallel, dtype=engine.dtype, params=params[rank]))
    return json.loads(json.dumps(out))  # what crosses the wire


def test_leaves_survive_json_in_the_trainers_device_order():
    mesh = Mesh(np.array([[1001001, 1000000], [1000001, 1001000]]), ("fsdp", "tp"))
    src = Source({"w": Layout((8, 6), mesh, (("fsdp", "tp"), None), "bfloat16"),
                  "b": Layout((6,), mesh, (None,), "float32")})
    back = source_from_data(json.loads(json.dumps(source_to_data(src))))
    assert back == src
    assert back.layout("w").mesh.devices.tolist() == [[1001001, 1000000], [1000001, 1001000]]


@pytest.mark.parametrize("recipe", [Recipe.llama(C.qwen3_config()), Recipe.qwen3_moe(MoeConfig.load("qwen3-moe-tiny"))],
                         ids=["llama", "qwen3-moe"])
def test_recipes_survive_json(recipe):
    assert Recipe.from_data(json.loads(json.dumps(recipe.to_data()))) == recipe


def test_recipe_refuses_what_is_not_a_rule():
    with pytest.raises(TypeError, match="Recipe rules must hold bridge.Rule, got str"):
        Recipe(("not a rule",))  # type: ignore[arg-type]


def test_a_matching_engine_agrees_and_every_worker_receives_its_lower_bound():
    from bridge.engines.agree import plan_from_hellos

    src, recipe = dense_source(), Recipe.llama(C.qwen3_config())
    pm = build_param_map(src, recipe, TP2)
    plan = plan_from_hellos(hellos(src, recipe, TP2, params_of(pm)))
    regions = {r: sum(int(np.prod(g.shape)) * 4 for p in pm.for_rank(r) for g in p.regions) for r in (2, 3)}
    assert plan.rank_bytes()["recv"] == regions
    params = {r: sum(int(np.prod(p.shape)) * 4 for p in pm.for_rank(r)) for r in (2, 3)}
    assert regions[2] == params[2] and regions[3] < params[3]  # rank 3's padded vocabulary rows are not sent


def test_a_mismatch_is_refused_with_what_differs():
    from bridge.engines.agree import plan_from_hellos
    from bridge.errors import PlanMismatchError

    src, recipe = dense_source(), Recipe.llama(C.qwen3_config())
    params = params_of(build_param_map(src, recipe, TP2))
    params[3] = [dataclasses.replace(t, dtype="bfloat16") if "qkv" in t.name else t for t in params[3]]
    with pytest.raises(PlanMismatchError, match=r"rank 3: 'model\.layers\.0\.self_attn\.qkv_proj\.weight' is "
                                                r"\(128, 128\) bfloat16 in the engine but \(128, 128\) float32"):
        plan_from_hellos(hellos(src, recipe, TP2, params))


def test_check_engine_params_names_missing_and_extra_params():
    src, recipe = dense_source(), Recipe.llama(C.qwen3_config())
    pm = build_param_map(src, recipe, TP2)
    params = params_of(pm)
    params[2] = [t for t in params[2] if t.name != "model.norm.weight"] + [EngineParam("model.extra.weight", (4,),
                                                                                       "float32")]
    problems = check_engine_params(pm, params)
    assert problems == ["rank 2: 1 parameters of the engine get no leaf, e.g. ['model.extra.weight']",
                        "rank 2: 1 params of the recipe are not in the engine, e.g. ['model.norm.weight']"]


def test_a_leaf_without_a_rule_is_refused():
    src = Source.build({**param_shapes(C.qwen3_config()), "extra/kernel": (4, 4)},
                       trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    with pytest.raises(ValueError, match=r"trainer leaves \['extra/kernel'\] \(1 in all\) match no rule"):
        build_param_map(src, Recipe.llama(C.qwen3_config()), TP2)


def test_a_worker_hello_round_trips_its_engine_params_and_ranks_follow_the_trainers():
    params = [EngineParam("model.norm.weight", (64,), "float32"), EngineParam("w", (2, 3), "float8_e4m3fn")]
    hello = json.loads(json.dumps(worker_hello(rank=5, replica=1, tp_rank=1, tp=2, replicas=2, expert_parallel=True,
                                               dtype="float32", params=params, extra={"fp8": {"block": [1, 1]}})))
    assert engine_params_of(hello) == params and hello["fp8"] == {"block": [1, 1]}
    assert [worker_rank(2, d, t, 2) for d in range(2) for t in range(2)] == [2, 3, 4, 5]
    assert "leaves" not in trainer_hello(1)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: worker_rank(2, 0, 2, 2), ValueError, r"tp_rank must be an int <= 1"),
    (lambda: worker_rank(2, -1, 0, 2), ValueError, r"replica must be an int >= 0, got -1"),
    (lambda: worker_rank(2, 0, 0, True), TypeError, r"tp must be an int, got bool"),
    (lambda: trainer_hello(0), ValueError, r"trainer rank 0's hello needs source, recipe and bucket_bytes"),
    (lambda: worker_hello(rank=2, replica=0, tp_rank=0, tp=0, replicas=1, expert_parallel=False, dtype="float32",
                          params=[]), ValueError, r"tp must be a positive int, got 0"),
], ids=["tp_rank", "replica", "tp-bool", "trainer-0", "tp-0"])
def test_hello_refusals(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_engine_shape_from_workers_and_its_refusals():
    def w(rank, replica, tp_rank, **kw):
        return {"rank": rank, "replica": replica, "tp_rank": tp_rank, "tp": 2, "replicas": 2,
                "expert_parallel": False, "dtype": "float32", **kw}

    shape = engine_shape([w(5, 1, 1), w(2, 0, 0), w(3, 0, 1), w(4, 1, 0)])
    assert shape.ranks == ((2, 3), (4, 5)) and shape.expert_grid() == [[2, 3], [4, 5]]
    assert dataclasses.replace(shape, expert_parallel=True).expert_grid() == [[2], [3], [4], [5]]
    with pytest.raises(ValueError, match=r"expected \[\(0, 0\), \(0, 1\), \(1, 0\), \(1, 1\)\]"):
        engine_shape([w(2, 0, 0), w(3, 0, 1), w(4, 1, 0)])
    with pytest.raises(ValueError, match="the vLLM workers disagree on dtype"):
        engine_shape([w(2, 0, 0), w(3, 0, 1, dtype="bfloat16")])


def test_expert_names_resolve_to_the_live_submodule_and_ep_places_experts_linearly():
    cfg = MoeConfig.load("qwen3-moe-tiny")
    src = Source.build(param_shapes(cfg), trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    ep = EngineShape(((2, 3),), True, "float32")
    pm = build_param_map(src, Recipe.qwen3_moe(cfg), ep)
    live = {r: [EngineParam(p.name.replace(".experts.", ".experts.routed_experts."), p.shape, p.dtype)
                if p.name.endswith(("w13_weight", "w2_weight")) else EngineParam(p.name, p.shape, p.dtype)
                for p in pm.for_rank(r)] for r in (2, 3)}
    resolved = resolve_names(pm, live)
    assert check_engine_params(resolved, live) == []
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in resolved.names(3)
    # Under expert parallelism rank r holds experts [4r, 4r + 4), whole (an independent NumPy oracle).
    from bridge import BridgePlan

    rng = np.random.default_rng(0)
    arrays = {p: rng.standard_normal(s).astype(np.float32) for p, s in param_shapes(cfg).items()}
    ref = BridgePlan(src, pm).reference(arrays)
    gate, up = arrays["layers_1/mlp/experts/gate_proj"], arrays["layers_1/mlp/experts/up_proj"]  # [E, H, I]
    for r, rank in enumerate((2, 3)):
        want = np.concatenate([gate, up], axis=2).transpose(0, 2, 1)[4 * r:4 * r + 4]
        np.testing.assert_array_equal(ref[rank]["model.layers.1.mlp.experts.w13_weight"], want)
        want2 = arrays["layers_1/mlp/experts/down_proj"].transpose(0, 2, 1)[4 * r:4 * r + 4]
        np.testing.assert_array_equal(ref[rank]["model.layers.1.mlp.experts.w2_weight"], want2)


def test_a_wrong_shaped_expert_leaf_is_a_shape_mismatch_naming_the_leaf_not_missing_and_extra_names():
    from bridge.engines.agree import plan_from_hellos
    from bridge.errors import PlanMismatchError

    cfg = MoeConfig.load("qwen3-moe-tiny")
    src = Source.build(param_shapes(cfg), trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    recipe = Recipe.qwen3_moe(cfg)
    nested = {r: [EngineParam(p.name.replace(".experts.", ".experts.routed_experts."), p.shape, p.dtype)
                  for p in ps] for r, ps in params_of(build_param_map(src, recipe, TP2)).items()}
    shapes = dict(param_shapes(cfg))
    shapes["layers_1/mlp/experts/down_proj"] = (8, 32, 128)  # half the experts' inner size
    bad = Source.build(shapes, trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    with pytest.raises(PlanMismatchError) as e:
        plan_from_hellos(hellos(bad, recipe, TP2, nested))
    message = str(e.value)
    assert "get no leaf" not in message and "not in the engine" not in message, message
    assert ("rank 2: 'model.layers.1.mlp.experts.routed_experts.w2_weight' is (8, 128, 32) float32 in the engine "
            "but (8, 128, 16) float32 from the trainer's leaves 'layers_1/mlp/experts/down_proj' (8, 32, 128) "
            "and recipe") in message, message


def test_tied_embeddings_cross_the_wire_once_and_every_worker_receives_its_lower_bound():
    from bridge.engines.agree import agree

    tied_cfg = dataclasses.replace(C.qwen3_config(), tie_word_embeddings=True)
    untied_src, untied = dense_source(), Recipe.llama(C.qwen3_config())
    src = Source.build(param_shapes(tied_cfg), trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
    recipe = Recipe.llama(tied_cfg)
    pm = build_param_map(src, recipe, TP2)
    assert "lm_head.weight" not in pm.names(2) + pm.names(3)
    # vLLM's tied model has an lm_head param of its own (the embedding's tensor): the workers fill it.
    live = params_of(build_param_map(untied_src, untied, TP2))
    agreed = agree(hellos(src, recipe, TP2, live))
    assert agreed.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    untied_pm = build_param_map(untied_src, untied, TP2)
    for r in (2, 3):
        head = next(p for p in untied_pm.for_rank(r) if p.name == "lm_head.weight")
        lower = sum(int(np.prod(g.shape)) * 4 for p in untied_pm.for_rank(r) for g in p.regions) \
            - sum(int(np.prod(g.shape)) * 4 for g in head.regions)
        assert agreed.plan.rank_bytes()["recv"][r] == lower  # the untied sync less its lm_head: the embedding once
    live[3] = [dataclasses.replace(t, shape=(8, 128)) if t.name == "lm_head.weight" else t for t in live[3]]
    with pytest.raises(Exception, match=r"rank 3: 'lm_head.weight' is \(8, 128\) float32 in the engine but "
                                        r"\(512, 128\) float32"):
        agree(hellos(src, recipe, TP2, live))
