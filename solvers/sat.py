"""CP-SAT plumbing every search shares: the configured solver, its limit within a solve's
deadline (:mod:`solvers.deadline`) and its work counted there, bounds in seconds, search
statistics. Imports none of the solvers."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from solvers.checker import check
from solvers.deadline import Deadline
from solvers.plan import Plan
from solvers.problem import Problem
from solvers.result import SolverConfig, SolveResult, Status

PORTFOLIO_WORKERS = 8  # CP-SAT search workers when the config says 0
# The most workers a config may ask for: more than the cores of any one machine, which
# extra workers would only share (CP-SAT itself rejects its model above 10000).
MAX_WORKERS = 1024
MAX_SEED = 2**31 - 1  # CP-SAT's random_seed is a 32-bit int
# Seconds a CP-SAT solve gets at least where a deadline leaves less: with none it returns no
# plan, not even its hint's (a 45-decision span at checkpointing's peak: UNKNOWN at 0 and
# 0.01 s, its hint's plan at 0.05 s).
LEAST_SOLVE = 0.05


def make_solver(config: SolverConfig) -> cp_model.CpSolver:
    s = cp_model.CpSolver()
    limit(s, config, config.time_limit)
    # CP-SAT's portfolio needs about 8 workers to include its LP-heavy and LNS workers; on
    # fewer cores the workers share them (docs/solvers.md, "Workers").
    s.parameters.num_workers = config.workers or PORTFOLIO_WORKERS
    s.parameters.random_seed = config.seed
    s.parameters.relative_gap_limit = config.relative_gap
    s.parameters.log_search_progress = config.log
    # CP-SAT otherwise installs its own SIGINT handler for the rest of the process: a
    # later Ctrl-C in the user's training loop would end the process without a
    # KeyboardInterrupt. Interrupting a search is the caller's business (solvers.progress).
    s.parameters.catch_sigint_signal = False
    # Workers run in batches in a fixed order, sharing what they learn only between
    # batches, so the search no longer depends on which thread gets a core first.
    s.parameters.interleave_search = config.deterministic
    return s


def limit(solver: cp_model.CpSolver, config: SolverConfig, seconds: float, wall: float = math.inf) -> None:
    """Stop ``solver`` after ``seconds``: of wall time, or of CP-SAT's deterministic time
    under ``config.deterministic``, and then after ``wall`` seconds of wall time only as a
    backstop (a wall-clock limit that stops it makes the plan depend on the machine's
    load)."""
    if config.deterministic:
        solver.parameters.max_deterministic_time = seconds
        solver.parameters.max_time_in_seconds = max(LEAST_SOLVE, wall) if math.isfinite(wall) else math.inf
    else:
        solver.parameters.max_time_in_seconds = seconds


def spent(config: SolverConfig, started: float, work: float) -> float:
    """What a solve has used of its time limit since ``started``: wall seconds, or under
    ``config.deterministic`` the ``work`` its stages counted (deterministic seconds)."""
    return work if config.deterministic else time.perf_counter() - started


def within(solver: cp_model.CpSolver, config: SolverConfig, deadline: Deadline, seconds: float = math.inf) -> None:
    """Stop ``solver`` at ``seconds`` or at what is left of ``deadline``, whichever is less
    (``LEAST_SOLVE`` at least)."""
    limit(solver, config, max(LEAST_SOLVE, min(seconds, deadline.left())), wall=deadline.wall_left())


def solved(solver: cp_model.CpSolver, cp: cp_model.CpModel, deadline: Deadline,
           callback: cp_model.CpSolverSolutionCallback | None = None) -> cp_model.CpSolverStatus:
    """``solver.solve(cp)``, its deterministic seconds counted against ``deadline``."""
    try:
        return solver.solve(cp, callback) if callback is not None else solver.solve(cp)
    finally:
        deadline.count(solver.deterministic_time)


def make_peak_solver(config: SolverConfig) -> cp_model.CpSolver:
    """:func:`make_solver` for a minimum-peak search: no gap limit. CP-SAT answers OPTIMAL
    when it stops at a gap limit, and a minimum-peak search's OPTIMAL is read as the proof
    of the least feasible budget."""
    return make_solver(replace(config, relative_gap=0.0))


@dataclass(frozen=True)
class Incumbent:
    """A better plan a search found, as a status line shows it (:func:`latest`)."""

    added: float | None  # seconds the plan adds; None where its search did not say how to read it
    bound: float | None  # seconds no plan adds less than, the same
    gap: float  # (objective - bound) / objective
    at: float  # time.perf_counter() when it was found


_LATEST: list[Incumbent] = []  # the last one of this process, under _LATEST_LOCK
_LATEST_LOCK = threading.Lock()


def latest(*, since: float = -math.inf) -> Incumbent | None:
    """The last better plan any search of this process found, if at or after ``since``
    (a ``time.perf_counter()`` reading)."""
    with _LATEST_LOCK:
        found = _LATEST[-1] if _LATEST else None
    return found if found is not None and found.at >= since else None


class Watch(cp_model.CpSolverSolutionCallback):
    """Counts the incumbents of a search and when the last one was found (CP-SAT calls
    this from its worker threads once per better plan), and publishes each to
    :func:`latest`, its objective read as seconds by ``seconds`` where given."""

    def __init__(self, seconds: Callable[[float], float] | None = None) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.solutions = 0
        self.last_found = time.perf_counter()
        self.stalled = False  # stopped by ``stall_time``, set by :func:`search`
        self.seconds = seconds

    def on_solution_callback(self) -> None:
        now = time.perf_counter()
        with self.lock:
            self.solutions += 1
            self.last_found = now
        objective, bound = self.ObjectiveValue(), self.BestObjectiveBound()
        found = Incumbent(added=self.seconds(objective) if self.seconds else None,
                          bound=self.seconds(bound) if self.seconds else None,
                          gap=abs(objective - bound) / max(abs(objective), 1e-9), at=now)
        with _LATEST_LOCK:
            _LATEST[:] = [found]


def search(solver: cp_model.CpSolver, cp: cp_model.CpModel, config: SolverConfig,
           watch: Watch | None = None, *, seeded: bool = False,
           tick: float = 0.1, deadline: Deadline | None = None) -> cp_model.CpSolverStatus:
    """``solver.solve(cp)``, stopped once ``config.stall_time`` seconds pass after the last
    better plan (never before the first; ``seeded``: a plan is in hand from the start, the
    seed the model is hinted with, which CP-SAT may never report as its own). CP-SAT has
    no such limit of its own: a thread beside the search watches the incumbents and calls
    ``stop_search``. Not under ``config.deterministic``: when a wall-clock watch stops the
    search depends on the load. Its deterministic seconds count against ``deadline``."""
    def run() -> cp_model.CpSolverStatus:
        if deadline is not None:
            return solved(solver, cp, deadline, watch)
        return solver.solve(cp, watch) if watch is not None else solver.solve(cp)

    if config.stall_time <= 0 or config.deterministic:
        return run()
    watch = watch if watch is not None else Watch()
    done = threading.Event()

    def stop_when_stalled() -> None:
        while not done.wait(tick):
            with watch.lock:
                found = watch.solutions > 0 or seeded
                stalled = found and time.perf_counter() - watch.last_found > config.stall_time
            if stalled:
                watch.stalled = True
                solver.stop_search()
                return

    guard = threading.Thread(target=stop_when_stalled, name="cpsat-stall", daemon=True)
    guard.start()
    try:
        return run()
    finally:
        done.set()
        guard.join()


def objective_seconds(tie_break: int, problem: Problem, objective_bound: float) -> float:
    """An objective bound in seconds: objectives are T·time + (count < T), time in
    ``problem.scale`` units; drop the tie-break term."""
    units = objective_bound // tie_break
    return float(units) * problem.scale.seconds_per_unit


def proven_optimal(code: cp_model.CpSolverStatus, solver: cp_model.CpSolver, tie_break: int) -> bool:
    """CP-SAT also answers OPTIMAL when it stopped at a gap limit: optimal means the bound
    met the objective (to within the tie-break, under one time unit)."""
    return code == cp_model.OPTIMAL and solver.objective_value - solver.best_objective_bound < tie_break


def search_stats(
    cp: cp_model.CpModel, solver: cp_model.CpSolver, code: cp_model.CpSolverStatus, *, stalled: bool = False
) -> dict[str, float | int | str]:
    stats: dict[str, float | int | str] = {
        "variables": len(cp.proto.variables),
        "constraints": len(cp.proto.constraints),
        "branches": solver.num_branches,
        "conflicts": solver.num_conflicts,
        "cp_status": solver.status_name(code),
    }
    if stalled:
        stats["stopped"] = "stall"  # no better plan for ``stall_time`` seconds
    return stats


def min_peak_result(problem: Problem, solver: cp_model.CpSolver, code: cp_model.CpSolverStatus,
                    read_plan: Callable[[], Plan], *, started: float, name: str,
                    stats: dict[str, float | int | str]) -> SolveResult:
    """The result of a minimum-peak search: its plan judged by the checker, status OPTIMAL
    when the peak is proven least, UNKNOWN (no plan) when the search found none."""
    wall = time.perf_counter() - started
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=float("inf"),
                           bound=0.0, wall_time=wall, solver=name)
    plan = read_plan()
    report = check(problem, plan)
    return SolveResult(
        status=Status.OPTIMAL if code == cp_model.OPTIMAL else Status.FEASIBLE,
        plan=plan, report=report, objective=report.added_time, bound=0.0, wall_time=wall,
        solver=name, stats=stats,
    )
