"""Weight-sync scenarios: a model, training and inference parallelism, and hardware.

A scenario file has the format of ``jreshard/data/systems/*.json``::

  {"model": "qwen3-32b",
   "train": {"gpus": 32, "tp": 4, "pp": 4, "dp": 2},
   "infer": {"gpus": 32, "tp": 4, "dp": 8},
   "hardware": "dgx-h100",
   "dtype": "bfloat16"}

Optional fields: ``colocated`` (training and inference share device ids; otherwise
inference devices follow the training ones), ``gpus_per_domain_override``,
``published`` (figures quoted publicly, seconds per full sync), ``notes``.

``dtype`` is the dtype delivered to inference. An FP8 dtype (``"float8_e4m3fn"``)
means FP8 delivery (``jreshard.fleet.fp8``): the trainer keeps the model's dtype,
the tensors the catalog marks ``quantize`` arrive block-scaled in FP8 with their
``weight_scale_inv``, the others in the model's dtype. ``fp8_block`` sets the block
(``[128, 128]`` by default, ``"tensor"``, ``"channel"``); an inference split that
cuts a block is refused, as vLLM refuses it.
``model`` and ``hardware`` name files of the package data, or are paths to a
Hugging Face-style ``config.json`` / a hardware JSON file.

Example:
  >>> from jreshard.fleet import scenario
  >>> s = scenario.load_scenario({"model": "llama-tiny", "train": {"gpus": 4, "fsdp": 4},
  ...                             "infer": {"gpus": 4, "tp": 2, "dp": 2}, "hardware": "dgx-h100"})
  >>> src, dst = s.layouts()
  >>> len(src), s.infer_devices()
  (39, range(4, 8))
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

from jreshard.core.args import INT64_MAX, check_int
from jreshard.core.fp8 import Fp8Format
from jreshard.core.jsonfile import read_json_object
from jreshard.core.layout import Layout, canonical_dtype
from jreshard.fleet import catalog, cost
from jreshard.fleet.fp8 import AmaxSummary, Fp8Costs, fp8_costs, fp8_layouts, parse_block
from jreshard.fleet.presets import InferParallel, TrainParallel, check_degrees, infer_layouts, train_layouts

__all__ = ["Scenario", "load_scenario", "scenario_names", "ScenarioError"]

_TOP = {"model", "train", "infer", "hardware", "dtype", "colocated", "gpus_per_domain_override", "published",
        "notes", "name", "fp8_block"}
_TRAIN = {f.name for f in dataclasses.fields(TrainParallel)} | {"gpus"}
_INFER = {f.name for f in dataclasses.fields(InferParallel)} | {"gpus"}


class ScenarioError(ValueError):
    """A scenario file is malformed; the message names the field.

    ``field`` is the top-level field at fault (``'infer'``, ``'model'``) where one
    value is, and ``reason`` the message without the scenario and field, so that a
    caller with its own names for the fields (the CLI's flags) can restate it.
    """

    def __init__(self, message: str, *, field: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason if reason is not None else message


def _field_error(where: str, field: str, exc: Exception) -> ScenarioError:
    return ScenarioError(f"{where}: field {field!r}: {exc}", field=field, reason=str(exc))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Scenario:
    """One weight sync: model, both sides' parallelism and devices, hardware.

    ``fp8`` is the format of an FP8 delivery (``dtype`` is then its FP8 type), else ``None``.
    """

    name: str
    model: catalog.ModelConfig
    train: TrainParallel
    infer: InferParallel
    train_gpus: int
    infer_gpus: int
    hardware: cost.Hardware
    dtype: str | None = None
    colocated: bool = False
    gpus_per_domain: int | None = None
    published: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fp8: Fp8Format | None = None

    def train_devices(self) -> range:
        return range(self.train_gpus)

    def infer_devices(self) -> range:
        start = 0 if self.colocated else self.train_gpus
        return range(start, start + self.infer_gpus)

    def topology(self) -> cost.Topology:
        return cost.Topology.from_hardware(self.hardware, self.gpus_per_domain)

    def tensors(self, experts: str = "separate") -> list[catalog.TensorInfo]:
        """The model's tensors in the trainer's dtype (the model's own under FP8 delivery)."""
        return catalog.tensors(self.model, experts=experts, dtype=None if self.fp8 else self.dtype)

    def layouts(self, experts: str = "separate") -> tuple[dict[str, Layout], dict[str, Layout]]:
        """(training layouts, inference layouts), flat dicts keyed by Hugging Face name.

        Under FP8 delivery the inference layouts of quantized tensors are FP8 and each has a
        ``<name>_scale_inv`` leaf on both sides (``jreshard.fleet.fp8.fp8_layouts``).
        """
        infos = self.tensors(experts)
        src = train_layouts(infos, self.train, self.train_devices())
        dst = infer_layouts(infos, self.infer, self.infer_devices())
        return fp8_layouts(infos, src, dst, self.fp8) if self.fp8 else (src, dst)

    def fp8_costs(self, experts: str = "separate") -> tuple[Fp8Costs, AmaxSummary] | None:
        """What FP8 delivery adds to the cost model, and its summary; ``None`` without FP8."""
        if self.fp8 is None:
            return None
        infos = self.tensors(experts)
        return fp8_costs(infos, train_layouts(infos, self.train, self.train_devices()), self.fp8, self.topology())


def scenario_names() -> tuple[str, ...]:
    files = resources.files("jreshard").joinpath("data/systems").iterdir()
    return tuple(sorted(f.name[:-5] for f in files if f.name.endswith(".json")))


def _positive_int(where: str, field: str, v: Any) -> int:
    try:
        return check_int(f"field {field!r}", v, minimum=1)
    except (TypeError, ValueError) as e:  # one error type for a malformed file, naming the file
        raise ScenarioError(f"{where}: {e}") from None


def _side(where: str, data: Mapping, field: str, allowed: set, cls: type,
          infos: list[catalog.TensorInfo]) -> tuple[Any, int]:
    if field not in data:
        raise ScenarioError(f"{where}: field {field!r} is missing; give for example {{\"gpus\": 8, \"tp\": 8}}.")
    side = data[field]
    if not isinstance(side, Mapping):
        raise ScenarioError(f"{where}: field {field!r} must be an object of degrees, got {side!r}.")
    unknown = sorted(set(side) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: field '{field}.{unknown[0]}' is not known; {field} takes {sorted(allowed)}.")
    degrees = {k: _positive_int(where, f"{field}.{k}", v) for k, v in side.items() if k != "gpus"}
    par = cls(**degrees)
    if "gpus" in side:
        gpus = _positive_int(where, f"{field}.gpus", side["gpus"])
    elif cls is InferParallel:
        gpus = par.tp * par.dp
    else:
        # Experts fold into the data-parallel ranks (Megatron): a stage holds both groups.
        gpus = par.pp * math.lcm(par.tp * par.cp * par.fsdp * par.dp, par.ep * par.fsdp * par.expert_tp)
    try:
        par.world(gpus) if cls is TrainParallel else par.check(gpus)
        check_degrees(infos, par)
    except ValueError as exc:
        raise _field_error(where, field, exc) from None
    return par, gpus


def _fp8(where: str, dtype: str | None, block: Any, infos: list[catalog.TensorInfo], infer: InferParallel,
         devices: range) -> Fp8Format | None:
    if dtype is None or not dtype.startswith("float8"):
        if block is not None:
            raise ScenarioError(f"{where}: field 'fp8_block' needs an FP8 dtype such as 'float8_e4m3fn', "
                                f"got dtype {dtype!r}.", field="fp8_block", reason="needs an FP8 dtype")
        return None
    try:
        fmt = Fp8Format(block=parse_block((128, 128) if block is None else block), dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise _field_error(where, "fp8_block" if block is not None else "dtype", exc) from None
    try:  # one tensor of each kind: an inference split that cuts a block is the infer field's fault
        dst = infer_layouts(infos, infer, devices)
        fp8_layouts(infos, dst, dst, fmt)
    except ValueError as exc:
        raise _field_error(where, "infer", exc) from None
    return fmt


def load_scenario(spec: str | os.PathLike | Mapping, *, name: str | None = None, dtype: str | None = None,
                  fp8_block: Any = None) -> Scenario:
    """Reads a scenario from a built-in name, a JSON path, or a mapping.

    ``dtype`` and ``fp8_block``, when given, replace the scenario's fields of those names
    (``jreshard plan NAME --dtype float8_e4m3fn``).

    Raises:
      ScenarioError (a ValueError): a field is missing, unknown or bad; the message names it.
    """
    if isinstance(spec, Mapping):
        data, where = dict(spec), f"scenario {name or '<dict>'}"
    elif isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if path in scenario_names():
            data = json.loads(resources.files("jreshard").joinpath(f"data/systems/{path}.json").read_text())
            where = f"scenario {path!r}"
        elif os.path.exists(path):
            try:
                data = read_json_object("scenario file", path, "a scenario such as those in jreshard/data/systems")
            except ValueError as exc:
                raise ScenarioError(str(exc)) from None
            where = f"scenario file {path!r}"
        else:
            raise ScenarioError(f"scenario {path!r} is neither a built-in name {scenario_names()} "
                                "nor an existing file.")
        name = name or os.path.basename(path).removesuffix(".json")
    else:
        raise TypeError(f"scenario must be a name, a path or a dict, got {type(spec).__name__}.")
    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise ScenarioError(f"{where}: field {unknown[0]!r} is not known; scenario fields are {sorted(_TOP)}.")
    if "model" not in data:
        raise ScenarioError(f"{where}: field 'model' is missing; name one of {catalog.models()}.")
    model_spec = data["model"]
    try:
        if (isinstance(model_spec, str) and model_spec not in catalog.models()
                and (model_spec.endswith(".json") or os.path.exists(model_spec))):
            model = catalog.register_model(model_spec)  # a path: its own errors (missing, a folder, not JSON)
        else:
            model = catalog.get_model(model_spec)
    except (TypeError, ValueError) as exc:
        raise _field_error(where, "model", exc) from None
    infos = catalog.tensors(model, experts="stacked")  # the degree checks need each kind of tensor once
    first = {t.shape: t for t in reversed(infos)}.values()  # the first tensor of each shape
    huge = next((t for t in first if math.prod(t.shape) * 16 > INT64_MAX), None)
    if huge is not None:  # counted in bytes by the planner, in int64 (16: the widest element)
        raise _field_error(where, "model", ValueError(
            f"tensor {huge.name!r} of shape {huge.shape} has more bytes than the 2**63 - 1 a plan can count; "
            "check the config's sizes."))
    train, train_gpus = _side(where, data, "train", _TRAIN, TrainParallel, infos)
    infer, infer_gpus = _side(where, data, "infer", _INFER, InferParallel, infos)
    if "hardware" not in data:
        raise ScenarioError(f"{where}: field 'hardware' is missing; name one of {cost.hardware_names()}.")
    try:
        hw = cost.load_hardware(data["hardware"])
    except (TypeError, ValueError) as exc:
        raise _field_error(where, "hardware", exc) from None
    if dtype is not None:
        data["dtype"] = dtype
    if fp8_block is not None:
        data["fp8_block"] = fp8_block
    try:
        dtype = canonical_dtype(data.get("dtype"))
    except TypeError as exc:
        raise _field_error(where, "dtype", exc) from None
    colocated = data.get("colocated", False)
    if not isinstance(colocated, bool):
        raise ScenarioError(f"{where}: field 'colocated' must be true or false, got {colocated!r}.")
    if colocated and train_gpus != infer_gpus:
        raise ScenarioError(f"{where}: field 'colocated' needs as many inference as training devices, "
                            f"got {infer_gpus} and {train_gpus}.")
    gpd = data.get("gpus_per_domain_override")
    if gpd is not None:
        gpd = _positive_int(where, "gpus_per_domain_override", gpd)
    published = data.get("published", {})
    if not isinstance(published, Mapping):
        raise ScenarioError(f"{where}: field 'published' must be an object, got {published!r}.")
    infer_devices = range(0 if colocated else train_gpus, (0 if colocated else train_gpus) + infer_gpus)
    fmt = _fp8(where, dtype, data.get("fp8_block"), infos, infer, infer_devices)
    return Scenario(data.get("name") or name or model.name, model, train, infer, train_gpus, infer_gpus, hw, dtype,
                    colocated, gpd, dict(published), fmt)
