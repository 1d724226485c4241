"""Doctest collection of bridge.engines.vllm: the worker-side engine module needs vLLM installed."""

from __future__ import annotations

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") else ["engine.py"]
