"""The notebooks run top to bottom on a python3 kernel of this environment; a failing cell fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="executing notebooks needs the dev extra (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="executing notebooks needs the dev extra (nbclient)")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:5] == ["01_quickstart.ipynb", "02_plan_a_model.ipynb", "03_jax_to_torch.ipynb",
                                               "04_vllm_refit.ipynb", "05_rl_loop.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_without_outputs_and_simulates_devices_first(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    for i, cell in enumerate(code):
        assert cell.outputs == [] and cell.execution_count is None, (
            f"{path.name}: code cell {i} is stored with outputs; clear them before committing "
            "(jupyter nbconvert --clear-output --inplace notebooks/*.ipynb)")
    first = code[0].source
    # The device count can only be set before jax is first imported in the kernel.
    assert "--xla_force_host_platform_device_count=8" in first
    assert first.index("xla_force_host_platform_device_count") < first.find("import jax") or "import jax" not in first
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch, tmp_path):
    # The kernel inherits this environment: the repository on the path, no GPU, one thread per op.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # No user-level kernel specs: 'python3' is this environment's, whose bare 'python' jupyter_client
    # replaces with this interpreter.
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter"))
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)", id="interpreter-check"))
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if out.output_type == "error"]
    assert errors == []
    assert nb.cells[-1].outputs[0].text.strip() == sys.executable


def test_render_figures_draws_one_picture_per_notebook(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "notebooks" / "render_figures.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    pictures = sorted(p.name for p in tmp_path.iterdir())
    assert pictures == [f"{p.stem}.png" for p in NOTEBOOKS]
    for name in pictures:
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    # The README shows the committed copies: one for each notebook.
    assert sorted(p.name for p in (ROOT / "docs" / "images").glob("0*.png")) == pictures
