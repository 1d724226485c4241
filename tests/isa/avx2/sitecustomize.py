"""Makes every Python process that starts with this folder on ``PYTHONPATH`` run as on an x86 CPU
with AVX2 only (no AVX-512, no AMX), such as an AMD EPYC of the Zen 2 or Zen 3 generations.

``make test-avx2`` runs the suite this way on a machine that has AVX-512 and AMX, so that the
kernels a smaller CPU gets are tested too: torch's ATen kernels (``ATEN_CPU_CAPABILITY``) and
oneDNN (``ONEDNN_MAX_CPU_ISA``) are capped at AVX2, and ``torch.cpu``'s feature probes, which
vLLM's CPU platform reads to pick its kernel library (``vllm._C_AVX2``), its attention kernel and
its FP8 GEMM, answer ``False`` for AVX-512 and AMX. The probes are patched right after
``torch.cpu`` is imported (a post-import hook), so a process that never imports torch pays nothing.
Processes that vLLM or the tests start inherit ``PYTHONPATH`` and the environment, so they run the
same way.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"

_PROBES = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
           "_is_amx_tile_supported", "_is_amx_fp16_supported")


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
