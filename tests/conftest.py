"""Test set-up: 8 simulated CPU devices for JAX, one thread per process, no GPU."""

from __future__ import annotations

import os

# Must happen before jax is first imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hypothesis import settings  # noqa: E402

# `pytest --hypothesis-profile=thorough` runs the sweeps with many more examples.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=3000, deadline=None)
settings.load_profile(os.environ.get("JRESHARD_HYPOTHESIS_PROFILE", "ci"))
