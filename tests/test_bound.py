"""The relaxation's lower bound (:mod:`solvers.singlephase.bound`): exact where one value must go,
never above the brute force's optimum (however many copies), and the bound a solve reports."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers import Problem, SolverConfig, save_all
from solvers.problem import node
from solvers.singlephase import anywhere
from solvers.singlephase.bound import lower_bound, stakes
from tests.graphs import P
from tests.test_anywhere import brute_force, small_dags

CFG = SolverConfig(workers=1, time_limit=10.0)


def burst() -> Problem:
    """``a`` (4 B, 1 s) is read at step 3, over a 20-byte burst at step 2 (``x`` read and
    ``y`` made there, neither recomputable): within 20 B, ``a`` must be out of memory at
    step 2, so recomputed once."""
    return P(
        node("a", size=4, time=1.0),  # 0
        node("x", size=10, time=5.0, recomputable=False),  # 1
        node("y", 1, size=10, time=5.0, recomputable=False),  # 2
        node("u", 0, 2, size=0, time=1.0),  # 3
    )


def movable(problem: Problem) -> set[int]:
    return set(anywhere.recomputable(problem))


def test_stakes_split_each_step_into_fixed_bytes_and_values_at_stake() -> None:
    fixed, spans = stakes(burst(), {0})
    assert fixed == [4, 10, 20, 14]  # a at steps 0 and 3, x at 1-2, y at 2-3
    assert spans == {1: [0], 2: [0]}


def test_the_bound_is_exact_where_one_value_must_be_recomputed() -> None:
    p = burst().with_budget(20)
    assert lower_bound(p, movable(p), CFG, 5.0) == pytest.approx(1.0, rel=1e-6)
    assert lower_bound(burst().with_budget(24), movable(p), CFG, 5.0) == 0.0  # everything fits
    assert lower_bound(burst(), movable(p), CFG, 5.0) == 0.0  # no budget


def test_a_step_that_cannot_fit_bounds_at_infinity() -> None:
    p = burst().with_budget(19)  # x and y alone take 20 B at step 2
    assert lower_bound(p, movable(p), CFG, 5.0) == math.inf


@settings(max_examples=30, deadline=None)
@given(small_dags(), st.integers(0, 100))
def test_the_bound_never_exceeds_the_brute_force_optimum(problem: Problem, pct: int) -> None:
    outcomes = brute_force(problem, copies=3)  # up to two recomputations of each value
    budget = min(o.peak for o in outcomes) + pct * (max(o.peak for o in outcomes) - min(o.peak for o in outcomes)) // 100
    q = problem.with_budget(budget)
    best = min((o.added_time for o in outcomes if o.peak <= budget), default=math.inf)
    assert lower_bound(q, movable(q), CFG, 5.0) <= best + 1e-9


def random_dag(n: int, seed: int) -> Problem:
    rng = random.Random(seed)
    return P(*(node(f"v{i}", *rng.sample(range(i), k=min(i, rng.randint(1, 3))),
                    size=rng.randint(1, 9), time=float(rng.randint(1, 5))) for i in range(n)))


def test_a_solve_reports_the_relaxation_where_it_is_higher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped early, CP-SAT's interval model bounds a 40-step graph at 60% of its peak
    below the relaxation; the result carries the higher of the two."""
    p = random_dag(40, seed=3)
    q = p.with_budget(int(0.6 * save_all(p).report.peak))
    cfg = SolverConfig(workers=1, time_limit=0.1, deterministic=True)
    relaxed = lower_bound(q, movable(q), cfg, 1.0)
    assert anywhere.solve(q, cfg).bound == pytest.approx(relaxed, rel=1e-9)
    monkeypatch.setattr(anywhere, "lower_bound", lambda *a: 0.0)
    assert anywhere.solve(q, cfg).bound < relaxed - 1.0  # CP-SAT's own
