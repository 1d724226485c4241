"""The bridge's trainer layer (JAX): ``Sender`` sends a trainer process's shards; ``fp8`` quantizes them
to block FP8 first. The only bridge folder, with ``bridge.engines.vllm.trainer``, that imports jax."""

from __future__ import annotations

from bridge.trainer.sender import Sender

__all__ = ["Sender"]
