"""Which solver a problem gets: the one entry point for solving a :class:`Problem`.

A problem with a backward goes to :mod:`solvers.cpsat`; a single-phase problem (no
backward) to :mod:`solvers.singlephase.anywhere`. Each function has the contract of its
:mod:`solvers.cpsat` namesake; ``prepare`` and ``finish`` split :func:`solve` for callers
that run the search themselves (:mod:`solvers.progress`).
"""

from __future__ import annotations

from collections.abc import Callable

from ortools.sat.python import cp_model

from solvers import cpsat
from solvers.plan import Plan
from solvers.problem import Problem
from solvers.result import SolverConfig, SolveResult
from solvers.singlephase import anywhere

Model = cpsat.Model | anywhere.Model


def solve(problem: Problem, config: SolverConfig = SolverConfig()) -> SolveResult:
    """The cheapest plan within ``problem.budget`` (:func:`solvers.cpsat.solve`)."""
    if problem.single_phase:
        return anywhere.solve(problem, config)
    return cpsat.solve(problem, config)


def min_feasible_peak(problem: Problem, config: SolverConfig = SolverConfig()) -> SolveResult:
    """The plan with the smallest peak (:func:`solvers.cpsat.min_feasible_peak`)."""
    if problem.single_phase:
        return anywhere.min_feasible_peak(problem, config)
    return cpsat.min_feasible_peak(problem, config)


def known_only(problem: Problem, config: SolverConfig) -> SolveResult | None:
    """:func:`solvers.cpsat.known_only`; None for a single-phase problem (always searched)."""
    return None if problem.single_phase else cpsat.known_only(problem, config)


def prepare(problem: Problem, config: SolverConfig, *, on_best: Callable[[Plan, float], None] | None = None
            ) -> tuple[Model, cp_model.CpSolver]:
    """The model and a configured solver (:func:`solvers.cpsat.prepare`). A single-phase
    problem's local search runs first and tells ``on_best`` each better plan it finds."""
    if problem.single_phase:
        return anywhere.prepare(problem, config, on_best=on_best)
    return cpsat.prepare(problem, config)


def finish(problem: Problem, config: SolverConfig, model: Model, solver: cp_model.CpSolver,
           code: cp_model.CpSolverStatus, *, started: float, stalled: bool = False,
           interrupted: bool = False) -> SolveResult:
    """The result of a finished or stopped search (:func:`solvers.cpsat.finish`).
    ``interrupted``: stopped by the user, so a single-phase solve skips its polish."""
    if isinstance(model, anywhere.Model):
        return anywhere.finish(problem, config, model, solver, code, started=started, stalled=stalled,
                               interrupted=interrupted)
    return cpsat.finish(problem, config, model, solver, code, started=started, stalled=stalled)
