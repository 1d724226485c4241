"""A ``vllm serve`` server (TP2, backend "jreshard") updated over HTTP by two JAX trainer processes.

The server is started as users start it, ``python -m bridge.engines.vllm.serve MODEL ...`` on
127.0.0.1, and serves the tiny dense Qwen3 of the other live tests. Trainer rank 0 drives it
with ``bridge.engines.vllm.http.HTTPClient`` (vLLM's HTTP weight-sync client: the RL routes,
``/pause`` and ``/resume``, the job's secret in the init info). After each of two syncs the
greedy tokens and log-probabilities that ``/v1/completions`` returns for token-id prompts equal
``transformers`` on the trainers' weights, and ``/weight_info`` reports the trainers' version.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("jax")
requests = pytest.importorskip("requests")

from tests._procs import free_ports, kill_all  # noqa: E402
from tests.vllm import _common as C  # noqa: E402
from tests.vllm._live import (  # noqa: E402
    ENGINE_START,
    HTTP_TIMEOUT,
    assert_matches,
    check_two_syncs,
    generate,
    version,
    write_model,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SERVED = "qwen3-test"  # --served-model-name


def _log(base: Path) -> str:
    return (base / "server.log").read_text()[-8000:]


def _wait_healthy(proc: subprocess.Popen, url: str, base: Path) -> None:
    """Returns once ``/health`` answers 200; fails with the server's log if it exits or takes too long."""
    deadline = time.monotonic() + ENGINE_START
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited ({proc.returncode}):\n{_log(base)}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1)
    pytest.fail(f"vllm serve did not answer /health within {ENGINE_START:g} s:\n{_log(base)}")


@contextlib.contextmanager
def vllm_serve(base: Path) -> Iterator[dict]:
    """``python -m bridge.engines.vllm.serve`` on a random tiny dense Qwen3, TP2 on 127.0.0.1."""
    model = write_model(base, "dense")
    (port,) = free_ports(1)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop("XLA_FLAGS", None)
    cmd = [C.python(), "-m", "bridge.engines.vllm.serve", str(base / "model"), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", SERVED, "--tensor-parallel-size", str(C.TP),
           "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init", "--max-model-len", "256",
           "--distributed-executor-backend", "mp", "--uvicorn-log-level", "warning"]
    with open(base / "server.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, cwd=C.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, base)
        yield {"url": url, "served": SERVED, "client": "http", "address": ("127.0.0.1", port), "dir": base,
               "model": base / "model", "kind": "dense", "proc": proc,
               "initial": C.hf_greedy(model, C.PROMPTS, C.MAX_TOKENS)}
    finally:
        kill_all([proc])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm_serve")
    with vllm_serve(base) as s:
        yield s


@contextlib.contextmanager
def showing_log(server: dict) -> Iterator[None]:
    """Prints the server's log (pytest shows it) when the body fails."""
    try:
        yield
    except BaseException:
        print(f"--- vllm serve\n{_log(server['dir'])}")
        raise


def test_the_server_serves_the_saved_model_with_the_jreshard_backend(server):
    with showing_log(server):
        assert_matches(generate(server), server["initial"])
        routes = requests.get(f"{server['url']}/openapi.json", timeout=HTTP_TIMEOUT).json()["paths"]
        assert {"/init_weight_transfer_engine", "/update_weights", "/weight_info", "/pause"} <= set(routes)


def test_two_syncs_over_http_match_transformers_and_set_the_version(server, tmp_path):
    with showing_log(server):
        # Each sync: tokens, version, bytes; after both, a prompt whose KV block was cached before them
        # (the client pauses the server for each update, and vLLM's pause clears its prefix cache).
        recs = check_two_syncs(server, tmp_path, padded_vocab=True)
        assert [r["ok"] for r in recs] == [True, True]
        assert version(server) == "2"
        assert requests.get(f"{server['url']}/is_paused", timeout=HTTP_TIMEOUT).json() == {"is_paused": False}
