"""A live vLLM engine (TP2, tiny Qwen3-MoE: FusedMoE experts split over both ranks) synced from two JAX trainers."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("jax")

from tests.vllm._live import assert_matches, check_two_syncs, engine_server, generate  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with engine_server(tmp_path_factory.mktemp("vllm_moe"), "moe") as e:
        yield e


def test_engine_serves_the_saved_model(engine):
    assert_matches(generate(engine), engine["initial"])


def test_two_syncs_match_transformers_with_the_trainers_weights(engine, tmp_path):
    check_two_syncs(engine, tmp_path, padded_vocab=False)
