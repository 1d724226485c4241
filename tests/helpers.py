"""Shared test helpers: an oracle for shards and plans that shares no code with jreshard.

Shards come from first principles (JAX ``PartitionSpec`` semantics, ``torch.chunk`` ranges):
a device's mesh coordinates on the axes that split a dim, read as a mixed-radix number with
the first axis most significant, give its shard index ``i`` among ``k`` (the product of those
axes' sizes), and the shard of a dim of size ``n`` is ``[i*c, min((i+1)*c, n))`` with
``c = ceil(n/k)``. Plans are executed with NumPy slicing from the ``Move`` fields alone.
Boxes here are tuples of ``(lo, hi)`` pairs; anything jreshard returns is read as slices.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import ml_dtypes
import numpy as np

import jreshard

Bounds = tuple[tuple[int, int], ...]

# Bytes per element, written out rather than asked of jreshard; None: statistics count elements.
ITEMSIZE: dict[str | None, int] = {None: 1, "bool": 1, "int8": 1, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclasses.dataclass(frozen=True)
class LayoutCase:
    """A layout as a user states it: shape, mesh device array, axis names, spec, dtype."""

    shape: tuple[int, ...]
    devices: np.ndarray  # device ids; array axis j is mesh axis axis_names[j]
    axis_names: tuple[str, ...]
    spec: tuple[Any, ...]  # per leading dim: None, an axis name or a tuple of names (major to minor)
    dtype: str | None = None

    @classmethod
    def of(cls, layout: jreshard.Layout) -> LayoutCase:
        """The case a built layout states (its public fields, read as a user would)."""
        return cls(tuple(layout.shape), np.asarray(layout.mesh.devices), tuple(layout.mesh.axis_names),
                   tuple(layout.spec), layout.dtype)

    def layout(self) -> jreshard.Layout:
        return jreshard.Layout(self.shape, jreshard.Mesh(self.devices, self.axis_names), self.spec, self.dtype)

    def axes_per_dim(self) -> list[tuple[str, ...]]:
        """Per dim, the mesh axes that split it, major to minor (``()``: not split)."""
        out: list[tuple[str, ...]] = []
        for entry in self.spec:
            out.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
        return out + [()] * (len(self.shape) - len(out))

    def shards(self) -> dict[int, Bounds]:
        """Every device's shard, derived from its mesh coordinates."""
        sizes = dict(zip(self.axis_names, self.devices.shape, strict=True))
        per_dim = self.axes_per_dim()
        out: dict[int, Bounds] = {}
        for coords in np.argwhere(np.ones(self.devices.shape, dtype=bool)):
            coord = dict(zip(self.axis_names, (int(c) for c in coords), strict=True))
            box = []
            for n, axes in zip(self.shape, per_dim, strict=True):
                index, parts = 0, 1
                for axis in axes:  # the first axis is the most significant digit
                    index = index * sizes[axis] + coord[axis]
                    parts *= sizes[axis]
                c = -(-n // parts)
                box.append((min(index * c, n), min((index + 1) * c, n)))
            out[int(self.devices[tuple(coords)])] = tuple(box)
        return out


def bounds(box: Any) -> Bounds:
    """Any box jreshard hands out (slices, one per dim) as ``(lo, hi)`` pairs."""
    return tuple((int(s.start), int(s.stop)) for s in box)


def volume(box: Bounds) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in box)


def intersect(a: Bounds, b: Bounds) -> Bounds:
    return tuple((max(x[0], y[0]), max(max(x[0], y[0]), min(x[1], y[1]))) for x, y in zip(a, b, strict=True))


def inside(inner: Bounds, outer: Bounds) -> bool:
    return all(o[0] <= i[0] and i[1] <= o[1] for i, o in zip(inner, outer, strict=True))


def relative(box: Bounds, origin: Bounds) -> tuple[slice, ...]:
    """``box`` as slices into a device's local array whose shard is ``origin``."""
    return tuple(slice(lo - o[0], hi - o[0]) for (lo, hi), o in zip(box, origin, strict=True))


def global_slices(box: Bounds) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def itemsize(dtype: str | None) -> int:
    if dtype in ITEMSIZE:
        return ITEMSIZE[dtype]
    return np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize


def wire_itemsize(src: LayoutCase, dst: LayoutCase) -> int:
    """Bytes per element on the wire: a cast happens at the sender, so the destination's dtype."""
    return itemsize(dst.dtype if dst.dtype is not None else src.dtype)


def lower_bound(src: LayoutCase, dst: LayoutCase) -> int:
    """Bytes any plan must move: per destination device, what its own source shard lacks."""
    have = src.shards()
    lacking = 0
    for device, want in dst.shards().items():
        lacking += volume(want) - (volume(intersect(want, have[device])) if device in have else 0)
    return lacking * wire_itemsize(src, dst)


def execute_moves(moves: Any, src: LayoutCase, dst: LayoutCase) -> dict[int, int]:
    """Runs ``moves`` on NumPy arrays from the oracle's shards and checks every destination.

    Each source device starts with its slice of a global array of distinct values; each move
    copies its box from its sender's array into its receiver's. Asserts that every move reads
    data its sender holds and writes inside its receiver's shard, that every destination
    element is written exactly once, and that every destination array ends equal to the
    global array at its shard. Returns the network bytes each sender sent.
    """
    have, want = src.shards(), dst.shards()
    full = np.arange(math.prod(src.shape), dtype=np.int64).reshape(src.shape)
    held = {d: full[global_slices(box)].copy() for d, box in have.items()}
    out = {d: np.full(tuple(hi - lo for lo, hi in box), -1, np.int64) for d, box in want.items()}
    writes = {d: np.zeros(a.shape, np.int64) for d, a in out.items()}
    sent: dict[int, int] = defaultdict(int)
    size = wire_itemsize(src, dst)
    for m in moves:
        box = bounds(m.box)
        assert m.src in have, f"{m!r} reads from device {m.src}, which is not in the source mesh"
        assert m.dst in want, f"{m!r} writes to device {m.dst}, which is not in the destination mesh"
        assert volume(box) > 0, f"{m!r} is empty"
        assert inside(box, have[m.src]), f"{m!r} sends data device {m.src} does not hold ({have[m.src]})"
        assert inside(box, want[m.dst]), f"{m!r} writes outside device {m.dst}'s shard {want[m.dst]}"
        if m.src != m.dst and m.dst in have:
            assert volume(intersect(box, have[m.dst])) == 0, f"{m!r} sends device {m.dst} data it holds"
        out[m.dst][relative(box, want[m.dst])] = held[m.src][relative(box, have[m.src])]
        writes[m.dst][relative(box, want[m.dst])] += 1
        if m.src != m.dst:
            sent[m.src] += volume(box) * size
    for d, box in want.items():
        assert (writes[d] == 1).all(), f"device {d}: elements written {np.unique(writes[d])} times, not once"
        np.testing.assert_array_equal(out[d], full[global_slices(box)], err_msg=f"device {d}")
    return dict(sent)


def sender_load_limit(src: LayoutCase, dst: LayoutCase) -> float:
    """The largest sender load a balanced plan of one tensor may reach.

    Non-empty source shards are disjoint, so a piece a destination lacks has exactly one replica
    group of possible senders, and groups balance independently. Within a group of ``r``
    devices, giving each piece (destination shard intersected with the group's shard) to the
    least loaded member leaves no member above ``total / r + (1 - 1/r) * largest piece``
    (Graham's list-scheduling bound); splitting pieces only lowers it.
    """
    have = src.shards()
    groups: dict[Bounds, list[int]] = defaultdict(list)
    for device, box in have.items():
        if volume(box):
            groups[box].append(device)
    limit = 0.0
    size = wire_itemsize(src, dst)
    for box, members in groups.items():
        pieces = [volume(intersect(want, box)) * size
                  for device, want in dst.shards().items() if device not in members]
        if pieces:
            r = len(members)
            limit = max(limit, sum(pieces) / r + (1 - 1 / r) * max(pieces))
    return limit


def assert_plan_ok(tp: jreshard.TensorPlan, src: LayoutCase | None = None, dst: LayoutCase | None = None) -> None:
    """Checks a plan against the oracle: exact data, exactly-once writes, bytes at the lower bound.

    ``src`` and ``dst`` are the cases the layouts were built from; by default they are read
    back from the plan's layouts.
    """
    src = LayoutCase.of(tp.src) if src is None else src
    dst = LayoutCase.of(tp.dst) if dst is None else dst
    sent = execute_moves(tp.moves, src, dst)
    expected = lower_bound(src, dst)
    assert sum(sent.values()) == expected, f"network bytes {sum(sent.values())} != lower bound {expected}"
    stats = tp.stats()
    assert stats.network_bytes == stats.lower_bound_bytes == expected
    assert {d: b for d, b in stats.send_bytes.items() if b} == {d: b for d, b in sent.items() if b}


def hf_state(flat: dict[str, np.ndarray], cfg: Any, *, experts: str = "hf") -> dict[str, np.ndarray]:
    """The full Hugging Face tensors of ``jreshard.nn``'s flax leaves (Llama, Qwen3, Qwen3-MoE): the oracle's
    starting point, written out from the two models' conventions (flax kernels are ``[in, out]``).

    ``experts``: ``"hf"`` names routed experts as transformers does (``gate_up_proj``, ``down_proj``),
    ``"vllm"`` as vLLM's ``FusedMoE`` does (``w13_weight``, ``w2_weight``); both ``[E, 2I, H]`` and
    ``[E, H, I]``. A tied model's ``lm_head.weight`` is the embedding (transformers keeps it in the state).
    """
    if experts not in ("hf", "vllm"):
        raise ValueError(f"experts must be 'hf' or 'vllm', got {experts!r}.")
    w13, w2 = ("w13_weight", "w2_weight") if experts == "vllm" else ("gate_up_proj", "down_proj")
    full = {"model.embed_tokens.weight": flat["embed/embedding"], "model.norm.weight": flat["final_norm/scale"],
            "lm_head.weight": flat["embed/embedding"] if cfg.tie_word_embeddings else flat["lm_head/kernel"].T}
    for i in range(cfg.num_hidden_layers):
        j, h = f"layers_{i}/", f"model.layers.{i}."
        for n in "qkvo":
            full[h + f"self_attn.{n}_proj.weight"] = flat[j + f"attn/{n}_proj/kernel"].T
        for n in "qk":
            if j + f"attn/{n}_norm/scale" in flat:
                full[h + f"self_attn.{n}_norm.weight"] = flat[j + f"attn/{n}_norm/scale"]
        full[h + "input_layernorm.weight"] = flat[j + "input_norm/scale"]
        full[h + "post_attention_layernorm.weight"] = flat[j + "post_attention_norm/scale"]
        if hasattr(cfg, "is_sparse") and cfg.is_sparse(i):
            gate, up = flat[j + "mlp/experts/gate_proj"], flat[j + "mlp/experts/up_proj"]  # [E, H, I]
            full[h + "mlp.gate.weight"] = flat[j + "mlp/router/kernel"].T  # [E, H]
            full[h + f"mlp.experts.{w13}"] = np.concatenate([gate, up], axis=2).transpose(0, 2, 1)  # [E, 2I, H]
            full[h + f"mlp.experts.{w2}"] = flat[j + "mlp/experts/down_proj"].transpose(0, 2, 1)  # [E, H, I]
        else:
            for n in ("gate", "up", "down"):
                full[h + f"mlp.{n}_proj.weight"] = flat[j + f"mlp/{n}_proj/kernel"].T
    return full
