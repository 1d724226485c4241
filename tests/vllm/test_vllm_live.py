"""A live vLLM engine (TP2, tiny dense Qwen3) updated by two JAX trainer processes through the "jreshard" backend.

One engine per module (started once, about a minute on an idle machine). Each test starts its own
trainer processes (tests/vllm/trainer_worker.py) and checks the engine's greedy tokens and
log-probabilities against ``transformers`` loaded with the trainers' weights.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("jax")

from tests.vllm import _common as C  # noqa: E402
from tests.vllm._live import (  # noqa: E402
    assert_matches,
    check_two_syncs,
    engine_server,
    finish,
    generate,
    logs,
    oracle,
    start_trainers,
    version,
    wait_sync,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with engine_server(tmp_path_factory.mktemp("vllm_dense"), "dense") as e:
        yield e


def test_engine_serves_the_saved_model(engine):
    assert_matches(generate(engine), engine["initial"])


def test_two_syncs_match_transformers_with_the_trainers_weights(engine, tmp_path):
    check_two_syncs(engine, tmp_path, padded_vocab=True)


def test_plan_mismatch_is_refused_before_any_byte_moves(engine, tmp_path):
    before, served = generate(engine), version(engine)
    procs = start_trainers(engine, tmp_path, "7", mode="mismatch")
    try:
        for rank in range(C.TRAINERS):
            rec = wait_sync(tmp_path, procs, rank, 7)
            assert not rec["ok"] and rec["error"] == "PlanMismatchError", rec
            assert "bfloat16" in rec["message"] and "float32" in rec["message"], rec["message"]
        finish(procs, tmp_path)
    finally:
        C.kill_all(procs)
    assert generate(engine) == before
    assert version(engine) == served


def test_a_trainer_killed_mid_sync_leaves_the_engine_serving_then_a_later_sync_succeeds(engine, tmp_path):
    before, served = generate(engine), version(engine)
    procs = start_trainers(engine, tmp_path / "killed", "5", mode="die")
    try:
        rec = wait_sync(tmp_path / "killed", procs, 0, 5)
        assert not rec["ok"] and rec["error"] == "SyncError", rec
        assert finish(procs, tmp_path / "killed")[1] == 17
    finally:
        C.kill_all(procs)
    assert generate(engine) == before
    assert version(engine) == served
    procs = start_trainers(engine, tmp_path / "again", "6")
    try:
        rec = wait_sync(tmp_path / "again", procs, 0, 6)
        assert rec["ok"], rec
        assert_matches(generate(engine), oracle(engine, tmp_path / "again", 6))
        assert version(engine) == "6"
        (tmp_path / "again" / "go_v6").touch()
        assert finish(procs, tmp_path / "again") == [0, 0], logs(tmp_path / "again")
    finally:
        C.kill_all(procs)
