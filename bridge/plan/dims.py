"""Named dims: how a rule's leaf dims become a param's dims (stacked, merged, moved, new).

A dim spec reads like an einops pattern, ``"L emb heads hd -> (heads hd) emb"``: the
left side names every leaf dim, the right side every param dim, parentheses merging
several names into one param dim (major to minor). A name only on the left is a
*stacked* dim (the layer axis of a scanned model): the rule makes one param per index
along it, and ``{L}`` in the param name is that index. A name only on the right is a
*new* dim: many leaves (one per expert) fill one param, each at the index the rule's
``at`` gives. Pure: no jax, no torch.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["DimSpec"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(r"\(([^()]*)\)|([^\s()]+)|(\S)")


@dataclasses.dataclass(frozen=True, slots=True)
class DimSpec:
    """Leaf dims by name, and the names each param dim holds, major to minor.

    Example:
      >>> from bridge.plan.dims import DimSpec
      >>> s = DimSpec.parse("L emb heads hd -> (heads hd) emb", "Rule 'q'")
      >>> s.param, s.stacked, s.flat
      ((('heads', 'hd'), ('emb',)), ('L',), ('heads', 'hd', 'emb'))
      >>> DimSpec.from_perm((1, 0)).param
      (('d1',), ('d0',))
    """

    leaf: tuple[str, ...]
    param: tuple[tuple[str, ...], ...]

    @classmethod
    def parse(cls, text: str, what: str) -> DimSpec:
        """Reads ``"a b c -> (c b) a"``; ``what`` names the rule in errors."""
        if not isinstance(text, str) or text.count("->") != 1:
            raise ValueError(f"{what}: dims must read 'leaf dims -> param dims', such as "
                             f"'L emb heads hd -> (heads hd) emb', got {text!r}.")
        left, right = text.split("->")
        leaf = tuple(left.split())
        param: list[tuple[str, ...]] = []
        for group, single, bad in _TOKEN.findall(right):
            if bad:
                raise ValueError(f"{what}: dims {text!r} has an unbalanced {bad!r}; write merged dims as '(a b)'.")
            names = tuple(group.split()) if group or not single else (single,)
            if not names:
                raise ValueError(f"{what}: dims {text!r} has an empty group '()'; name the dims it merges.")
            param.append(names)
        spec = cls(leaf, tuple(param))
        spec._check(text, what)
        return spec

    @classmethod
    def from_perm(cls, perm: tuple[int, ...]) -> DimSpec:
        """The spec of a plain permutation: param dim ``i`` is leaf dim ``perm[i]``."""
        return cls(tuple(f"d{i}" for i in range(len(perm))), tuple((f"d{p}",) for p in perm))

    def _check(self, text: str, what: str) -> None:
        flat = self.flat
        for name in (*self.leaf, *flat):
            if not _NAME.fullmatch(name):
                raise ValueError(f"{what}: dims {text!r} names a dim {name!r}; use identifiers such as 'emb'.")
        for side, names in (("leaf", self.leaf), ("param", flat)):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{what}: dims {text!r} names {dup} twice on the {side} side; name each dim once.")
        new = self.new
        if len(new) > 1:
            raise ValueError(f"{what}: dims {text!r} has new dims {list(new)}; a rule places a leaf along one "
                             "new param dim at most.")
        if new and flat[-1] == new[0]:
            raise ValueError(f"{what}: dims {text!r} puts the new dim {new[0]!r} last; a leaf must fill a "
                             "contiguous block of it, so put it before another param dim.")

    @property
    def flat(self) -> tuple[str, ...]:
        """The param dims' names, major to minor, merged dims expanded."""
        return tuple(n for group in self.param for n in group)

    @property
    def stacked(self) -> tuple[str, ...]:
        """Leaf dims absent from the param: one param per index along them."""
        flat = set(self.flat)
        return tuple(n for n in self.leaf if n not in flat)

    @property
    def new(self) -> tuple[str, ...]:
        """Param dims absent from the leaf: a leaf fills one index of them."""
        leaf = set(self.leaf)
        return tuple(n for n in self.flat if n not in leaf)

    def group_of(self, name: str) -> int:
        """The param dim that holds ``name``."""
        return next(i for i, g in enumerate(self.param) if name in g)
