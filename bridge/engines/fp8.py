"""FP8 engines: the engine's block format, its workers' FP8 hello and the FP8 sync of a recipe (pure).

An engine that serves a block-quantized FP8 checkpoint (``quantization_config``
``{"quant_method": "fp8", "weight_block_size": [n, k]}``) holds, per linear layer and
rank, ``weight`` as ``float8_e4m3fn`` ``[out/tp, in]`` (or ``[out, in/tp]``) and
``weight_scale_inv`` float32 ``[ceil(out/tp/n), ceil(in/k)]`` (vLLM's
``Fp8LinearMethod`` and ``BlockQuantScaleParameter``); these are its engine params
(``bridge.engines.vllm.model.live_params``), and ``write_layers`` puts new FP8 weights and
scales into them and reruns the layer's post-load processing (the CPU kernel's weight
packing) as for any other weights. The sync differs in one place: its param map is
``fp8_sync_map``, the recipe's param map made FP8 exactly for the params the engine
holds in FP8 (``bridge.fp8_param_map``, with the engine's block). FP8 weights travel as
``float8_e4m3fn``, so ``check_engine_params`` compares that map with the engine params as it is, and
the received tensors go to ``write_layers`` as they arrive.

The trainer quantizes with ``bridge.trainer.fp8.quantize_params(params, fp8)`` on the
same ``Fp8ParamMap``. Per-tensor FP8 checkpoints (``weight_scale``, one per logical
part of a fused layer) are not handled.

Example:
  >>> from bridge.engines.fp8 import engine_fp8_format
  >>> engine_fp8_format({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
  Fp8Format(block=(128, 128), dtype='float8_e4m3fn', amax_floor=0.0001, scaling='reciprocal')
  >>> engine_fp8_format(None) is None
  True

The hello: a worker of an FP8 engine adds ``fp8_hello(quant_config)`` to its
hello (nothing when the model is not FP8, so that hello is unchanged), and every
rank reads the engine's format back with ``fp8_from_hellos``:

  >>> from bridge.engines.fp8 import fp8_from_hellos, fp8_hello
  >>> hello = fp8_hello({"quant_method": "fp8", "weight_block_size": [128, 128]})
  >>> hello
  {'fp8': {'block': [128, 128], 'dtype': 'float8_e4m3fn'}}
  >>> fp8_from_hellos([hello, hello]).block, fp8_hello(None), fp8_from_hellos([{}, {}]) is None
  ((128, 128), {}, True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bridge.engines.hello import EngineParam
from bridge.plan.fp8 import Fp8ParamMap, fp8_param_map
from bridge.plan.param_map import ParamMap
from bridge.plan.source import Source
from jreshard.core.fp8 import Fp8Format

__all__ = ["engine_fp8_format", "fp8_sync_map", "fp8_hello", "fp8_from_hellos"]

_FORMATS = {"e4m3": "float8_e4m3fn"}


def engine_fp8_format(quant_config: Mapping[str, Any] | None) -> Fp8Format | None:
    """The block format of a checkpoint's ``quantization_config``; ``None`` when it is not FP8.

    Raises:
      TypeError: ``quant_config`` is not a mapping.
      ValueError: an FP8 config without ``weight_block_size`` (per-tensor scales) or in
        another FP8 format than e4m3.
    """
    if quant_config is None:
        return None
    if not isinstance(quant_config, Mapping):
        raise TypeError(f"quant_config must be the checkpoint's quantization_config mapping, got "
                        f"{type(quant_config).__name__}.")
    if quant_config.get("quant_method") != "fp8":
        return None
    block = quant_config.get("weight_block_size")
    if not block:
        raise ValueError(f"quant_config {dict(quant_config)} is per-tensor FP8 (no weight_block_size): vLLM keeps "
                         "one weight_scale per logical part of a fused layer, which the sync does not fill; "
                         "serve a block-quantized checkpoint (weight_block_size [128, 128]).")
    fmt = quant_config.get("fmt", "e4m3")
    if fmt not in _FORMATS:
        raise ValueError(f"quant_config fmt {fmt!r} is not supported; the sync quantizes to {list(_FORMATS)}.")
    return Fp8Format(block=tuple(block), dtype=_FORMATS[fmt])


def fp8_sync_map(source: Source, param_map: ParamMap, engine_params: Mapping[int, Sequence[EngineParam]],
                 fmt: Fp8Format) -> Fp8ParamMap:
    """The FP8 sync of a recipe's ``param_map``: quantized exactly where the engine's param is FP8.

    Args:
      source: the trainer's leaves.
      param_map: the recipe's params (``build_param_map``, names resolved).
      engine_params: every worker's engine params.
      fmt: the engine's format (``engine_fp8_format``).
    """
    fp8_names = {t.name for live in engine_params.values() for t in live if t.dtype == fmt.dtype}
    return fp8_param_map(source, param_map, fmt, quantize=lambda name: name in fp8_names)


def fp8_hello(quant_config: Any) -> dict[str, Any]:
    """A worker's FP8 entry of its hello: ``{}`` when the model is not FP8.

    ``{"fp8": {"block": [n, k], "dtype": ...}}`` for a block-FP8 model; a config the sync
    cannot fill gives ``{"fp8": {"error": ...}}``, so that every rank refuses the plan
    (``fp8_from_hellos``) instead of the worker failing alone.
    """
    if quant_config is not None and not isinstance(quant_config, Mapping) and hasattr(quant_config, "to_dict"):
        quant_config = quant_config.to_dict()
    try:
        fmt = engine_fp8_format(quant_config)
    except (TypeError, ValueError) as e:
        return {"fp8": {"error": str(e)}}
    if fmt is None:
        return {}
    return {"fp8": {"block": list(fmt.block), "dtype": fmt.dtype}}


def fp8_from_hellos(workers: Sequence[Mapping[str, Any]]) -> Fp8Format | None:
    """The engine's FP8 format from its workers' hellos; ``None`` when none is FP8.

    Raises:
      ValueError: a worker's model is FP8 in a form the sync cannot fill, or the workers disagree.
    """
    entries = [w.get("fp8") for w in workers]
    errors = [e["error"] for e in entries if e and "error" in e]
    if errors:
        raise ValueError(errors[0])
    formats = {None if e is None else (tuple(e["block"]), e["dtype"]) for e in entries}
    if len(formats) != 1:
        raise ValueError(f"the engine's workers disagree on the FP8 format (block, dtype): "
                         f"{sorted(map(str, formats))}; serve one checkpoint on every worker.")
    (only,) = formats
    if only is None:
        return None
    return Fp8Format(block=only[0], dtype=only[1])
