"""Live vLLM engines (TP2) updated by two JAX trainer processes through the "jreshard" backend.

One engine per class (started once, about a minute on an idle machine): a tiny dense Qwen3 and a
tiny Qwen3-MoE (FusedMoE experts split over both ranks). Each test starts its own trainer
processes (tests/vllm/trainer_worker.py) and checks the engine's greedy tokens and
log-probabilities against ``transformers`` loaded with the trainers' weights.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("jax")

from tests._procs import kill_all  # noqa: E402
from tests.vllm import _common as C  # noqa: E402
from tests.vllm._live import (  # noqa: E402
    EngineChecks,
    assert_matches,
    finish,
    generate,
    logs,
    oracle,
    start_trainers,
    version,
    wait_sync,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

KILL_TIMEOUT = 5.0  # seconds: the sync deadline of the trainers one of which dies
RETRY_SECONDS = 60.0  # a sync after a failed one: a few seconds; the stale store made it 30 to 225 s or fail


class TestDense(EngineChecks):
    """Padded vocabulary (TP rank 1 holds 24 padding rows), one KV head replicated on both ranks; the faults."""

    kind, padded_vocab = "dense", True

    def test_plan_mismatch_is_refused_before_any_byte_moves(self, engine, tmp_path):
        before, served = generate(engine), version(engine)
        procs = start_trainers(engine, tmp_path, "7", mode="mismatch")
        try:
            for rank in range(C.TRAINERS):
                rec = wait_sync(tmp_path, procs, rank, 7)
                assert not rec["ok"] and rec["error"] == "PlanMismatchError", rec
                assert "bfloat16" in rec["message"] and "float32" in rec["message"], rec["message"]
            finish(procs, tmp_path)
        finally:
            kill_all(procs)
        assert generate(engine) == before
        assert version(engine) == served

    def test_a_trainer_killed_mid_sync_leaves_the_engine_serving_then_a_later_sync_succeeds(self, engine, tmp_path):
        before, served = generate(engine), version(engine)
        # A short deadline: the survivors learn of the death from gloo at once, the deadline bounds the rest.
        procs = start_trainers(engine, tmp_path / "killed", "5", mode="die", timeout=KILL_TIMEOUT)
        try:
            rec = wait_sync(tmp_path / "killed", procs, 0, 5)
            assert not rec["ok"] and rec["error"] == "SyncError", rec
            assert rec["seconds"] < KILL_TIMEOUT + 1.0, rec
            assert finish(procs, tmp_path / "killed")[1] == 17
        finally:
            kill_all(procs)
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
            kill_all(procs)


    def test_a_sync_after_a_failed_one_on_the_same_object_and_port_works_at_once(self, engine, tmp_path):
        procs = start_trainers(engine, tmp_path, "1,2,3", mode="retry")
        try:
            assert wait_sync(tmp_path, procs, 0, 1)["ok"]
            (tmp_path / "go_v1").touch()
            for rank in range(C.TRAINERS):
                rec = wait_sync(tmp_path, procs, rank, 2)
                assert not rec["ok"] and rec["error"] == "ValueError" and "final_norm/scale" in rec["message"], rec
            rec = wait_sync(tmp_path, procs, 0, 3)
            assert rec["ok"], rec
            assert rec["seconds"] < RETRY_SECONDS, rec  # at once: no stale store, no wait for the garbage collector
            assert_matches(generate(engine), oracle(engine, tmp_path, 3))
            assert version(engine) == "3"
            (tmp_path / "go_v3").touch()
            assert finish(procs, tmp_path) == [0, 0], logs(tmp_path)
        finally:
            kill_all(procs)


class TestTied(EngineChecks):
    """Tied embeddings (as Qwen3-0.6B to 4B): the embedding crosses the wire once and fills vLLM's lm_head too."""

    kind, padded_vocab = "tied", True


class TestMoe(EngineChecks):
    """FusedMoE w13/w2 split over both ranks, the router replicated."""

    kind, padded_vocab = "moe", False
