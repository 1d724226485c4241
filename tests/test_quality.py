"""Code quality gates: ruff, mypy and the import layering contracts (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


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


def test_every_bridge_module_lives_in_a_layer():
    """The layers contract names folders: a module at the bridge's root, outside every layer, would
    escape it. Only the package's API table and the errors it re-exports live there."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    layers = set(contract["layers"])
    for path in (ROOT / "bridge").rglob("*.py"):
        top = path.relative_to(ROOT / "bridge").with_suffix("").parts[0]
        assert top == "__init__" or top in layers, f"{path} is outside the bridge's layers {sorted(layers)}"
