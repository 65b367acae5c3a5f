"""The one entry point for solving a :class:`Problem`: which solver it gets, and the
portfolio a two-phase problem is planned with.

A single-phase problem (no backward) goes to :mod:`solvers.singlephase.anywhere`. A
two-phase one gets the cheapest, by the checker, of the plans found without the flat search
(checkpointing, offloaded where the copies hide, the multi-level plan, the chain model's, a
plan an error stated before) and of the flat CP-SAT search (:mod:`solvers.cpsat`) started
from the best of them; from ``CHAIN_ONLY_CANDIDATES`` decisions the flat search does not
run, unless the problem has no chain (fewer than two segments) for the chain model to plan
instead. ``prepare`` and ``finish`` split :func:`solve` for callers that run the search
themselves (:mod:`solvers.progress`). Every stage of one solve runs within one
:class:`solvers.deadline.Deadline`, made from the config and handed down. See
docs/solvers.md, "solvers.solve" and "Time".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from ortools.sat.python import cp_model

from solvers import bound, chain, cpsat, multilevel
from solvers.baselines import (
    LastProblem,
    checkpoint_every,
    greedy,
    ladder_rungs,
    rejudged,
    selective,
)
from solvers.checker import Report, check
from solvers.deadline import Deadline
from solvers.hostcopy import offload_hidden
from solvers.plan import Plan
from solvers.problem import Problem
from solvers.result import InfeasibleBudgetError, Planner, SolverConfig, SolveResult, Status
from solvers.sat import Watch, objective_seconds, search
from solvers.segments import find_segments
from solvers.singlephase import anywhere

log = logging.getLogger(__name__)

Model = cpsat.Model | anywhere.Model

SEED_SHARE = 0.2  # of the time limit, at most, for the greedy plan that seeds the search
PEAK_SEED_SHARE = 0.5  # of it, at most, for the minimum-peak model's seed when the greedy's does not fit
# From this many decisions the flat model no longer improves on the chain model's plan in
# a minute, so the chain model gets all the time and the flat search does not run
# (docs/solvers.md, the chain model).
CHAIN_ONLY_CANDIDATES = 1000
LATE_GREEDY_SHARE = 0.05  # of the time limit, kept for the greedy after the chain model's plan there
BOUND_SHARE = 0.05  # of the time limit, at most, for the step relaxation's bound there (solvers.bound)
KNOWN_EVERY = (1, 2, 3, 4)  # checkpointing every k-th segment, for k in these
# With a host link, of the time limit for the flat search without it, whose plan starts
# the search with it (:func:`recompute_only`)
RECOMPUTE_FIRST_SHARE = 0.5
CHAIN_SHARE = 0.3  # of it, at most, for the chain model's plan (solvers.chain) that may seed it instead
# Candidates from which a problem's chain model runs: below, the flat model finds the
# optimum or near it within seconds, above it stalls on its start (Llama-2-7B's 32 layers:
# 1421 decisions, never better than the greedy's plan in 60 s). At 300, the 12-layer GPT-2
# traced with flash attention (248 decisions) went without the chain model's plan, 26%
# cheaper at a 10 s limit (docs/constants.md).
CHAIN_MIN_CANDIDATES = 200
STATED_KEPT = 8  # problems whose stated least-peak plan this process remembers (:func:`state`)

# The least-peak plan behind each unproven smallest budget an error stated, by unbudgeted
# problem. The searches that found it run against the wall clock (the chain model plans
# fewer spans on a loaded machine), so a later solve may not find it again; it starts
# from this plan instead, and the budget the error stated gets a plan. Kept with its peak.
_STATED: dict[Problem, tuple[int, Plan]] = {}
# The last problem's checkpointing plans, unbudgeted (:func:`unbudgeted_checkpointing`),
# and the same offloaded (:func:`hosted`).
_CHECKPOINTING: LastProblem[list[SolveResult]] = LastProblem()
_HOSTED: LastProblem[list[SolveResult]] = LastProblem()


def solve(problem: Problem, config: SolverConfig = SolverConfig(), *, deadline: Deadline | None = None
          ) -> SolveResult:
    """The cheapest plan within ``problem.budget``, within ``deadline`` (made from
    ``config`` where not given; a stage that plans a part of a problem hands its own part).

    Raises :class:`InfeasibleBudgetError` (with the smallest feasible budget) when no plan
    fits. On a time-out, returns the best plan found (status FEASIBLE, with its gap), or
    status UNKNOWN and no plan.
    """
    if problem.single_phase:
        return anywhere.solve(problem, config)
    t0 = time.perf_counter()
    with said_if_stopped_by_wall(deadline or Deadline.of(config), made=deadline is None) as deadline:
        known = known_only(problem, config, deadline=deadline)
        if known is not None:
            return known
        model, solver = _prepare(problem, config, deadline)
        watch = Watch(seconds=lambda objective: objective_seconds(model.tie_break, problem, objective))
        code = search(solver, model.cp, config, watch, seeded=model.seed is not None, deadline=deadline)
        return finish(problem, config, model, solver, code, started=t0, stalled=watch.stalled, deadline=deadline)


@contextlib.contextmanager
def said_if_stopped_by_wall(deadline: Deadline, *, made: bool) -> Iterator[Deadline]:
    """``deadline``, and where it was ``made`` for this solve, a warning once the solve
    ends (or raises) if the wall clock's backstop stopped a deterministic stage
    (:data:`solvers.deadline.WALL_BACKSTOP`): its plan may then differ between runs."""
    try:
        yield deadline
    finally:
        if made and deadline.by_wall:
            log.warning("a deterministic solve ran out of its %g s in wall time before its work "
                        "(CP-SAT counts its work slower than this machine's clock): it stopped there, and "
                        "its plan may differ between runs; a larger time_limit keeps it reproducible",
                        deadline.seconds)


def min_feasible_peak(problem: Problem, config: SolverConfig = SolverConfig(), *,
                      deadline: Deadline | None = None, start: Plan | None = None) -> SolveResult:
    """The plan with the smallest checker peak (any added time); ``report.peak`` is the
    smallest feasible budget when the status is OPTIMAL. Where the search proves nothing,
    never above the least peak of the plans :func:`known_plans` finds without a budget,
    nor of ``start`` (a plan found before: the search starts from it). ``deadline`` as
    for :func:`solve`."""
    if problem.single_phase:
        return anywhere.min_feasible_peak(problem, config)
    with said_if_stopped_by_wall(deadline or Deadline.of(config), made=deadline is None) as deadline:
        return _min_feasible_peak(problem, config, deadline, start)


def _min_feasible_peak(problem: Problem, config: SolverConfig, deadline: Deadline, start: Plan | None
                       ) -> SolveResult:
    t0 = time.perf_counter()
    given = [] if start is None else [judged_least(problem, start, "start")]
    if not searched_flat(problem):  # the flat search would find less
        known = [*given, *least_known_peaks(problem, config, deadline=deadline)]
    else:
        # With a host link, the least peak without it first (a plan here too, though not
        # proven least: offload may go lower), to start the larger model's search; or the
        # plan given, which a search begun from that one found (:func:`seeded`).
        local = given or least_peak_unlinked(problem, config, deadline)
        # The chain model's least peak (:func:`least_known_peaks`) keeps its share.
        kept = config.time_limit * CHAIN_SHARE if chained(problem, config) else 0.0
        found = (local[0] if local and deadline.expired() else  # no time to search (out of time)
                 cpsat.min_peak(problem, config, start=local[0].plan if local else None,
                                deadline=deadline.part(deadline.left() - kept)))
        if found.status is Status.OPTIMAL:
            # Proven least as the flat model counts, every copy recomputed before one op
            # alive through it; the checker may find a rung of the holding ladder lower.
            rung = least_known_rung(problem)
            assert found.report is not None
            lower = rung if rung is not None and rung.report.peak < found.report.peak else found  # type: ignore[union-attr]
            return replace(lower, wall_time=time.perf_counter() - t0)
        known = [found, *local, *least_known_peaks(problem, config, deadline=deadline)]
    best = min((r for r in known if r.report is not None), key=lambda r: r.report.peak)  # type: ignore[union-attr]
    return replace(best, wall_time=time.perf_counter() - t0)


def searched_flat(problem: Problem) -> bool:
    """Whether the flat CP-SAT search runs on ``problem``: below ``CHAIN_ONLY_CANDIDATES``
    decisions, or where the problem has no chain (fewer than two segments) whose model
    would plan it instead: there the flat search, started from the best known plan and
    stopped by the deadline, is the only search."""
    return len(problem.candidates) < CHAIN_ONLY_CANDIDATES or len(find_segments(problem)) < 2


def known_only(problem: Problem, config: SolverConfig, *, deadline: Deadline | None = None
               ) -> SolveResult | None:
    """On a two-phase problem the flat search does not run on (:func:`searched_flat`), the cheapest
    plan that fits among the greedy's, checkpointing's, the multi-level one's and the chain
    model's, the chain model given what is left of the time limit; None on a problem
    searched flat or a single-phase one. Status FEASIBLE, bounded by the step relaxation
    (:mod:`solvers.bound`): none of these searches proves a bound. Where none fits, raises
    :class:`InfeasibleBudgetError` with the least peak among their least-peak plans (not
    proven least: the flat search, which could prove it, does not finish at this size).
    ``deadline`` as for :func:`solve`."""
    if problem.single_phase or problem.budget is None or searched_flat(problem):
        return None
    t0 = time.perf_counter()
    deadline = deadline or Deadline.of(config)
    # What no plan beats (the searches below prove no bound), in a share of the time. Under
    # ``deterministic`` its wall time is not counted as work, and the searches' shares are
    # of work: taken first, it would leave them less of the wall clock's backstop (3.9 s of
    # 25 on Llama-2-70B at checkpointing's peak, where the chain model's search meets the
    # backstop before its share of work), so it comes after them.
    relaxed = None if config.deterministic else bound.lower_bound(problem, seconds=bound_time(config, deadline))
    built = chain.build_chain(problem, config, planner=PLANNER,
                              deadline=deadline.part(config.time_limit * chain.OPTION_SHARE))
    before = deadline.spent()
    found = [*checkpointing(problem, config), *hosted(problem, config), *grouped(problem, config, deadline)]
    # Where none of these fits, the least-peak plans may be searched for after the chain
    # model (for the error), and they repeat these: the chain model leaves what they took.
    repeated = 0.0 if any(r.plan is not None for r in found) else deadline.spent() - before
    # The greedy comes last, with what the chain model leaves of the time: at this size
    # one of its checker replays takes up to half a second, and its plan is seldom the best.
    late = config.time_limit * LATE_GREEDY_SHARE
    found.append(chain.solve(problem, config, chain=built, deadline=deadline.part(deadline.left() - late - repeated)))
    fitting = [r for r in [*found, *stated(problem)] if r.plan is not None]
    # Where no plan fits yet, the greedy gets its share, and the rest goes to the least
    # peak the error states (:func:`least_known_peaks`), less the bound's share after it.
    greedy_s = deadline.left() if fitting else min(late, deadline.left())
    # it checks the clock between checker replays: stopped one replay early (about what
    # the chain model's last plan took to judge), it ends within the limit
    judged = built.judge_s if built is not None and not config.deterministic else 0.0
    found.append(greedy(problem, config, deadline=deadline.part(greedy_s - judged)))
    fitting = [r for r in [*found, *stated(problem)] if r.plan is not None]
    if not fitting:
        explaining = deadline.part(deadline.left() - bound_kept(config))
        low = min((r for r in least_known_peaks(problem, config, built=built, deadline=explaining)
                   if r.report is not None),
                  key=lambda r: r.report.peak)  # type: ignore[union-attr]
        assert low.report is not None and low.plan is not None
        if not low.report.fits:  # a least-peak plan may fit where the budgeted searches missed
            at_least = bound.least_budget(problem, low.report.peak, seconds=bound_time(config, deadline))
            raise state(InfeasibleBudgetError(problem.budget, low.report.peak, proven=False, plan=low.plan,
                                              at_least=at_least), problem)
        fitting = [low]
    best = min(fitting, key=lambda r: r.objective)
    if relaxed is None:
        relaxed = bound.lower_bound(problem, seconds=bound_time(config, deadline))
    return replace(best, status=Status.FEASIBLE, bound=min(best.objective, relaxed.seconds),
                   wall_time=time.perf_counter() - t0,
                   stats={**best.stats, "from": best.solver, "bound_step": -1 if relaxed.step is None else relaxed.step})


def prepare(problem: Problem, config: SolverConfig, *, on_best: Callable[[Plan, float], None] | None = None,
            deadline: Deadline | None = None) -> tuple[Model, cp_model.CpSolver]:
    """The model and a configured solver: for a two-phase problem the flat model hinted
    with :func:`seed`'s plan (:func:`solvers.cpsat.prepare`), the search given what is left
    of ``deadline`` (made from ``config`` where not given). A single-phase problem's local
    search runs first and tells ``on_best`` each better plan it finds."""
    if problem.single_phase:
        return anywhere.prepare(problem, config, on_best=on_best)
    return _prepare(problem, config, deadline or Deadline.of(config))


def _prepare(problem: Problem, config: SolverConfig, deadline: Deadline) -> tuple[cpsat.Model, cp_model.CpSolver]:
    """:func:`prepare` of a two-phase problem: the seed's searches count against the time
    limit, and the flat search gets what is left, less the step relaxation's share for
    its bound after it (:func:`finish`)."""
    start = seeded(problem, config, deadline)
    return cpsat.prepare(problem, config, start=start,
                         deadline=deadline.part(deadline.left() - bound_kept(config)))


def finish(problem: Problem, config: SolverConfig, model: Model, solver: cp_model.CpSolver,
           code: cp_model.CpSolverStatus, *, started: float, stalled: bool = False,
           interrupted: bool = False, deadline: Deadline | None = None) -> SolveResult:
    """The result of a finished or stopped search (:func:`solvers.cpsat.finish`), its bound
    raised by the step relaxation (:mod:`solvers.bound`) where the search proved none; a
    proven infeasible budget raised as :class:`InfeasibleBudgetError` with the smallest
    feasible one (:func:`explained`). ``interrupted``: stopped by the user, so a
    single-phase solve skips its polish. ``deadline``: the solve's (what is left of it
    goes to the explanation and the bound; made from ``config`` where not given)."""
    if isinstance(model, anywhere.Model):
        return anywhere.finish(problem, config, model, solver, code, started=started, stalled=stalled,
                               interrupted=interrupted)
    deadline = deadline or Deadline.of(config)
    found = cpsat.finish(problem, model, solver, code, started=started, stalled=stalled)
    if found.status is Status.INFEASIBLE:  # the seed, where there is one, is the least-peak plan found
        raise explained(problem, config, deadline=deadline, start=model.seed)
    if found.status is Status.FEASIBLE:  # the step relaxation may prove more than the search did
        relaxed = bound.lower_bound(problem, seconds=bound_time(config, deadline)).seconds
        found = replace(found, bound=min(found.objective, max(found.bound, relaxed)))
    return found


def explained(problem: Problem, config: SolverConfig, *, deadline: Deadline | None = None,
              start: Plan | None = None) -> InfeasibleBudgetError:
    """The error for ``problem``'s budget, proven infeasible: the least peak
    (:func:`min_feasible_peak`, from ``start`` where given: the least-peak plan found
    before) and, where that is not proven least, the budget the step relaxation shows no
    plan fits under (:func:`solvers.bound.least_budget`), in what is left of ``deadline``
    (made from ``config`` where not given)."""
    assert problem.budget is not None
    deadline = deadline or Deadline.of(config)
    peak = min_feasible_peak(problem, config, deadline=deadline.part(deadline.left() - bound_kept(config)),
                             start=start)
    proven = peak.status is Status.OPTIMAL
    least = peak.report.peak if peak.report else None
    at_least = (bound.least_budget(problem, least, seconds=bound_time(config, deadline))
                if least is not None and not proven else None)
    return state(InfeasibleBudgetError(problem.budget, least, proven=proven, plan=peak.plan,
                                       at_least=at_least), problem)


def bound_time(config: SolverConfig, deadline: Deadline) -> float:
    """Seconds for the step relaxation (:mod:`solvers.bound`): ``BOUND_SHARE`` of the time
    limit, or what is left of ``deadline`` where that is less (it relaxes one step at
    least); under ``config.deterministic``, where its work is not counted, what the wall
    clock's backstop leaves (it ends its bound, never the plan)."""
    if config.deterministic:
        return deadline.wall_left()
    return min(config.time_limit * BOUND_SHARE, deadline.left())


def bound_kept(config: SolverConfig) -> float:
    """Seconds a search keeps for the step relaxation after it: :func:`bound_time`'s share,
    none under ``config.deterministic`` (its work is not counted)."""
    return 0.0 if config.deterministic else config.time_limit * BOUND_SHARE


def seed(problem: Problem, config: SolverConfig, *, deadline: Deadline | None = None) -> Plan | None:
    """A plan to start the search from: the cheapest within budget of the greedy's (given
    ``SEED_SHARE`` of the time), :func:`known_plans` and, with a host link, the plan found
    without it (:func:`recompute_only`); else the minimum-peak model's first plan within
    budget (``PEAK_SEED_SHARE``), or the least-peak plan it found (where it found none in
    its time, the one found without the host link); or None. Raises
    :class:`InfeasibleBudgetError` when that search proves the least peak over the budget.
    Its searches run within ``deadline`` (made from ``config`` where not given).
    See docs/solvers.md, "solvers.solve"."""
    return seeded(problem, config, deadline or Deadline.of(config))


def seeded(problem: Problem, config: SolverConfig, deadline: Deadline) -> Plan | None:
    """:func:`seed`, its searches within ``deadline``."""
    start = greedy(problem, config, deadline=deadline.part(config.time_limit * SEED_SHARE))
    local, least = recompute_only(problem, config, deadline)
    fitting = [r for r in [start, *local, *known_plans(problem, config, deadline)] if r.plan is not None]
    if fitting:
        return min(fitting, key=lambda r: r.objective).plan
    if problem.budget is None:
        return start.plan
    if least is not None and deadline.expired():  # out of time to search for a lower one
        return least
    t0 = time.perf_counter()
    capacity = problem.scale.capacity(problem.budget)
    model, solver, code = cpsat.peak_search(problem, config, stop=cpsat.StopAtMost(capacity), start=least,
                                            deadline=deadline.part(config.time_limit * PEAK_SEED_SHARE))
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return least
    plan = cpsat.extract_plan(model, solver)
    fits = solver.objective_value <= capacity
    if code == cp_model.OPTIMAL and not fits:
        raise InfeasibleBudgetError(problem.budget, check(problem, plan).peak, proven=True, plan=plan)
    log.info("seed: the minimum-peak model's %s after %.1f s",
             "first plan within budget" if fits else "least-peak plan found (over budget)",
             time.perf_counter() - t0)
    return plan


def recompute_only(problem: Problem, config: SolverConfig, deadline: Deadline
                   ) -> tuple[list[SolveResult], Plan | None]:
    """Where ``problem`` has a host link: the flat search's plan without it, given
    ``RECOMPUTE_FIRST_SHARE`` of the time limit. Moving nothing, that plan is one here
    too, so a search it starts never ends dearer than recompute-only's; the offload
    model, with its copy windows, is larger and may not reach that plan on its own in the
    time. Returns ([the plan judged against ``problem``] or [], the least-peak plan the
    search found where no plan fits the budget (else None)); within ``deadline``."""
    if problem.host_bandwidth <= 0 or problem.single_phase:
        return [], None
    local = replace(config, time_limit=config.time_limit * RECOMPUTE_FIRST_SHARE)
    try:
        found = solve(replace(problem, host_bandwidth=0.0), local, deadline=deadline.part(local.time_limit))
    except InfeasibleBudgetError as e:
        return [], e.plan
    if found.plan is None:
        return [], None
    report = check(problem, found.plan)
    return [replace(found, status=Status.FEASIBLE, report=report, objective=report.added_time,
                    bound=0.0, solver="recompute-only")], None


def checkpointing(problem: Problem, config: SolverConfig) -> list[SolveResult]:
    """The checkpointing baselines, each judged by the checker: every k-th segment kept for
    k in ``KNOWN_EVERY`` (k = 1 is checkpointing every block), selective checkpointing and
    the rungs of the holding ladder (:func:`solvers.baselines.ladder_rungs`). The flat model
    counts a copy recomputed before one op as alive through it, where the checker follows
    the op's entries, so it may prove no plan fits a budget a rung fits (a transformers
    GPT-2 whose GELU is written out in steps)."""
    return [*rejudged(problem, unbudgeted_checkpointing(problem, config)), *ladder_rungs(problem)]


def unbudgeted_checkpointing(problem: Problem, config: SolverConfig) -> list[SolveResult]:
    """Checkpointing every k-th segment for k in ``KNOWN_EVERY``, in that order, then
    selective checkpointing, each judged without a budget (so each has its plan). The plans
    do not depend on the budget, and the last problem's are kept: a solve asks for them
    three times (:func:`checkpointing`, :func:`hosted`, and :func:`least_known_peaks` for
    an infeasible budget's error), and each time took 1.3-3.2 s on Llama-2-70B."""
    return _CHECKPOINTING.get(problem, lambda free: [*(checkpoint_every(free, config, k=k) for k in KNOWN_EVERY),
                                                     selective(free, config)])


def least_known_rung(problem: Problem) -> SolveResult | None:
    """The rung of the holding ladder (:func:`solvers.baselines.ladder_rungs`) that peaks
    least, its report against ``problem``'s budget (status FEASIBLE: not proven least);
    None without a value to recompute."""
    rungs = ladder_rungs(problem.with_budget(None))
    if not rungs:
        return None
    least = min(rungs, key=lambda r: r.report.peak)  # type: ignore[union-attr]
    assert least.report is not None
    return replace(least, report=replace(least.report, budget=problem.budget))


def hosted(problem: Problem, config: SolverConfig) -> list[SolveResult]:
    """Where the problem has a host link, checkpointing every k-th segment (k in
    ``KNOWN_EVERY``) with what it keeps offloaded where the copies hide
    (:func:`solvers.hostcopy.offload_hidden`), each judged against the budget. The
    plans do not depend on the budget, and the last problem's are kept: asked again at
    another budget (an infeasible one's least-peak plans, :func:`least_known_peaks`), only
    the verdicts change (Llama-2-70B: 3.4 s each time)."""
    if problem.host_bandwidth <= 0 or problem.single_phase:
        return []

    def offload(free: Problem) -> list[SolveResult]:
        every = unbudgeted_checkpointing(free, config)[:len(KNOWN_EVERY)]
        return [r for found in every for r in offloaded(free, found)]

    return rejudged(problem, _HOSTED.get(problem, offload))


def grouped(problem: Problem, config: SolverConfig, deadline: Deadline) -> list[SolveResult]:
    """The multi-level plan (:mod:`solvers.multilevel`) where ``config.multilevel``; with a
    host link also that plan, or where none fits the budget the multi-level least-peak
    plan, with what it keeps offloaded where the copies hide (:func:`offloaded`)."""
    if not config.multilevel:
        return []
    found = multilevel.solve(problem, config, deadline=deadline)
    if problem.host_bandwidth <= 0 or problem.single_phase:
        return [found]
    base = found
    if found.plan is None:
        base = multilevel.min_peak(problem.with_budget(None), config, deadline=deadline)
    return [found, *offloaded(problem, base)]


def offloaded(problem: Problem, result: SolveResult) -> list[SolveResult]:
    """``result``'s plan with what it keeps offloaded where the copies hide
    (:func:`solvers.hostcopy.offload_hidden`; a multi-level plan keeps its schedule),
    judged against ``problem``'s budget; none where nothing moves or there is no plan."""
    if result.plan is None:
        return []
    t0 = time.perf_counter()
    plan, report = offload_hidden(problem, result.plan)
    if plan is result.plan:
        return []
    return [SolveResult(status=Status.FEASIBLE if report.fits else Status.INFEASIBLE,
                        plan=plan if report.fits else None, report=report, objective=report.added_time,
                        bound=0.0, wall_time=result.wall_time + time.perf_counter() - t0,
                        solver=f"{result.solver}+offload")]


def chained(problem: Problem, config: SolverConfig) -> bool:
    """Whether the flat search's portfolio runs the chain model: from
    ``CHAIN_MIN_CANDIDATES`` candidates, and not under ``config.deterministic``, where
    it would count every span's searches against the limit, on a problem the flat search
    plans well (:func:`known_plans`)."""
    return len(problem.candidates) >= CHAIN_MIN_CANDIDATES and not config.deterministic


def known_plans(problem: Problem, config: SolverConfig, deadline: Deadline | None = None) -> list[SolveResult]:
    """Plans found without the flat search, each judged by the checker: the checkpointing
    baselines (:func:`checkpointing`), the multi-level plan (:func:`grouped`) and, on
    problems of at least ``CHAIN_MIN_CANDIDATES`` candidates, the chain model's (:mod:`solvers.chain`), given
    ``CHAIN_SHARE`` of the time limit (:func:`chained`). A plan among them that fits the budget starts
    every search, so no search ends on a plan dearer than one of them. Within ``deadline``
    (made from ``config`` where not given)."""
    deadline = deadline or Deadline.of(config)
    out = [*checkpointing(problem, config), *hosted(problem, config), *grouped(problem, config, deadline)]
    out.extend(stated(problem))
    if chained(problem, config):
        share = config.time_limit * CHAIN_SHARE
        out.append(chain.solve(problem, replace(config, time_limit=share), planner=PLANNER,
                               deadline=deadline.part(share)))
    return out


def least_peak_unlinked(problem: Problem, config: SolverConfig, deadline: Deadline) -> list[SolveResult]:
    """Where ``problem`` has a host link: the least-peak plan without it, searched for with
    ``RECOMPUTE_FIRST_SHARE`` of the time limit and judged against ``problem`` (status
    FEASIBLE: least without offload, not proven least with it); else none. Within ``deadline``."""
    if problem.host_bandwidth <= 0 or problem.single_phase:
        return []
    share = config.time_limit * RECOMPUTE_FIRST_SHARE
    found = min_feasible_peak(replace(problem, host_bandwidth=0.0), replace(config, time_limit=share),
                              deadline=deadline.part(share))
    if found.plan is None:
        return []
    report = check(problem, found.plan)
    return [replace(found, status=Status.FEASIBLE, report=report, objective=report.added_time)]


def judged_least(problem: Problem, plan: Plan, solver: str, report: Report | None = None) -> SolveResult:
    """``plan``, a least-peak plan found for ``problem`` or a part of it, and the checker's
    verdict on it against ``problem``'s budget (``report``, where given): status FEASIBLE
    (not proven least here), the plan kept where it does not fit."""
    report = report if report is not None else check(problem, plan)
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=report, objective=report.added_time,
                       bound=0.0, wall_time=0.0, solver=solver)


def least_known_peaks(problem: Problem, config: SolverConfig, *, built: chain.Chain | None = None,
                      deadline: Deadline | None = None) -> list[SolveResult]:
    """:func:`known_plans`' least-peak plans and the one behind a smallest budget stated
    before (:func:`stated`), each judged against ``problem``'s budget, within ``deadline``
    (made from ``config`` where not given). ``built``: the problem's chain model, already
    built (its least peak is then taken with what is left of ``deadline``)."""
    deadline = deadline or Deadline.of(config)
    unbudgeted = problem.with_budget(None)
    found = unbudgeted_checkpointing(unbudgeted, config)[:len(KNOWN_EVERY)]
    if (rung := least_known_rung(unbudgeted)) is not None:
        found.append(rung)
    found += hosted(unbudgeted, config)
    if config.multilevel:
        least = multilevel.min_peak(unbudgeted, config, deadline=deadline)
        found += [least, *offloaded(unbudgeted, least)]
    if built is not None:
        found.append(chain.min_peak(unbudgeted, config, chain=built, deadline=deadline))
    elif chained(problem, config):
        # Beside the flat search, ``CHAIN_SHARE`` of the time limit; from
        # ``CHAIN_ONLY_CANDIDATES``, where the flat search does not run, what is left.
        flat = searched_flat(problem)
        share = config.time_limit * CHAIN_SHARE if flat else deadline.left()
        found.append(chain.min_peak(unbudgeted, replace(config, time_limit=share), planner=PLANNER,
                                    deadline=deadline.part(share)))
    out = []
    for r in found:
        if r.plan is not None:
            # Each was judged without a budget, on these nodes: only the verdict is left to
            # give (a check of each again took 2 s on Llama-2-70B).
            report = (replace(r.report, budget=problem.budget) if r.report is not None and r.report.budget is None
                      else None)
            out.append(judged_least(problem, r.plan, "known-min-peak", report))
    return [*out, *stated(problem, fitting=False)]


def state(error: InfeasibleBudgetError, problem: Problem) -> InfeasibleBudgetError:
    """``error``, after remembering the plan behind its smallest budget when that budget is
    not proven (a proven one is found again by any search): :func:`stated` hands it to every
    later solve of ``problem`` in this process, at any budget."""
    if not error.proven and error.plan is not None and error.min_feasible is not None:
        key = problem.with_budget(None)
        kept = _STATED.get(key)
        if kept is None or kept[0] > error.min_feasible:
            _STATED.pop(key, None)
            if len(_STATED) >= STATED_KEPT:
                _STATED.pop(next(iter(_STATED)))
            _STATED[key] = (error.min_feasible, error.plan)
    return error


def stated(problem: Problem, *, fitting: bool = True) -> list[SolveResult]:
    """The plan behind the smallest budget an error stated for ``problem`` (:func:`state`),
    judged against its budget; none where there is none or (``fitting``) it does not fit."""
    kept = _STATED.get(problem.with_budget(None)) if _STATED else None
    if kept is None:
        return []
    found = judged_least(problem, kept[1], "stated")
    assert found.report is not None
    return [] if fitting and not found.report.fits else [found]


def forget_stated() -> None:
    """Drop the plans :func:`state` remembered (tests start from none)."""
    _STATED.clear()


# What a solver that plans parts of a problem with this portfolio is handed (the chain
# model, for its segments: it cannot import this module, which runs it).
PLANNER = Planner(solve=solve, min_feasible_peak=min_feasible_peak)
