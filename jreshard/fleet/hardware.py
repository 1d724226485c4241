"""Hardware descriptions and the topology the cost model needs of a cluster.

A hardware file (``jreshard/data/hardware/*.json``) gives the NVLink domain size,
the NVLink and network bandwidths per GPU per direction, the latency of one
message and, optionally, the rate at which a GPU copies its own memory
(``copy_GBps``: the executors' packing and unpacking); ``Topology`` adds the
bucket size and places device ``d`` in domain ``d // gpus_per_domain``, or in the
domains it is given (``device_domains``, a ``jreshard.core.domains.Domains``: the
devices of each JAX process, ranks grouped by node). See ``docs/cost_model.md``.

Example:
  >>> from jreshard.fleet.hardware import Topology
  >>> topo = Topology.from_hardware("dgx-h100")
  >>> topo.gpus_per_domain, topo.domain([0, 7, 8]).tolist(), topo.domains
  (8, [0, 0, 1], Domains.contiguous(8))
  >>> from jreshard.core.domains import Domains
  >>> topo.with_domains(Domains.from_groups([[0, 8], [7]])).domain([0, 7, 8]).tolist()
  [0, 1, 0]
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

from jreshard.core.args import check_int
from jreshard.core.domains import Domains
from jreshard.core.jsonfile import read_json_object

__all__ = ["Hardware", "Topology", "load_hardware", "hardware_names"]

_HW_FIELDS = {"gpus_per_domain": int, "nvlink_GBps_per_direction": float, "network_GBps_per_gpu_per_direction": float,
              "latency_us": float}
_OPTIONAL = {"copy_GBps": float}  # absent: local copies are not charged


@dataclasses.dataclass(frozen=True, slots=True)
class Hardware:
    """One hardware description (a file of ``jreshard/data/hardware``)."""

    name: str
    gpus_per_domain: int
    nvlink_GBps: float
    network_GBps: float
    latency_us: float
    copy_GBps: float | None = None


def hardware_names() -> tuple[str, ...]:
    """Names of the hardware files in the package data."""
    files = resources.files("jreshard").joinpath("data/hardware").iterdir()
    return tuple(sorted(f.name[:-5] for f in files if f.name.endswith(".json")))


def load_hardware(spec: str | os.PathLike | Mapping | Hardware) -> Hardware:
    """A ``Hardware`` from a name in the package data, a JSON path, or a mapping.

    Raises ValueError naming the missing or bad field.
    """
    if isinstance(spec, Hardware):
        return spec
    where = "hardware"
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if path in hardware_names():
            data = json.loads(resources.files("jreshard").joinpath(f"data/hardware/{path}.json").read_text())
            where = f"hardware {path!r}"
        elif os.path.exists(path):
            data = read_json_object("hardware file", path, "a hardware description such as "
                                    "jreshard/data/hardware/dgx-h100.json")
            where = f"hardware file {path!r}"
        else:
            raise ValueError(f"hardware {path!r} is neither a known name {hardware_names()} nor a JSON file.")
    elif isinstance(spec, Mapping):
        data = dict(spec)
    else:
        raise TypeError(f"hardware must be a name, a path or a mapping, got {type(spec).__name__}.")
    values: dict[str, Any] = {}
    for key, kind in (_HW_FIELDS | _OPTIONAL).items():
        if key not in data:
            if key in _OPTIONAL:
                continue
            raise ValueError(f"{where}: field {key!r} is missing; give it as a number.")
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or v < 0 or (kind is int and (v % 1 or v < 1)) or (
                key in _OPTIONAL and v == 0):
            want = "positive int" if kind is int else "positive number" if key in _OPTIONAL else "non-negative number"
            raise ValueError(f"{where}: field {key!r} must be a {want}, got {v!r}.")
        values[key] = int(float(v)) if kind is int else float(v)
    return Hardware(str(data.get("name", "custom")), values["gpus_per_domain"], values["nvlink_GBps_per_direction"],
                    values["network_GBps_per_gpu_per_direction"], values["latency_us"], values.get("copy_GBps"))


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """What the cost model needs of a cluster (bandwidths per GPU per direction).

    ``copy_GBps``: GB per second one device copies in its own memory (the executors'
    packing, unpacking and local moves; ``docs/cost_model.md``); ``None`` charges nothing.
    """

    gpus_per_domain: int
    nvlink_GBps: float
    network_GBps: float
    latency_us: float
    bucket_bytes: int = 256 << 20
    device_domains: Domains | None = None  # None: blocks of gpus_per_domain consecutive ids
    copy_GBps: float | None = None

    def __post_init__(self) -> None:
        check_int("gpus_per_domain", self.gpus_per_domain, minimum=1)
        for name in ("nvlink_GBps", "network_GBps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}.")
        if self.latency_us < 0 or self.bucket_bytes < 1:
            raise ValueError("latency_us must be >= 0 and bucket_bytes >= 1.")
        if self.copy_GBps is not None and not self.copy_GBps > 0:
            raise ValueError(f"copy_GBps must be positive, or None to charge no local copies; got {self.copy_GBps!r}.")
        if self.device_domains is not None and not isinstance(self.device_domains, Domains):
            raise TypeError(f"device_domains must be a jreshard.core.domains.Domains or None, got "
                            f"{type(self.device_domains).__name__}; build one with Domains.from_groups(groups).")

    @classmethod
    def from_hardware(cls, hw: Hardware | str | Mapping, gpus_per_domain: int | None = None) -> Topology:
        hw = load_hardware(hw)
        return cls(gpus_per_domain or hw.gpus_per_domain, hw.nvlink_GBps, hw.network_GBps, hw.latency_us,
                   copy_GBps=hw.copy_GBps)

    @property
    def domains(self) -> Domains:
        """Which devices share NVLink: ``device_domains``, else blocks of ``gpus_per_domain``."""
        return self.device_domains if self.device_domains is not None else Domains.contiguous(self.gpus_per_domain)

    def with_domains(self, domains: Domains) -> Topology:
        """This topology with its devices grouped by ``domains`` instead of blocks."""
        return dataclasses.replace(self, device_domains=domains)

    def domain(self, devices: Any) -> Any:
        """The NVLink domain of each device id."""
        return self.domains.of(devices)
