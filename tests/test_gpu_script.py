"""The GPU check script (tests/gpu/run_device_checks.py) on a machine without a GPU: every check skips with
its reason and the script exits 0; with --device cpu the checks whose logic runs on the CPU pass."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "gpu" / "run_device_checks.py"


def _run(*args: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240)
    return p.returncode, p.stdout + p.stderr


def _rows(out: str) -> dict[str, tuple[str, str]]:
    return {m[1]: (m[2], m[3]) for m in re.finditer(r"^(\w+)\s+(PASS|FAIL|SKIP)\s+\S+\s+(.*)$", out, re.M)}


def test_without_a_gpu_every_check_skips_saying_why():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script runs its checks for real")
    rc, out = _run()
    rows = _rows(out)
    assert rc == 0, out
    assert len(rows) >= 8 and all(status == "SKIP" and why for status, why in rows.values()), out
    assert "0 FAIL" in out


def test_the_cpu_mode_runs_the_checks_logic():
    rc, out = _run("--device", "cpu")
    rows = _rows(out)
    assert rc == 0, out
    for name in ("dlpack", "pack_unpack", "transfer", "digest", "qwen3_receiver"):
        assert rows[name][0] == "PASS", (name, out)
