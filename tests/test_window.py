"""The window model (``solvers.singlephase.window``): exact over its window against brute force, and
the plan outside the window kept."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers import Plan, Problem, SolverConfig, Step, check
from solvers.problem import node
from solvers.sat import make_solver
from solvers.singlephase import local, window
from tests.graphs import P
from tests.test_anywhere import brute_force, plan_of, three_reads

CFG = SolverConfig(workers=1, time_limit=30.0)


def best(problem: Problem, copies: int) -> float | None:
    """The brute force's least added time within budget, None if no plan fits."""
    assert problem.budget is not None
    return min((o.added_time for o in brute_force(problem, copies) if o.peak <= problem.budget), default=None)


def dearest(problem: Problem) -> Plan | None:
    """The plan within budget that adds the most time, of those recomputing each value at
    most once (None if none fits): a start with the most for the polish to undo."""
    options = [[(), *(((v, b),) for b in range(v + 1, problem.last_step + 1))]
               for v in local.recomputable(problem)]
    plans = [plan_of(*(s for steps in choice for s in steps)) for choice in itertools.product(*options)]
    fitting = [(check(problem, q).added_time, i) for i, q in enumerate(plans) if check(problem, q).fits]
    return plans[max(fitting)[1]] if fitting else None


def whole(problem: Problem, start: Plan) -> Plan | None:
    """The window over every step: the model of the whole graph."""
    return window.solve_window(problem, start, 0, problem.last_step, CFG, 30.0).plan


def test_a_value_recomputed_twice() -> None:
    """Within 20 B ``a`` must be dead over both bursts: two recomputations, which the
    interval model with two copies cannot express; the window over the graph finds them."""
    p = three_reads().with_budget(20)
    found = whole(p, Plan({}))
    assert found is not None
    assert [(s.node, s.before) for s in found.schedule] == [(0, 3), (0, 6)]
    report = check(p, found)
    assert report.fits and report.added_time == best(p, 3) == 2.0


@st.composite
def tiny_dags(draw: st.DrawFn) -> Problem:
    """Up to 4 values, so the brute force can try every set of steps to recompute each
    value before (any number of recomputations)."""
    n = draw(st.integers(2, 4))
    nodes = []
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=2, unique=True)) if i else []
        nodes.append(node(f"v{i}", *deps, size=draw(st.integers(0, 6)), time=float(draw(st.integers(0, 4))),
                          recomputable=draw(st.integers(0, 4)) > 0))
    return P(*nodes)


@settings(max_examples=40, deadline=None)
@given(tiny_dags(), st.integers(0, 100))
def test_a_window_over_the_graph_is_exact(problem: Problem, pct: int) -> None:
    """From no plan at all, the window over the whole graph finds the brute force's
    optimum over any number of recomputations, or nothing when no plan fits."""
    peak = check(problem, Plan({})).peak
    p = problem.with_budget(peak * pct // 100)
    optimum = best(p, len(p.nodes))
    found = whole(p, Plan({}))
    if optimum is None:
        assert found is None
        return
    assert found is not None
    report = check(p, found)
    assert report.fits and report.added_time == pytest.approx(optimum)


def test_the_plan_outside_the_window_is_kept() -> None:
    """A window over the second burst only: ``a``'s recomputation before step 3 stays, and
    the window adds the one before step 6."""
    p = three_reads().with_budget(20)
    start = local.as_plan([Step(0, 3)])
    assert not check(p, start).fits
    found = window.solve_window(p, start, 4, 7, CFG, 30.0).plan
    assert found is not None
    assert [(s.node, s.before) for s in found.schedule] == [(0, 3), (0, 6)]
    assert check(p, found).fits


@settings(max_examples=25, deadline=None)
@given(tiny_dags(), st.one_of(st.just(100), st.integers(50, 99)))  # the plain peak leaves most to undo
def test_the_polish_widens_to_the_optimum(problem: Problem, pct: int) -> None:
    """From the dearest plan within budget (at most one recomputation per value), windows
    of 1 step double until one spans the graph: never dearer on the way, and the brute
    force's optimum (any number of recomputations) at the end."""
    p = problem.with_budget(check(problem, Plan({})).peak * pct // 100)
    start = dearest(p)
    if start is None:
        return
    polished = window.polish(p, start, CFG, 10.0, width=1)
    after, before = check(p, polished), check(p, start)
    assert after.fits and after.added_time <= before.added_time
    assert after.added_time == pytest.approx(best(p, len(p.nodes)))


@pytest.mark.parametrize(("budget", "kept"), [(24, [(0, 3)]), (20, [(0, 3), (0, 6)])])
def test_a_recomputation_in_the_window_of_a_value_dropped_before_it(budget: int, kept: list[tuple[int, int]]) -> None:
    """The window [6, 7] reads ``a``, which the incumbent drops after step 3 and recomputes
    before 6. Within 24 B the window keeps the copy over steps 4-5 instead (a bridge: 20 B
    of the second burst at step 5, plus ``a``'s 4); within 20 B that copy does not fit at
    step 5, before the window, so the recomputation stays."""
    p = three_reads().with_budget(budget)
    start = local.as_plan([Step(0, 3), Step(0, 6)])
    assert check(p, start).fits
    found = window.solve_window(p, start, 6, 7, CFG, 30.0).plan
    assert found is not None
    assert [(s.node, s.before) for s in found.schedule] == kept
    assert check(p, found).fits


def early_copy() -> Problem:
    """``p`` and ``q`` (4 B, 1 s each) are read at step 2 and again after a 20-byte burst
    (x, y) at steps 3-4: within 24 B only one of them may be in memory at step 4."""
    return P(
        node("p", size=4, time=1.0),  # 0
        node("q", size=4, time=1.0),  # 1
        node("r", 0, 1, size=0),  # 2 reads p and q
        node("x", size=10, time=5.0, recomputable=False),  # 3
        node("y", 3, size=10, time=5.0),  # 4
        node("s", 1, 4, size=0),  # 5 reads q
        node("t", 0, 1, size=1),  # 6 reads p and q
    ).with_budget(24)


def test_a_recomputation_before_the_window_whose_copy_is_first_read_in_it_is_undone() -> None:
    """The incumbent recomputes ``p`` before step 3, where nothing reads it until step 6,
    and ``q`` before step 5 (2 s). The window [4, 6] undoes ``p``'s recomputation (release),
    keeps ``q`` from step 2 (bridge) and recomputes ``p`` before step 6: 1 s. Without the
    release the copy made before step 3 must stay in memory at step 4, and the window
    can only trade one recomputation for the other."""
    p = early_copy()
    start = plan_of((0, 3), (1, 5))
    assert check(p, start).fits
    found = window.solve_window(p, start, 4, 6, CFG, 30.0).plan
    assert found is not None
    assert [(s.node, s.before) for s in found.schedule] == [(0, 6)]
    report = check(p, found)
    assert report.fits and report.added_time == 1.0 == best(p, 2)


def test_a_copy_stays_in_memory_only_until_its_last_read() -> None:
    """The free family: with no plan, ``p``'s last read is at step 6, and ``x``'s (read by
    ``y``) at step 4; a model that kept ``x`` at step 5 has no solution."""
    p = early_copy().with_budget(100)
    w = window.build(p, Plan({}), 0, p.last_step)
    assert (3, 5) in w.L
    w.cp.add(w.L[3, 5] == 1)
    assert cp_solve(w) == "INFEASIBLE"
    w = window.build(p, Plan({}), 0, p.last_step)
    w.cp.add(w.L[3, 4] == 1)
    assert cp_solve(w) == "OPTIMAL"


def cp_solve(w: window.Window) -> str:
    solver = make_solver(CFG)
    return solver.status_name(solver.solve(w.cp))


@settings(max_examples=40, deadline=None)
@given(tiny_dags(), st.integers(50, 100), st.data())
def test_any_window_of_a_plan_within_budget_stays_within_it(problem: Problem, pct: int, data: st.DataObject) -> None:
    """From the dearest plan within budget, any window's plan is within budget by the
    checker and adds no more time: the bridge, release and free families may only
    change the plan where the window's model accounts for every byte."""
    p = problem.with_budget(check(problem, Plan({})).peak * pct // 100)
    start = dearest(p)
    if start is None:
        return
    first = data.draw(st.integers(0, p.last_step))
    last = data.draw(st.integers(first, p.last_step))
    found = window.solve_window(p, start, first, last, CFG, 30.0).plan
    assert found is not None  # the incumbent itself is a solution
    after = check(p, found)
    assert after.fits and after.added_time <= check(p, start).added_time


def unit_chain(n: int, *, budget: int) -> Problem:
    """v0 -> v1 -> ... -> v{n-1}, 1 byte and 1 s each."""
    return P(node("v0", size=1), *(node(f"v{i}", i - 1, size=1) for i in range(1, n))).with_budget(budget)


@pytest.mark.parametrize("n", [21, 22, 23, 24])
def test_a_window_of_full_width_ends_at_the_last_step(n: int) -> None:
    """Windows laid out from the start every quarter width are cut short at the end, where
    most reads are, unless the steps divide evenly: one more ends at the last step."""
    p = unit_chain(n, budget=2)
    plan = Plan({})
    assert min(check(p, plan).timeline[1:]) == 2  # every step is at the budget: all in play
    spans = window.windows(p, plan, 8)
    assert (n - 8, n - 1) in spans
    assert all(b - a + 1 <= 8 for a, b in spans)


def test_windows_where_the_plan_spends_as_much_go_widest_first() -> None:
    """A wider window allows a narrower one's moves: of windows where the plan spends the
    same recomputation time, the widest is solved first (windows cut short at the end last)."""
    p = unit_chain(22, budget=2)
    spans = window.windows(p, Plan({}), 8)  # no recomputation: every window spends 0
    widths = [b - a + 1 for a, b in spans]
    assert min(widths) < 8 and widths == sorted(widths, reverse=True)


def test_a_window_solved_on_the_current_plan_is_not_solved_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first window's solve removes a useless recomputation; every window after it then
    sees the new plan, so the next pass solves none of them again but widens instead."""
    p = unit_chain(22, budget=2)
    useless = plan_of((0, 1))  # v0 made again for its one read, right after its own step
    assert check(p, useless).fits and check(p, useless).added_time > 0 == check(p, Plan({})).added_time
    calls: list[tuple[int, int]] = []

    def fake(problem: Problem, plan: Plan, first: int, last: int, *_: object) -> window.Solved:
        calls.append((first, last))
        return window.Solved(Plan({}) if len(calls) == 1 else plan, 0.01)

    monkeypatch.setattr(window, "solve_window", fake)
    assert window.polish(p, useless, CFG, 5.0, width=8) == Plan({})
    after = calls[1:]
    assert len(after) > 1 and len(after) == len(set(after))
