"""How an inference engine (vLLM) splits each param over its tensor-parallel ranks.

One description for the fleet's presets (``jreshard.fleet.presets``, which lay out
catalog tensors by role) and the bridge's rules (``bridge.plan.rules``, whose recipes
name the same roles), so their byte counts agree:

- *which dim*: per role of a torch weight ``[out, in]`` (``TP_DIMS``): column
  parallel splits its output rows, row parallel its input columns, the vocabulary
  parallel embedding and head their vocabulary rows; other roles (norms, routers)
  are replicated. A stacked ``[E, ...]`` expert weight shifts the dim by one.
- *how*: ``tp_split``: whole attention heads (``jreshard.core.heads``, KV heads
  replicated when there are more ranks than heads), or an even split of the dim
  padded to a multiple of ``pad_to`` (a padded vocabulary), the last ranks holding
  the padding rows.

Example:
  >>> from jreshard.core.tp_split import tp_dim, tp_split
  >>> tp_dim("row"), tp_dim("column", stacked=True), tp_dim("norm")
  (1, 1, None)
  >>> tp_split(1000, 4, pad_to=64, what="embed").ranges  # 1024 rows, the last rank 232 real ones
  ((0, 256), (256, 512), (512, 768), (768, 1000))
  >>> tp_split(128, 8, heads=4, replicate_heads=True, what="k_proj").replicas  # 4 KV heads at TP8
  2
"""

from __future__ import annotations

import dataclasses

from jreshard.core.args import check_int
from jreshard.core.heads import split_heads

__all__ = ["TP_DIMS", "VOCAB_ROLES", "TpSplit", "tp_dim", "tp_split"]

# Per role of a torch weight [out, in]: the dim an engine's tensor parallelism splits.
TP_DIMS = {"column": 0, "row": 1, "embed": 0, "head": 0}
# Roles split on the vocabulary, which engines pad to split it (``pad_to``).
VOCAB_ROLES = ("embed", "head")


def tp_dim(role: str, *, stacked: bool = False) -> int | None:
    """The dim TP splits in a weight of ``role`` (``None``: replicated); ``stacked``: an ``[E, ...]`` weight."""
    dim = TP_DIMS.get(role)
    return None if dim is None else dim + int(stacked)


@dataclasses.dataclass(frozen=True, slots=True)
class TpSplit:
    """A dim split over TP ranks: each rank's local size, its ``[lo, hi)`` of the dim, and head replicas."""

    local: int
    ranges: tuple[tuple[int, int], ...]
    replicas: int = 1  # consecutive ranks that hold the same heads


def tp_split(n: int, tp: int, *, heads: int | None = None, replicate_heads: bool = False, pad_to: int = 1,
             what: str, dim: object = None, degree: str = "the TP degree") -> TpSplit:
    """How an engine splits a dim of size ``n`` over ``tp`` ranks.

    Args:
      n: the dim's size.
      tp: the ranks (the tensor-parallel degree).
      heads: the dim holds this many equal heads; whole heads go to each rank
        (``jreshard.core.heads.split_heads``).
      replicate_heads: with more ranks than ``heads``, replicate each head (KV heads).
      pad_to: pad the dim to a multiple of this first (no heads); the padding rows
        are held by the last ranks and belong to no rank's range.
      what, dim, degree: name the tensor, the dim and the degree in error messages.

    Raises:
      ValueError: the split would cut a head or is uneven.
    """
    n, tp = check_int("n", n), check_int("tp", tp, minimum=1)
    where = f"{what}: dim {dim}" if dim is not None else what
    if heads is not None:
        if n % heads:
            raise ValueError(f"{where} of size {n} is not {heads} equal heads; give the number of heads it holds.")
        h = split_heads(heads, n // heads, tp, replicate=replicate_heads, what=what)
        return TpSplit(h.local_size, h.ranges(), h.replicas)
    padded = -(-n // pad_to) * pad_to
    if padded % tp:
        padding = f" (padded to {padded} with pad_to={pad_to})" if pad_to > 1 else ""
        raise ValueError(f"{where} of size {n}{padding} does not split evenly over {tp} ranks; make {degree} a "
                         f"divisor of {padded}" + (f" or pad_to a multiple of {tp}." if pad_to > 1 else "."))
    s = padded // tp
    return TpSplit(s, tuple((min(r * s, n), min((r + 1) * s, n)) for r in range(tp)))
