"""The water fill that balances large classes of rows (jreshard.core.balance._water_fill), against its rule."""

from __future__ import annotations

import numpy as np
import pytest

from jreshard.core.balance import _water_fill


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
    _water_fill(mine, members, nbytes, chosen, got_load, 256.0 if equal else None)
    assert {int(i): int(chosen[i]) for i in mine} == want
    np.testing.assert_array_equal(got_load, want_load)
    # each member takes one contiguous run of the rows, in their order
    order = chosen[mine]
    assert all(np.sum(np.diff(np.nonzero(order == m)[0]) != 1) == 0 for m in members)


def test_equal_sizes_given_or_gathered_agree():
    rng = np.random.default_rng(7)
    members, nbytes, mine = np.array([1, 3, 4, 8]), np.full(50_000, 4096.0), rng.permutation(50_000)
    load = rng.integers(0, 10**8, 10).astype(np.float64)
    a, b = np.full(50_000, -1), np.full(50_000, -1)
    la, lb = load.copy(), load.copy()
    _water_fill(mine, members, nbytes, a, la)
    _water_fill(mine, members, nbytes, b, lb, 4096.0)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(la, lb)
