"""Plans that need no search, with the same signature and result type as every solver."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Generic, TypeVar

from solvers.checker import Report, check
from solvers.deadline import Deadline
from solvers.floor import baseline
from solvers.plan import Decision, Plan, needed_values, plan_from_decisions
from solvers.problem import Problem
from solvers.result import SolverConfig, SolveResult, Status
from solvers.segments import segment_boundaries


def save_all(problem: Problem, config: SolverConfig = SolverConfig()) -> SolveResult:
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


def greedy(problem: Problem, config: SolverConfig = SolverConfig(), *,
           free_time: float | None = None, deadline: Deadline | None = None) -> SolveResult:
    """Recompute every *free* value at once if that lowers the peak (a chain of cheap
    values only pays off whole), then the cheapest seconds-per-byte values one by one until
    the checker's peak fits; finally un-recompute the most expensive ones not needed to fit.

    ``free_time``: values costing at most this many seconds count as free (default: the
    rule of :func:`free_values`). Any set of recomputed values gives a valid plan when
    everything else the backward (or a recomputation) reads is saved, so each step is one
    checker replay: about 2·|candidates| in all. Status FEASIBLE with a plan when it fits,
    else INFEASIBLE (greedy proves nothing: the budget may still be feasible). Past
    ``deadline`` (made from ``config`` where not given; under ``config.deterministic`` it
    counts the replays) it stops where it is: unfit, or fit but not yet trimmed.
    """
    t0 = time.perf_counter()
    deadline = deadline or Deadline.of(config)
    recomputed, report = _free_start(problem, free_time)
    order = sorted(
        (v for v in problem.candidates
         if problem.nodes[v].recomputable and problem.nodes[v].size and v not in recomputed),
        key=lambda v: (problem.nodes[v].time / problem.nodes[v].size, v),
    )
    for v in order:
        if report.fits or deadline.expired():
            break
        trial = check(problem, plan_with(problem, recomputed | {v}))
        if trial.peak <= report.peak:
            recomputed.add(v)
            report = trial
    if report.fits:
        for v in sorted(recomputed, key=lambda v: -problem.nodes[v].time):
            if deadline.expired():
                break
            trial = check(problem, plan_with(problem, recomputed - {v}))
            if trial.fits:
                recomputed.discard(v)
                report = trial
    return judged(problem, plan_with(problem, recomputed), "greedy", t0)


def free_recompute(problem: Problem, config: SolverConfig = SolverConfig(), *,
                   free_time: float | None = None) -> SolveResult:
    """Recompute every free value (see :func:`greedy`) when that lowers the peak, else
    nothing: the plan for "no budget" under Inductor, where a recomputed pointwise op
    fuses into its consumer and costs a launch, so the peak drops at almost no time."""
    t0 = time.perf_counter()
    return judged(problem, free_plan(problem, free_time), "free_recompute", t0)


def free_plan(problem: Problem, free_time: float | None = None) -> Plan:
    """:func:`free_recompute`'s plan, within the budget or not."""
    recomputed, _ = _free_start(problem, free_time)
    return plan_with(problem, recomputed)


def free_values(problem: Problem, free_time: float | None = None) -> set[int]:
    """The recomputable candidates costing at most ``free_time`` seconds each. By default
    those that compute no FLOPs where FLOPs tell the candidates apart (pointwise ops,
    copies, gathers, reductions: a pass over memory at most, none where the compiler fuses
    them into their reader, plus their transcendentals), else those at the smallest
    positive recompute time (a problem whose FLOPs are all zero, or all its costs)."""
    recomputable = [v for v in problem.candidates if problem.nodes[v].recomputable]
    if free_time is None:
        flop_free = {v for v in recomputable if problem.nodes[v].flops == 0}
        if 0 < len(flop_free) < len(recomputable):
            return flop_free
    times = [problem.nodes[v].time for v in problem.candidates if problem.nodes[v].time > 0]
    limit = free_time if free_time is not None else min(times, default=0.0)
    return {v for v in recomputable if problem.nodes[v].time <= limit}


def _free_start(problem: Problem, free_time: float | None) -> tuple[set[int], Report]:
    """The free values, if recomputing them all lowers the peak, and the checker's report."""
    nothing = check(problem, plan_with(problem, set()))
    free = free_values(problem, free_time)
    with_free = check(problem, plan_with(problem, free))
    if with_free.peak < nothing.peak:
        return free, with_free
    return set(), nothing


def checkpoint_every(problem: Problem, config: SolverConfig = SolverConfig(), *, k: int = 1) -> SolveResult:
    """Activation checkpointing: keep every k-th segment boundary, recompute the rest.

    Segment boundaries are the forward values that alone carry the computation from one
    step to the next (every later value depends on earlier ones only through them): a
    residual stream between blocks, a CNN's stage outputs. ``k = 1`` is checkpointing
    every block (``torch.utils.checkpoint`` around each); random and must-save values are
    saved whatever ``k``.
    """
    t0 = time.perf_counter()
    if k < 1:
        raise ValueError(f"checkpoint_every: k must be >= 1, got {k}")
    boundaries = segment_boundaries(problem)
    kept = set(boundaries[k - 1 :: k])
    recomputed = {v for v in problem.candidates
                  if problem.nodes[v].recomputable and v not in kept}
    return judged(problem, plan_with(problem, recomputed), f"checkpoint_every_{k}", t0)


def selective(problem: Problem, config: SolverConfig = SolverConfig()) -> SolveResult:
    """Selective activation checkpointing: save what the compute-bound ops produce and
    recompute every other value the backward reads, whatever the budget. The values
    recomputed are :func:`free_values`' (no FLOPs: pointwise ops, norms' elementwise parts,
    copies, reductions): what Megatron-LM's selective recomputation aims at (the parts of
    a layer that take memory but few FLOPs to recompute) and what a save-list policy of
    matmuls and attention in ``torch.utils.checkpoint`` (torchtitan's op-level selective
    checkpointing) does around every block."""
    t0 = time.perf_counter()
    return judged(problem, plan_with(problem, free_values(problem)), "selective", t0)


def sqrt_n(problem: Problem, config: SolverConfig = SolverConfig()) -> SolveResult:
    """Chen et al.'s √n checkpointing: keep every ⌈√n⌉-th of the n segment boundaries."""
    n = max(1, len(segment_boundaries(problem)))
    result = checkpoint_every(problem, config, k=max(1, math.isqrt(n - 1) + 1 if n > 1 else 1))
    return replace(result, solver="sqrt_n")


def knapsack(problem: Problem, config: SolverConfig = SolverConfig()) -> SolveResult:
    """PyTorch 2.13's ``activation_memory_budget`` choice: a 0/1 knapsack that saves the
    values of largest recompute time whose *total saved bytes* fit, with no liveness.

    Capacity is the budget minus the floor no plan avoids (the peak of the values every
    plan holds); weights are quantized to 10,000 units of it, as PyTorch's ``dp`` solver
    does. Whatever is not saved is recomputed; the checker then says whether the peak,
    which the knapsack never looked at, fits.
    """
    t0 = time.perf_counter()
    if problem.budget is None:
        return replace(save_all(problem, config), solver="knapsack")
    items = [v for v in problem.candidates if problem.backward_uses[v] and problem.nodes[v].recomputable]
    saved = knapsack_choice(problem, items, problem.budget)
    recomputed = {v for v in items if v not in saved}
    return judged(problem, plan_with(problem, recomputed), "knapsack", t0)


def knapsack_choice(problem: Problem, items: list[int], budget: int, *, units: int = 10_000) -> frozenset[int]:
    """The items to save: largest total recompute time with total bytes <= budget - floor."""
    capacity = max(0, budget - max(baseline(problem), default=0))
    weight = {v: math.ceil(problem.nodes[v].size * units / capacity) if capacity else units + 1
              for v in items}
    best: list[tuple[float, frozenset[int]]] = [(0.0, frozenset())] * (units + 1)
    for v in items:  # the classic DP over capacity, keeping the chosen set
        w, value = weight[v], problem.nodes[v].time
        for c in range(units, w - 1, -1):
            cand = best[c - w][0] + value
            if cand > best[c][0]:
                best[c] = (cand, best[c - w][1] | {v})
    return best[units][1]


def judged(problem: Problem, plan: Plan, name: str, t0: float, report: Report | None = None) -> SolveResult:
    """A baseline's plan and the checker's verdict on it (``report``, where given)."""
    report = report if report is not None else check(problem, plan)
    return SolveResult(
        status=Status.FEASIBLE if report.fits else Status.INFEASIBLE,
        plan=plan if report.fits else None,
        report=report,
        objective=report.added_time,
        bound=0.0,
        wall_time=time.perf_counter() - t0,
        solver=name,
    )


def plan_with(problem: Problem, recomputed: AbstractSet[int]) -> Plan:
    """Recompute ``recomputed``; save everything else the backward or they read."""
    return plan_from_decisions(problem, decisions_with(problem, recomputed))


def recompute_every(problem: Problem) -> Plan:
    """Every recomputable candidate recomputed: the plan that holds least (a block
    checkpointed whole, as HF's gradient checkpointing does)."""
    return plan_with(problem, {v for v in problem.candidates if problem.nodes[v].recomputable})


# Values a ladder judges one by one with the checker, and plans it builds, at most: beyond
# that (a whole model's graph planned for several calls) it orders by each value's own
# recompute time per byte and builds only the rungs it returns.
LADDER_SCAN = 128


def holding_ladder(problem: Problem, rungs: int = 16) -> list[Plan]:
    """At most ``rungs`` plans from the block checkpointed whole (:func:`recompute_every`)
    towards saving everything, in order: each saves more than the last, adding the
    recomputed values in the order of the added time each takes off, alone, per byte it
    adds to what is saved (a free one first); where there are more steps than ``rungs``,
    steps spread evenly along them. Each plan is the checker's to judge: saving one value
    also changes what its readers need. With more than :data:`LADDER_SCAN` recomputable
    values, the order is by each one's own time per byte, without the checker.

    A graph whose forward runs many times before its backward (a block compiled on its
    own) holds every call's saved bytes at once, so what matters there is the time each
    byte held buys; a search for the least time under a peak does not step through
    these plans (its plans hold what a single call's peak allows)."""
    recomputable = {v for v in problem.candidates if problem.nodes[v].recomputable}
    free = problem.with_budget(None)
    gains: list[tuple[float, int]] = []
    if len(recomputable) <= LADDER_SCAN:
        base = check(free, plan_with(free, recomputable))
        for v in recomputable:
            report = check(free, plan_with(free, recomputable - {v}))
            added = report.saved_bytes - base.saved_bytes
            saved = base.added_time - report.added_time
            if saved > 0:
                gains.append((math.inf if added <= 0 else saved / added, v))
    else:
        for v in recomputable:
            n = problem.nodes[v]
            if n.time > 0:
                gains.append((math.inf if n.size <= 0 else n.time / n.size, v))
    gains.sort(key=lambda g: (-g[0], g[1]))
    order = [v for _, v in gains]
    # the steps built: every one, or as many as are returned, spread evenly
    steps = (range(1, len(order) + 1) if len(order) <= LADDER_SCAN
             else sorted({round(k * len(order) / rungs) for k in range(1, rungs + 1)}))
    ladder, seen = [], set()
    for k in steps:
        plan = plan_with(problem, recomputable - set(order[:k]))
        if plan.key not in seen:
            seen.add(plan.key)
            ladder.append(plan)
    if len(ladder) <= rungs:
        return ladder
    return [ladder[round(k * (len(ladder) - 1) / (rungs - 1))] for k in range(rungs)]


T = TypeVar("T")


class LastProblem(Generic[T]):
    """What is computed from a problem's nodes and host link alone (not its budget), kept
    for the last problem asked: by the identity of its nodes (the same object for the
    problem at every budget) and its host link. A solve asks for the baselines more than
    once (its known plans, their offloaded forms, then the least-peak plans that explain
    an infeasible budget), seconds each time on a 70B-shaped step."""

    def __init__(self) -> None:
        self._kept: tuple[tuple[object, float], T] | None = None

    def get(self, problem: Problem, make: Callable[[Problem], T]) -> T:
        """The value kept for ``problem``, else ``make(problem without its budget)``, kept."""
        key = (problem.nodes, problem.host_bandwidth)
        kept = self._kept  # read once: another thread may replace it meanwhile
        if kept is None or kept[0][0] is not key[0] or kept[0][1] != key[1]:
            kept = self._kept = (key, make(problem.with_budget(None)))
        return kept[1]


def rejudged(problem: Problem, found: Iterable[SolveResult]) -> list[SolveResult]:
    """Results judged without a budget on ``problem``'s nodes, each judged against its
    budget: only the verdict changes."""
    t0 = time.perf_counter()
    out = []
    for r in found:
        assert r.plan is not None and r.report is not None  # without a budget every plan fits
        out.append(judged(problem, r.plan, r.solver, t0, replace(r.report, budget=problem.budget)))
    return out


_LADDER: LastProblem[list[SolveResult]] = LastProblem()


def ladder_rungs(problem: Problem) -> list[SolveResult]:
    """The plans of :func:`holding_ladder`, each judged by the checker against
    ``problem``'s budget, as the baselines above are (no plan where it does not fit). The
    last problem's ladder and verdicts are kept: asked again at another budget, only the
    budget changes."""
    def judge(free: Problem) -> list[SolveResult]:
        t0 = time.perf_counter()
        return [judged(free, plan, "holding-ladder", t0) for plan in holding_ladder(free)]

    return rejudged(problem, _LADDER.get(problem, judge))


def decisions_with(problem: Problem, recomputed: AbstractSet[int]) -> dict[int, Decision]:
    """:func:`plan_with`'s decisions: ``recomputed`` less what nothing reads, recomputed;
    everything else the backward or they read, saved."""
    rec = set(recomputed)
    while True:  # a recomputed value nothing reads is dropped, and then what only it read
        needed = needed_values(problem, rec)
        if rec <= needed:
            break
        rec &= needed
    return {v: Decision.SAVE for v in needed} | {v: Decision.RECOMPUTE for v in rec}
