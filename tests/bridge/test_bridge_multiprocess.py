"""Two JAX trainer processes (2 CPU devices each, FSDP over 4) -> two torch inference ranks (TP2), over gloo.

One launch of four worker processes (tests/bridge/worker.py) runs every phase; the
tests below check what each rank recorded against NumPy references.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests.bridge import _common as C

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

HERE = Path(__file__).parent
WORKER = HERE / "worker.py"
LIMIT = 420  # seconds for the whole launch, restart included


def _launch(rank: int, out: Path, ports: dict, restart: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--rank", str(rank), "--port", str(ports["torch"]),
           "--port2", str(ports["torch2"]), "--jax-port", str(ports["jax2" if restart else "jax"]), "--out", str(out)]
    if restart:
        cmd.append("--restart")
    with open(out / f"rank{rank}{'_restart' if restart else ''}.log", "w") as log:
        env = C.worker_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                           TOKENIZERS_PARALLELISM="false")
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge")
    ports = dict(zip(("torch", "torch2", "jax", "jax2"), C.free_ports(4), strict=True))
    procs = {r: _launch(r, out, ports) for r in range(C.WORLD)}
    restarted = []
    deadline = time.monotonic() + LIMIT
    try:
        for r in C.TRAINERS:  # trainer 1 kills itself in the kill phase, trainer 0 then exits
            procs[r].wait(max(1.0, deadline - time.monotonic()))
        restarted = [_launch(r, out, ports, restart=True) for r in C.TRAINERS]
        for p in [procs[r] for r in C.RECEIVERS] + restarted:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        C.kill_all(list(procs.values()) + restarted)
    events = {}
    for r in range(C.WORLD):
        f = out / f"rank{r}.json"
        events[r] = json.loads(f.read_text()) if f.exists() else {}
    f = out / "rank0_restart.json"
    events["restart0"] = json.loads(f.read_text()) if f.exists() else {}
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("*.log")))
    return {"out": out, "events": events, "logs": logs, "rc": {r: p.returncode for r, p in procs.items()},
            "rc_restart": [p.returncode for p in restarted]}


def _received(run, rank: int, phase: str) -> dict[str, np.ndarray]:
    ev = run["events"][rank].get(phase)
    assert ev and ev["ok"], f"rank {rank} phase {phase}: {ev}\n{run['logs']}"
    with np.load(run["out"] / f"rank{rank}_{phase}.npz") as z:
        return dict(z)


def _check_equal(got: dict, want: dict, rank: int) -> None:
    assert sorted(got) == sorted(want), (rank, sorted(set(got) ^ set(want)))
    for name, w in want.items():
        assert got[name].shape == w.shape, (rank, name, got[name].shape, w.shape)
        np.testing.assert_array_equal(got[name], w, err_msg=f"rank {rank} {name}")


def test_workers_finished(run):
    for r in C.RECEIVERS:
        assert run["events"][r].get("done"), f"receiver {r} did not finish\n{run['logs']}"
        assert run["events"][r]["jax_imported"] is False, "an inference process imported jax"
    assert run["rc"][C.TRAINERS[1]] == -signal.SIGKILL, run["logs"]
    assert run["rc_restart"] == [0, 0], run["logs"]
    assert run["events"][0]["describe_matches_config"] is True


def test_fused_tp2_float32_bit_exact(run):
    want = C.vllm_shards(C.make_arrays(C.small_config(), 1), C.small_config(), 2, fused=True, vocab_pad=64)
    for i, r in enumerate(C.RECEIVERS):
        got = _received(run, r, "fused_f32")
        assert got["model.embed_tokens.weight"].shape == (512, 256)  # 1000 rows padded to 1024
        _check_equal(got, want[i], r)
        assert run["events"][r]["fused_f32"]["version"] == 1


def test_fused_tp2_bfloat16_equals_cast_reference(run):
    want = C.vllm_shards(C.make_arrays(C.small_config(), 1), C.small_config(), 2, fused=True, vocab_pad=64)
    for i, r in enumerate(C.RECEIVERS):
        cast = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in want[i].items()}
        _check_equal(_received(run, r, "fused_bf16"), cast, r)


def test_dtensor_params(run):
    a = C.make_arrays(C.small_config(), 1)
    q, down = a["layers_0/attn/q_proj/kernel"].T, a["layers_1/mlp/down_proj/kernel"].T
    for i, r in enumerate(C.RECEIVERS):
        assert run["events"][r]["dtensor_param_map_matches"] is True
        want = {"q.weight": np.split(q, 2, 0)[i], "down.weight": np.array_split(down, 2, 1)[i],
                "embed.weight": a["embed/embedding"], "norm.weight": np.split(a["final_norm/scale"], 2)[i]}
        _check_equal(_received(run, r, "dtensor"), want, r)


def test_plan_mismatch_is_an_error_on_every_rank_that_says_what_differs(run):
    for r in range(C.WORLD):
        ev = run["events"][r]["mismatch"]
        assert ev["ok"] is False and ev["error"] == "PlanMismatchError", (r, ev)
        assert "different sync plans" in ev["message"]
        # The receivers padded the vocabulary to 1056 rows, the trainers to 1024.
        assert ("ranks [2, 3] against ranks [0, 1]: " in ev["message"]
                and "differ in shape, e.g. 'lm_head.weight on rank 2': [528, 256] vs [512, 256]" in ev["message"]), ev


def test_a_rank_that_rejects_fails_every_other_rank_at_once(run):
    rejecting = C.RECEIVERS[1]
    ev = run["events"][rejecting]["rejected"]
    assert ev["ok"] is False and ev["error"] == "ValueError" and "param map expects" in ev["message"], ev
    for r in (*C.TRAINERS, C.RECEIVERS[0]):
        ev = run["events"][r]["rejected"]
        assert ev["ok"] is False and ev["error"] == "SyncError", (r, ev)
        assert f"ranks [{rejecting}] rejected the sync" in ev["message"], (r, ev)
        # The handshake fails at once, not after ready_timeout (300 s in the worker).
        assert ev["seconds"] < C.SLACK * 3, (r, ev)
    assert run["events"][C.RECEIVERS[0]]["rejected"]["unchanged"] is True


def test_end_to_end_llama_logits(run):
    import torch
    import transformers

    cfg = C.tiny_config()
    shards = [_received(run, r, "e2e") for r in C.RECEIVERS]
    # Gather the TP shards (in the test only) into one Hugging Face model and compare logits.
    full = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = np.concatenate(parts)[: cfg.vocab_size]
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = np.concatenate(parts, axis=1)
        elif parts[0].ndim == 2:
            w = np.concatenate(parts)
        else:
            np.testing.assert_array_equal(parts[0], parts[1])
            w = parts[0]
        full[name] = torch.from_numpy(np.ascontiguousarray(w))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.hf_kwargs(), attn_implementation="eager"))
    hf.load_state_dict(full, strict=True)
    with torch.no_grad():
        got = hf(torch.from_numpy(C.tokens(cfg)).long()).logits.numpy()
    want = np.load(run["out"] / "jax_logits.npy")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.isfinite(run["events"][0]["e2e_loss"])


def test_killed_rank_fails_everyone_cleanly_and_restart_succeeds(run):
    from tests.bridge.worker import KILL_TIMEOUT

    for r in (C.TRAINERS[0], *C.RECEIVERS):
        ev = run["events"][r]["kill"]
        assert ev["ok"] is False and ev["error"] == "SyncError", (r, ev)
        # Timed from the start of the rank's sync call: within the deadline plus a second.
        assert ev["seconds"] < KILL_TIMEOUT + 1.0, (r, ev)
    want_old = C.vllm_shards(C.make_arrays(C.small_config(), 1), C.small_config(), 2, fused=True, vocab_pad=64)
    want_new = C.vllm_shards(C.make_arrays(C.small_config(), 3), C.small_config(), 2, fused=True, vocab_pad=64)
    for i, r in enumerate(C.RECEIVERS):
        ev = run["events"][r]["kill"]
        assert ev["unchanged"] is True and ev["version_after"] == 6, (r, ev)
        _check_equal(_received(run, r, "pre_kill"), want_old[i], r)
        _check_equal(_received(run, r, "restart"), want_new[i], r)
        assert run["events"][r]["restart"]["version"] == 8
    assert run["events"]["restart0"]["restart"]["ok"] is True
