"""Plans that need no search, with the same signature and result type as every solver."""

from __future__ import annotations

import time

from solvers.checker import check
from solvers.plan import Decision, plan_from_decisions
from solvers.problem import Problem
from solvers.result import SolverConfig, SolveResult, Status


def save_all(problem: Problem, config: SolverConfig = SolverConfig()) -> SolveResult:  # noqa: B008 (SolverConfig is frozen: one shared default is safe)
    """Save every value the backward reads, recompute nothing: what autograd does.

    Its checker peak is the *unconstrained* activation memory that fractional budgets
    ("40%") refer to. Status is FEASIBLE when it fits the budget (it is optimal then: it
    adds no time), INFEASIBLE otherwise.
    """
    t0 = time.perf_counter()
    decisions = {v: Decision.SAVE for v in problem.candidates if problem.backward_uses[v]}
    plan = plan_from_decisions(problem, decisions)
    report = check(problem, plan)
    return SolveResult(
        status=Status.OPTIMAL if report.fits else Status.INFEASIBLE,
        plan=plan if report.fits else None,
        report=report,
        objective=0.0,
        bound=0.0,
        wall_time=time.perf_counter() - t0,
        solver="save_all",
    )
