"""The no-budget plan under a fusing compiler (``solvers.free``): the least peak over plans
that recompute only free values, brute-forced on small graphs."""

from __future__ import annotations

from itertools import chain, combinations

from hypothesis import given, settings

from solvers import Decision, Problem, SolverConfig, Status, check
from solvers.baselines import free_recompute, free_values, plan_with
from solvers.free import floor, least_peak_free, only_free
from solvers.problem import node
from tests.test_cpsat import small_problems

CFG = SolverConfig(workers=1)

# b and c cost one launch (free). The peak is at gd, before c is read: recomputing c there
# needs b, which the backward saves anyway; recomputing b needs a, four times its size.
PICKY = Problem(nodes=(
    node("x", size=1, resident=True),
    node("a", 0, size=8, time=5.0),
    node("b", 1, size=2, time=1.0),
    node("c", 2, size=4, time=1.0),
    node("d", 3, size=1, time=5.0),
    node("gd", 4, size=10, backward=True),
    node("e", 5, size=1, backward=True),
    node("gc", 3, 6, size=1, backward=True),
    node("gb", 2, 7, size=1, backward=True),
    node("ga", 8, size=1, backward=True, keep=True),
))


def by_brute_force(problem: Problem) -> tuple[int, float]:
    """The least peak over every subset of free values recomputed, and the least added
    time among the subsets that reach it."""
    free = sorted(free_values(problem))
    subsets = chain.from_iterable(combinations(free, k) for k in range(len(free) + 1))
    reports = [check(problem, plan_with(problem, set(s))) for s in subsets]
    least = min(r.peak for r in reports)
    return least, min(r.added_time for r in reports if r.peak == least)


def least_by_brute_force(problem: Problem) -> int:
    return by_brute_force(problem)[0]


def test_where_flops_are_recorded_the_free_values_are_those_computing_none() -> None:
    """A captured problem: the matmul is cheap but computes FLOPs; the tanh and the
    LayerNorm output it feeds cost a transcendental pass and a memory pass, but none. A
    problem recording no FLOPs (PICKY) keeps the least-time rule."""
    captured = Problem(nodes=(
        node("x", size=1, resident=True),
        node("norm", 0, size=8, time=3e-3),
        node("mm", 1, size=8, time=1e-3, flops=2e8),
        node("tanh", 2, size=8, time=8e-3),
        node("grad", 3, size=8, backward=True),
        node("gx", 1, 2, 4, size=1, backward=True, keep=True),
    ))
    assert free_values(captured) == {1, 3}
    assert free_values(captured, free_time=1e-3) == {2}
    assert free_values(PICKY) == {2, 3}


def test_some_free_values_not_all() -> None:
    """Recomputing every free value keeps ``a`` for ``b``: higher than recomputing
    nothing, so the all-or-nothing plan recomputes nothing; recomputing ``c`` alone is
    lower than both."""
    assert free_values(PICKY) == {2, 3}
    nothing = check(PICKY, plan_with(PICKY, set())).peak
    every = check(PICKY, plan_with(PICKY, {2, 3})).peak
    only_c = check(PICKY, plan_with(PICKY, {3})).peak
    assert only_c < nothing < every
    baseline = free_recompute(PICKY, CFG).report
    result = least_peak_free(PICKY, CFG)
    assert baseline is not None and result.report is not None and result.plan is not None
    assert baseline.peak == nothing
    assert result.report.peak == only_c == least_by_brute_force(PICKY)
    assert result.plan.of(Decision.RECOMPUTE) == (3,)
    assert result.status is Status.OPTIMAL and result.solver == "free_least_peak"


def test_over_the_budget_is_no_plan() -> None:
    least = least_by_brute_force(PICKY)
    result = least_peak_free(PICKY.with_budget(least - 1), CFG)
    assert result.status is Status.INFEASIBLE and result.plan is None
    assert result.report is not None and result.report.peak == least
    assert least_peak_free(PICKY.with_budget(least), CFG).plan is not None


@settings(max_examples=60, deadline=None)
@given(small_problems())
def test_least_peak_equals_brute_force(problem: Problem) -> None:
    """The least peak over every subset of free values, no recomputation it can do
    without, and never above the all-or-nothing plan's peak."""
    result = least_peak_free(problem, CFG)
    assert result.report is not None and result.plan is not None
    least, seconds = by_brute_force(problem)
    assert result.report.peak == least and result.report.added_time >= seconds - 1e-9
    kept = set(result.plan.of(Decision.RECOMPUTE))
    for v in kept:
        assert check(problem, plan_with(problem, kept - {v})).peak > least
    assert floor(only_free(problem, free_values(problem))) <= least  # a lower bound
    assert set(result.plan.of(Decision.RECOMPUTE)) <= free_values(problem)
    baseline = free_recompute(problem, CFG).report
    assert baseline is not None and result.report.peak <= baseline.peak
