"""End to end over processes: the flax MoE model, EP over 4 JAX devices, into transformers' Qwen3-MoE on TP2.

Two JAX trainer processes (2 CPU devices each, experts split over ``ep``) take a training
step and sync through the bridge into two torch ranks that hold Qwen3MoeForCausalLM's
params split by the rules (tensor parallel, experts split inside as vLLM's FusedMoE does).
The test reassembles the shards into one transformers model: its logits equal JAX's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.bridge import _common as C

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).parent / "moe_worker.py"
LIMIT = 300  # seconds for the whole launch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge_moe")
    ports = dict(zip(("torch", "jax"), C.free_ports(2), strict=True))
    env = C.worker_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = []
    for r in range(C.WORLD):
        cmd = [sys.executable, str(WORKER), "--rank", str(r), "--port", str(ports["torch"]),
               "--jax-port", str(ports["jax"]), "--out", str(out)]
        with open(out / f"rank{r}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    C.wait_all(procs, LIMIT)
    events = {r: json.loads(f.read_text()) if (f := out / f"rank{r}.json").exists() else {} for r in range(C.WORLD)}
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("*.log")))
    return {"out": out, "events": events, "logs": logs}


def test_moe_logits_after_a_training_step_and_a_sync(run):
    import torch
    import transformers

    from tests.bridge.moe_worker import VOCAB_PAD, config

    for r in range(C.WORLD):
        assert run["events"][r].get("done"), f"rank {r} did not finish\n{run['logs']}"
    for r in C.RECEIVERS:
        assert run["events"][r]["jax_imported"] is False, "an inference process imported jax"
        assert run["events"][r]["moe"]["version"] == 1
    assert run["events"][0]["describe_matches_config"] is True
    cfg = config()
    shards = []
    for r in C.RECEIVERS:
        with np.load(run["out"] / f"rank{r}_moe.npz") as z:
            shards.append(dict(z))
    assert shards[1]["model.embed_tokens.weight"].shape == (VOCAB_PAD, cfg.hidden_size)
    assert not shards[1]["model.embed_tokens.weight"][cfg.vocab_size - VOCAB_PAD:].any()  # padding untouched
    m = cfg.moe_intermediate_size // 2
    assert shards[0]["model.layers.0.mlp.experts.gate_up_proj"].shape == (cfg.num_experts, 2 * m, cfg.hidden_size)
    # Reassemble the TP shards (in the test only) into one transformers model.
    full = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = np.concatenate(parts)[: cfg.vocab_size]
        elif name.endswith("experts.gate_up_proj"):  # each rank: its gate rows, then its up rows
            w = np.concatenate([p[:, :m] for p in parts] + [p[:, m:] for p in parts], axis=1)
        elif name.endswith("experts.down_proj"):
            w = np.concatenate(parts, axis=2)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = np.concatenate(parts, axis=1)
        elif name.endswith("proj.weight"):
            w = np.concatenate(parts)
        else:
            np.testing.assert_array_equal(parts[0], parts[1])
            w = parts[0]
        full[name] = torch.from_numpy(np.ascontiguousarray(w))
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg.hf_kwargs(), attn_implementation="eager"))
    hf.load_state_dict(full, strict=True)
    with torch.no_grad():
        got = hf(torch.from_numpy(C.tokens(cfg)).long()).logits.numpy()
    want = np.load(run["out"] / "jax_logits.npy")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.isfinite(run["events"][0]["loss"])
