"""Makes every Python process that starts with this folder on ``PYTHONPATH`` run as on an x86 CPU
without AMX (AVX-512 kept), such as an Ice Lake Xeon or an AMD EPYC of the Zen 4 generation.

``make test-no-amx`` runs the suite this way on a machine that has AMX, so that the paths a CPU
without AMX takes are tested too: ``torch.cpu``'s AMX probes, which vLLM's CPU platform reads to
pick its attention kernel (``vec`` instead of ``amx``) and its FP8 GEMM (none: the FP8 engine test
skips, saying why), answer ``False``. They are patched right after ``torch.cpu`` is imported (a
post-import hook), so a process that never imports torch pays nothing. Processes that vLLM or the
tests start inherit ``PYTHONPATH``, so they run the same way.

Capping AVX-512 too (so that vLLM loads its ``_C_AVX2`` kernel library, as on an AVX2-only CPU)
is not done: on an AMX machine the TP2 engine then fails at its first generation ("index out of
range" in the vocabulary-parallel embedding), which a real AVX2-only CPU does not show.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_PROBES = ("_is_amx_tile_supported", "_is_amx_fp16_supported")


def _cap(module: ModuleType) -> None:
    for name in _PROBES:
        if hasattr(module, name):
            setattr(module, name, lambda: False)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _cap(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if "torch.cpu" in sys.modules:
    _cap(sys.modules["torch.cpu"])
else:
    sys.meta_path.insert(0, _Finder())
