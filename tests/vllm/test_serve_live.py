"""A ``vllm serve`` server (TP2, backend "jreshard") updated over HTTP by two JAX trainer processes.

The server is started as users start it, ``python -m bridge.engines.vllm.serve MODEL ...`` on
127.0.0.1, and serves the tiny dense Qwen3 of the other live tests. Trainer rank 0 drives it
with ``bridge.engines.vllm.http.HTTPClient`` (vLLM's HTTP weight-sync client: the RL routes,
``/pause`` and ``/resume``, the job's secret in the init info). After each of two syncs the
greedy tokens and log-probabilities that ``/v1/completions`` returns for token-id prompts equal
``transformers`` on the trainers' weights, and ``/weight_info`` reports the trainers' version.

Refit while serving: with ``VLLMWeightSync(pause="commit")`` and ``HTTPClient(pause_mode="keep")``, a
greedy request streamed from ``/inference/v1/generate`` (``--enable-scale-out``) and frozen mid-flight
lives across a sync (it may run to the end of the context, and is aborted once the new weights produced
some of its tokens); the weight versions the server reports for its tokens split it where the weights
changed, and each span equals ``transformers`` with that version's weights.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("jax")
requests = pytest.importorskip("requests")

from bridge.engines.vllm.server import Server  # noqa: E402
from tests._procs import free_ports, kill_all  # noqa: E402
from tests.vllm import _common as C  # noqa: E402
from tests.vllm._live import (  # noqa: E402
    ENGINE_START,
    HTTP_TIMEOUT,
    assert_matches,
    check_two_syncs,
    engine_env,
    finish,
    generate,
    logs,
    oracle,
    serve_arguments,
    start_trainers,
    stream_tokens,
    version,
    wait_ready,
    wait_sync,
    write_model,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SERVED = "qwen3-test"  # --served-model-name


def _log(base: Path) -> str:
    return (base / "server.log").read_text()[-8000:]


@contextlib.contextmanager
def vllm_serve(base: Path) -> Iterator[dict]:
    """``python -m bridge.engines.vllm.serve`` on a random tiny dense Qwen3, TP2 on 127.0.0.1."""
    model = write_model(base, "dense")
    (port,) = free_ports(1)
    with Server(serve_arguments(base / "model", "127.0.0.1", port, SERVED), env=engine_env(),
                log=base / "server.log", cwd=C.ROOT) as server:
        try:
            server.wait(ENGINE_START)
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(str(e))
        yield {"url": server.url, "served": SERVED, "client": "http", "address": ("127.0.0.1", port), "dir": base,
               "model": base / "model", "kind": "dense", "proc": server.proc,
               "initial": C.hf_greedy(model, C.PROMPTS, C.MAX_TOKENS)}


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


# The request in flight across a refit may run to the end of the context: far more tokens than can pass
# between its first token and the pause. It is aborted once the new weights produced AFTER tokens of it.
LONG = C.MAX_POSITIONS - len(C.PROMPTS[0])
AFTER = 16
CHECKED = 64  # tokens of each span compared with transformers (its oracle takes one full forward per token)


class Stream:
    """One greedy request streamed from ``/inference/v1/generate`` in a thread; ``first`` is set at its first token."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        self.chunks: list[dict] = []
        self.first, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self._read, args=(url, prompt), daemon=True)
        self.thread.start()

    def _read(self, url: str, prompt: list[int]) -> None:
        try:
            for chunk in stream_tokens(url, prompt, LONG):
                self.chunks.append(chunk)
                self.first.set()
        except Exception as e:  # the test reports it
            self.error = e
        finally:
            self.first.set()

    def tokens(self) -> list[int]:
        return [t for chunk in list(self.chunks) for c in chunk["choices"] for t in c.get("token_ids") or []]

    def wait_for(self, n: int) -> None:
        """Until the request has ``n`` tokens or ended."""
        deadline = time.monotonic() + HTTP_TIMEOUT
        while len(self.tokens()) < n and self.thread.is_alive():
            assert time.monotonic() < deadline, f"the request has {len(self.tokens())} tokens, not {n}"
            time.sleep(0.05)

    def result(self) -> tuple[list[int], list[dict], str]:
        """The request's tokens, the weight versions of their spans and its finish reason (the final chunk's)."""
        self.thread.join(HTTP_TIMEOUT)
        assert not self.thread.is_alive() and self.error is None, self.error
        last = self.chunks[-1]["choices"][-1]
        return self.tokens(), last["weight_versions"], last["finish_reason"]


def test_a_request_in_flight_across_a_refit_gets_each_token_from_the_weights_that_produced_it(server, tmp_path):
    with showing_log(server):
        url = server["url"]
        procs = start_trainers(server, tmp_path, "1,2", pause="commit", gate=True)
        try:
            (tmp_path / "start_v1").touch()
            assert wait_sync(tmp_path, procs, 0, 1)["ok"]
            (tmp_path / "go_v1").touch()
            wait_ready(tmp_path, procs, 2)  # the trainers' step is done: nothing delays the pause below
            prompt = C.PROMPTS[0]
            stream = Stream(url, prompt)  # version 1's tokens, then frozen by /pause?mode=keep
            assert stream.first.wait(HTTP_TIMEOUT) and stream.error is None, stream.error
            requests.post(f"{url}/pause", params={"mode": "keep"}, timeout=HTTP_TIMEOUT).raise_for_status()
            frozen = len(stream.tokens())
            assert frozen < LONG and stream.thread.is_alive(), f"the request ended ({frozen} tokens) before the pause"
            (tmp_path / "start_v2").touch()  # sync 2 streams into staging, pauses for the commit, resumes
            rec = wait_sync(tmp_path, procs, 0, 2)
            assert rec["ok"], rec
            stream.wait_for(len(stream.tokens()) + AFTER)
            request_id = stream.chunks[0]["request_id"]
            requests.post(f"{url}/inference/v1/abort_requests", json={"request_ids": [request_id]},
                          timeout=HTTP_TIMEOUT).raise_for_status()
            tokens, spans, reason = stream.result()
            (tmp_path / "go_v2").touch()
            assert finish(procs, tmp_path) == [0, 0], logs(tmp_path)
        finally:
            kill_all(procs)
        assert version(server) == "2"
        assert requests.get(f"{url}/is_paused", timeout=HTTP_TIMEOUT).json() == {"is_paused": False}
        assert reason in ("abort", "length"), reason  # aborted, unless it reached the end of the context first
        n = len(tokens)
        print(f"{frozen} tokens when frozen, {n} in all ({reason}), spans {spans}")
        assert [s["version"] for s in spans] == ["1", "2"], spans
        cut = spans[1]["start"]
        assert spans[0] == {"version": "1", "start": 0, "end": cut} and spans[1]["end"] == n and 0 < cut < n
        # Before the cut, version 1's greedy tokens; after it, version 2's greedy continuation of the prompt
        # and those tokens (vLLM's pause dropped the request's cache, so the new weights recompute it). A slow
        # machine may give a span more than CHECKED tokens; its first CHECKED are compared.
        first = min(cut, CHECKED)
        assert tokens[:first] == oracle(server, tmp_path, 1, [prompt], first)[0]["tokens"]
        after = min(n - cut, CHECKED)
        assert tokens[cut:cut + after] == oracle(server, tmp_path, 2, [prompt + tokens[:cut]], after)[0]["tokens"]
        # the trainers paused the engine for the commit only
        assert rec["pause_seconds"] is not None and 0 < rec["pause_seconds"] < rec["sync_seconds"]
