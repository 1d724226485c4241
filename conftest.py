"""Test set-up for tests/ and the library's doctests: 8 simulated CPU devices, one thread, no GPU."""

from __future__ import annotations

import os

# Must happen before jax is first imported anywhere in the test session; this file sits at the
# root so that `pytest jreshard/...` (doctests alone) gets the same devices as `pytest tests/...`.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Sweeps are seeded with a fixed number of examples; JRESHARD_HYPOTHESIS_PROFILE=thorough runs
# many more, from a fresh random seed each time.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=3000, deadline=None)
settings.load_profile(os.environ.get("JRESHARD_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _doctests_without_module_globals(request: pytest.FixtureRequest) -> None:
    """Docstring examples run with empty globals, so each one imports what it uses."""
    test = getattr(request.node, "dtest", None)
    if test is not None:
        test.globs.clear()

