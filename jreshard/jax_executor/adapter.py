"""The JAX adapter: jax Arrays, ShapeDtypeStructs, Shardings and PartitionSpecs in, Layouts and Plans out.

Everything that touches jax objects at the edge of the library lives here: the
arguments of ``jreshard.plan`` and ``jreshard.transfer`` are parsed once into one
canonical form (a flat list of leaves with their path names, source Layouts,
target shardings, destination Layouts and output dtypes) that the pure planner and
the executor consume.

Words as in docs/glossary.md. A leaf's name in a plan is its path as
``jax.tree_util.keystr(path, simple=True, separator="/")`` prints it
(``'layers/0/wq'``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jreshard.core.dtypes import canonical_dtype, numpy_dtype
from jreshard.core.layout import Layout
from jreshard.core.mesh import Mesh
from jreshard.core.planner import Plan, plan_layouts

__all__ = ["Leaves", "parse", "plan_from_jax", "leaf_name", "check_live", "check_concrete"]


def leaf_name(path: tuple) -> str:
    """A leaf's name in a plan: its key path with simple keys joined by ``/`` (``'layers/0/wq'``)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


@dataclasses.dataclass(frozen=True, slots=True)
class Leaves:
    """The canonical form of (params, target, dtype): one entry per leaf, in tree order."""

    treedef: Any  # jax treedef of params
    names: tuple[str, ...]
    values: tuple[Any, ...]  # the leaves as given (jax.Array or ShapeDtypeStruct)
    shardings: tuple[Sharding, ...]  # target shardings
    dtypes: tuple[np.dtype, ...]  # output dtypes
    src: tuple[Layout, ...]
    dst: tuple[Layout, ...]

    def plan(self, balance: bool = True) -> Plan:
        return plan_layouts(list(zip(self.names, self.src, self.dst, strict=True)), balance=balance)


def _is_jax_leaf(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def _is_target_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (Sharding, PartitionSpec))


def _is_dtype_leaf(x: Any) -> bool:
    if x is None or isinstance(x, (str, np.dtype, type)):
        return True
    # Containers are subtrees (np.dtype would read a dict or list as a structured dtype).
    return not isinstance(x, (dict, list, tuple)) and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


def _broadcast(prefix: Any, treedef: Any, paths: tuple[tuple, ...], is_leaf: Any, arg: str, example: str) -> list:
    """Expands ``prefix`` (a pytree prefix of params) to one value per leaf of params."""
    if is_leaf(prefix):
        return [prefix] * treedef.num_leaves
    full = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    try:
        expanded = jax.tree_util.tree_map(
            lambda value, sub: jax.tree_util.tree_map(lambda _: value, sub), prefix, full, is_leaf=is_leaf)
    except (ValueError, TypeError):
        where = _mismatch(prefix, paths, is_leaf)
        raise ValueError(f"{arg} must be {example} or a pytree prefix of params: {where}.") from None
    out = jax.tree_util.tree_leaves(expanded, is_leaf=is_leaf)
    if len(out) != len(paths):
        raise ValueError(
            f"{arg} expands to {len(out)} entries but params has {len(paths)} leaves; "
            f"give {example} or a pytree prefix of params."
        )
    return out


def _mismatch(prefix: Any, paths: tuple[tuple, ...], is_leaf: Any) -> str:
    """Where ``prefix`` fails to be a prefix of the params whose leaves have ``paths``, by path."""
    entries = [p for p, _ in jax.tree_util.tree_flatten_with_path(prefix, is_leaf=is_leaf)[0]]
    have = set(entries)
    for path in paths:
        if not any(path[:k] in have for k in range(len(path) + 1)):
            return f"it has no entry for params leaf {leaf_name(path)!r}; add one, or one for a subtree above it"
    for entry in entries:
        if not any(path[:len(entry)] == entry for path in paths):
            return f"its entry at {leaf_name(entry)!r} is not in params; remove it"
    return (f"its containers differ from params' ({jax.tree_util.tree_structure(prefix, is_leaf=is_leaf)} "
            f"against {jax.tree_util.tree_structure(tuple(paths))}); give the same container types")


@functools.lru_cache(maxsize=256)
def _mesh_of(jax_mesh: Any) -> Mesh:
    return Mesh.from_jax(jax_mesh)


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], sharding: Sharding, dtype: str) -> Layout:
    if isinstance(sharding, NamedSharding):
        return Layout(shape, _mesh_of(sharding.mesh), tuple(sharding.spec), dtype)
    return Layout.from_jax(shape, sharding, dtype)


def _jax_mesh(mesh: Any) -> jax.sharding.Mesh:
    """``mesh=`` as a jax Mesh: a jax Mesh as is, a jreshard.Mesh looked up by device id."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    if isinstance(mesh, Mesh):
        by_id = {d.id: d for d in jax.devices()}
        missing = [i for i in mesh.device_ids if i not in by_id]
        if missing:
            raise ValueError(
                f"mesh {mesh!r} names devices {missing} that jax does not have; its devices are "
                f"{sorted(by_id)}. Build the mesh from jax.devices()."
            )
        devices = np.array([by_id[i] for i in mesh.device_ids], dtype=object).reshape(mesh.shape)
        return jax.sharding.Mesh(devices, mesh.axis_names)
    raise TypeError(
        f"mesh must be a jax.sharding.Mesh or a jreshard.Mesh, got {type(mesh).__name__} {mesh!r}."
    )


def _target_sharding(name: str, value: Any, mesh: jax.sharding.Mesh | None) -> Sharding:
    where = f" at {name!r}" if name else ""
    if isinstance(value, Sharding):
        if mesh is not None:
            raise TypeError(
                f"target{where} is a Sharding ({value}), which carries its own mesh, but mesh= was also "
                "given; pass mesh= only with PartitionSpec targets."
            )
        return value
    if isinstance(value, PartitionSpec):
        _check_axes_once(f"target{where}", value)
        if mesh is None:
            raise TypeError(
                f"target{where} is a PartitionSpec {value} but no mesh= was given; pass "
                "mesh=jax.sharding.Mesh(...) or a NamedSharding."
            )
        try:
            return NamedSharding(mesh, value)
        except ValueError as exc:
            raise ValueError(f"target{where} {value} does not fit mesh {dict(mesh.shape)}: {exc}") from None
    raise TypeError(
        f"target{where} must be a jax.sharding.Sharding or a PartitionSpec (with mesh=), got "
        f"{type(value).__name__} {value!r}."
    )


def _check_axes_once(arg: str, spec: PartitionSpec) -> None:
    """Refuses a spec that names a mesh axis twice (``P('tp', 'tp')``), before jax's own error."""
    axes = [a for e in spec if isinstance(e, (str, tuple)) for a in ((e,) if isinstance(e, str) else e)]
    twice = [a for i, a in enumerate(axes) if a in axes[:i]]
    if twice:
        raise ValueError(f"{arg} {spec} uses mesh axis {twice[0]!r} twice; a mesh axis shards at most one dim, once. "
                         "Name each axis once, e.g. P('tp', None) or P(('dp', 'tp'), None).")


def check_concrete(where: str, x: Any, call: str) -> None:
    """Refuses a tracer (``call`` inside ``jax.jit``: TypeError) and a deleted array (ValueError), naming ``where``."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{where} is a tracer: {call} must be called outside jax.jit (and other jax transformations), on "
            "concrete arrays; call it between jitted steps."
        )
    if isinstance(x, jax.Array) and x.is_deleted():
        raise ValueError(f"{where} has been deleted (donated by an earlier call?); pass live arrays.")


def parse(params: Any, target: Any, *, mesh: Any = None, dtype: Any = None, need_data: bool = False) -> Leaves:
    """Parses the arguments of ``transfer`` / ``plan`` into their canonical form.

    Raises:
      TypeError: a leaf is not a jax Array (or ShapeDtypeStruct with a sharding),
        or a target / dtype entry has the wrong kind.
      ValueError: the target or dtype pytree does not fit params, a target does not
        fit its array's rank or shape, or a mesh names devices jax lacks.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not flat:
        raise ValueError(f"params is an empty pytree ({treedef}); pass at least one jax.Array.")
    paths = tuple(p for p, _ in flat)
    names = tuple(leaf_name(p) for p in paths)
    if len(set(names)) != len(names):  # keys that print alike ('0' and 0): keep every detail
        names = tuple(jax.tree_util.keystr(p) for p in paths)
    values = tuple(v for _, v in flat)
    for name, v in zip(names, values, strict=True):
        where = f" at {name!r}" if name else ""
        check_concrete(f"params leaf{where}", v, "jreshard.transfer and jreshard.plan")
        if not _is_jax_leaf(v) or (need_data and not isinstance(v, jax.Array)):
            kinds = "jax.Array" if need_data else "jax.Array or jax.ShapeDtypeStruct with a sharding"
            raise TypeError(
                f"params leaf{where} must be a {kinds}, got {type(v).__name__}; "
                "put it on devices first with jax.device_put(x, sharding)."
            )
        if getattr(v, "sharding", None) is None:
            raise TypeError(
                f"params leaf{where} is a ShapeDtypeStruct without a sharding; build it with "
                "jax.ShapeDtypeStruct(shape, dtype, sharding=...)."
            )
    jmesh = _jax_mesh(mesh) if mesh is not None else None
    targets = _broadcast(target, treedef, paths, _is_target_leaf, "target",
                         "a Sharding, a PartitionSpec (with mesh=)")
    shardings = tuple(_target_sharding(n, t, jmesh) for n, t in zip(names, targets, strict=True))
    dts = _broadcast(dtype, treedef, paths, _is_dtype_leaf, "dtype", "a dtype")
    out_dtypes = []
    for name, v, dt in zip(names, values, dts, strict=True):
        where = f" at {name!r}" if name else ""
        resolved = None if dt is None else numpy_dtype(dt, arg=f"dtype{where}")
        out_dtypes.append(np.dtype(v.dtype) if resolved is None else resolved)
    src, dst = [], []
    for name, v, s, dt in zip(names, values, shardings, out_dtypes, strict=True):
        where = f" at {name!r}" if name else ""
        shape = tuple(int(n) for n in v.shape)
        try:
            src.append(_layout(shape, v.sharding, canonical_dtype(v.dtype)))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"params leaf{where} has a sharding jreshard cannot read: {exc}") from None
        try:
            s.shard_shape(shape)
        except Exception as exc:  # jax raises its own IndivisibleError / ValueError
            raise ValueError(
                f"target{where} {s} does not fit the array of shape {shape}: {exc}. "
                "Pick a spec with at most one entry per dim whose mesh axes divide the dims."
            ) from None
        try:
            dst.append(_layout(shape, s, canonical_dtype(dt)))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"target{where} does not fit the array of shape {shape}: {exc}") from None
    return Leaves(treedef, names, values, shardings, tuple(out_dtypes), tuple(src), tuple(dst))


def check_live(names: tuple[str, ...], values: tuple[Any, ...]) -> None:
    """Raises ValueError naming the first deleted array among ``values`` (``names`` in the same order)."""
    for name, v in zip(names, values, strict=True):
        check_concrete(f"params leaf at {name!r}" if name else "params leaf", v, "jreshard.transfer")


def plan_from_jax(src: Any, dst: Any, *, balance: bool = True, mesh: Any = None, dtype: Any = None) -> Plan:
    """``jreshard.plan`` for jax arguments: a pytree of jax Arrays or ShapeDtypeStructs and a target.

    Args:
      src: a pytree of ``jax.Array`` or ``jax.ShapeDtypeStruct`` (with a sharding).
      dst: a ``Sharding`` for every leaf, a pytree prefix of Shardings, or
        PartitionSpec(s) together with ``mesh``.
      balance: balance replicated senders (see ``jreshard.plan``).
      mesh: the mesh for PartitionSpec targets.
      dtype: output dtype (or pytree prefix of dtypes); only the cast bytes move.

    Returns:
      A ``Plan`` keyed by leaf path (``'layers/0/wq'``), which ``transfer(..., plan=)`` accepts.
    """
    return parse(src, dst, mesh=mesh, dtype=dtype).plan(balance)
