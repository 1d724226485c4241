"""The vLLM rule for splitting attention heads over tensor-parallel ranks.

A projection whose split dim holds ``num_heads`` equal heads of ``head_dim`` rows
is cut between heads, never through one:

- ``tp`` divides ``num_heads``: rank ``r`` holds heads ``[r*k, (r+1)*k)`` with
  ``k = num_heads // tp``.
- more ranks than heads (only KV heads, ``replicate=True``): ``num_heads`` divides
  ``tp`` and each head is replicated on ``tp // num_heads`` consecutive ranks, so
  rank ``r`` holds head ``r // (tp // num_heads)``.
- anything else is refused: query heads are never replicated, and a split that
  would cut a head has no vLLM layout.

The bridge's rules, the fleet presets and the cost model all use this one rule, so
their byte counts agree.

Example:
  >>> from jreshard.core.heads import split_heads
  >>> s = split_heads(8, 128, 16, replicate=True)  # 8 KV heads over TP16
  >>> s.replicas, s.local_size, s.rows(0), s.rows(1), s.rows(2)
  (2, 128, (0, 128), (0, 128), (128, 256))
"""

from __future__ import annotations

import dataclasses

from jreshard.core.args import INT64_MAX, check_int

__all__ = ["HeadSplit", "split_heads", "head_range"]


@dataclasses.dataclass(frozen=True, slots=True)
class HeadSplit:
    """Which rows of a ``num_heads * head_dim`` dim each of ``tp`` ranks holds.

    ``replicas`` is how many consecutive ranks hold each head (1 unless heads are
    replicated); ``shards`` is how many distinct row ranges there are.
    """

    num_heads: int
    head_dim: int
    tp: int
    replicas: int

    @property
    def shards(self) -> int:
        """Distinct row ranges: ``tp // replicas``."""
        return self.tp // self.replicas

    @property
    def heads_per_rank(self) -> int:
        return max(self.num_heads // self.tp, 1)

    @property
    def local_size(self) -> int:
        """Rows each rank holds."""
        return self.heads_per_rank * self.head_dim

    def rows(self, rank: int) -> tuple[int, int]:
        """The half-open row range ``[lo, hi)`` that TP rank ``rank`` holds."""
        rank = check_int("rank", rank, minimum=-INT64_MAX - 1)
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} is not a TP rank of tp={self.tp}; use 0 <= rank < {self.tp}.")
        lo = (int(rank) // self.replicas) * self.local_size
        return lo, lo + self.local_size

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """Every TP rank's row range, in rank order."""
        return tuple(self.rows(r) for r in range(self.tp))


def split_heads(num_heads: int, head_dim: int, tp: int, *, replicate: bool = False,
                what: str = "attention") -> HeadSplit:
    """Splits ``num_heads`` heads of ``head_dim`` rows over ``tp`` ranks as vLLM does.

    Args:
      num_heads: the heads in the split dim (query heads, or KV heads).
      head_dim: rows per head.
      tp: the tensor-parallel degree.
      replicate: with more ranks than heads, replicate each head on ``tp // num_heads``
        consecutive ranks (vLLM does this for KV heads only) instead of refusing.
      what: names the tensor in error messages.

    Raises:
      TypeError: an argument is not an int.
      ValueError: the split would cut a head, or needs a replication vLLM does not do.

    Example:
      >>> from jreshard.core.heads import split_heads
      >>> split_heads(64, 128, 8).ranges()[:2]  # 64 query heads over TP8: 8 heads a rank
      ((0, 1024), (1024, 2048))
      >>> split_heads(40, 128, 16)
      Traceback (most recent call last):
      ValueError: attention: 16 tensor-parallel ranks for 40 heads: a head would be cut; use a TP degree dividing 40.
    """
    num_heads = check_int("num_heads", num_heads, minimum=1)
    head_dim = check_int("head_dim", head_dim, minimum=1)
    tp = check_int("tp", tp, minimum=1)
    if tp <= num_heads:
        if num_heads % tp:
            raise ValueError(f"{what}: {tp} tensor-parallel ranks for {num_heads} heads: a head would be cut; "
                             f"use a TP degree dividing {num_heads}.")
        return HeadSplit(num_heads, head_dim, tp, 1)
    if not replicate:
        raise ValueError(f"{what}: {tp} tensor-parallel ranks for {num_heads} heads, which are not replicated; "
                         f"use a TP degree dividing {num_heads}.")
    if tp % num_heads:
        raise ValueError(f"{what}: {num_heads} heads cannot be replicated evenly over {tp} tensor-parallel ranks; "
                         f"use a TP degree that is a multiple or a divisor of {num_heads}.")
    return HeadSplit(num_heads, head_dim, tp, tp // num_heads)


def head_range(rank: int, tp: int, num_heads: int, head_dim: int, *, replicate: bool = False) -> tuple[int, int]:
    """The row range ``[lo, hi)`` of TP rank ``rank``: ``split_heads(...).rows(rank)``.

    Example:
      >>> from jreshard.core.heads import head_range
      >>> head_range(5, 16, 8, 128, replicate=True)  # ranks 4 and 5 share KV head 2
      (256, 384)
    """
    return split_heads(num_heads, head_dim, tp, replicate=replicate).rows(rank)
