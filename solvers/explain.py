"""Why a plan decides what it decides, and what makes a budget infeasible.

:func:`explain` gives one :class:`Explained` row per saved, recomputed or offloaded value,
largest first, with a reason a reader can check against the numbers (the value's bytes,
its recompute time, whether it is live at the plan's peak). :func:`culprits` lists the
values live at the peak step of the smallest-peak plan, largest first, each with why no
plan can free it there: they are what keeps a smaller budget out of reach.

Both read per-value live intervals (:func:`value_intervals`), the checker's rules
(:mod:`solvers.checker`) kept per value; the tests check that they add up to the
checker's timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from solvers.checker import Report, transfer_stalls, value_intervals
from solvers.plan import Decision, Plan
from solvers.problem import Problem


@dataclass(frozen=True)
class Explained:
    index: int
    name: str
    op: str
    decision: Decision
    size: int  # bytes
    time: float  # seconds (or the problem's time unit) of one recomputation
    flops: float
    why: str


@dataclass(frozen=True)
class Culprit:
    index: int
    name: str
    op: str
    size: int  # bytes live at the peak step
    why: str


def live_at(problem: Problem, plan: Plan, step: int) -> list[int]:
    """Values occupying memory at ``step``."""
    return [i for i, spans in value_intervals(problem, plan).items()
            if any(lo <= step <= hi for lo, hi in spans)]


def explain(problem: Problem, plan: Plan, report: Report, *, unconstrained_peak: int) -> list[Explained]:
    """Every value the plan decides on, largest first, with a reason."""
    at_peak = set(live_at(problem, plan, report.peak_step))
    everything_fits = problem.budget is None or unconstrained_peak <= problem.budget
    stalls = transfer_stalls(problem, plan)  # one replay of the copy engines for every row
    rows = []
    for i, d in plan.decisions.items():
        n = problem.nodes[i]
        rows.append(Explained(i, n.name, n.op, d, n.size, n.time, n.flops,
                              _why(problem, plan, i, d, at_peak=i in at_peak,
                                   everything_fits=everything_fits, peak_step=report.peak_step,
                                   stalls=stalls)))
    rows.sort(key=lambda r: (-r.size, r.index))
    return rows


def _why(problem: Problem, plan: Plan, i: int, d: Decision, *, at_peak: bool,
         everything_fits: bool, peak_step: int, stalls: dict[int, float]) -> str:
    n = problem.nodes[i]
    if d is Decision.SAVE:
        if everything_fits:
            return "everything fits the budget: saving adds no time"
        if not n.recomputable:
            return "cannot be recomputed (random op or must-save)"
        if n.size == 0:
            return "occupies no memory"
        if not at_peak:
            return f"not live at the peak (step {peak_step}): saving it costs no peak memory"
        if n.flops > 0:
            return f"expensive to recompute: {n.flops:.3g} FLOPs for {n.size} B"
        return "recomputing it would also need what it reads: saving is cheaper"
    if d is Decision.OFFLOAD:
        t = plan.transfer(i)
        if t is None:
            return "copied to host after its last forward use, back before its first backward use"
        # Hidden where the compute stream never waits at the end of either copy's window.
        back_due = next(s.before for s in plan.schedule if s.node == i) - 1
        hidden = t.offload_at not in stalls and back_due not in stalls
        return (f"copied to host over steps {problem.copy_out_from(i)}..{t.offload_at} and back over "
                f"steps {t.reload_at}..{back_due} ({'hidden under compute' if hidden else 'partly exposed'})")
    readers = [u for u in problem.forward_users[i] if plan.decisions.get(u) is Decision.RECOMPUTE]
    if not problem.backward_uses[i] and readers:
        names = ", ".join(problem.nodes[u].name for u in readers[:3])
        return f"input of recomputed {names}"
    if n.time == 0:
        return "free to recompute (a view or a zero-cost op)"
    if n.flops == 0:
        return "cheap to recompute: memory-bound, no FLOPs"
    return f"cheap for its size: {n.flops:.3g} FLOPs to free {n.size} B over the peak"


def culprits(problem: Problem, plan: Plan, report: Report) -> list[Culprit]:
    """Values live at the peak step of ``plan`` (the smallest-peak plan), largest first."""
    k = report.peak_step
    out = []
    for i in live_at(problem, plan, k):
        n = problem.nodes[i]
        d = plan.decisions.get(i)
        if i == k:
            why = "computed at this step"
        elif n.keep:
            why = "kept to the end of the step (an output or a gradient)"
        elif n.backward:
            why = f"backward value still read at step {max(problem.users[i])}"
        elif n.returned and k <= problem.last_forward_use[i]:
            why = "returned: alive until the forward hands it over at its end"
        elif k <= problem.last_forward_use[i]:
            why = f"read by the forward at step {problem.last_forward_use[i]}"
        elif d is Decision.SAVE and not n.recomputable:
            why = "must be saved (random op or must-save)"
        elif d is Decision.SAVE:
            why = "saved: recomputing it does not lower this peak"
        else:
            why = "rematerialized for a backward step at or after this one"
        out.append(Culprit(i, n.name, n.op, n.size, why))
    out.sort(key=lambda c: (-c.size, c.index))
    return out
