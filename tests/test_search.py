"""quantkit search: the exact allocation, the sensitivity pass, the chosen recipe and its artifact."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from quantkit.errors import QuantkitError
from quantkit.search import allocate


def _brute(increase, cost, budget):
    best = None
    for pick in itertools.product(range(cost.shape[1]), repeat=cost.shape[0]):
        ch = allocate.choice(list(pick), increase, cost)
        if ch.bytes <= budget and (best is None or ch.worst < best.worst - 1e-12):
            best = ch
    return best


@pytest.mark.parametrize("seed", range(5))
def test_allocation_is_the_exact_min_max(seed):
    """The MILP's worst domain equals brute force's over every mix of 6 groups x 3 candidates x 3 domains."""
    rng = np.random.default_rng(seed)
    inc = rng.random((6, 3, 3)) * np.array([1.0, 0.3, 0.0])[None, :, None]  # a float candidate costs no KLD
    cost = np.tile(np.array([100, 200, 400]), (6, 1)) + rng.integers(0, 50, (6, 3))
    budget = int(cost[:, 1].sum())
    got, want = allocate.allocate(inc, cost, budget), _brute(inc, cost, budget)
    assert got.bytes <= budget
    assert got.worst == pytest.approx(want.worst, rel=1e-6, abs=1e-9)


def test_budget_below_the_cheapest_mix_is_one_line():
    inc = np.zeros((2, 2, 1))
    cost = np.array([[10, 20], [10, 20]])
    with pytest.raises(QuantkitError, match=r"search.budget: 19 bytes .* cheapest candidate of every group already "
                                            r"takes 20"):
        allocate.allocate(inc, cost, 19)
