"""Package-level promises: the core imports without jax/torch, the README examples run.

The library's docstring examples are collected by pytest itself (``--doctest-modules``).
"""

from __future__ import annotations

import doctest
import subprocess
import sys
import textwrap

import pytest

import jreshard

BLOCKER = textwrap.dedent(
    """
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in ('jax', 'jaxlib', 'flax', 'torch'):
                raise ImportError(f'{name} is blocked')
    sys.meta_path.insert(0, Block())
    """
)


def test_core_imports_and_plans_without_jax_or_torch():
    code = BLOCKER + textwrap.dedent(
        """
        import jreshard
        from jreshard import Layout, Mesh, plan
        p = plan(Layout((8,), Mesh([0, 1], 'x'), ('x',)), Layout((8,), Mesh([2], 'y'), ()))
        assert p.stats().network_bytes == 8
        import bridge
        print('ok')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_public_api_table():
    for name in jreshard.__all__:
        assert hasattr(jreshard, name), name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        jreshard.nonexistent  # noqa: B018


def test_demo_runs_exact():
    out = subprocess.run([sys.executable, "-m", "jreshard", "demo"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "bit-exact: True" in out.stdout


def test_readme_examples():
    from pathlib import Path

    readme = Path(__file__).resolve().parents[1] / "README.md"
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    result = doctest.testfile(str(readme), module_relative=False, optionflags=flags)
    assert result.attempted > 0
    assert result.failed == 0


def test_submodules_load_on_first_use():
    code = BLOCKER + textwrap.dedent(
        """
        import importlib, sys, jreshard
        assert 'jreshard.fleet.cost' not in sys.modules and 'matplotlib' not in sys.modules
        assert jreshard.nn.LlamaConfig is not None  # the pure config; the flax model stays unloaded
        # The 0.1 alias modules are gone (docs/changelog.md): one import path per module.
        for old in ('catalog', 'cost', 'presets', 'reference', 'scenario'):
            assert not hasattr(jreshard, old), old
            try:
                importlib.import_module('jreshard.' + old)
            except ModuleNotFoundError:
                pass
            else:
                raise AssertionError('jreshard.' + old + ' still imports')
        print('ok')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
