"""Plan values: ``Move``, ``TensorPlan`` (one leaf) and ``Plan`` (a pytree), and their printing."""

from __future__ import annotations

import dataclasses
from collections.abc import ItemsView, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jreshard.core.box import Box
from jreshard.core.check import PlanError, check_tensor_plan
from jreshard.core.layout import Layout
from jreshard.core.rows import GroupRows, LeafRange, LeafRanges, MoveArrays
from jreshard.core.stats import PlanStats, format_amount, plan_stats
from jreshard.core.tree import path_str

if TYPE_CHECKING:
    from jreshard.core.leaves import Leaf

__all__ = ["Move", "MoveArrays", "TensorPlan", "Plan"]


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """Copy ``box`` (global coordinates) from device ``src`` to device ``dst``.

    Example:
      >>> from jreshard import Move
      >>> Move(0, 4, [(0, 256), (0, 128)])
      Move(0 -> 4, [0:256, 0:128])
    """

    src: int
    dst: int
    box: Box

    def __post_init__(self) -> None:
        if not isinstance(self.box, Box):
            object.__setattr__(self, "box", Box(self.box))

    @property
    def is_local(self) -> bool:
        return self.src == self.dst

    @property
    def shape(self) -> tuple[int, ...]:
        return self.box.shape

    @property
    def size(self) -> int:
        return self.box.size

    def __repr__(self) -> str:
        return f"Move({self.src} -> {self.dst}, {self.box})"


def _unit(layouts: Iterable[tuple[Layout, Layout]]) -> str:
    return "bytes" if any(s.dtype or d.dtype for s, d in layouts) else "elements"


class TensorPlan:
    """The moves that reshard one tensor from ``src`` to ``dst``.

    ``moves`` is a tuple of ``Move``; the same data is available as arrays
    (``move_src``, ``move_dst``, ``move_lo``, ``move_hi``), which executors use.
    """

    __slots__ = ("src", "dst", "itemsize", "move_src", "move_dst", "move_lo", "move_hi",
                 "lower_bound_bytes", "naive_bytes", "_moves")

    def __init__(self, src: Layout, dst: Layout, itemsize: int, move_src: np.ndarray, move_dst: np.ndarray,
                 move_lo: np.ndarray, move_hi: np.ndarray, lower_bound_bytes: int, naive_bytes: int) -> None:
        self.src, self.dst, self.itemsize = src, dst, itemsize
        self.move_src, self.move_dst, self.move_lo, self.move_hi = move_src, move_dst, move_lo, move_hi
        self.lower_bound_bytes, self.naive_bytes = lower_bound_bytes, naive_bytes
        self._moves: tuple[Move, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src.shape

    @property
    def moves(self) -> tuple[Move, ...]:
        if self._moves is None:
            self._moves = tuple(
                Move(int(s), int(d), Box._trusted(lo, hi))
                for s, d, lo, hi in zip(self.move_src, self.move_dst, self.move_lo, self.move_hi, strict=True)
            )
        return self._moves

    def moves_to(self, device: int) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.dst == device)

    def moves_from(self, device: int) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.src == device)

    @property
    def move_bytes(self) -> np.ndarray:
        if not self.src.ndim:
            return np.full(len(self.move_src), self.itemsize, np.int64)
        return np.prod(self.move_hi - self.move_lo, axis=1, dtype=np.int64) * self.itemsize

    def move_arrays(self) -> MoveArrays:
        """The moves as parallel arrays (sender, receiver, bytes), one row per move.

        Example:
          >>> from jreshard import Layout, Mesh, plan
          >>> src = Layout((4,), Mesh([0, 1], "x"), ("x",), "float32")
          >>> rows = plan(src, Layout((4,), Mesh([2], "y"), (), "float32")).move_arrays()
          >>> rows.src.tolist(), rows.dst.tolist(), rows.nbytes.tolist(), rows.moves.tolist()
          ([0, 1], [2, 2], [8, 8], [1, 1])
        """
        return MoveArrays(self.move_src, self.move_dst, self.move_bytes, np.ones(len(self.move_src), np.int64))

    @property
    def unit(self) -> str:
        """``'bytes'`` when a layout has a dtype, else ``'elements'``."""
        return _unit([(self.src, self.dst)])

    def stats(self) -> PlanStats:
        return plan_stats(self.move_src, self.move_dst, self.move_bytes, self.lower_bound_bytes,
                          self.naive_bytes, self.unit)

    def check(self) -> None:
        """Verifies the invariants; raises ``PlanError`` naming the first violation.

        Every element of every destination shard is written by exactly one move,
        each move's box lies inside its source's shard and its destination's shard,
        and no destination receives over the network what it already holds.
        """
        check_tensor_plan(self)

    def _move_lines(self, moves: Sequence[Move]) -> list[str]:
        unit = "B" if self.unit == "bytes" else "el"
        return [f"  {'local' if m.is_local else 'send '} {m.src:>5} -> {m.dst:<5} {m.box}  "
                f"{m.size * self.itemsize:,} {unit}" for m in moves]

    def table(self, limit: int | None = 50) -> str:
        """The two layouts, then one line per move (the first ``limit`` moves; all with ``None``)."""
        shown = self.moves if limit is None else self.moves[:limit]
        lines = [f"{self.src!r}\n  -> {self.dst!r}", *self._move_lines(shown)]
        if len(self.moves) > len(shown):
            lines.append(f"  ... {len(self.moves) - len(shown)} more moves")
        return "\n".join(lines)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"TensorPlan({self.shape}, {s.moves} network moves, {s.local_moves} local, "
                f"network {format_amount(s.network_bytes, s.unit)})")

    def __str__(self) -> str:
        return f"{self.table(limit=20)}\n{self.stats()}"


class Plan:
    """Per-leaf TensorPlans for a pytree of layouts, balanced across all its tensors.

    ``plan.tensors`` maps each leaf path (``'layers/0/wq'``) to its TensorPlan;
    ``plan[path]`` does the same; ``plan.stats()`` aggregates, ``plan.table()`` lists
    the moves tensor by tensor.
    """

    __slots__ = ("paths", "treedef", "_leaves", "_groups", "_index", "_tensors", "_stats")

    def __init__(self, paths: Sequence[tuple], treedef: Any, leaves: Sequence[Leaf],
                 groups: Sequence[GroupRows], index: Sequence[LeafRange] | LeafRanges) -> None:
        self.paths = tuple(paths)
        self.treedef = treedef
        self._leaves = leaves
        self._groups = groups
        self._index = index
        self._tensors: dict[str, TensorPlan] | None = None
        self._stats: PlanStats | None = None

    def _tensor(self, leaf: int) -> TensorPlan:
        where = self._index[leaf]
        rows = self._groups[where.group]
        src, dst, itemsize = self._leaves[leaf]
        s, d, lo, hi = rows.rows(where.start, where.stop)
        return TensorPlan(src, dst, itemsize, s, d, lo, hi, rows.lower[leaf], rows.naive[leaf])

    @property
    def tensors(self) -> dict[str, TensorPlan]:
        if self._tensors is None:
            self._tensors = {path_str(p): self._tensor(i) for i, p in enumerate(self.paths)}
        return self._tensors

    @property
    def layouts(self) -> list[tuple[Layout, Layout]]:
        return [(leaf.src, leaf.dst) for leaf in self._leaves]

    def __getitem__(self, path: str | tuple) -> TensorPlan:
        key = path if isinstance(path, str) else path_str(path)
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"no tensor {key!r} in this plan; paths start with {list(self.tensors)[:5]!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.paths)

    def items(self) -> ItemsView[str, TensorPlan]:
        return self.tensors.items()

    def move_arrays(self) -> MoveArrays:
        """Every tensor's moves as parallel arrays (sender, receiver, bytes, moves per row).

        Reads the plan's compact rows without building a TensorPlan per tensor: where
        the meshes fix the senders, one row stands for the same move of every tensor
        that shares a shape and layouts (``moves`` says how many, ``nbytes`` sums them).
        Totals per device or per (sender, receiver) pair equal those of the tensors'
        own ``move_arrays``.

        Example:
          >>> from jreshard import Layout, Mesh, plan
          >>> src = Layout((4,), Mesh([0, 1], "x"), ("x",), "float32")
          >>> dst = Layout((4,), Mesh([2], "y"), (), "float32")
          >>> rows = plan({"b": src, "w": src}, {"b": dst, "w": dst}).move_arrays()
          >>> rows.src.tolist(), rows.dst.tolist(), rows.nbytes.tolist(), rows.moves.tolist()
          ([0, 1], [2, 2], [16, 16], [2, 2])
        """
        if not self._groups:
            empty = np.zeros(0, np.int64)
            return MoveArrays(empty, empty, empty, empty)
        parts = [g.move_arrays() for g in self._groups]
        return MoveArrays(*(np.concatenate(column) for column in zip(*parts, strict=True)))

    def stats(self) -> PlanStats:
        if self._stats is None:
            src, dst, nb, moves = self.move_arrays()
            lower = sum(g.lower.total() for g in self._groups)
            naive = sum(g.naive.total() for g in self._groups)
            unit = _unit((leaf.src, leaf.dst) for leaf in self._leaves)
            self._stats = plan_stats(src, dst, nb, lower, naive, unit, moves)
        return self._stats

    def check(self) -> None:
        """Checks every TensorPlan's invariants (see ``TensorPlan.check``)."""
        for path, tp in self.tensors.items():
            try:
                tp.check()
            except PlanError as exc:
                raise PlanError(f"tensor {path!r}: {exc}") from None

    def table(self, limit: int | None = 50) -> str:
        """Per tensor, its path and layouts, then its moves (the first ``limit`` moves in all).

        Example:
          >>> from jreshard import Layout, Mesh, plan
          >>> src = Layout((4,), Mesh([0, 1], "x"), ("x",), "float32")
          >>> dst = Layout((4,), Mesh([2], "y"), (), "float32")
          >>> print(plan({"b": src, "w": src}, {"b": dst, "w": dst}).table(limit=3))
          b: Layout((4,), float32, P('x'), Mesh(x=2; devices [0, 1]))
            -> Layout((4,), float32, P(), Mesh(y=1; devices [2]))
            send      0 -> 2     [0:2]  8 B
            send      1 -> 2     [2:4]  8 B
          w: Layout((4,), float32, P('x'), Mesh(x=2; devices [0, 1]))
            -> Layout((4,), float32, P(), Mesh(y=1; devices [2]))
            send      0 -> 2     [0:2]  8 B
            ... 1 more moves
        """
        lines: list[str] = []
        left, hidden = limit, 0
        for path, tp in self.tensors.items():
            if left is not None and left <= 0:
                hidden += len(tp.moves)
                continue
            shown = tp.moves if left is None else tp.moves[:left]
            lines.append(f"{path or '<root>'}: {tp.src!r}\n  -> {tp.dst!r}")
            lines.extend(tp._move_lines(shown))
            hidden += len(tp.moves) - len(shown)
            if left is not None:
                left -= len(shown)
        if hidden:
            lines.append(f"  ... {hidden} more moves")
        return "\n".join(lines)

    def __repr__(self) -> str:
        s = self.stats()
        return f"Plan({len(self)} tensors, network {format_amount(s.network_bytes, s.unit)}, {s.messages} messages)"

    def __str__(self) -> str:
        lines = [f"Plan for {len(self)} tensors", str(self.stats())]
        shown = list(self.tensors.items())[:12]
        width = max((len(p) for p, _ in shown), default=4)
        for path, tp in shown:
            s = tp.stats()
            lines.append(f"  {path or '<root>':<{width}}  {str(tp.shape):<16} {s.moves:>4} moves  "
                         f"{format_amount(s.network_bytes, s.unit):>12}  {tp.src.spec_str} -> {tp.dst.spec_str}")
        if len(self) > len(shown):
            lines.append(f"  ... {len(self) - len(shown)} more tensors")
        return "\n".join(lines)
