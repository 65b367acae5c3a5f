"""The local search of single-phase plans (:mod:`solvers.singlephase.local`) and how CP-SAT's solve uses it.

Its plans are judged by the checker, never cost more than the plan it starts from, and are
the same for one seed when it stops by patience; on tiny graphs it is compared with the
brute force of ``tests.test_anywhere`` (at least as costly as the optimum, never below).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from solvers import (
    InfeasibleBudgetError,
    Plan,
    Problem,
    SolverConfig,
    Status,
    check,
)
from solvers.problem import node
from solvers.singlephase import anywhere, local
from tests.graphs import P
from tests.test_anywhere import brute_force, plan_of, small_dags, three_reads

CFG = SolverConfig(workers=1, time_limit=30.0)


def bursts(n: int) -> Problem:
    """``n`` values computed first and read one by one at the end, with a burst of scratch
    values between: within a budget below the plain peak (63 B at n = 8), some must be
    recomputed, and the cheapest per byte freed are the ones to pick."""
    nodes = [node(f"a{i}", size=4 + i % 3, time=1.0 + (i * 7) % 5) for i in range(n)]
    nodes += [node("x", size=12, time=1.0, recomputable=False), node("y", n, size=12, time=1.0)]
    nodes += [node(f"r{i}", i, n + 1 + i, size=1, time=1.0) for i in range(n)]  # reads a_i, then r_{i-1}
    return P(*nodes)


def test_improve_finds_a_plan_within_budget_no_dearer_than_the_greedy() -> None:
    p = bursts(8).with_budget(40)
    greedy = anywhere.greedy(p)
    assert greedy.plan is not None
    better = local.improve(p, greedy.plan, seconds=10.0)
    assert better is not None
    report = check(p, better)
    assert report.fits and report.added_time <= greedy.objective + 1e-12


def test_improve_starts_from_a_plan_over_budget() -> None:
    p = bursts(8).with_budget(40)
    better = local.improve(p, Plan({}), seconds=10.0)
    assert better is not None and check(p, better).fits


def test_improve_is_deterministic_for_a_seed() -> None:
    p = bursts(10).with_budget(44)
    plans = [local.improve(p, Plan({}), seconds=60.0, seed=3, patience=50) for _ in range(2)]
    assert plans[0] is not None and plans[0].schedule == plans[1].schedule


def test_improve_returns_none_when_it_finds_nothing_within_budget() -> None:
    # Within 20 B a must be recomputed twice; the local search recomputes a value once.
    assert local.improve(three_reads().with_budget(20), Plan({}), seconds=5.0) is None


def dead_input() -> Problem:
    """x (4 B) is read by y at once and by z at the end, over a 20 B burst (25 B live
    there against a 24 B budget); its input s (10 B) is dead by then. Recomputing x alone
    before z would keep s alive over the burst instead (31 B); recomputing s and x
    together frees x's 4 B."""
    return P(node("s", size=10, time=0.5), node("x", 0, size=4), node("y", 1, size=1),
             node("big", 2, size=20, recomputable=False), node("w", 3, size=1),
             node("z", 1, 4, size=1))


def test_the_repair_recomputes_a_dead_input_with_its_reader() -> None:
    p = dead_input().with_budget(24)
    assert not check(p, Plan({})).fits
    steps, report = local.repair(p, [])
    assert report.fits and sorted((s.node, s.before) for s in steps) == [(0, 5), (1, 5)]
    best = min(o.added_time for o in brute_force(p, 2) if o.peak <= 24)
    assert report.added_time == pytest.approx(best)


def test_drop_removes_what_the_plan_fits_without() -> None:
    p = three_reads().with_budget(24)
    plan = plan_of((0, 6), (2, 3))  # recomputing y1 frees nothing that matters here
    kept = local.drop(p, list(plan.schedule))
    assert check(p, local.as_plan(kept)).fits
    assert len(kept) < len(plan.schedule)


@settings(max_examples=25, deadline=None)
@given(small_dags(), st.integers(0, 100))
def test_improve_is_never_below_the_optimum_and_always_fits(problem: Problem, pct: int) -> None:
    outcomes = brute_force(problem, 2)
    budget = max(o.peak for o in outcomes) * pct // 100
    q = problem.with_budget(budget)
    found = local.improve(q, Plan({}), seconds=5.0, patience=20)
    feasible = [o.added_time for o in outcomes if o.peak <= budget]
    if found is None:
        return
    report = check(q, found)
    assert report.fits
    assert feasible and report.added_time >= min(feasible) - 1e-9


def test_solve_returns_the_local_search_plan_when_cp_sat_finds_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """A search stopped before its first plan still returns the seed, judged by the checker."""
    p = bursts(8).with_budget(40)
    real_search = anywhere.search
    codes: list[int] = []

    def stopped(solver: cp_model.CpSolver, cp: cp_model.CpModel, config: SolverConfig, watch: object) -> int:
        solver.parameters.max_deterministic_time = 0.0  # no time to find anything
        codes.append(real_search(solver, cp, config, None))
        return codes[-1]

    monkeypatch.setattr(anywhere, "search", stopped)
    result = anywhere.solve(p, CFG)
    assert codes == [cp_model.UNKNOWN]
    assert result.plan is not None and check(p, result.plan).fits
    assert result.status is Status.FEASIBLE


def test_a_proven_optimum_is_not_polished(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Plan] = []
    real = local.improve

    def counting(problem: Problem, start: Plan, **kw: object) -> Plan | None:
        calls.append(start)
        return real(problem, start, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(local, "improve", counting)
    result = anywhere.solve(three_reads().with_budget(24), CFG)
    assert result.status is Status.OPTIMAL
    assert len(calls) == 1  # the seed's search only


def test_an_infeasible_budget_still_names_the_least_one() -> None:
    with pytest.raises(InfeasibleBudgetError) as info:
        anywhere.solve(three_reads().with_budget(20), dataclasses.replace(CFG, time_limit=10.0))
    assert info.value.min_feasible == 24
