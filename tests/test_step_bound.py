"""The step relaxation's lower bound (:mod:`solvers.bound`): never above the brute force's
optimum at any step, with or without a host link, nor above a multi-level plan; exact
where one value must go; infinite only where no plan fits; and the bound the default
planner reports at scale."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

from solvers import InfeasibleBudgetError, Problem, SolverConfig, check, multilevel, planner
from solvers.baselines import checkpoint_every
from solvers.bound import least_budget, lower_bound, pressing_steps, step_bound
from solvers.floor import baseline
from tests.test_cpsat import (
    HAND,
    HAND_OUTCOMES,
    brute_force,
    cheapest,
    interesting_budgets,
    loss_heads,
    small_problems,
)
from tests.test_multilevel import deep_gpt, every_segment_peak

REL = 1e-6


def every_step(problem: Problem) -> float:
    """The largest of the relaxations at every step (what :func:`lower_bound` samples)."""
    return max(step_bound(problem, k) for k in range(len(problem.nodes)))


def assert_bounds_brute_force(problem: Problem) -> None:
    outcomes = brute_force(problem)
    least = min(o.peak for o in outcomes)
    assert least_budget(problem, least) <= least  # no plan fits under it
    for budget in interesting_budgets(outcomes):
        q = problem.with_budget(budget)
        best = cheapest(outcomes, budget)
        relaxed = every_step(q)
        assert lower_bound(q).seconds <= relaxed
        if best is None:
            continue  # any bound holds where no plan fits
        assert relaxed <= best * (1 + REL) + 1e-12, (budget, best, relaxed)


@pytest.mark.parametrize("graph", list(HAND))
def test_hand_graphs_bound_at_or_below_their_optimum(graph: str) -> None:
    assert_bounds_brute_force(HAND[graph])


@settings(max_examples=40, deadline=None)
@given(small_problems())
def test_random_dags_bound_at_or_below_their_optimum(p: Problem) -> None:
    assert_bounds_brute_force(p)


@settings(max_examples=30, deadline=None)
@given(small_problems(max_forward=5, offload=True))
def test_random_dags_with_a_host_link_bound_at_or_below_their_optimum(p: Problem) -> None:
    assert_bounds_brute_force(p)


@settings(max_examples=20, deadline=None)
@given(loss_heads())
def test_random_loss_heads_bound_at_or_below_their_optimum(p: Problem) -> None:
    assert_bounds_brute_force(p)


def test_the_bound_is_exact_where_the_cheapest_value_must_go() -> None:
    """f0 -> f1 -> f2 (2, 3, 5 B; 1, 2, 4 s) and the gradients back: save-all peaks at
    15 B in the first backward step, which also holds f2 and the gradient of f2. Within
    13 B the 2 bytes of f0 must go, and recomputing f0 (1 s) is the cheapest way."""
    p = HAND["chain"].with_budget(13)
    assert cheapest(HAND_OUTCOMES["chain"], 13) == 1.0
    assert lower_bound(p).seconds == pytest.approx(1.0, rel=10 * REL)  # less SAFETY
    assert lower_bound(p).step == p.n_forward


def test_infinite_only_where_no_plan_fits() -> None:
    for name, p in HAND.items():
        outcomes = HAND_OUTCOMES[name]
        for budget in interesting_budgets(outcomes):
            if math.isinf(lower_bound(p.with_budget(budget)).seconds):
                assert cheapest(outcomes, budget) is None, (name, budget)
    assert lower_bound(HAND["chain"]).seconds == 0.0  # no budget
    assert lower_bound(HAND["chain"].with_budget(16)).step is None  # save-all fits: no step over it


def test_multilevel_plans_which_recompute_values_twice_are_bounded_too() -> None:
    """The relaxation holds for any plan the checker accepts, not only those that
    recompute each value once: on the 12-layer GPT below checkpointing every segment's
    peak, the multi-level plans (values recomputed twice) add at least the bound, which
    binds there."""
    p = deep_gpt()
    top = every_segment_peak(p)
    for fraction in (0.9, 0.8, 0.7):
        q = p.with_budget(int(fraction * top))
        result = multilevel.solve(q, SolverConfig(time_limit=5.0, workers=1))
        assert result.plan is not None and result.plan.multilevel
        report = check(q, result.plan)
        assert report.fits
        assert 0.0 < lower_bound(q).seconds <= report.added_time * (1 + REL)


def test_pressing_steps_are_those_over_the_budget() -> None:
    p = HAND["chain"].with_budget(13)
    steps = pressing_steps(p, baseline(p), 10)
    assert steps and steps[0] == p.n_forward  # save-all's peak, 2 B over
    assert all(every_step(p.with_budget(13)) >= step_bound(p, k) for k in steps)
    assert pressing_steps(p.with_budget(10**6), baseline(p), 10) == []


def test_the_planner_reports_the_relaxation_as_its_bound_at_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain route (problems of at least CHAIN_ONLY_CANDIDATES decisions) proves no
    bound of its own; it reports the relaxation's, below its plan."""
    monkeypatch.setattr(planner, "CHAIN_ONLY_CANDIDATES", 1)
    p = deep_gpt()
    every = checkpoint_every(p).report
    assert every is not None
    q = p.with_budget(every.peak)
    result = planner.solve(q, SolverConfig(time_limit=10.0, workers=2))
    assert result.plan is not None
    assert 0.0 < result.bound <= result.objective
    assert result.bound == pytest.approx(lower_bound(q).seconds, rel=REL)
    assert result.gap < 1.0


def test_the_least_budget_can_be_the_least_peak() -> None:
    """On the diamond, what every plan holds at some step is 13 B; the relaxation shows
    no plan fits under 17 B, which is the least peak."""
    p = HAND["diamond"]
    least = min(o.peak for o in HAND_OUTCOMES["diamond"])
    assert max(baseline(p)) == 13
    assert least_budget(p, 21) == least == 17


def test_an_unproven_least_budget_states_what_no_plan_fits_under(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the chain route, which proves no least peak, the error states the least found
    and the budget the relaxation shows no plan fits under."""
    monkeypatch.setattr(planner, "CHAIN_ONLY_CANDIDATES", 1)
    planner.forget_stated()
    p = deep_gpt()
    floor = max(baseline(p))
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.solve(p.with_budget(floor // 2), SolverConfig(time_limit=10.0, workers=2))
    e = info.value
    assert not e.proven and e.min_feasible is not None and e.at_least is not None
    assert floor <= e.at_least < e.min_feasible
    assert f"no plan fits under {e.at_least} bytes ({e.at_least / 2**20:.2f} MiB)" in str(e)
    planner.forget_stated()
