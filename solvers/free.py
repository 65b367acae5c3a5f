"""The plan for "no budget" under a fusing compiler: the least peak that recomputing only
*free* values reaches, with as few recomputations as that peak allows.

Under Inductor a recomputed pointwise op fuses into the kernel that reads it, or is
rebuilt in one pass over memory for a matmul: it computes no FLOPs and costs a launch,
that pass and its transcendentals at most (:func:`solvers.baselines.free_values`).
Recomputing every free value (:func:`solvers.baselines.free_recompute`) is not the least
peak they give: a recomputation keeps its inputs alive into the backward, and where
those are larger than what it frees the peak goes up. So the choice among free values
is a search:

1. minimize the peak over plans that recompute free values only (CP-SAT's minimum-peak
   model on the problem where nothing else is recomputable or offloadable), hinted with
   recomputing them all, stopped ``FREE_STALL`` seconds after its last better plan;
2. drop every recomputation the plan keeps that peak without (a checker replay each). A
   CP-SAT search for the least time at that peak first has to find a plan at exactly the
   least peak again: on the 12-layer GPT-2 it ran 20 s to save 0.07 ms of modelled time.

On the Llama benchmark (554 values, 164 of them free) recomputing every free value peaks
at 808.8 MiB; step 1 finds 704.75 MiB within its 2 s stall, for 75 ms of modelled time
(SiLU's exponentials and the RMSNorm outputs rebuilt for their matmuls).
"""

from __future__ import annotations

import time
from dataclasses import replace

from ortools.sat.python import cp_model

from solvers.baselines import free_plan, free_values, plan_with
from solvers.checker import check
from solvers.cpsat import build, extract_plan, hint
from solvers.plan import Decision, Plan
from solvers.problem import Problem
from solvers.result import SolverConfig, SolveResult, Status
from solvers.sat import make_peak_solver, search

FREE_STALL = 2.0  # seconds without a lower peak before step 1 stops
# Step 1's limit under ``config.deterministic``, which has no stall watch: deterministic
# seconds of CP-SAT's interleaved portfolio, whose LP workers take 24-65 wall seconds
# per deterministic second on this model (Llama and GPT-2 benchmark problems, 2 cores:
# 0.1 reaches the peaks the 2 s stall does, 704.75 and 632.75 MiB, in 3.9 s and 2.4 s).
FREE_WORK = 0.1


def only_free(problem: Problem, free: set[int]) -> Problem:
    """``problem`` where only the values in ``free`` may be recomputed, nothing offloaded."""
    nodes = tuple(replace(n, recomputable=v in free, offloadable=False) for v, n in enumerate(problem.nodes))
    return replace(problem, nodes=nodes)


def floor(restricted: Problem) -> int:
    """A lower bound on the peak of any plan of ``restricted`` (:func:`only_free`'s): bytes
    live at the busiest step whatever it decides. A recomputable value lives at least to
    its last forward read; any other to its last read (saved, as nothing is offloaded). A
    value with an unstored forward copy that the backward need not find saved may hold
    nothing."""
    p = restricted
    recomputable = {v for v in p.candidates if p.nodes[v].recomputable}
    saved = {v for v in p.candidates if p.backward_uses[v] and v not in recomputable}
    delta = [0] * (len(p.nodes) + 1)
    for i, n in enumerate(p.nodes):
        if n.resident or n.size == 0 or (p.computed_in(i) is not None and i not in saved):
            continue
        hi = p.last_step if n.keep else p.forward_end(i) if i in recomputable else p.fixed_end(i)
        delta[i] += n.size
        delta[hi + 1] -= n.size
    live, most = 0, 0
    for d in delta[:-1]:
        live += d
        most = max(most, live)
    return most


def least_peak_free(problem: Problem, config: SolverConfig = SolverConfig(), *,
                    free_time: float | None = None) -> SolveResult:
    """The plan of least peak among those recomputing only free values, with every
    recomputation it can do without at that peak dropped, judged against ``problem`` (and
    its budget); never above :func:`solvers.baselines.free_recompute`'s peak, which it
    starts from. Status OPTIMAL when the peak is proven least, FEASIBLE when not,
    INFEASIBLE (and no plan) when the least peak found is over the budget."""
    t0 = time.perf_counter()
    free = free_values(problem, free_time)
    start = free_plan(problem, free_time)
    proven, found = least_peak(only_free(problem, free).with_budget(None), config, start)
    candidates = [start] if found is None else [found, start]
    best = min(candidates, key=lambda p: check(problem, p).peak)
    plan = trimmed(problem, best)
    report = check(problem, plan)
    return SolveResult(
        status=Status.INFEASIBLE if not report.fits else Status.OPTIMAL if proven else Status.FEASIBLE,
        plan=plan if report.fits else None, report=report, objective=report.added_time, bound=0.0,
        wall_time=time.perf_counter() - t0, solver="free_least_peak",
        stats={"free": len(free), "all_free_peak": check(problem, start).peak},
    )


def trimmed(problem: Problem, plan: Plan) -> Plan:
    """``plan`` less each recomputation it keeps its peak without, dearest first, in passes
    until none can go (a checker replay each; everything else the backward reads is saved,
    :func:`plan_with`). A drop can free another: a second pass looks again.

    A plan that peaks lower than the canonical plan of its recomputations (CP-SAT's may
    place them otherwise) is kept as it is unless a smaller set of recomputations reaches
    its peak too."""
    peak = check(problem, plan).peak
    kept = set(plan.of(Decision.RECOMPUTE))
    canonical = check(problem, plan_with(problem, kept)).peak <= peak
    dropped = True
    while dropped:
        dropped = False
        for v in sorted(kept, key=lambda v: (-problem.nodes[v].time, v)):
            if check(problem, plan_with(problem, kept - {v})).peak <= peak:
                kept.discard(v)
                dropped = canonical = True
    return plan_with(problem, kept) if canonical else plan


def least_peak(restricted: Problem, config: SolverConfig, start: Plan) -> tuple[bool, Plan | None]:
    """CP-SAT's minimum-peak model on ``restricted``, hinted with ``start``, stopped
    ``FREE_STALL`` seconds after its last better plan (or sooner if ``config`` says so;
    under ``config.deterministic`` after ``FREE_WORK`` deterministic seconds): whether the
    peak is proven least, and the plan (None if it found none)."""
    stall = FREE_STALL if config.stall_time <= 0 else min(config.stall_time, FREE_STALL)
    config = replace(config, stall_time=stall)
    if config.deterministic:
        config = replace(config, time_limit=min(config.time_limit, FREE_WORK))
    model = build(restricted, minimize_peak=True)
    hint(model, start)
    solver = make_peak_solver(config)
    code = search(solver, model.cp, config)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False, None
    return code == cp_model.OPTIMAL, extract_plan(model, solver)
