"""The water fill that balances large classes of rows (jreshard.core.water), against its rule row by row."""

from __future__ import annotations

import numpy as np
import pytest

import jreshard.core.balance as balance
from jreshard.core.balance import _greedy, _Rows, _water_fill
from jreshard.core.water import Fill


def rule(mine, members, nbytes, load):
    """The rule, row by row: the water level over the members' loads, each member's quota up to it, and row i to
    the first member whose cumulative quota reaches the middle of row i (the last member takes the rest)."""
    load = load.copy()
    have = [float(load[m]) for m in members]
    total = float(sum(nbytes[i] for i in mine))
    srt = sorted(have)
    level = None
    for k in range(len(members)):
        lv = (total + sum(srt[:k + 1])) / (k + 1)
        if k + 1 < len(members) and lv <= srt[k + 1]:
            level = lv
            break
    level = lv if level is None else level
    ends, acc = [], 0.0
    for h in have:
        acc += max(level - h, 0.0)
        ends.append(acc)
    chosen, done = {}, 0.0
    for i in mine:
        mid = done + nbytes[i] / 2
        done += nbytes[i]
        k = next((j for j, e in enumerate(ends) if e >= mid), len(members) - 1)
        chosen[i] = members[k]
        load[members[k]] += nbytes[i]
    return chosen, load


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("equal", [False, True])
def test_water_fill_follows_its_rule(seed, equal):
    rng = np.random.default_rng(seed)
    rows, devices = int(rng.integers(1, 400)), 10
    members = np.sort(rng.choice(devices, size=int(rng.integers(1, 8)), replace=False))
    nbytes = (np.full(rows, 256.0) if equal else rng.integers(1, 5000, rows).astype(np.float64))
    mine = rng.permutation(rows)
    load = rng.integers(0, 20_000, devices).astype(np.float64)
    want, want_load = rule(mine.tolist(), members.tolist(), nbytes, load)
    chosen, got_load = np.full(rows, -1), load.copy()
    _water_fill(mine, members, nbytes, chosen, got_load)
    assert {int(i): int(chosen[i]) for i in mine} == want
    np.testing.assert_array_equal(got_load, want_load)
    # each member takes one contiguous run of the rows, in their order
    order = chosen[mine]
    assert all(np.sum(np.diff(np.nonzero(order == m)[0]) != 1) == 0 for m in members)


def _rows(rng, n_classes: int, sizes, devices: int, big: bool):
    """Rows of ``n_classes`` candidate sets over ``devices`` senders, receivers 100..131, sizes from ``sizes``."""
    counts = rng.integers(25_000, 60_000, n_classes) if big else rng.integers(1, 300, n_classes)
    inverse = rng.permutation(np.repeat(np.arange(n_classes), counts))
    n = len(inverse)
    nbytes = rng.choice(np.asarray(sizes, np.float64), n)
    receivers = rng.integers(100, 132, n)
    classes = np.full((n_classes, 4), -1, np.int64)
    for c in range(n_classes):
        k = int(rng.integers(1, 5))
        classes[c, :k] = np.sort(rng.choice(devices, k, replace=False))
    rows = _Rows(cls=inverse, nbytes=nbytes, chosen=np.full(n, -1, np.int64), starts=np.array([0, n]))
    return rows, classes, receivers


def test_fill_follows_the_rule_on_one_class():
    """One class of many rows of three sizes: every row's member and the loads as the rule gives them, over
    the rows sorted by (receiver, larger first, row)."""
    rng = np.random.default_rng(3)
    rows, classes, receivers = _rows(rng, 1, (96.0, 4096.0, 700.0), 6, True)
    members = classes[0][classes[0] >= 0]
    load = rng.integers(0, 10**6, 6).astype(np.float64)
    order = np.lexsort([np.arange(len(receivers)), -rows.nbytes, receivers])
    want, want_load = rule(order.tolist(), members.tolist(), rows.nbytes, load)
    fill = Fill.of(rows.cls, receivers, rows.nbytes, 1)
    assert fill is not None and fill.takes(0, len(members))
    got_load = load.copy()
    fill.level(0, members, got_load)
    assert len(members) > 1 and fill.cut  # runs end inside some receivers' blocks
    fill.assign(rows.chosen)
    assert rows.chosen.tolist() == [want[i] for i in range(len(receivers))]
    np.testing.assert_array_equal(got_load, want_load)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_with_and_without_the_fill_agree(seed, monkeypatch):
    """Large and small classes, shared senders, mixed sizes: the fill changes no member and no load."""
    rng = np.random.default_rng(seed)
    big, classes, receivers = _rows(rng, 5, (256.0, 688.0, 8192.0)[: 1 + seed % 3], 8, True)
    small, small_classes, small_receivers = _rows(rng, 3, (64.0, 100.0), 8, False)
    n = len(big.cls) + len(small.cls)
    rows = _Rows(cls=np.concatenate([big.cls, small.cls + len(classes)]),
                 nbytes=np.concatenate([big.nbytes, small.nbytes]),
                 chosen=np.full(n, -1, np.int64), starts=np.array([0, len(big.cls), n]))
    classes, receivers = np.concatenate([classes, small_classes]), np.concatenate([receivers, small_receivers])
    load = rng.integers(0, 10**7, 8).astype(np.float64)
    assert Fill.of(rows.cls, receivers, rows.nbytes, len(classes)) is not None
    fast, fast_load = dataclass_copy(rows), load.copy()
    _greedy(fast, classes, receivers, fast_load, True)
    monkeypatch.setattr(balance.Fill, "of", classmethod(lambda cls, *a: None))
    slow, slow_load = dataclass_copy(rows), load.copy()
    _greedy(slow, classes, receivers, slow_load, True)
    np.testing.assert_array_equal(fast.chosen, slow.chosen)
    np.testing.assert_array_equal(fast_load, slow_load)
    assert (fast.chosen >= 0).all()


def dataclass_copy(rows: _Rows) -> _Rows:
    return _Rows(rows.cls.copy(), rows.nbytes.copy(), rows.chosen.copy(), rows.starts.copy())


@pytest.mark.parametrize("runs", [True, False])
def test_sizes_and_ranks_whether_rows_come_in_runs_or_not(runs):
    """The distinct sizes (largest first) and every row's rank among them, as ``np.unique`` gives them, read
    off long runs of one size or off rows of mixed sizes; more than ``MOST_SIZES`` sizes give ``None``."""
    from jreshard.core.water import MOST_SIZES, _sizes

    rng = np.random.default_rng(5)
    values = np.array([256.0, 688.0, 8192.0, 96.0, 4096.0])
    if runs:  # a group's rows: each tensor's overlaps, tensor after tensor
        nbytes = np.repeat(values[rng.integers(0, len(values), 40)], rng.integers(100, 400, 40))
    else:
        nbytes = values[rng.integers(0, len(values), 5000)]
    sizes, rank = _sizes(nbytes)
    want = np.unique(nbytes)[::-1]
    np.testing.assert_array_equal(sizes, want)
    np.testing.assert_array_equal(sizes[rank], nbytes)
    many = np.arange(1.0, MOST_SIZES + 2)
    assert _sizes(np.repeat(many, 1000) if runs else np.tile(many, 1000)) is None
    assert _sizes(np.repeat(many[:MOST_SIZES], 1000) if runs else np.tile(many[:MOST_SIZES], 1000)) is not None
