"""Plans that need no search, with the same signature and result type as every solver."""

from __future__ import annotations

import time

from solvers.checker import Report, check
from solvers.plan import Decision, Plan, needed_values, plan_from_decisions
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


def greedy(problem: Problem, config: SolverConfig = SolverConfig()) -> SolveResult:  # noqa: B008 (SolverConfig is frozen: one shared default is safe)
    """Recompute the cheapest seconds-per-byte values first until the checker's peak fits,
    then un-recompute the most expensive ones that are not needed to fit.

    Any set of recomputed values gives a valid plan when everything else the backward
    (or a recomputation) reads is saved, so each step is one checker replay: about
    2·|candidates| replays in all. Status FEASIBLE with a plan when it fits, else
    INFEASIBLE (greedy proves nothing: the budget may still be feasible).
    """
    t0 = time.perf_counter()
    order = sorted(
        (v for v in problem.candidates if problem.nodes[v].recomputable and problem.nodes[v].size),
        key=lambda v: (problem.nodes[v].time / problem.nodes[v].size, v),
    )
    recomputed: set[int] = set()

    def replay(rec: set[int]) -> Report:
        return check(problem, plan_with(problem, rec))

    report = replay(recomputed)
    for v in order:
        if report.fits:
            break
        trial = replay(recomputed | {v})
        if trial.peak <= report.peak:
            recomputed.add(v)
            report = trial
    if report.fits:
        for v in sorted(recomputed, key=lambda v: -problem.nodes[v].time):
            trial = replay(recomputed - {v})
            if trial.fits:
                recomputed.discard(v)
                report = trial
    plan = plan_with(problem, recomputed)
    return SolveResult(
        status=Status.FEASIBLE if report.fits else Status.INFEASIBLE,
        plan=plan if report.fits else None,
        report=report,
        objective=report.added_time,
        bound=0.0,
        wall_time=time.perf_counter() - t0,
        solver="greedy",
    )


def plan_with(problem: Problem, recomputed: set[int]) -> Plan:
    """Recompute ``recomputed``; save everything else the backward or they read."""
    rec = set(recomputed)
    while True:  # a recomputed value nothing reads is dropped, and then what only it read
        needed = needed_values(problem, rec)
        if rec <= needed:
            break
        rec &= needed
    decisions = {v: Decision.SAVE for v in needed}
    decisions.update({v: Decision.RECOMPUTE for v in rec})
    return plan_from_decisions(problem, decisions)
