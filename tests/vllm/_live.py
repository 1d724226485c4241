"""Helpers of the live vLLM tests: an engine server per test class, trainer processes, the oracle, shared checks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests._procs import free_ports, kill_all
from tests.helpers import hf_state
from tests.vllm import _common as C

ENGINE_START = 900.0  # seconds: an engine starts in about a minute, much longer on a loaded machine
STEP = 600.0  # seconds for trainers to start, take a step and sync
HTTP_TIMEOUT = 120.0  # seconds for one request to a vllm serve server (tests/vllm/test_serve_live.py)


def write_model(base: Path, kind: str) -> Any:
    """Saves a random ``kind`` model under ``base / "model"`` with its weights (``initial.npz``); returns it."""
    cfg = C.config(kind)
    model = C.hf_model(cfg)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if kind == "fp8":  # the engine serves the FP8 checkpoint; the oracle and the trainers start from its values
        state = save_fp8(model, state, base / "model")
        model = C.hf_model(cfg, state)
    else:
        model.save_pretrained(base / "model")
    np.savez(base / "model" / "initial.npz", **state)
    return model


def engine_env() -> dict[str, str]:
    """The environment of a live engine's process: vLLM on this CPU at TP2 (a core per worker), no downloads."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop("XLA_FLAGS", None)
    return env


def serve_arguments(model_dir: Path | str, host: str, port: int, served: str) -> list[str]:
    """``vllm serve``'s arguments for the saved tiny model: TP2, float32, token-id prompts, with the scale-out
    routes (``/inference/v1/generate``, whose completions carry ``weight_versions``)."""
    return [str(model_dir), "--host", host, "--port", str(port), "--served-model-name", served,
            "--tensor-parallel-size", str(C.TP), "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
            "--max-model-len", str(C.MAX_POSITIONS), "--distributed-executor-backend", "mp",
            "--uvicorn-log-level", "warning",
            "--enable-scale-out"]


def serve_command(model_dir: Path | str, host: str, port: int, served: str) -> list[str]:
    """``python -m bridge.engines.vllm.serve`` with ``serve_arguments``, for a server placed by the caller
    (``bridge.engines.vllm.server.Server`` starts one here)."""
    return [C.python(), "-m", "bridge.engines.vllm.serve", *serve_arguments(model_dir, host, port, served)]


def stream_tokens(url: str, prompt: list[int], max_tokens: int) -> Iterator[dict]:
    """The chunks of one greedy request streamed from a ``vllm serve`` server's ``/inference/v1/generate``
    (server-sent events; the final chunk's choice carries ``weight_versions``)."""
    import requests

    body = {"token_ids": prompt, "stream": True,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    with requests.post(f"{url}/inference/v1/generate", json=body, stream=True, timeout=HTTP_TIMEOUT) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield json.loads(line[6:])


@contextlib.contextmanager
def engine_server(base: Path, kind: str) -> Iterator[dict]:
    """A vLLM engine (TP2, backend "jreshard") on a random ``kind`` model saved under ``base``."""
    model = write_model(base, kind)
    port_file = base / "port"
    env = engine_env()
    with open(base / "engine.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([C.python(), str(C.HERE / "engine_server.py"), str(base / "model"), str(port_file),
                                 "bfloat16" if kind == "fp8" else "float32"],
                                cwd=C.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + ENGINE_START
        while not port_file.exists():
            if proc.poll() is not None:
                pytest.fail(f"the engine exited ({proc.returncode}):\n{(base / 'engine.log').read_text()[-6000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the engine did not start within {ENGINE_START:g} s")
            time.sleep(1)
        address = ("127.0.0.1", int(port_file.read_text()))
        initial = C.hf_greedy(model, C.PROMPTS, C.MAX_TOKENS)
        yield {"address": address, "dir": base, "model": base / "model", "initial": initial, "proc": proc,
               "kind": kind}
    finally:
        kill_all([proc])


def fp8_values(state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Float32 Hugging Face weights as a block-FP8 checkpoint holds them.

    Returns the values the checkpoint stands for (float32: each linear weight quantized with
    ``C.FP8_BLOCK`` blocks by the tests' NumPy quantizer and dequantized, every other tensor
    rounded to bfloat16) and the checkpoint's tensors (FP8 weights with their float32
    ``weight_scale_inv``, the others bfloat16, as torch tensors).
    """
    import torch

    from tests.bridge.test_fp8_rules import ref_quantize

    values, tensors = {}, {}
    bn, bk = C.FP8_BLOCK
    for name, w in state.items():
        if name.endswith("_proj.weight"):
            q, s = ref_quantize(w, bn, bk)
            values[name] = q.astype(np.float32) * np.repeat(np.repeat(s, bn, 0), bk, 1)[:w.shape[0], :w.shape[1]]
            tensors[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.from_numpy(s)
        else:
            tensors[name] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
            values[name] = tensors[name].float().numpy()
    return values, tensors


def save_fp8(model, state: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """Saves ``state`` as the block-FP8 checkpoint of ``model``'s Qwen3; returns the values it holds (float32)."""
    from safetensors.torch import save_file

    values, tensors = fp8_values(state)
    model.config.architectures = [type(model).__name__]  # as model.save_pretrained records it
    model.config.save_pretrained(path)
    conf = json.loads((path / "config.json").read_text())
    conf.update(dtype="bfloat16", quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                                       "weight_block_size": list(C.FP8_BLOCK), "fmt": "e4m3"})
    (path / "config.json").write_text(json.dumps(conf, indent=1))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return values


def generate(engine, prompts: list[list[int]] = C.PROMPTS) -> list[dict]:
    """Greedy tokens and log-probabilities of ``prompts``: the engine server's, or a ``vllm serve``
    server's (an engine with a ``url``) through its OpenAI completions endpoint."""
    if "url" in engine:
        return completions(engine["url"], engine["served"], prompts, C.MAX_TOKENS)
    return C.request(engine["address"], "generate", prompts=prompts, max_tokens=C.MAX_TOKENS)


def version(engine) -> str:
    """The weight version the engine serves (a ``vllm serve`` server's from ``/weight_info``)."""
    if "url" in engine:
        import requests

        return str(requests.get(f"{engine['url']}/weight_info", timeout=HTTP_TIMEOUT).json()["weight_version"])
    return C.request(engine["address"], "version")


def completions(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """``/v1/completions`` with token-id prompts, greedy, with each token's log-probability (no tokenizer)."""
    import requests

    body = {"model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    response = requests.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT)
    assert response.ok, (response.status_code, response.text)
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [{"tokens": c["token_ids"], "logprobs": c["logprobs"]["token_logprobs"]} for c in choices]


def assert_matches(got: list[dict], want: list[dict], atol: float = 2e-4, near_tie: float = 0.0) -> int:
    """The engine's greedy tokens and log-probabilities equal the oracle's (within ``atol``).

    With ``near_tie``, the engine may pick another token than the oracle where the oracle's top
    two log-probabilities are closer than that (an engine computing in lower precision may take
    either); the prompt's comparison ends there, since every later token follows another
    prefix. At least half the tokens must still be compared. Returns the number compared.
    """
    if not near_tie:
        assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
        np.testing.assert_allclose([g["logprobs"] for g in got], [w["logprobs"] for w in want], rtol=0, atol=atol)
        return sum(len(w["tokens"]) for w in want)
    compared = 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for j, (gt, wt, margin) in enumerate(zip(g["tokens"], w["tokens"], w["margins"], strict=True)):
            if gt != wt:
                assert margin < near_tie, f"prompt {i} token {j}: {gt} against {wt}, margin {margin:.4f}\n{got}\n{want}"
                break
            assert abs(g["logprobs"][j] - w["logprobs"][j]) <= atol, (i, j, g["logprobs"][j], w["logprobs"][j])
            compared += 1
    assert 2 * compared >= sum(len(w["tokens"]) for w in want), f"only {compared} tokens compared:\n{got}\n{want}"
    return compared


def oracle(engine: dict, out: Path, v: int, prompts: list[list[int]] = C.PROMPTS,
           max_tokens: int = C.MAX_TOKENS) -> list[dict]:
    """``transformers``' greedy tokens on ``prompts`` with the trainers' weights of version ``v``."""
    cfg = C.config(engine["kind"])
    with np.load(out / f"params_v{v}.npz") as z:
        flat = {k: z[k] for k in z.files}
    state = hf_state(flat, cfg)
    if engine["kind"] == "fp8":  # the trainers' weights as the sync quantizes them (bfloat16 where kept)
        state = fp8_values(state)[0]
    return C.hf_greedy(C.hf_model(cfg, state), prompts, max_tokens)


def start_trainers(engine, out: Path, versions: str, mode: str = "normal", timeout: float = 30.0,
                   pause: str = "sync", place: Any = None, host: str = "127.0.0.1",
                   gate: bool = False) -> list[subprocess.Popen]:
    """The two trainer processes; ``place(rank, argv)`` gives the command that runs ``argv`` where that rank runs
    (default: here), ``host`` is trainer rank 0's address; with ``gate`` each sync ``v`` waits for ``start_v{v}``."""
    out.mkdir(parents=True, exist_ok=True)
    jax_port, sync_port = free_ports(2)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for rank in range(C.TRAINERS):
        with open(out / f"trainer{rank}.log", "w") as log:
            argv = [C.python(), str(C.HERE / "trainer_worker.py"), "--rank", str(rank), "--jax-port", str(jax_port),
                    "--sync-port", str(sync_port), "--server", str(engine["address"][1]), "--model",
                    str(engine["model"]), "--out", str(out), "--versions", versions, "--mode", mode,
                    "--kind", engine["kind"], "--timeout", str(timeout), "--client", engine.get("client", "remote"),
                    "--pause", pause, "--host", host, "--server-host", engine["address"][0]] + ["--gate"] * gate
            procs.append(subprocess.Popen(argv if place is None else place(rank, argv), cwd=C.ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(out.glob("trainer*.log")))


def wait_sync(out: Path, procs, rank: int, v: int) -> dict:
    """Rank ``rank``'s record of sync ``v`` once written (fails if the trainers died first)."""
    deadline = time.monotonic() + STEP
    path = out / f"rank{rank}.json"
    while time.monotonic() < deadline:
        if path.exists():
            rec = json.loads(path.read_text())["syncs"].get(str(v))
            if rec is not None:
                return rec
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    pytest.fail(f"no record of sync {v} from trainer rank {rank}:\n{logs(out)}")


def wait_ready(out: Path, procs: list[subprocess.Popen], v: int) -> None:
    """Returns once both trainers wait to sync ``v`` (their training step and gather, jax's traffic, are done)."""
    deadline = time.monotonic() + STEP
    while not all((out / f"ready_v{v}_r{rank}").exists() for rank in range(C.TRAINERS)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(f"the trainers did not get ready for sync {v}:\n{logs(out)}")
        time.sleep(0.1)


def finish(procs, out: Path) -> list[int]:
    try:
        return [p.wait(STEP) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"trainers did not exit:\n{logs(out)}")
    finally:
        kill_all(procs)


def check_two_syncs(engine: dict, tmp_path: Path, *, padded_vocab: bool, atol: float = 2e-4,
                    near_tie: float = 0.0) -> list[dict]:
    """Two trainers sync versions 1 and 2; after each the engine equals transformers on their weights.

    After both, so does a prompt whose first KV block the engine cached before them (``C.LONG_PROMPT``).
    Returns trainer rank 0's record of each sync."""
    generate(engine, [C.LONG_PROMPT])
    before, recs = generate(engine), []
    procs = start_trainers(engine, tmp_path, "1,2")
    try:
        for v in (1, 2):
            rec = wait_sync(tmp_path, procs, 0, v)
            assert rec["ok"], rec
            recs.append(rec)
            got = generate(engine)
            assert_matches(got, oracle(engine, tmp_path, v), atol, near_tie)
            assert [g["tokens"] for g in got] != [b["tokens"] for b in before]
            assert version(engine) == str(v)
            # Every worker received exactly its slices: the counters equal the plan's bytes, which
            # equal the lower bound (the bytes of its params' regions; the padded vocabulary rows of
            # TP rank 1 are not sent).
            workers = [str(r) for r in range(C.TRAINERS, C.TRAINERS + C.TP)]
            assert sorted(rec["bytes_received"]) == workers
            for r in workers:
                assert rec["bytes_received"][r] == rec["plan_recv"][r] == rec["region_bytes"][r]
                # trainers and workers share this host: "auto" writes every byte into the workers' staging
                assert rec["transport_bytes"][r] == {"shm": rec["bytes_received"][r]}, rec["transport_bytes"]
            assert rec["region_bytes"][workers[0]] == rec["param_bytes"][workers[0]]
            assert (rec["region_bytes"][workers[1]] < rec["param_bytes"][workers[1]]) == padded_vocab
            before = got
            (tmp_path / f"go_v{v}").touch()
        assert_matches(generate(engine, [C.LONG_PROMPT]), oracle(engine, tmp_path, 2, [C.LONG_PROMPT]), atol,
                       near_tie)
        assert finish(procs, tmp_path) == [0, 0], logs(tmp_path)
    finally:
        kill_all(procs)
    return recs


class EngineChecks:
    """The checks every live engine passes; a test class sets ``kind`` and gets one engine for all its tests."""

    kind: str
    padded_vocab: bool  # whether the last TP rank holds padding rows of the vocabulary (not sent)
    atol = 2e-4  # log-probabilities against transformers
    near_tie = 0.0  # see assert_matches

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tmp_path_factory):
        with engine_server(tmp_path_factory.mktemp(f"vllm_{cls.kind}"), cls.kind) as e:
            yield e

    def test_engine_serves_the_saved_model(self, engine):
        assert_matches(generate(engine), engine["initial"], self.atol, self.near_tie)

    def test_two_syncs_match_transformers_with_the_trainers_weights(self, engine, tmp_path):
        check_two_syncs(engine, tmp_path, padded_vocab=self.padded_vocab, atol=self.atol, near_tie=self.near_tie)
