"""Parallelism degrees of each side of a weight sync, and their parser.

``TrainParallel`` holds the training degrees (Megatron / JAX trainers) and
``InferParallel`` the inference ones (vLLM-style engines); ``parse_degrees`` and
``parse_parallel`` read them from ``'tp=4,pp=2'`` text. ``jreshard.fleet.presets``
turns them into layouts; the words are those of its docstring.

Example:
  >>> from jreshard.fleet.degrees import TrainParallel
  >>> TrainParallel(ep=4, fsdp=2, pp=2).world(32)  # (stage size, dense replicas, expert replicas)
  (16, 8, 2)
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

__all__ = ["TrainParallel", "InferParallel", "parse_degrees", "parse_parallel"]


def _check_positive(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= int(v) < 2**63:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be a positive int below 2**63, got {v!r}.")


@dataclasses.dataclass(frozen=True, slots=True)
class TrainParallel:
    """Training-side degrees (Megatron / JAX trainers).

    Routed experts are split over ``ep`` (major) and ``fsdp`` (minor) on their expert
    dim, and inside each expert over ``expert_tp``; dense weights over ``fsdp`` and ``tp``.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    expert_tp: int = 1
    fsdp: int = 1

    def __post_init__(self) -> None:
        _check_positive(self)

    def world(self, gpus: int) -> tuple[int, int, int]:
        """(stage size, dense replicas, expert replicas) for ``gpus`` devices.

        Raises ValueError when the degrees do not fit ``gpus``.
        """
        if gpus % self.pp:
            raise ValueError(f"{gpus} training devices do not split into pp={self.pp} stages; "
                             "make the device count a multiple of pp.")
        stage = gpus // self.pp
        dense = self.tp * self.cp * self.fsdp * self.dp
        if stage % dense:
            raise ValueError(f"a pipeline stage of {stage} devices cannot hold tp*cp*fsdp*dp = {dense}; "
                             f"degrees {self} do not fit {gpus} devices.")
        if self.ep == 1 and self.expert_tp == 1 and stage != dense:
            raise ValueError(f"tp*cp*fsdp*dp*pp = {dense * self.pp} but there are {gpus} training devices; "
                             f"degrees {self} must multiply to the device count.")
        expert = self.ep * self.fsdp * self.expert_tp
        if stage % expert:
            raise ValueError(f"a pipeline stage of {stage} devices cannot hold ep*fsdp*expert_tp = "
                             f"{expert}; degrees {self} do not fit {gpus} devices.")
        return stage, stage // (self.tp * self.cp * self.fsdp), stage // expert


@dataclasses.dataclass(frozen=True, slots=True)
class InferParallel:
    """Inference-side degrees (vLLM-style engines: tp x dp; experts over ep x expert_tp).

    Without ``ep`` and ``expert_tp`` the routed experts follow ``tp`` (their
    intermediate dim split, as vLLM's ``FusedMoE``); with either, they live on a
    ``(edp, ep, expert_tp)`` view of the devices: rank ``r`` of ``ep`` holds experts
    ``[r*E/ep, (r+1)*E/ep)``, each split over ``expert_tp`` consecutive ranks.
    """

    tp: int = 1
    dp: int = 1
    ep: int = 1
    expert_tp: int = 1

    def __post_init__(self) -> None:
        _check_positive(self)

    @property
    def splits_experts(self) -> bool:
        """Whether experts live on their own ``(edp, ep, expert_tp)`` view instead of following ``tp``."""
        return self.ep > 1 or self.expert_tp > 1

    def check(self, gpus: int) -> None:
        """Raises ValueError unless the degrees fit ``gpus`` inference devices."""
        if self.tp * self.dp != gpus:
            raise ValueError(f"inference tp*dp = {self.tp * self.dp} but there are {gpus} inference devices; "
                             "make tp*dp equal the device count.")
        if gpus % (self.ep * self.expert_tp):
            raise ValueError(f"inference ep*expert_tp = {self.ep * self.expert_tp} does not divide {gpus} devices; "
                             "make it a divisor of tp*dp.")


_KINDS = {"train": TrainParallel, "infer": InferParallel}


def parse_degrees(text: str, kind: str, *, gpus: bool = False) -> dict[str, int]:
    """Parses ``'tp=4,pp=4,dp=2'`` into ``{'tp': 4, 'pp': 4, 'dp': 2}``, checking names and values.

    Args:
      text: comma-separated ``name=int`` pairs.
      kind: ``'train'`` (names of ``TrainParallel``) or ``'infer'`` (names of ``InferParallel``).
      gpus: also accept ``gpus=N`` (the device count of a scenario side).

    Raises:
      TypeError: ``text`` is not a string.
      ValueError: a pair is malformed, a name unknown, a value not a positive int, or a name repeated.

    Example:
      >>> from jreshard.fleet.presets import parse_degrees
      >>> parse_degrees("tp=8, dp=2", "infer")
      {'tp': 8, 'dp': 2}
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'train' or 'infer', got {kind!r}.")
    if not isinstance(text, str):
        raise TypeError(f"{kind} degrees must be a string such as 'tp=4,dp=2', got {type(text).__name__}.")
    names = [f.name for f in dataclasses.fields(_KINDS[kind])] + (["gpus"] if gpus else [])
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, val = (x.strip() for x in part.partition("="))
        if not eq or key not in names or not val.isdigit() or int(val) < 1:
            raise ValueError(f"{kind} degrees {text!r}: cannot read {part!r}; write name=int pairs with positive "
                             f"ints, such as 'tp=4,dp=2', with names from {names}.")
        if key in values:
            raise ValueError(f"{kind} degrees {text!r}: {key} is given twice; give it once.")
        values[key] = int(val)
    return values


def parse_parallel(text: str, kind: str) -> TrainParallel | InferParallel:
    """Parses ``'tp=4,pp=4,dp=2'`` into a ``TrainParallel`` (``kind='train'``) or ``InferParallel``.

    Example:
      >>> from jreshard.fleet.presets import parse_parallel
      >>> parse_parallel("tp=4,pp=2", "train")
      TrainParallel(tp=4, pp=2, dp=1, cp=1, ep=1, expert_tp=1, fsdp=1)
    """
    values = parse_degrees(text, kind)
    return _KINDS[kind](**values)
