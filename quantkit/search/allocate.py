"""The exact allocation: one candidate per fused group, the stored bytes within the budget, the worst domain's
predicted KLD (the sum of the groups' measured increases on that domain) as low as it goes. A mixed-integer program
(HiGHS through scipy): minimise t subject to t >= sum_g increase[g, choice_g, d] for every domain d, with a small
weight on the mean over domains so that ties go to the mix that is better on average."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ..errors import QuantkitError

TIE = 1e-3  # weight of the domains' mean beside the worst one


@dataclass
class Choice:
    pick: list[int]  # candidate index per group
    predicted: list[float]  # per domain: the sum of the picked increases
    bytes: int  # the groups' bytes at the picks (the fixed bytes not included)

    @property
    def worst(self) -> float:
        return max(self.predicted)


def allocate(increase: np.ndarray, cost: np.ndarray, budget: int, allowed: np.ndarray | None = None) -> Choice:
    """increase [G, C, D] (KLD per domain), cost [G, C] (bytes); budget: bytes the groups may take together;
    allowed [G, C]: the candidates each group can take (a group size must divide its Linears), all by default."""
    groups, cands, domains = increase.shape
    allowed = np.ones((groups, cands), dtype=bool) if allowed is None else allowed
    check_budget(cost, budget, allowed)
    n = groups * cands
    c = np.concatenate([TIE * increase.mean(axis=2).reshape(n), [1.0]])  # x (flattened g-major), then t
    rows = [LinearConstraint(np.concatenate([cost.reshape(n), [0.0]])[None], -np.inf, budget)]
    one = np.zeros((groups, n + 1))
    for g in range(groups):
        one[g, g * cands:(g + 1) * cands] = 1
    rows.append(LinearConstraint(one, 1, 1))
    worst = np.concatenate([increase.transpose(2, 0, 1).reshape(domains, n), -np.ones((domains, 1))], axis=1)
    rows.append(LinearConstraint(worst, -np.inf, 0))
    integrality = np.concatenate([np.ones(n), [0]])
    upper = np.concatenate([allowed.reshape(n).astype(float), [np.inf]])  # a candidate a group cannot take: 0
    res = milp(c, constraints=rows, integrality=integrality, bounds=Bounds(0, upper))
    if res.x is None:
        raise QuantkitError(f"search: the allocation found no mix within the budget ({res.message})")
    pick = [int(np.argmax(res.x[g * cands:(g + 1) * cands])) for g in range(groups)]
    chosen = choice(pick, increase, cost)
    if not res.success or chosen.bytes > budget:  # the picks rounded from a solution feasible only within tolerance
        raise QuantkitError(f"search: the allocation's mix takes {chosen.bytes} bytes of {budget} ({res.message})")
    return chosen


def check_budget(cost: np.ndarray, budget: int, allowed: np.ndarray | None = None) -> None:
    cheapest = int(_masked(cost, allowed, np.inf).min(axis=1).sum())
    if cheapest > budget:
        raise QuantkitError(f"search.budget: {budget} bytes for the searched Linears; the cheapest candidate of every "
                            f"group already takes {cheapest}")


def choice(pick: list[int], increase: np.ndarray, cost: np.ndarray) -> Choice:
    g = np.arange(len(pick))
    return Choice(pick, [float(x) for x in increase[g, pick].sum(axis=0)], int(cost[g, pick].sum()))


def front(increase: np.ndarray, cost: np.ndarray, allowed: np.ndarray | None = None,
          points: int = 12) -> list[Choice]:
    """The predicted Pareto front: the best mix at budgets evenly spread from the cheapest to the dearest."""
    lo = int(_masked(cost, allowed, np.inf).min(axis=1).sum())
    hi = int(_masked(cost, allowed, -np.inf).max(axis=1).sum())
    out: list[Choice] = []
    for b in np.linspace(lo, hi, points):
        ch = allocate(increase, cost, int(b), allowed)
        if not out or ch.pick != out[-1].pick:
            out.append(ch)
    return out


def _masked(cost: np.ndarray, allowed: np.ndarray | None, fill: float) -> np.ndarray:
    return cost if allowed is None else np.where(allowed, cost, fill)
