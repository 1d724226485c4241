"""Domains: which devices share fast links (an NVLink domain, a node, one JAX process).

Hierarchical delivery (``jreshard.core.hierarchical``) sends each byte across a
domain boundary at most once per domain that needs it, then completes the
replicas inside the domain over its fast links. A ``Domains`` value says which
domain each *device* (a global device id or a rank) lies in. Two forms:

- ``Domains.contiguous(n)``: device ``d`` lies in domain ``d // n`` (GPUs of one
  NVLink domain numbered together; the cost model's ``Topology``);
- ``Domains.from_groups(groups)``: any grouping, domain ``k`` holding the devices
  of ``groups[k]`` (the devices of each JAX process, inference ranks by node).

Example:
  >>> from jreshard.core.domains import Domains
  >>> nodes = Domains.from_groups([[0, 1, 2, 3], [4, 5, 6, 7]])
  >>> nodes.domain(5), nodes.members(0), nodes.size
  (1, (0, 1, 2, 3), 2)
  >>> nodes.of([0, 7, 3]).tolist()
  [0, 1, 0]
  >>> Domains.contiguous(8).domain(13), Domains.contiguous(8).members(1)[:3]
  (1, (8, 9, 10))
  >>> Domains.from_groups([[0, 2], [1, 3]])  # any grouping, not only blocks
  Domains.from_groups([[0, 2], [1, 3]])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import numpy as np

from jreshard.core.args import check_int

__all__ = ["Domains"]


@dataclasses.dataclass(frozen=True, slots=True)
class Domains:
    """A mapping from device ids to domain ids; build it with ``contiguous`` or ``from_groups``.

    ``block`` is set for contiguous domains (``groups`` is then empty and every
    non-negative id has a domain); otherwise ``groups[k]`` lists domain ``k``'s
    devices in ascending order, and only listed devices have a domain.
    """

    groups: tuple[tuple[int, ...], ...] = ()
    block: int | None = None

    def __post_init__(self) -> None:
        if (self.block is None) == (not self.groups):
            raise ValueError("Domains needs either groups or a block size; build it with Domains.from_groups(groups) "
                             "or Domains.contiguous(n).")

    @classmethod
    def contiguous(cls, n: Any) -> Domains:
        """Device ``d`` in domain ``d // n``: blocks of ``n`` consecutive ids."""
        return cls(block=check_int("n (devices per domain)", n, minimum=1))

    @classmethod
    def from_groups(cls, groups: Any) -> Domains:
        """Domain ``k`` holds the devices of ``groups[k]`` (each device in at most one group)."""
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
            raise TypeError(f"groups must be a list of lists of device ids, got {type(groups).__name__} {groups!r}; "
                            "pass for example [[0, 1, 2, 3], [4, 5, 6, 7]].")
        parsed: list[tuple[int, ...]] = []
        seen: dict[int, int] = {}
        for k, group in enumerate(groups):
            if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
                raise TypeError(f"groups[{k}] must be a list of device ids, got {group!r}; "
                                "pass for example [[0, 1, 2, 3], [4, 5, 6, 7]].")
            ids = []
            for d in group:
                d = check_int(f"groups[{k}] device id", d)
                if d in seen:
                    raise ValueError(f"device {int(d)} is in groups[{seen[int(d)]}] and groups[{k}]; "
                                     "each device lies in one domain.")
                seen[int(d)] = k
                ids.append(int(d))
            if not ids:
                raise ValueError(f"groups[{k}] is empty; every domain holds at least one device.")
            parsed.append(tuple(sorted(ids)))
        if not parsed:
            raise ValueError("groups is empty; give at least one group of device ids.")
        return cls(groups=tuple(parsed))

    @property
    def size(self) -> int | None:
        """The number of domains (``None`` for contiguous domains, which have no end)."""
        return None if self.block is not None else len(self.groups)

    def domain(self, device: int) -> int:
        """The domain of one device id."""
        return int(self.of([check_int("device", device)])[0])

    def members(self, domain: int) -> tuple[int, ...]:
        """The device ids of one domain, ascending."""
        domain = check_int("domain", domain)
        if self.block is not None:
            return tuple(range(int(domain) * self.block, (int(domain) + 1) * self.block))
        if domain >= len(self.groups):
            raise ValueError(f"domain {domain} does not exist; there are {len(self.groups)} domains.")
        return self.groups[domain]

    def of(self, devices: Any) -> np.ndarray:
        """The domain of each device id in an array of ids (same shape)."""
        ids = np.asarray(devices, dtype=np.int64)
        if self.block is not None:
            return ids // self.block
        table = _lookup(self)
        bad = (ids < 0) | (ids >= len(table))
        bad[~bad] = table[ids[~bad]] < 0
        if bad.any():
            raise ValueError(f"device {int(ids[bad].flat[0])} lies in no domain of {self!r}; "
                             "list every device in Domains.from_groups.")
        return table[ids]

    def __repr__(self) -> str:
        if self.block is not None:
            return f"Domains.contiguous({self.block})"
        return f"Domains.from_groups({[list(g) for g in self.groups]})"


@functools.lru_cache(maxsize=64)
def _lookup(domains: Domains) -> np.ndarray:
    """Device id -> domain id (-1: none) for domains from groups."""
    top = max(max(g) for g in domains.groups) + 1
    table = np.full(top, -1, dtype=np.int64)
    for k, group in enumerate(domains.groups):
        table[list(group)] = k
    table.flags.writeable = False
    return table
