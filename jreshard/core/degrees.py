"""Parallelism degrees of each side of a weight sync: the one degree arithmetic, and its parser.

``TrainParallel`` holds the training degrees (Megatron / JAX trainers) and
``InferParallel`` the inference ones (vLLM-style engines: ``dp`` engines of ``tp``
ranks, routed experts over ``ep`` x ``expert_tp``). Both are frozen and check their
degrees when built; their arithmetic (how many devices, which devices form an engine
or an expert-parallel group) needs no process group and no mesh, as torchtitan's
``ParallelDims``. ``parse_degrees`` and ``parse_parallel`` read them from
``'tp=4,pp=2'`` text. ``jreshard.fleet.presets`` turns them into layouts, the bridge
(``bridge.plan.rules``, ``bridge.engines.hello``) into rank grids.

Example:
  >>> from jreshard.core.degrees import InferParallel, TrainParallel
  >>> TrainParallel(ep=4, fsdp=2, pp=2).world(32)  # (stage size, dense replicas, expert replicas)
  (16, 8, 2)
  >>> InferParallel(tp=2, dp=2).engines(range(4, 8)).tolist()  # each engine's TP ranks
  [[4, 5], [6, 7]]
  >>> InferParallel(tp=2, dp=2, ep=4).expert_groups(range(4, 8)).tolist()  # one expert block per rank
  [[4], [5], [6], [7]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from jreshard.core.args import check_int

__all__ = ["TrainParallel", "InferParallel", "rank_grid", "parse_degrees", "parse_parallel"]


def _check_positive(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, check_int(f"{type(obj).__name__}.{f.name}", getattr(obj, f.name), minimum=1))


def rank_grid(ranks: Any, what: str, *, below: int) -> np.ndarray:
    """``ranks`` (one list of ranks, or equal-length lists of them) as a 2-D array of distinct ranks in ``[0, below)``.

    Example:
      >>> from jreshard.core.degrees import rank_grid
      >>> rank_grid([2, 3], "tp_ranks", below=8).tolist()
      [[2, 3]]
    """
    try:
        arr = np.asarray(ranks)
    except ValueError:  # ragged nested lists
        arr = np.asarray(None)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(
            f"{what} must be a list of torch ranks (one TP group) or a list of equal-length lists "
            f"(one per replica or expert-parallel group), got {ranks!r}."
        )
    if len(set(arr.ravel().tolist())) != arr.size or (arr < 0).any() or (arr >= below).any():
        raise ValueError(f"{what} must hold distinct torch ranks in [0, {below}) (inference ranks), "
                         f"got {arr.tolist()}.")
    return arr.astype(np.int64)


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

    def engines(self, devices: Iterable[int]) -> np.ndarray:
        """``devices`` (rank order) as ``[dp, tp]``: row ``d`` is engine ``d``'s TP ranks, in TP order."""
        ids = np.asarray(list(devices), dtype=np.int64)
        self.check(ids.size)
        return ids.reshape(self.dp, self.tp)

    def expert_groups(self, devices: Iterable[int]) -> np.ndarray:
        """The rows routed experts split over: each engine's TP ranks, or with ``splits_experts`` the
        ``[edp * ep, expert_tp]`` groups of consecutive ranks (row ``r`` of each ``ep`` block holds experts
        ``[r*E/ep, (r+1)*E/ep)``, split over its ``expert_tp`` ranks)."""
        ids = self.engines(devices)
        return ids.reshape(-1, self.expert_tp) if self.splits_experts else ids

    @classmethod
    def of_grid(cls, grid: Any, *, expert_parallel: bool = False) -> InferParallel:
        """The degrees of a ``[dp, tp]`` rank grid; ``expert_parallel``: one expert block per rank (vLLM's EP)."""
        dp, tp = np.shape(grid)
        return cls(tp=tp, dp=dp, ep=tp * dp if expert_parallel else 1)


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
      >>> from jreshard.core.degrees import parse_degrees
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
      >>> from jreshard.core.degrees import parse_parallel
      >>> parse_parallel("tp=4,pp=2", "train")
      TrainParallel(tp=4, pp=2, dp=1, cp=1, ep=1, expert_tp=1, fsdp=1)
    """
    values = parse_degrees(text, kind)
    return _KINDS[kind](**values)
