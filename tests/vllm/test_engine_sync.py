"""``TrainerSync`` and ``WorkerSync`` without an engine: one JAX trainer and two torch workers in this process.

The workers run in threads behind a test ``EngineControl`` (``Engine``) and commit into plain
dicts, checked against the plan's NumPy reference. What a user of an engine meets after a
failure: a retry on the same object and port works at once, the error's advice fits the
trainer (no ``rebuild_group``), and a second trainer object cannot take the workers from a
first one that is still open.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from bridge.engines.hello import EngineParam, EngineShape, build_param_map, worker_hello  # noqa: E402
from bridge.engines.trainer import PAUSES, TrainerSync  # noqa: E402
from bridge.engines.worker import Commit, GroupInfo, WorkerSync  # noqa: E402
from bridge.errors import SyncError  # noqa: E402
from bridge.recipes import Recipe  # noqa: E402
from bridge.trainer.sender import describe, flatten_params  # noqa: E402
from jreshard.nn import LlamaConfig, param_shapes  # noqa: E402
from tests._procs import free_ports  # noqa: E402

WORKERS = (1, 2)  # sync ranks of the engine's TP2 workers (the trainer is rank 0)


def config(tied: bool = False) -> LlamaConfig:
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, qk_norm=True,
                       tie_word_embeddings=tied, name="tiny")


def make_params(cfg: LlamaConfig, seed: int, shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
    """A flax-like tree of single-device jax arrays with random values."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    rng = np.random.default_rng(seed)
    tree: dict = {}
    for path, shape in (shapes or param_shapes(cfg)).items():
        node = tree
        *head, last = path.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = jax.device_put(rng.standard_normal(shape).astype(np.float32),
                                    NamedSharding(mesh, PartitionSpec()))
    return tree


class Engine:
    """An ``EngineControl`` over two ``WorkerSync``s in threads; each commits into a dict of tensors."""

    def __init__(self, recipe: Recipe, params: Any) -> None:
        source = describe(params, [0])
        pm = build_param_map(source, recipe, EngineShape((WORKERS,), False, "float32"))
        live = {r: [EngineParam(p.name, p.shape, p.dtype) for p in pm.for_rank(r)] for r in WORKERS}
        for r in WORKERS:  # a tied param is the engine's own too (vLLM's lm_head holds the embedding's tensor)
            live[r] += [EngineParam(name, t.shape, t.dtype) for name, src in recipe.tied.items() for t in live[r]
                        if t.name == src]
        self.hellos = {r: worker_hello(rank=r, replica=0, tp_rank=i, tp=len(WORKERS), replicas=1,
                                       expert_parallel=False, dtype="float32", params=live[r])
                       for i, r in enumerate(WORKERS)}
        self.workers = {r: WorkerSync() for r in WORKERS}
        self.models: dict[int, dict[str, np.ndarray]] = {r: {} for r in WORKERS}
        self.stall: set[int] = set()  # workers whose next update never receives
        self.events: list[str] = []  # the control calls, in order
        self.can_pause = False  # whether pause() pauses (vLLM's LLMClient cannot, HTTPClient can)
        self.on_pause: Any = None  # called when the trainer pauses
        self._pool = concurrent.futures.ThreadPoolExecutor(len(WORKERS))

    def _all(self, fn) -> list[Any]:
        return list(self._pool.map(fn, WORKERS))

    def connect(self, info: GroupInfo) -> None:
        self._all(lambda r: self.workers[r].join(info, self.hellos[r]))

    def pause(self) -> bool:
        self.events.append("pause")
        if self.on_pause is not None:
            self.on_pause()
        return self.can_pause

    def begin_update(self) -> None:
        self.events.append("begin")
        for r in WORKERS:
            if r not in self.stall:
                self.workers[r].start()

    def update(self, version: int) -> None:
        self.events.append("update")

        def one(r: int) -> bool:
            if r in self.stall:
                self.stall.discard(r)
                return False
            return self.workers[r].receive(version, lambda t, _: self._commit(r, t))

        self._all(one)

    def _commit(self, rank: int, tensors) -> Commit:
        self.models[rank] = {k: v.clone().numpy() for k, v in tensors.items()}
        return Commit(len(tensors), 0.0)

    def end_update(self, version: int | None) -> None:
        self.events.append("end")
        for w in self.workers.values():
            w.settle()

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
        self._pool.shutdown()


def check_served(engine: Engine, sync: TrainerSync, params: Any) -> None:
    """The workers' models equal the plan's NumPy reference of ``params`` (a tied param its source's)."""
    assert sync.plan is not None
    ref = sync.plan.reference({k: np.asarray(v) for k, v in flatten_params(params).items()})
    for r in WORKERS:
        ref[r].update({name: ref[r][src] for name, src in sync.recipe.tied.items()})
        assert sorted(engine.models[r]) == sorted(ref[r])
        for name, want in ref[r].items():
            np.testing.assert_array_equal(engine.models[r][name], want, err_msg=name)


@pytest.fixture
def setup():
    cfg = config()
    params = make_params(cfg, 0)
    engine = Engine(Recipe.llama(cfg), params)
    syncs: list[TrainerSync] = []

    def trainer(port: int, **kw: Any) -> TrainerSync:
        s = TrainerSync(Recipe.llama(cfg), workers=len(WORKERS), control=engine, rank=0, trainers=1, port=port,
                        timeout=kw.pop("timeout", 10.0), ready_timeout=kw.pop("ready_timeout", 20.0), **kw)
        syncs.append(s)
        return s

    yield cfg, params, engine, trainer
    for s in syncs:
        s.close()
    engine.close()


def _wrong_shape(cfg: LlamaConfig) -> dict:
    shapes = dict(param_shapes(cfg))
    shapes["layers_0/mlp/up_proj/kernel"] = (32, 32)
    return make_params(cfg, 1, shapes)


def _missing_leaf(cfg: LlamaConfig) -> dict:
    params = make_params(cfg, 1)
    del params["final_norm"]
    return params


@pytest.mark.parametrize("bad,match", [(_wrong_shape, r"up_proj/kernel'\] is \(32, 32\)"),
                                       (_missing_leaf, r"lacks trainer leaves \['final_norm/scale'\]")],
                         ids=["wrong-shape", "missing-leaf"])
@pytest.mark.parametrize("pause", PAUSES)
def test_a_retry_after_a_failed_sync_works_at_once_on_the_same_object_and_port(setup, bad, match, pause):
    cfg, params, engine, trainer = setup
    engine.can_pause = True
    sync = trainer(free_ports(1)[0], pause=pause)
    sync.sync(params, 1)
    check_served(engine, sync, params)
    with pytest.raises(ValueError, match=match) as failed:  # the traceback stays alive, holding the old group
        sync.sync(bad(cfg), 2)
    assert failed.value is not None and sync.group is None
    assert engine.events[-1] == "end"  # the failed update was ended, and generation resumed
    t0 = time.monotonic()
    new = make_params(cfg, 3)
    report = sync.sync(new, 3)
    assert time.monotonic() - t0 < 10.0
    assert report.version == 3 and all(w.version == 3 for w in engine.workers.values())
    check_served(engine, sync, new)


def _reference(sync: TrainerSync, params: Any) -> dict[int, dict[str, np.ndarray]]:
    assert sync.plan is not None
    return sync.plan.reference({k: np.asarray(v) for k, v in flatten_params(params).items()})


@pytest.mark.parametrize("pause", PAUSES)
def test_generation_pauses_for_the_whole_sync_or_only_for_the_commit(setup, pause):
    cfg, params, engine, trainer = setup
    sync = trainer(free_ports(1)[0], pause=pause)
    sync.sync(params, 1)
    old, new = _reference(sync, params), make_params(cfg, 2)
    seen: dict[str, Any] = {}

    def at_pause() -> None:  # what the workers hold when generation stops
        seen["models"] = {r: dict(engine.models[r]) for r in WORKERS}
        seen["staging"] = {r: {n: t.clone().numpy() for n, t in engine.workers[r].receiver.params.items()}
                           for r in WORKERS}

    engine.events.clear()
    engine.can_pause, engine.on_pause = True, at_pause
    report = sync.sync(new, 2)
    check_served(engine, sync, new)
    want = _reference(sync, new)
    if pause == "sync":
        assert engine.events == ["pause", "begin", "update", "end"]
    else:  # the bytes were staged while the engine served; it paused only to commit them
        assert engine.events == ["begin", "pause", "update", "end"]
        for r in WORKERS:
            assert sorted(seen["staging"][r]) == sorted(want[r])
            for name, a in want[r].items():
                np.testing.assert_array_equal(seen["staging"][r][name], a, err_msg=name)
    for r in WORKERS:  # either way nothing was committed before the pause
        for name, a in old[r].items():
            np.testing.assert_array_equal(seen["models"][r][name], a, err_msg=name)
    assert report.pause_seconds is not None and 0 < report.pause_seconds <= report.sync_seconds
    engine.can_pause = False  # an engine that cannot pause: the report says so
    assert sync.sync(params, 3).pause_seconds is None


def test_a_bad_pause_is_refused_with_the_choices(setup):
    _, _, _, trainer = setup
    with pytest.raises(ValueError, match=r"pause must be one of \('sync', 'commit'\).*got 'always'"):
        trainer(free_ports(1)[0], pause="always")


def test_a_sync_error_advises_calling_sync_again_and_that_works(setup):
    cfg, params, engine, trainer = setup
    sync = trainer(free_ports(1)[0], timeout=2.0, ready_timeout=3.0)
    sync.sync(params, 1)
    engine.stall.add(WORKERS[1])  # one worker never joins version 2's transfer
    with pytest.raises(SyncError) as failed:
        sync.sync(make_params(cfg, 2), 2)
    message = str(failed.value)
    assert "rebuild_group" not in message and "call sync(params, version) again" in message, message
    new = make_params(cfg, 3)
    assert sync.sync(new, 3).version == 3
    check_served(engine, sync, new)


def test_a_second_trainer_sync_is_refused_while_the_first_is_open_and_takes_over_once_it_closed(setup):
    cfg, params, engine, trainer = setup
    port_a, port_b = free_ports(2)
    first, second = trainer(port_a), trainer(port_b)
    first.sync(params, 1)
    with pytest.raises(SyncError, match=rf"synced by the trainers at 127\.0\.0\.1:{port_a}, which have not "
                                        r"closed; call close\(\) on that"):
        second.sync(make_params(cfg, 2), 2)
    again = make_params(cfg, 3)
    assert first.sync(again, 3).version == 3  # the first still holds the workers
    check_served(engine, first, again)
    first.close()
    last = make_params(cfg, 4)
    assert second.sync(last, 4).version == 4
    check_served(engine, second, last)


def test_the_same_port_twice_is_refused_with_what_to_do(setup):
    _, params, _, trainer = setup
    port = free_ports(1)[0]
    first, second = trainer(port), trainer(port)
    first.sync(params, 1)
    with pytest.raises(ValueError, match=rf"port {port} on 127\.0\.0\.1 cannot be bound .*close\(\) that one"):
        second.sync(params, 2)


def test_tied_embeddings_are_sent_once_and_fill_both_params():
    cfg = config(tied=True)
    params = make_params(cfg, 0)
    recipe = Recipe.llama(cfg)
    engine = Engine(recipe, params)
    sync = TrainerSync(recipe, workers=len(WORKERS), control=engine, rank=0, trainers=1, port=free_ports(1)[0],
                       timeout=10.0, ready_timeout=20.0)
    try:
        report = sync.sync(params, 1)
        check_served(engine, sync, params)
        assert all("lm_head.weight" in engine.models[r] for r in WORKERS)
        assert sync.plan is not None and "lm_head.weight" not in sync.plan.param_map.names(1)
        for r in WORKERS:  # the lower bound: every param's regions once, the embedding's once
            lower = sum(int(np.prod(g.shape)) * 4 for p in sync.plan.param_map.for_rank(r) for g in p.regions)
            assert report.bytes_received[r] == lower
    finally:
        sync.close()
        engine.close()
