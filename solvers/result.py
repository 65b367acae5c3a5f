"""What every solver takes and returns: one config type, one result type, one error."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from solvers.checker import Report
from solvers.deadline import Deadline
from solvers.plan import Plan
from solvers.problem import Problem


class Status(enum.Enum):
    OPTIMAL = "optimal"  # proven best under the model
    FEASIBLE = "feasible"  # a plan within budget, optimality not proven (see gap)
    INFEASIBLE = "infeasible"  # proven: no plan fits the budget
    UNKNOWN = "unknown"  # the time limit hit before any plan or proof


@dataclass(frozen=True, kw_only=True)
class SolverConfig:
    time_limit: float = 60.0  # seconds of wall time for one solve
    workers: int = 0  # CP-SAT search workers; 0 = 8, its full portfolio (sharing the cores)
    seed: int = 0  # CP-SAT's and the local search's random seed (see ``deterministic``)
    relative_gap: float = 0.0  # stop once (objective - bound) / objective <= this
    # Stop once objective - bound <= this fraction of the step's estimated time (the sum of
    # all values' times): a plan provably within 1% of the step of the best is good enough
    # to train with, even where the relative gap on a tiny added time stays large.
    step_gap: float = 0.0
    # Stop once no better plan has been found for this many seconds (0: never). The
    # bound on these graphs rises far slower than the plans improve (a 45% budget on the
    # 6-layer GPT: the last better plan at 12-14 s, the gap limit never reached in 60 s), so
    # a search that has stopped improving mostly spends its time on the proof.
    stall_time: float = 0.0
    # Same problem, seed and workers, same plan, from run to run and under any load: CP-SAT
    # interleaves its workers in a fixed order (its ``interleave_search``) and every limit
    # counts work, not wall seconds: ``time_limit`` is in CP-SAT's deterministic seconds
    # (its measure of work, about a second of one core), the local search counts checker
    # replays, and ``stall_time`` (a wall-clock watch) is not used. Off by default: the
    # interleaved portfolio proves optimality more slowly (see the numbers in docs/solvers.md,
    # "Determinism").
    deterministic: bool = False
    log: bool = False  # CP-SAT's own search log to stderr
    # Offer plans that recompute a value more than once (solvers.multilevel) beside the
    # others. Off where a caller keeps a plan's decisions only (the chain model's options).
    multilevel: bool = True


@dataclass(frozen=True, kw_only=True)
class SolveResult:
    status: Status
    plan: Plan | None
    report: Report | None  # the checker's verdict on ``plan``
    objective: float  # seconds added by the plan (the checker's figure)
    bound: float  # seconds: no plan within budget adds less
    wall_time: float  # seconds spent solving
    solver: str
    stats: Mapping[str, float | int | str] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """Relative optimality gap, 0 when proven optimal."""
        if self.status is Status.OPTIMAL or self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


class InfeasibleBudgetError(ValueError):
    """No plan keeps the step's peak within the budget; says the smallest budget that works.

    ``plan``, when given, is a plan whose checked peak is ``min_feasible``: the figure is
    one in hand, so asking for that budget can reuse the plan instead of searching again.
    ``at_least``, when given for an unproven ``min_feasible``, is a budget no plan fits
    under (:func:`solvers.bound.least_budget`): the true minimum lies between the two."""

    def __init__(self, budget: int, min_feasible: int | None, *, proven: bool = True,
                 plan: Plan | None = None, where: str = "", at_least: int | None = None) -> None:
        self.budget = budget
        self.min_feasible = min_feasible
        self.proven = proven or (at_least is not None and min_feasible is not None and at_least >= min_feasible)
        self.at_least = None if self.proven or min_feasible is None else at_least
        self.plan = plan if min_feasible is not None else None
        if min_feasible is None:
            hint = "no smaller budget could be determined in the time limit"
        else:
            exact = ("" if self.proven else " (best found; the true minimum may be lower)" if self.at_least is None
                     else f" (best found; no plan fits under {self.at_least} bytes ({_mib(self.at_least)}))")
            hint = f"the smallest feasible budget is {min_feasible} bytes ({_mib(min_feasible)}){exact}"
        # ``where``: what the budget was for, when not the whole problem (a graph of a step).
        super().__init__(f"{where}budget {budget} bytes ({_mib(budget)}) cannot be met: {hint}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class Solver(Protocol):
    """Every solver: ``solve(problem, config) -> SolveResult``; budget from the problem."""

    def __call__(self, problem: Problem, config: SolverConfig, /) -> SolveResult: ...


class Planned(Protocol):
    """One of the planner's entry points: a solver that also takes the ``deadline`` of the
    solve it is part of (:mod:`solvers.deadline`), whose work it counts."""

    def __call__(self, problem: Problem, config: SolverConfig, /, *,
                 deadline: Deadline | None = None) -> SolveResult: ...


class Planner(NamedTuple):
    """The planner's two entry points (:mod:`solvers.planner`), handed to a solver that
    plans parts of a problem with the whole portfolio, as the chain model plans its
    segments: the planner runs that solver, so that solver cannot import the planner."""

    solve: Planned  # the cheapest plan within the problem's budget
    min_feasible_peak: Planned  # the plan of least peak
