"""DTensor params: every rank of a DTensor's mesh gets its local shard, by ``Shard``/``Replicate`` placements."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from bridge.plan.param_map import Param, ParamMap, Region
from bridge.plan.rules import Rule, param_dtype
from bridge.plan.source import Source
from jreshard.core.box import Box

__all__ = ["dtensor_params"]


def _placement(p: Any) -> int | None:
    """A placement as the sharded torch dim, or None for Replicate."""
    kind = type(p).__name__
    if kind == "Shard" or (isinstance(p, tuple) and len(p) == 2 and p[0] == "shard"):
        return int(p.dim if kind == "Shard" else p[1])
    if kind == "Replicate" or p == "replicate" or p == ("replicate",):
        return None
    raise TypeError(
        f"placement {p!r} is not supported; use torch.distributed.tensor.Shard(dim) or Replicate() "
        "(or ('shard', dim) / 'replicate')."
    )


def dtensor_params(name: str, source: Source, leaf: str, mesh_ranks: Any, placements: Sequence[Any],
                   *, transpose: bool | Sequence[int] = False, dtype: Any = "float32") -> ParamMap:
    """The params of one DTensor: every rank of its mesh gets its local shard (torch chunk rules).

    Args:
      name: the param name.
      source: the trainer leaves; ``leaf`` names the one to read.
      mesh_ranks: the DeviceMesh's ``mesh`` (an array of global ranks), or the DeviceMesh.
      placements: one ``Shard(d)``/``Replicate()`` per mesh dim.
      transpose: as in ``Rule``; the DTensor's global shape is the permuted leaf shape.

    Example:
      >>> from bridge import Source, dtensor_params, trainer_mesh
      >>> from jreshard import Layout
      >>> src = Source({"w": Layout((5, 3), trainer_mesh((2,), "x", [0], 2), ("x",), "float32")})
      >>> m = dtensor_params("w", src, "w", [[4, 5], [6, 7]], [("shard", 1), "replicate"], transpose=True)
      >>> [(p.rank, p.shape, str(p.regions[0].box)) for p in m.params]  # doctest: +NORMALIZE_WHITESPACE
      [(4, (3, 3), '[0:3, 0:3]'), (5, (3, 3), '[0:3, 0:3]'),
       (6, (3, 2), '[3:5, 0:3]'), (7, (3, 2), '[3:5, 0:3]')]
    """
    mesh_arr = getattr(mesh_ranks, "mesh", mesh_ranks)
    mesh_arr = np.asarray(mesh_arr.tolist() if hasattr(mesh_arr, "tolist") else mesh_arr, dtype=np.int64)
    if mesh_arr.ndim != len(placements):
        raise ValueError(
            f"placements {list(placements)!r} give {len(placements)} entries for a mesh of "
            f"{mesh_arr.ndim} dims (shape {mesh_arr.shape}); give one per mesh dim."
        )
    dtype_name = param_dtype(dtype)
    shape = source.layout(leaf).shape
    perm = Rule(leaf, name, transpose=transpose if isinstance(transpose, bool) else tuple(transpose)).perm(len(shape))
    tshape = tuple(shape[p] for p in perm)
    dims = [_placement(p) for p in placements]
    for d in dims:
        if d is not None and not 0 <= d < len(tshape):
            raise ValueError(f"placement Shard({d}) is out of range for the global shape {tshape}.")
    params = []
    for coord in np.ndindex(*mesh_arr.shape):
        lo, hi = [0] * len(tshape), list(tshape)
        for axis, d in enumerate(dims):
            if d is None:
                continue
            k, j = mesh_arr.shape[axis], coord[axis]
            size = hi[d] - lo[d]
            c = math.ceil(size / k) if size else 0
            lo[d], hi[d] = lo[d] + min(j * c, size), lo[d] + min((j + 1) * c, size)
        box = [(0, 0)] * len(shape)
        for i, p in enumerate(perm):
            box[p] = (lo[i], hi[i])
        local = tuple(b - a for a, b in zip(lo, hi, strict=True))
        regions = (Region(leaf, Box(box), (0,) * len(tshape), perm),) if math.prod(local) else ()
        params.append(Param(name, int(mesh_arr[coord]), local, dtype_name, regions))
    return ParamMap(params)
