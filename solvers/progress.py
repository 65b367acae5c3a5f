"""CP-SAT with progress reports and a clean stop: the exact solver of :mod:`solvers.cpsat`
run in a worker thread, watched from the calling thread.

:func:`solve_watched` builds the same model, hint and parameters as
:func:`solvers.planner.solve` and returns the same :class:`SolveResult`; in addition

* ``on_progress`` is called from the calling thread every ``tick`` seconds and after each
  new incumbent with an :class:`Incumbent` (objective, bound, gap, elapsed time), for a
  progress bar; on a single-phase problem also after each better plan of the local search
  that runs before CP-SAT's model is built;
* a ``KeyboardInterrupt`` in the calling thread (Ctrl-C), or setting ``stop``, asks CP-SAT
  to stop (``CpSolver.stop_search``); the best plan found so far is then returned with
  its gap and ``interrupted=True``. CP-SAT's own SIGINT handler is turned off
  (``catch_sigint_signal``) so that Ctrl-C reaches Python, and Python's handler is
  re-registered first (:func:`restore_sigint`): a CP-SAT solve that did catch SIGINT
  leaves the signal's disposition at the default, which kills the process. On a
  single-phase problem a Ctrl-C during the local search that runs before the model is
  built returns that search's best plan the same way (``model`` is then None).

A stop by ``config.stall_time`` (:func:`solvers.sat.search`) is not an interruption: it is
the search's own limit, like the time limit, and shows as ``result.stats["stopped"]``.

The search runs in a worker thread because a Python signal handler only runs when the
main thread executes bytecode, not while it waits inside ``CpSolver.solve``.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from solvers import planner
from solvers.checker import check
from solvers.deadline import Deadline
from solvers.plan import Plan
from solvers.problem import Problem
from solvers.result import SolverConfig, SolveResult, Status
from solvers.sat import Watch, objective_seconds, search
from solvers.singlephase import anywhere


@dataclass(frozen=True)
class Incumbent:
    """The state of the search: the best plan's added time and the proven bound."""

    objective: float | None  # seconds added by the best plan so far; None before the first
    bound: float  # seconds: no plan adds less
    elapsed: float  # seconds since the search started
    solutions: int  # incumbents found so far

    @property
    def gap(self) -> float | None:
        if self.objective is None:
            return None
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


@dataclass(frozen=True)
class Watched:
    result: SolveResult
    interrupted: bool  # stopped by Ctrl-C or ``stop`` before the search finished
    model: planner.Model | None  # the CP-SAT model that was solved (for dumps), if built


class _Watcher(Watch):
    """Records each incumbent; called from CP-SAT's threads."""

    def __init__(self, model: planner.Model, t0: float) -> None:
        super().__init__()
        self._model = model
        self._t0 = t0
        # A single-phase model comes with the local search's plan, which the result is
        # chosen against: the best so far from the start, before CP-SAT's first.
        seed = model.seed if isinstance(model, anywhere.Model) else None
        self.objective: float | None = check(model.problem, seed).added_time if seed is not None else None
        self.bound = 0.0

    def on_solution_callback(self) -> None:
        objective = objective_seconds(self._model.tie_break, self._model.problem, self.objective_value)
        bound = objective_seconds(self._model.tie_break, self._model.problem, self.best_objective_bound)
        with self.lock:
            best = objective if self.objective is None else min(objective, self.objective)
            self.objective, self.bound = best, min(bound, best)
        super().on_solution_callback()

    def snapshot(self) -> Incumbent:
        with self.lock:
            return Incumbent(self.objective, self.bound, time.perf_counter() - self._t0, self.solutions)


def solve_watched(
    problem: Problem,
    config: SolverConfig = SolverConfig(),
    *,
    on_progress: Callable[[Incumbent], None] | None = None,
    stop: threading.Event | None = None,
    tick: float = 0.1,
) -> Watched:
    """:func:`solvers.planner.solve` with progress and interruption (see the module docstring).

    Raises :class:`InfeasibleBudgetError` when the budget is proven infeasible.
    """
    restore_sigint()
    with planner.said_if_stopped_by_wall(Deadline.of(config), made=True) as deadline:  # one for every stage below
        return _solve_watched(problem, config, deadline, on_progress=on_progress, stop=stop, tick=tick)


def _solve_watched(problem: Problem, config: SolverConfig, deadline: Deadline, *,
                   on_progress: Callable[[Incumbent], None] | None, stop: threading.Event | None,
                   tick: float) -> Watched:
    t0 = time.perf_counter()
    known = planner.known_only(problem, config, deadline=deadline)
    if known is not None:
        return Watched(known, False, None)
    first: list[Plan] = []  # the best plan of the local search before CP-SAT (single-phase)

    def local_best(plan: Plan, seconds: float) -> None:
        first[:] = [plan]
        if on_progress is not None:
            on_progress(Incumbent(seconds, 0.0, time.perf_counter() - t0, 0))

    try:
        model, solver = planner.prepare(problem, config, on_best=local_best, deadline=deadline)
    except KeyboardInterrupt:  # during that search: its best plan, as CP-SAT's would be
        if not first:
            raise
        return Watched(local_result(problem, first[0], started=t0), True, None)
    watcher = _Watcher(model, t0)
    codes: list[cp_model.CpSolverStatus] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            codes.append(search(solver, model.cp, config, watcher,
                                seeded=getattr(model, "seed", None) is not None, deadline=deadline))
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)
        finally:
            done.set()

    worker = threading.Thread(target=run, name="cpsat", daemon=True)
    worker.start()
    interrupted = False
    seen = -1
    # Wait on an Event, not Thread.join: on Python 3.11 a KeyboardInterrupt inside join()
    # can leave the thread looking finished while CP-SAT still runs in it.
    while not done.is_set():
        try:
            done.wait(tick)
            if stop is not None and stop.is_set() and not interrupted:
                interrupted = True
                solver.stop_search()
        except KeyboardInterrupt:
            interrupted = True
            solver.stop_search()
        if on_progress is not None:
            state = watcher.snapshot()
            if state.solutions != seen or not done.is_set():
                on_progress(state)
                seen = state.solutions
    worker.join()
    if errors:
        raise errors[0]
    result = planner.finish(problem, config, model, solver, codes[0], started=t0, stalled=watcher.stalled,
                            interrupted=interrupted, deadline=deadline)
    return Watched(result, interrupted, model)


def local_result(problem: Problem, plan: Plan, *, started: float) -> SolveResult:
    """The local search's plan as the result of a solve stopped before CP-SAT ran."""
    report = check(problem, plan)
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=report, objective=report.added_time,
                       bound=0.0, wall_time=time.perf_counter() - started, solver="local-search",
                       stats={"stopped": "interrupted before CP-SAT"})


def restore_sigint() -> None:
    """Re-register Python's SIGINT handler with the OS (main thread only).

    CP-SAT with ``catch_sigint_signal`` (its default) installs its own handler for the
    solve and afterwards leaves SIGINT at the default disposition: the next Ctrl-C kills
    the process instead of raising ``KeyboardInterrupt``.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGINT)
    if handler is not None:
        signal.signal(signal.SIGINT, handler)
