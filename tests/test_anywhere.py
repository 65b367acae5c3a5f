"""Single-phase graphs (no backward): the checker's rules, and the exact model against brute force.

The brute force enumerates, for every value worth recomputing, every set of at most
``copies - 1`` steps to recompute it before, replays each plan on the checker and takes the
cheapest within budget; CP-SAT must reach the same objective with a plan the checker puts
within budget, and explain an infeasible budget with the brute force's smallest peak.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers import (
    Decision,
    InfeasibleBudgetError,
    Plan,
    PlanError,
    Problem,
    SolverConfig,
    Status,
    Step,
    Transfer,
    check,
    cpsat,
    min_feasible_peak,
    solve,
)
from solvers.problem import node
from solvers.singlephase import anywhere, local
from tests.graphs import P

R = Decision.RECOMPUTE
CFG = SolverConfig(workers=1, time_limit=30.0)


def three_reads() -> Problem:
    """``a`` (4 B, 1 s) is read at steps 3, 6 and 7; two 20-byte bursts (x_i, y_i) lie
    between. Within 20 B, ``a`` must be dead over both bursts: recomputed twice. (The x_i
    are not recomputable, which keeps the brute force small.)"""
    return P(
        node("a", size=4, time=1.0),  # 0
        node("x1", size=10, time=5.0, recomputable=False),  # 1
        node("y1", 1, size=10, time=5.0),  # 2
        node("u1", 0, 2, size=0, time=1.0),  # 3 reads a
        node("x2", size=10, time=5.0, recomputable=False),  # 4
        node("y2", 4, size=10, time=5.0),  # 5
        node("u2", 0, 5, size=0, time=1.0),  # 6 reads a
        node("out", 0, 3, 6, size=1, time=1.0),  # 7 reads a
    )


def plan_of(*steps: tuple[int, int]) -> Plan:
    return local.as_plan([Step(v, b) for v, b in steps])


# ---- the checker on single-phase problems ---------------------------------------------


def test_a_recomputed_value_lives_from_each_copy_to_the_reads_it_serves() -> None:
    p = three_reads()
    assert p.single_phase
    plain = check(p, Plan({}))
    assert plain.peak == 24  # a + x1 + y1 at step 2
    report = check(p, plan_of((0, 3), (0, 6)))
    assert report.peak == 20 and report.n_recomputed == 2 and report.added_time == 2.0
    # a: its own step only, then [3, 3] for u1, then [6, 7] for u2 and out.
    assert report.timeline[0] == 4 and report.timeline[1] == 10 and report.timeline[3] == 14


def test_a_read_takes_the_latest_copy() -> None:
    p = three_reads()
    once = check(p, plan_of((0, 6)))
    # The original serves step 3; the copy made before step 6 serves 6 and 7.
    assert once.timeline[5] == 20 + 0 and once.timeline[2] == 24


@pytest.mark.parametrize(
    ("plan", "words"),
    [
        (plan_of((0, 0)), "after the value's own"),
        (Plan({0: R}), "never scheduled"),
        (Plan({}, (Step(0, 3),)), "not recomputed"),
        (Plan({0: R}, (Step(0, 6), Step(0, 3))), "in order"),
        (Plan({0: Decision.OFFLOAD}, (Step(0, 3),), (Transfer(0, 1, 2),)), "no backward"),
        (Plan({99: R}), "no such value"),
    ],
)
def test_bad_single_phase_plans_are_named(plan: Plan, words: str) -> None:
    with pytest.raises(PlanError, match=words):
        check(three_reads(), plan)


# ---- the exact model against brute force ---------------------------------------------


class Outcome(NamedTuple):
    peak: int
    added_time: float


def brute_force(problem: Problem, copies: int) -> list[Outcome]:
    """Every plan with up to ``copies - 1`` recomputations of each value worth one."""
    last = problem.last_step
    options = []
    for v in anywhere.recomputable(problem):
        later = range(v + 1, last + 1)
        options.append([tuple((v, b) for b in bs) for n in range(copies) for bs in itertools.combinations(later, n)])
    assert len(list(itertools.product(*options))) <= 50_000, "brute force is for toys"
    out = []
    for choice in itertools.product(*options):
        report = check(problem, plan_of(*(s for steps in choice for s in steps)))
        out.append(Outcome(report.peak, report.added_time))
    return out


def assert_matches_brute_force(problem: Problem, budget: int, outcomes: list[Outcome], copies: int) -> None:
    q = problem.with_budget(budget)
    best = min((o.added_time for o in outcomes if o.peak <= budget), default=None)
    if best is None:
        with pytest.raises(InfeasibleBudgetError) as info:
            anywhere.solve(q, CFG, copies=copies)
        assert info.value.min_feasible == min(o.peak for o in outcomes)
        return
    result = anywhere.solve(q, CFG, copies=copies)
    assert result.status is Status.OPTIMAL
    assert result.objective == pytest.approx(best, rel=1e-6)
    assert result.plan is not None and check(q, result.plan).peak <= budget


@pytest.mark.parametrize("copies", [2, 3])
def test_two_recomputations_when_they_pay(copies: int) -> None:
    p = three_reads()
    outcomes = brute_force(p, copies)
    for budget in sorted({o.peak for o in outcomes} | {19, 20, 21}):
        assert_matches_brute_force(p, budget, outcomes, copies)
    if copies == 3:
        result = anywhere.solve(p.with_budget(20), CFG, copies=3)
        assert result.plan is not None
        assert [s.node for s in result.plan.schedule] == [0, 0]  # a, twice


def test_solve_routes_single_phase_problems_here() -> None:
    # One recomputation of a always leaves it live over one burst: 24 B is the least with
    # two copies, and solve() says so, through this module's model.
    assert min_feasible_peak(three_reads(), CFG).report.peak == 24
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget is 24 bytes"):
        solve(three_reads().with_budget(20), CFG)
    result = solve(three_reads().with_budget(24), CFG)
    assert result.solver == "cpsat-anywhere" and result.status is Status.OPTIMAL
    assert result.objective == 0.0


def test_the_two_phase_model_leaves_single_phase_problems_to_the_planner() -> None:
    """:mod:`solvers.cpsat` imports nothing of :mod:`solvers.singlephase` and refuses a
    single-phase problem; :mod:`solvers.planner` is where the two meet."""
    source = Path(cpsat.__file__).read_text(encoding="utf-8")
    imported = [n.module or "" for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names]
    assert imported and not [m for m in imported if "singlephase" in m]
    with pytest.raises(ValueError, match="single-phase"):
        cpsat.prepare(three_reads().with_budget(24), CFG)

@st.composite
def small_dags(draw: st.DrawFn) -> Problem:
    n = draw(st.integers(2, 6))
    nodes = []
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=2, unique=True)) if i else []
        nodes.append(node(f"v{i}", *deps, size=draw(st.integers(0, 6)),
                          time=float(draw(st.integers(0, 4))),
                          recomputable=draw(st.integers(0, 4)) > 0))
    return P(*nodes)


@settings(max_examples=25, deadline=None)
@given(small_dags(), st.integers(0, 100))
def test_random_single_phase_graphs_match_brute_force(problem: Problem, pct: int) -> None:
    outcomes = brute_force(problem, 2)
    budget = max(o.peak for o in outcomes) * pct // 100
    assert_matches_brute_force(problem, budget, outcomes, 2)


@settings(max_examples=15, deadline=None)
@given(small_dags(), st.integers(0, 100), st.integers(0, 20))
def test_a_larger_budget_never_costs_more(problem: Problem, pct: int, more: int) -> None:
    peak = check(problem, Plan({})).peak
    low, high = peak * pct // 100, peak * pct // 100 + more
    try:
        tight = anywhere.solve(problem.with_budget(low), CFG)
    except InfeasibleBudgetError:
        return
    loose = anywhere.solve(problem.with_budget(high), CFG)
    assert loose.objective <= tight.objective + 1e-9


def test_the_greedy_seed_is_judged_by_the_checker() -> None:
    p = three_reads()
    fits = anywhere.greedy(p.with_budget(24))
    assert fits.plan is not None and check(p.with_budget(24), fits.plan).fits
    assert anywhere.greedy(p.with_budget(20)).plan is None  # needs two copies of a: no plan


def test_a_chain_is_recomputed_when_its_reader_is() -> None:
    """``b`` is read again at the end; so is ``a``'s only reader. Within 7 B, ``a`` (read
    only at the next step) must be recomputed to recompute ``b``."""
    p = P(
        node("a", size=3, time=1.0),  # 0
        node("b", 0, size=2, time=1.0),  # 1
        node("big", size=5, time=1.0, recomputable=False),  # 2
        node("c", 2, size=1, time=1.0),  # 3
        node("out", 1, 3, size=1, time=1.0),  # 4 reads b
    )
    outcomes = brute_force(p, 2)
    for budget in sorted({o.peak for o in outcomes}):
        assert_matches_brute_force(p, budget, outcomes, 2)
    result = anywhere.solve(p.with_budget(7), CFG)
    assert result.plan is not None and set(result.plan.decisions) == {0, 1}


def assert_hint_is_a_solution(problem: Problem, copies: int) -> None:
    """The model's own optimal plan, read back by :func:`anywhere.hint` into a fresh model
    with every hinted variable fixed, is a solution with the same schedule: the hint sets
    every copy, read and interval end as the checker reads the plan (a wrong one leaves
    the fixed model infeasible)."""
    try:
        result = anywhere.solve(problem, CFG, copies=copies)
    except InfeasibleBudgetError:
        return
    assert result.plan is not None
    m = anywhere.build(problem, copies=copies)
    anywhere.hint(m, result.plan)
    solver = anywhere.make_solver(CFG)
    solver.parameters.fix_variables_to_their_hinted_value = True
    code = solver.solve(m.cp)
    assert solver.status_name(code) in ("OPTIMAL", "FEASIBLE")
    assert anywhere.extract_plan(m, solver).schedule == result.plan.schedule


@pytest.mark.parametrize("copies", [2, 3])
def test_the_hint_of_a_plan_is_a_solution(copies: int) -> None:
    p = three_reads()
    for budget in (20, 21, 24):
        assert_hint_is_a_solution(p.with_budget(budget), copies)


@settings(max_examples=20, deadline=None)
@given(small_dags(), st.integers(0, 100))
def test_the_hint_of_a_random_plan_is_a_solution(problem: Problem, pct: int) -> None:
    peak = check(problem, Plan({})).peak
    assert_hint_is_a_solution(problem.with_budget(peak * pct // 100), 2)
