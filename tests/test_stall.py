"""``SolverConfig.stall_time``: a search stops once it has found no better plan for that long.

CP-SAT itself is replaced by a stand-in whose search reports plans on a script and then runs
until ``stop_search`` (or its own time-out), so the stop is tested without a problem that
takes CP-SAT long to prove; the option's path through the real solvers is tested on a
small problem, where the search ends by proof and the stall never fires.
"""

from __future__ import annotations

import threading
import time

from ortools.sat.python import cp_model

from solvers import SolverConfig, Status, min_feasible_peak, solve
from solvers.sat import Watch, search
from tests.graphs import deep

TIMEOUT = 20.0  # seconds the stand-in search runs when nothing stops it


class ScriptedSearch:
    """Finds a better plan at each of ``found_at`` (seconds after the start), then
    searches on until stopped."""

    def __init__(self, found_at: list[float], timeout: float) -> None:
        self.found_at = found_at
        self.timeout = timeout
        self.stopped = threading.Event()
        self.ran_for = 0.0

    def solve(self, cp: cp_model.CpModel, watch: Watch) -> cp_model.CpSolverStatus:
        t0 = time.perf_counter()
        for at in self.found_at:
            if self.stopped.wait(max(0.0, at - (time.perf_counter() - t0))):
                break
            watch.on_solution_callback()
        self.stopped.wait(self.timeout)
        self.ran_for = time.perf_counter() - t0
        return cp_model.FEASIBLE

    def stop_search(self) -> None:
        self.stopped.set()


def run(found_at: list[float], stall_time: float, timeout: float = TIMEOUT) -> tuple[ScriptedSearch, Watch]:
    stand_in = ScriptedSearch(found_at, timeout)
    watch = Watch()
    search(stand_in, cp_model.CpModel(), SolverConfig(stall_time=stall_time), watch)  # type: ignore[arg-type]
    return stand_in, watch


def test_stops_after_stall_time_without_a_better_plan() -> None:
    stand_in, watch = run([0.0, 0.3], stall_time=0.5)
    assert watch.stalled and watch.solutions == 2
    # stopped 0.5 s after the second plan, not before, and long before the search's own end
    assert 0.8 <= stand_in.ran_for < TIMEOUT / 2


def test_a_better_plan_restarts_the_clock() -> None:
    stand_in, watch = run([0.0, 0.4, 0.8, 1.2], stall_time=0.6)
    assert watch.stalled and watch.solutions == 4
    assert stand_in.ran_for >= 1.8


def test_never_stops_before_the_first_plan() -> None:
    stand_in, watch = run([1.0], stall_time=0.2)
    assert watch.stalled and watch.solutions == 1
    assert stand_in.ran_for >= 1.2


def test_a_seeded_search_stops_though_it_never_finds_a_plan_of_its_own() -> None:
    """The seed the model is hinted with is the best plan from the start: a search that
    never beats it (nor reports it) stops after ``stall_time``, not at its time limit
    (a 28-block model spent the full 60 s on every graph)."""
    started = time.perf_counter()  # the watch counts the stall from its own start
    stand_in, watch = ScriptedSearch([], TIMEOUT), Watch()
    search(stand_in, cp_model.CpModel(), SolverConfig(stall_time=0.3), watch, seeded=True)  # type: ignore[arg-type]
    assert watch.stalled and watch.solutions == 0
    assert time.perf_counter() - started >= 0.3 and stand_in.ran_for < TIMEOUT / 2


def test_zero_stall_time_never_stops() -> None:
    stand_in, watch = run([0.0], stall_time=0.0, timeout=1.5)
    assert not watch.stalled and stand_in.ran_for >= 1.5


def test_real_search_ends_by_proof_before_a_stall() -> None:
    p = deep()
    least = min_feasible_peak(p).report
    assert least is not None
    result = solve(p.with_budget(least.peak), SolverConfig(workers=1, stall_time=30.0))
    assert result.status is Status.OPTIMAL and "stopped" not in result.stats
    assert result.report is not None and result.report.fits and result.objective > 0
