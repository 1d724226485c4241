"""``jreshard.transfer``: run a reshard plan on jax devices, in one process or many.

Every process computes the same plan and the same memory-capped schedule from it
(``jreshard.core.schedule``: pieces, buckets, rounds, messages; words as in
docs/glossary.md). How the pieces move is the *transport*:

- ``"collective"``: per bucket, each sender packs its messages into one buffer
  per receiver, one ``jax.lax.ppermute`` per round inside one ``jax.shard_map``
  over a mesh of every device moves them, each receiver unpacks
  (``buckets.py``, ``programs.py``). Works across ``jax.distributed`` processes.
- ``"device_put"``: the same, with one ``jax.device_put`` per message (one
  process only).
- ``"memcpy"``: on CPU, every piece copied straight from the source device's
  buffer into its destination buffer (no staging, several threads).

On backends whose device buffers are host memory (CPU), packing and unpacking
are NumPy copies into kept, aligned host buffers (``host.py``) instead of
compiled programs. The outputs are assembled with exactly the target sharding
(``executor.py``); a destination shard that is exactly a source shard on the
same device, in the same dtype, is reused without a copy.

*Hierarchical delivery* (``hierarchical=``; docs/transfer.md): where a domain
(by default the devices of one JAX process, which share memory as the GPUs of a
node share NVLink) holds several replicas of a target, stage 1 sends each byte
into the domain once, spread over its replicas (``jreshard.core.hierarchical``),
and stage 2 completes the replicas with local copies. ``"auto"`` takes it when the
devices lie in several domains and the cost model
(``jreshard.fleet.hierarchical.decide``) predicts it faster.

The executor of a (plan, shardings, dtypes, transport, cap) is cached, so a
second transfer of the same pytree builds and compiles nothing. The first one
compiles its programs (see docs/transfer.md, "First call"). Each call logs what
it did (logger ``"jreshard"``) and keeps an ``ExecutionStats`` of it
(``jreshard.core.execution``, the record every executor returns), which
``last_transfer_stats()`` returns in the calling thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from typing import Any

import jax
import numpy as np

from jreshard.core.args import check_flag, check_int
from jreshard.core.domains import Domains
from jreshard.core.execution import ExecutionStats
from jreshard.core.hierarchical import HIERARCHICAL, check_hierarchical
from jreshard.core.plans import Plan, TensorPlan
from jreshard.core.progress import progress_bar
from jreshard.fleet.hardware import Topology
from jreshard.fleet.hierarchical import decide
from jreshard.jax_executor import host
from jreshard.jax_executor.adapter import Leaves, check_live, parse
from jreshard.jax_executor.executor import Executor, Spec, TwoStageExecutor, executor, two_stage_executor
from jreshard.jax_executor.host import release_transfer_buffers

__all__ = ["transfer", "release_transfer_buffers", "last_transfer_stats", "auto_topology",
           "DEFAULT_MAX_BYTES_IN_FLIGHT", "TRANSPORTS", "HIERARCHICAL"]

log = logging.getLogger("jreshard")

DEFAULT_MAX_BYTES_IN_FLIGHT = 256 << 20
TRANSPORTS = ("auto", "collective", "device_put", "memcpy")

# What `transport="auto"` picks, per backend, when one process addresses every
# device (measured with benchmarks/transfer_bench.py, see docs/transfer.md); the
# collective everywhere else.
_AUTO_ONE_PROCESS = {"cpu": "memcpy"}

# Backends whose device buffers are host memory: there the collective and device_put
# transports pack and unpack with NumPy copies (one memcpy per byte each way) instead
# of compiled XLA programs, which on CPU copy slices several times slower.
_HOST_PACKING_BACKENDS = frozenset({"cpu"})

# The links `hierarchical="auto"` weighs, per backend: inside a domain (`nvlink_GBps`) and
# between domains (`network_GBps`), per device and direction. CPU: a host copy inside a
# process against the cross-process collective (gloo), as benchmarks/transfer_bench.py
# measures them here (docs/transfer.md); other backends: the DGX H100 hardware file.
_AUTO_LINKS = {"cpu": Topology(1, nvlink_GBps=2.0, network_GBps=0.25, latency_us=500)}
_AUTO_LINKS_DEFAULT = "dgx-h100"  # read from its hardware file on first use, not at import

_LAST = threading.local()


def last_transfer_stats() -> ExecutionStats | None:
    """What this thread's last ``transfer`` call did (``None`` before the first), as this process counted it.

    The ``ExecutionStats`` (``jreshard.core.execution``) that every executor returns: ``seconds``;
    ``sent_bytes``, the payload bytes this process's devices sent to another device, both stages
    together (a device's copies to itself are not counted; ``received_bytes`` stays 0: each process
    counts its own senders); ``link_bytes``, the same per (sender, receiver) device id;
    ``cross_domain_sent_bytes`` (also ``cross_domain_bytes``), the part that crossed a boundary of
    ``domains``; ``delivery`` (``"direct"`` or ``"hierarchical"``); ``transports``, one per stage;
    ``transport_bytes``, the bytes sent per transport. Kept per thread, so that threads that
    transfer at once each read their own call.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from jreshard import last_transfer_stats, transfer
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
      >>> w = jax.device_put(np.zeros((4, 4), np.float32), NamedSharding(mesh, P("x")))
      >>> _ = transfer(w, NamedSharding(mesh, P(None, "x")))
      >>> s = last_transfer_stats()
      >>> s.sent_bytes, sorted(s.link_bytes.items()), s.delivery, s.transports
      (32, [((0, 1), 16), ((1, 0), 16)], 'direct', ('memcpy',))
    """
    return getattr(_LAST, "stats", None)


def transfer(params: Any, target: Any, *, plan: Plan | TensorPlan | None = None, dtype: Any = None,
             donate: bool = False, max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
             mesh: Any = None, transport: str = "auto", block: Any = None, hierarchical: str = "auto",
             domains: Any = None, topology: Topology | None = None, progress: bool | None = None) -> Any:
    """Moves a pytree of sharded jax Arrays onto another sharding, sending only what each device lacks.

    Call it outside ``jax.jit``, on concrete arrays.

    Args:
      params: a pytree of ``jax.Array``; each leaf may have any sharding on any devices.
      target: a ``jax.sharding.Sharding`` for every leaf, a pytree (prefix) of Shardings,
        or a PartitionSpec / pytree of PartitionSpecs together with ``mesh``.
      plan: a plan from ``jreshard.plan(params, target, ...)`` to reuse; refused with a
        ``ValueError`` when it was made for other arrays, shardings or dtypes.
      dtype: output dtype, or a pytree prefix of dtypes (``None`` keeps a leaf's dtype).
        The cast happens at the sender, so only the cast bytes move.
      donate: delete the source arrays once they are sent (a source shard that is
        reused as a destination shard is kept).
      max_bytes_in_flight: per device, the most bytes sent plus received in one bucket
        (the staging memory on top of the output); larger transfers run in several
        buckets, and a tensor larger than this is cut into pieces.
      mesh: the ``jax.sharding.Mesh`` (or ``jreshard.Mesh``) for PartitionSpec targets.
      transport: ``"collective"`` (``ppermute`` inside ``shard_map``; works across
        processes), ``"device_put"`` (one ``device_put`` per message; one process
        must address every device), ``"memcpy"`` (CPU devices in one process: each box
        copied between the devices' host buffers), or ``"auto"``: the fastest measured
        for the backend when one process addresses every device (``"memcpy"`` on
        CPU), else ``"collective"``.
      block: with an FP8 ``dtype``, block-scaled FP8 quantized at the source: a block shape
        such as ``(128, 128)``, ``(None, None)`` (per tensor), ``(1, None)`` (per channel),
        or an ``Fp8Format``; then the call returns ``(weights, scales)``
        (``jreshard.jax_executor.fp8.transfer``; docs/fp8.md).
      hierarchical: ``"never"`` (every destination shard straight from a source),
        ``"always"`` (where a domain holds two or more replicas of a target, each byte
        crosses into it once, spread over its replicas, then local copies complete them),
        or ``"auto"``: hierarchical where the devices lie in several domains and the
        cost model predicts it faster
        (``jreshard.fleet.hierarchical.decide`` over ``auto_topology``; the same choice
        ``jreshard plan`` prints).
      domains: which devices share fast links: a ``jreshard.Domains`` or a list of
        lists of device ids; ``None``: the devices of each JAX process.
      topology: the links ``"auto"`` weighs (a ``jreshard.fleet.hardware.Topology``; its
        bandwidths and latency, over ``domains``); ``None``: ``auto_topology``.
      progress: show a tqdm bar of the bytes sent (``None``: when this process sends
        over 1 GiB and stderr is a terminal; ``jreshard.core.progress``).

    Returns:
      The pytree of ``params``' structure, each leaf a ``jax.Array`` with exactly its
      target sharding, bit-identical to the input (or cast to ``dtype``). With ``block``,
      the pair ``(weights, scales)`` described in ``jreshard.jax_executor.fp8.transfer``.
      What the call did is kept for ``last_transfer_stats()``.

    Raises:
      TypeError: a leaf is not a jax Array (a tracer: called inside ``jit``), or an
        argument has the wrong kind.
      ValueError: target or dtype do not fit params, ``plan`` does not match, or a
        leaf has been deleted (donated by an earlier call, in this thread or another).

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from jreshard import transfer
      >>> devs = np.array(jax.devices()[:8])
      >>> train = jax.sharding.Mesh(devs[:4], ("fsdp",))
      >>> serve = jax.sharding.Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
      >>> w = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(train, P("fsdp")))
      >>> out = transfer({"w": w}, NamedSharding(serve, P(None, "tp")))
      >>> out["w"].sharding == NamedSharding(serve, P(None, "tp")), np.array_equal(out["w"], w)
      (True, True)
    """
    if block is not None:
        from jreshard.jax_executor import fp8  # imports this module

        return fp8.transfer(params, target, block=block, plan=plan, dtype=dtype, donate=donate,
                            max_bytes_in_flight=max_bytes_in_flight, mesh=mesh, transport=transport,
                            hierarchical=hierarchical, domains=domains, topology=topology, progress=progress)
    cap, donate = _check_options(donate, transport, max_bytes_in_flight)
    check_hierarchical(hierarchical)
    progress = check_flag("progress", progress, none=True)
    groups = _check_domains(domains)
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a jreshard.fleet.hardware.Topology or None, got {type(topology).__name__}; "
                        "build one with Topology.from_hardware(name).")
    leaves = parse(params, target, mesh=mesh, dtype=dtype, need_data=True)
    if cap < max(dt.itemsize for dt in leaves.dtypes):
        raise ValueError(f"max_bytes_in_flight={cap} is smaller than one element; raise it.")
    if plan is None:
        plan = leaves.plan()
        tplans = [plan[name] for name in leaves.names]
    else:
        tplans = _check_plan(plan, leaves)
    transport = resolve_transport(transport, leaves)
    platforms = {d.platform for v in leaves.values for d in v.sharding.device_set}
    host_packing = transport != "memcpy" and platforms <= _HOST_PACKING_BACKENDS
    if not host_packing and transport != "memcpy":
        _check_compiled_dtypes(leaves)
    spec = Spec(plan, tuple(v.sharding for v in leaves.values), leaves.shardings,
                tuple(np.dtype(v.dtype) for v in leaves.values), leaves.dtypes, transport, cap, host_packing,
                tuple(tplans), leaves.src, leaves.dst)
    groups = groups if groups is not None else process_domains()
    delivery = _delivery(spec, leaves.names, groups, hierarchical, topology)
    ex: Any
    if delivery.two_stage is not None:
        ex = two_stage_executor(spec, leaves.names, delivery.two_stage)
        transports = tuple(t for t in ex.transports if t is not None)
    else:
        ex, transports = executor(spec), (transport,)
    start = time.perf_counter()
    with host.LOCK:
        # Another thread may have donated these arrays since they were parsed.
        check_live(leaves.names, leaves.values)
        bar = progress_bar(progress, ex.total_bytes, f"jreshard transfer process {jax.process_index()}")
        try:
            out = ex(leaves.values, donate, bar)
        finally:
            if bar is not None:
                bar.close()
        stats = _stats(ex, delivery.delivery, transports, groups, time.perf_counter() - start)
    _LAST.stats = stats
    log.info("transfer: %d leaves, %s delivery (%s) over %s; sent %d bytes (%d across domains) in %.3f s",
             len(leaves.names), stats.delivery, "+".join(transports), groups, stats.sent_bytes,
             stats.cross_domain_bytes, stats.seconds)
    return jax.tree_util.tree_unflatten(leaves.treedef, out)


def _stats(ex: Executor | TwoStageExecutor, delivery: str, transports: tuple[str, ...], domains: Domains,
           seconds: float) -> ExecutionStats:
    """The ``ExecutionStats`` of one call from what its executor counted (this process's senders)."""
    links = dict(ex.link_bytes)
    cross = sum(b for (s, d), b in links.items() if domains.domain(s) != domains.domain(d))
    stages = [ex] if isinstance(ex, Executor) else [e for e in (ex.stage1, ex.stage2) if e is not None]
    per_transport: Counter[str] = Counter()
    for stage, t in zip(stages, transports, strict=True):
        per_transport[t] += sum(stage.link_bytes.values())
    return ExecutionStats(seconds=seconds, sent_bytes=sum(links.values()), cross_domain_sent_bytes=cross,
                          delivery=delivery, transports=transports, transport_bytes=per_transport,
                          link_bytes=links, domains=domains)


def _check_domains(domains: Any) -> Domains | None:
    """``domains`` as Domains (or None); the ids of domains from groups must be jax's devices."""
    if domains is None:
        return None
    if isinstance(domains, (list, tuple)):
        domains = Domains.from_groups(domains)
    elif not isinstance(domains, Domains):
        raise TypeError(f"domains must be a jreshard.Domains, a list of lists of device ids or None, got "
                        f"{type(domains).__name__} {domains!r}.")
    known = {d.id for d in jax.devices()}
    unknown = sorted({i for g in domains.groups for i in g} - known)
    if unknown:
        raise ValueError(f"domains {domains!r} names devices {unknown[:8]} that jax does not have; its devices are "
                         f"{sorted(known)[:16]}{'...' if len(known) > 16 else ''}. List ids of jax.devices().")
    return domains


def process_domains() -> Domains:
    """The default domains: the devices of each JAX process."""
    groups: dict[int, list[int]] = {}
    for d in jax.devices():
        groups.setdefault(d.process_index, []).append(d.id)
    return Domains.from_groups([groups[p] for p in sorted(groups)])


def auto_topology(platform: str, domains: Domains) -> Topology:
    """The links ``hierarchical="auto"`` weighs for devices of ``platform`` grouped by ``domains``."""
    links = _AUTO_LINKS.get(platform) or _hardware_links(_AUTO_LINKS_DEFAULT)
    return links.with_domains(domains)


@functools.cache
def _hardware_links(name: str) -> Topology:
    return Topology.from_hardware(name)


@functools.lru_cache(maxsize=64)
def _delivery(spec: Spec, names: tuple[str, ...], domains: Domains, hierarchical: str,
              topology: Topology | None) -> Any:
    """The cost model's decision (``fleet.hierarchical.decide``) for a spec, made once per spec."""
    devices: list[Any] = [d for s in spec.sources + spec.targets for d in s.device_set]
    touched = set(domains.of(sorted({d.id for d in devices})).tolist())  # raises naming a device in no domain
    if hierarchical == "auto" and len(touched) == 1:
        hierarchical = "never"  # one domain: no byte crosses a boundary either way
    platforms = {d.platform for d in devices}
    topo = (auto_topology(platforms.pop() if len(platforms) == 1 else "", domains) if topology is None
            else topology.with_domains(domains))
    src, dst = dict(zip(names, spec.src, strict=True)), dict(zip(names, spec.dst, strict=True))
    d = decide(src, dst, topo, hierarchical, direct_plan=spec.plan if isinstance(spec.plan, Plan) else None)
    if d.hierarchical is not None:
        log.debug("hierarchical delivery predicted %.4g s against %.4g s direct: %s", d.hierarchical.seconds,
                  d.direct.seconds, d.delivery)
    return d


def _check_options(donate: Any, transport: Any, max_bytes_in_flight: Any) -> tuple[int, bool]:
    """The cap and ``donate``, once the options that do not depend on params are valid."""
    donate = check_flag("donate", donate)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}.")
    return check_int("max_bytes_in_flight", max_bytes_in_flight, minimum=16), donate


def _check_plan(plan: Any, leaves: Leaves) -> list[TensorPlan]:
    """The plan's TensorPlans in leaf order; a clear error if it was made for other arguments."""
    hint = "make it with jreshard.plan(params, target) with the same target, mesh and dtype"
    if isinstance(plan, TensorPlan):
        if len(leaves.names) != 1:
            raise ValueError(f"plan is a TensorPlan for one tensor but params has {len(leaves.names)} leaves; {hint}.")
        tplans = [plan]
    elif isinstance(plan, Plan):
        names = list(plan.tensors)
        if names != list(leaves.names):
            raise ValueError(
                f"plan does not match params: it covers tensors {names[:6]!r}{'...' if len(names) > 6 else ''} "
                f"but params has {list(leaves.names)[:6]!r}{'...' if len(leaves.names) > 6 else ''}; {hint}."
            )
        tplans = [plan[n] for n in names]
    else:
        raise TypeError(f"plan must be a jreshard.Plan or TensorPlan (from jreshard.plan), got {type(plan).__name__}.")
    for name, tp, s, d in zip(leaves.names, tplans, leaves.src, leaves.dst, strict=True):
        for side, have, want in (("source", tp.src, s), ("destination", tp.dst, d)):
            same = (have.shape, have.mesh, have.spec) == (want.shape, want.mesh, want.spec)
            if not same or (have.dtype is not None and have.dtype != want.dtype):
                where = f"tensor {name!r}" if name else "the tensor"
                raise ValueError(f"plan does not match params/target: for {where} the plan's {side} is "
                                 f"{have!r} but the arguments give {want!r}; {hint}.")
    return tplans


def _check_compiled_dtypes(leaves: Leaves) -> None:
    """Refuses dtypes that compiled packing cannot move bit for bit."""
    x64 = bool(jax.config.read("jax_enable_x64"))
    for name, v, dt in zip(leaves.names, leaves.values, leaves.dtypes, strict=True):
        for d in {np.dtype(v.dtype), dt}:
            if np.issubdtype(d, np.complexfloating) and not (x64 and d.itemsize == 8):
                raise TypeError(
                    f"params leaf {name!r} has dtype {d}, which this backend's compiled packing cannot "
                    "move (it needs an unsigned integer as wide as the element); move the real and "
                    "imaginary parts as separate float leaves, or enable jax_enable_x64 for complex64."
                )


def resolve_transport(transport: str, leaves: Leaves) -> str:
    """The transport ``transfer`` uses for ``leaves``: ``"auto"`` resolved, the others checked."""
    ids: set[int] = set()
    for v, s in zip(leaves.values, leaves.shardings, strict=True):
        used: list[Any] = [*v.sharding.device_set, *s.device_set]
        ids.update(d.id for d in used)
    me = jax.process_index()
    devices: list[Any] = [d for d in jax.devices() if d.id in ids]
    one_process = all(d.process_index == me for d in devices)
    platforms = {d.platform for d in devices}
    if transport in ("device_put", "memcpy") and not one_process:
        raise ValueError(
            f"transport={transport!r} needs every source and destination device in this process; "
            "use transport='collective' (or 'auto') under jax.distributed."
        )
    if transport == "memcpy" and platforms != {"cpu"}:
        raise ValueError(
            f"transport='memcpy' copies host buffers and needs CPU devices, got {sorted(platforms)}; "
            "use 'auto', 'device_put' or 'collective'."
        )
    if transport == "auto":
        backend = platforms.pop() if len(platforms) == 1 else ""
        return _AUTO_ONE_PROCESS.get(backend, "collective") if one_process else "collective"
    return transport
