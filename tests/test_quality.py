"""Code quality gates: ruff, mypy and the import layering contracts (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Trainer-side bridge modules: the only ones that may import jax.
BRIDGE_SENDER_MODULES = {"bridge.sender", "bridge.fp8_sender", "bridge.vllm.trainer"}


def run_tool(name: str, *args: str, timeout: int = 600) -> None:
    exe = BIN / name
    if not exe.exists():
        pytest.fail(f"{exe} is missing; install the dev extra (make venv, or pip install -r requirements.lock)")
    out = subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    command = " ".join((name, *args))
    assert out.returncode == 0, f"{command} failed:\n{out.stdout[-8000:]}\n{out.stderr[-4000:]}"


def test_ruff():
    run_tool("ruff", "check", "--no-cache")


def test_mypy():
    run_tool("mypy")


def test_import_layering():
    run_tool("lint-imports", "--no-cache")


def test_receiver_contract_names_every_bridge_module_but_the_sender():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if "receiver" in c["name"]]
    modules = set()
    for path in (ROOT / "bridge").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    listed = set()
    for expression in contract["source_modules"]:
        if expression.endswith(".*"):
            package = expression[:-2]
            listed |= {m for m in modules if m.rpartition(".")[0] == package}
        else:
            listed.add(expression)
    assert listed == modules - BRIDGE_SENDER_MODULES, (
        "the receiver-side contract in pyproject.toml must list every bridge module except the sender; "
        f"missing {sorted(modules - BRIDGE_SENDER_MODULES - listed)}, extra {sorted(listed - modules)}, "
        f"sender-side listed {sorted(listed & BRIDGE_SENDER_MODULES)}"
    )
