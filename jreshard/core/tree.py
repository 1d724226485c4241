"""A small pytree walker for the planner (dicts, lists, tuples, namedtuples, None).

The planner must not import jax, so it cannot use ``jax.tree_util``; this walker
follows the same conventions: mappings are visited in sorted key order, ``None``
is an empty subtree, everything else is a leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["flatten", "unflatten", "path_str", "first_leaf", "describe", "TreeDef"]

TreeDef = Any  # nested tuples: ("dict", keys, children) | ("list"|"tuple", n, children) | "leaf" | "none"


def _sorted_keys(mapping: Mapping) -> list:
    keys = list(mapping.keys())
    try:
        return sorted(keys)
    except TypeError:
        return keys


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[tuple], list, TreeDef]:
    """Returns (paths, leaves, treedef); a path is a tuple of keys and indices."""
    paths: list[tuple] = []
    leaves: list = []

    def walk(node: Any, path: tuple) -> TreeDef:
        if is_leaf is not None and is_leaf(node):
            paths.append(path)
            leaves.append(node)
            return "leaf"
        if node is None:
            return "none"
        if isinstance(node, Mapping):
            keys = _sorted_keys(node)
            return ("dict", tuple(keys), tuple(walk(node[k], path + (k,)) for k in keys))
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            fields = zip(node._fields, node, strict=True)
            return ("namedtuple", type(node), tuple(walk(v, path + (f,)) for f, v in fields))
        if isinstance(node, (list, tuple)):
            kind = "list" if isinstance(node, list) else "tuple"
            return (kind, len(node), tuple(walk(v, path + (i,)) for i, v in enumerate(node)))
        paths.append(path)
        leaves.append(node)
        return "leaf"

    treedef = walk(tree, ())
    return paths, leaves, treedef


def unflatten(treedef: TreeDef, leaves: list) -> Any:
    it = iter(leaves)

    def build(td: TreeDef) -> Any:
        if td == "leaf":
            return next(it)
        if td == "none":
            return None
        kind, meta, children = td
        values = [build(c) for c in children]
        if kind == "dict":
            return dict(zip(meta, values, strict=True))
        if kind == "namedtuple":
            return meta(*values)
        return values if kind == "list" else tuple(values)

    return build(treedef)


def _key_name(key: Any) -> str:
    # jax key entries (DictKey.key, SequenceKey.idx, GetAttrKey.name, FlattenedIndexKey.key)
    # are duck-typed so that this module needs no jax.
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: tuple) -> str:
    """The one leaf-path formatter: ``'layers/0/wq'`` for ``('layers', 0, 'wq')``; ``''`` for the root.

    Entries are dict keys, sequence indices, namedtuple fields, or jax key path
    entries (``jax.tree_util.tree_flatten_with_path``), which print as their key.

    Example:
      >>> from jreshard.core.tree import path_str
      >>> path_str(("layers", 0, "attn", "q_proj")), path_str(())
      ('layers/0/attn/q_proj', '')
    """
    return "/".join(_key_name(k) for k in path)


def first_leaf(tree: Any) -> Any:
    """The first leaf of ``tree`` in walk order without flattening it (``None`` if it has none).

    Example:
      >>> from jreshard.core.tree import first_leaf
      >>> first_leaf({"b": [None, 2], "a": None})
      2
    """
    if tree is None:
        return None
    if isinstance(tree, Mapping):
        children: Any = (tree[k] for k in _sorted_keys(tree))
    elif isinstance(tree, (list, tuple)):
        children = iter(tree)
    else:
        return tree
    for child in children:
        leaf = first_leaf(child)
        if leaf is not None:
            return leaf
    return None


def describe(treedef: TreeDef, depth: int = 0) -> str:
    """A short readable rendering of a tree structure, for error messages."""
    if treedef in ("leaf", "none"):
        return "*" if treedef == "leaf" else "None"
    kind, meta, children = treedef
    if depth > 1:
        return f"{kind}(...)"
    if kind == "dict":
        inner = ", ".join(f"{k!r}: {describe(c, depth + 1)}" for k, c in zip(meta, children, strict=True))
        return "{" + inner + "}"
    inner = ", ".join(describe(c, depth + 1) for c in children)
    return ("[" + inner + "]") if kind == "list" else ("(" + inner + ")")
