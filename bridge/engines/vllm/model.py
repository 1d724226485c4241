"""A live vLLM model as the sync sees it: its engine params, and how new weights enter it (torch and vLLM, never jax).

vLLM records every layer's parameters in their logical (checkpoint, per-rank) layout
when it builds the model (``record_metadata_for_reloading``), then its post-load
processing may replace them by kernel layouts: the CPU backend packs linear weights
into oneDNN or sgl kernels and leaves the parameter empty (shape ``(0,)``), and
rewrites ``FusedMoE`` expert weights. Writing into the live parameters would change
nothing there. So the engine params are the recorded logical parameters, and a commit does,
per layer, what vLLM's layerwise reload does: recreate the layer's parameters in
logical layout, fill them, run the layer's ``quant_method.process_weights_after_loading``,
then copy the processed tensors back into the storage the engine already holds (CUDA
graphs keep their pointers) where shapes allow. Layers without a quant method (norms)
are written in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

import torch

from bridge.engines.hello import EngineParam
from bridge.engines.worker import Commit

__all__ = ["live_params", "write_layers", "torch_dtype_name"]

log = logging.getLogger("bridge")


def torch_dtype_name(dtype: Any) -> str:
    """``'float32'`` for ``torch.float32`` (and for a dtype already given by name)."""
    return str(dtype).removeprefix("torch.")


def _reload_api():
    """vLLM's layerwise-reload helpers (vLLM 0.32 and later)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS, materialize_layer, restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    return get_layerwise_info, SKIP_TENSORS, materialize_layer, restore_layer_on_meta, get_layer_params_buffers


def _loadable(module: torch.nn.Module) -> bool:
    """Whether a module's parameters come from a checkpoint (attention layers hold only scales)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return not is_deferred_attention_layer(module)


def live_params(model: torch.nn.Module) -> list[EngineParam]:
    """Every parameter the model loads, in its recorded logical layout, named as vLLM names it."""
    get_layerwise_info, skip, *_ = _reload_api()
    out = []
    for prefix, module in model.named_modules():
        if not _loadable(module):
            continue
        params, _ = get_layerwise_info(module).restore_metadata
        for name, meta in params.items():
            if name in skip:
                continue
            full = f"{prefix}.{name}" if prefix else name
            out.append(EngineParam(full, tuple(meta.shape), torch_dtype_name(meta.dtype)))
    return out


def _by_module(values: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in values.items():
        prefix, _, leaf = name.rpartition(".")
        out.setdefault(prefix, {})[leaf] = t
    return out


@torch.no_grad()
def _reprocess(module: torch.nn.Module, values: Mapping[str, torch.Tensor], adopt: Collection[str]) -> tuple[
        float, set[str]]:
    """One layer: logical parameters recreated and filled, post-load processing, kernel storage kept.

    The recreated parameters named in ``adopt`` take the given tensors' storage instead of a copy.
    Returns the seconds vLLM's processing took and the names adopted.
    """
    get_layerwise_info, _, materialize_layer, restore_layer_on_meta, get_layer_params_buffers = _reload_api()
    info = get_layerwise_info(module)
    kernel_params, kernel_buffers = get_layer_params_buffers(module)
    non_persistent = set(module._non_persistent_buffers_set)
    restore_layer_on_meta(module, info)
    materialize_layer(module, info)
    params, buffers = get_layer_params_buffers(module)
    adopted = set()
    for name, t in params.items():
        if name in adopt and values[name].stride() == t.stride() and values[name].dtype == t.dtype:
            t.data = values[name]  # the staging tensor itself: no copy (materialized storage is never touched)
            adopted.add(name)
        elif name in values:
            t.data.copy_(values[name])
        elif name in kernel_params and kernel_params[name].shape == t.shape:
            t.data.copy_(kernel_params[name])  # not part of the sync (a bias the recipe leaves out)
    for name, t in buffers.items():
        if name in kernel_buffers and kernel_buffers[name].shape == t.shape:
            t.data.copy_(kernel_buffers[name])
    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")
    method: Any = module.quant_method
    on_cpu = any(t.device.type == "cpu" for t in params.values())
    if on_cpu and getattr(method, "moe_kernel", None) is not None:
        # vLLM 0.32 treats a second processing as a weight update and skips the CPU experts' prepack
        # (it keeps the kernel built at load time), so the kernel would read logical weights as
        # packed ones. Without a kernel the first-load path runs: a new kernel, the weights prepacked.
        method.moe_kernel = None
    t0 = time.perf_counter()
    method.process_weights_after_loading(module)
    seconds = time.perf_counter() - t0
    update_tp_status = getattr(module, "update_param_tp_status", None)
    if callable(update_tp_status):  # parameters re-created by processing get their TP state again
        update_tp_status()
    new_params, new_buffers = get_layer_params_buffers(module)
    same = (set(new_params) == set(kernel_params) and set(new_buffers) <= set(kernel_buffers)
            and all(kernel_params[n].shape == t.shape and kernel_params[n].dtype == t.dtype
                    for n, t in new_params.items())
            and all(kernel_buffers[n].shape == t.shape and kernel_buffers[n].dtype == t.dtype
                    for n, t in new_buffers.items()))
    if not same:
        return seconds, adopted  # processing changed the kernel layout's shapes: the new tensors stay
    for name, t in new_params.items():
        kernel_params[name].data.copy_(t)
    for name, t in new_buffers.items():
        kernel_buffers[name].data.copy_(t)
    for name in list(new_params) + list(new_buffers):
        delattr(module, name)
    for name, p in kernel_params.items():
        module.register_parameter(name, p)
    for name, b in kernel_buffers.items():
        module.register_buffer(name, b, persistent=name not in non_persistent)
    return seconds, adopted


@torch.no_grad()
def write_layers(model: torch.nn.Module, values: Mapping[str, torch.Tensor], *,
                 adopt: Collection[str] = ()) -> Commit:
    """Puts new logical-layout weights into the live model; returns what it did (``bridge.engines.worker.Commit``).

    ``values`` maps full parameter names to this rank's logical tensors. Layers with a
    quant method are reprocessed (see the module docstring); others are written in place.
    A reprocessed layer takes the tensors named in ``adopt`` as they are (their storage
    becomes the layer's logical parameter, as a copy would); the caller must not write
    into the tensors named in ``Commit.adopted`` again.
    """
    modules = dict(model.named_modules())
    count, process, adopted = 0, 0.0, set()
    for prefix, vals in _by_module(values).items():
        module = modules[prefix]
        if getattr(module, "quant_method", None) is not None:
            leaves = {n for n in vals if (f"{prefix}.{n}" if prefix else n) in adopt}
            seconds, took = _reprocess(module, vals, leaves)
            process += seconds
            adopted |= {f"{prefix}.{n}" if prefix else n for n in took}
        else:
            for name, t in vals.items():
                live = getattr(module, name)
                if tuple(live.shape) != tuple(t.shape):
                    raise ValueError(f"{prefix}.{name} is {tuple(live.shape)} in the engine but the sync brought "
                                     f"{tuple(t.shape)}; this layer has no quant method to reprocess it.")
                live.data.copy_(t)
        count += 1
    return Commit(count, process, frozenset(adopted))
