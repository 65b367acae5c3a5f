"""Torch-free rematerialization planning: the problem IR, plans, the checker and solvers.

Nothing in this package imports torch; problems come from :mod:`rematc` or from files.
"""

from solvers.baselines import save_all
from solvers.checker import Report, check
from solvers.io import (
    load_plan,
    load_problem,
    plan_from_json,
    plan_to_json,
    problem_from_json,
    problem_to_json,
    save_plan,
    save_problem,
)
from solvers.plan import Decision, Plan, PlanError, Step, Transfer, plan_from_decisions
from solvers.planner import min_feasible_peak, solve
from solvers.problem import Copy, Node, Problem, ProblemError, Scale
from solvers.result import InfeasibleBudgetError, SolverConfig, SolveResult, Status

__all__ = [
    "Copy",
    "Decision",
    "InfeasibleBudgetError",
    "Node",
    "Plan",
    "PlanError",
    "Problem",
    "ProblemError",
    "Report",
    "Scale",
    "SolveResult",
    "SolverConfig",
    "Status",
    "Step",
    "Transfer",
    "check",
    "load_plan",
    "load_problem",
    "min_feasible_peak",
    "plan_from_decisions",
    "plan_from_json",
    "plan_to_json",
    "problem_from_json",
    "problem_to_json",
    "save_all",
    "save_plan",
    "save_problem",
    "solve",
]
