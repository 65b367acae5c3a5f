r"""Multi-level recomputation: keep one block input in several and rebuild the others in
the backward by rerunning the blocks from the nearest kept one.

The step's forward is a chain of segments (:func:`solvers.chain.find_segments`), segment
``s`` ending at its boundary :math:`x_s` (a block's output, the next block's input). A
plan here splits the chain into *groups* of consecutive segments :math:`[a, e]`:

* the forward saves each group's input :math:`x_{a-1}` and none of the group's own values;
* in the backward, before the first of the group's segments needs its input, one *sweep*
  reruns segments :math:`a..e-1` from :math:`x_{a-1}`, keeping only their boundaries
  :math:`x_a..x_{e-1}`;
* then each segment :math:`s = e, e-1, .., a` recomputes from :math:`x_{s-1}` what its
  own backward reads (its *leaf*), each value right before the backward needs it.

A grouped segment's values are recomputed twice, in the sweep and in the leaf: the second
level of Revolve's and Rotor's schedules. A group of k segments holds k boundaries and one
segment's values at a time, where checkpointing every k-th boundary (one recomputation of
each value) holds all k segments' values until their own backward. A group of one segment
is checkpointing that segment.

The model. With :math:`b_s` the bytes of :math:`x_s`, :math:`u` the largest of them,
:math:`F_s` the seconds a sweep spends in segment s, :math:`B_s` those of its leaf, and
:math:`E_s` the bytes live during segment s's backward besides the boundaries (the
reference plan's, which saves every boundary and recomputes every segment: its largest
live bytes over the segment's window, less the boundaries saved before it), the j-th group
:math:`[a, e]` (counted from the first) costs

.. math::

    c(a, e) = \sum_{s=a}^{e-1} F_s + \sum_{s=a}^{e} B_s

and fits the budget :math:`M` where, while each of its segments' backward runs, the
inputs of the groups before it, its boundaries not yet consumed and that segment's own
bytes fit:

.. math::

    (j - 1)\,u + \max_{a \le s \le e} \Big(\sum_{a \le r < s} b_r + E_s\Big) \le M.

A dynamic program over (groups so far, last segment of the last group) finds the split of
least total cost exactly for this model, in :math:`O(n^2)` array operations of length
:math:`n`. A boundary that cannot be recomputed, or that a segment other than the next
reads, ends a group. The composed plan goes to
the checker, which stays the judge; where it finds the plan over budget (the model's
:math:`E_s` are the reference plan's, not the grouped plan's), the split is searched again
with the budget lowered by the excess (below the split's own figure where the same split
comes back), up to ``TIGHTEN`` times.

Recomputing each segment's values twice is what pays at budgets below checkpointing every
segment, where every single-recomputation plan holds at least one group's values at once;
above them the chain model (:mod:`solvers.chain`) is cheaper, and the default planner
takes whichever of its plans is cheapest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from solvers.baselines import plan_with
from solvers.chain import Segment, find_segments
from solvers.checker import check, unread_entries
from solvers.plan import Decision, Plan, Step, needed_values
from solvers.problem import Problem
from solvers.result import SolverConfig, SolveResult, Status

TIGHTEN = 6  # splits searched at most, each with the budget lowered by the last plan's excess


@dataclass(frozen=True)
class Chain:
    """A problem's chain of segments, measured for the grouping model (module docstring)."""

    segments: tuple[Segment, ...]
    boundary: tuple[int, ...]  # x_s, the value ending segment s (one fewer than segments)
    movable: tuple[bool, ...]  # x_s may be rebuilt by a sweep (a group may run past it)
    sweep: tuple[tuple[int, ...], ...]  # values a sweep through segment s recomputes, in order
    leaf: tuple[dict[int, int], ...]  # value -> the step segment s's leaf recomputes it before
    sweep_time: tuple[float, ...]  # F_s, seconds
    leaf_time: tuple[float, ...]  # B_s, seconds
    own: tuple[int, ...]  # E_s, bytes

    @property
    def n(self) -> int:
        return len(self.segments)


def measure(problem: Problem) -> Chain | None:
    """``problem``'s chain, measured; None where it has no chain of segments."""
    segments = find_segments(problem)
    if len(segments) < 2:
        return None
    boundary = tuple(s.forward[1] for s in segments[:-1])
    interior = {v: k for k, s in enumerate(segments) for v in s.interior}
    nodes = problem.nodes
    # A boundary may be rebuilt by a sweep where only the next segment reads it (in the
    # forward): the segments after that run from their own inputs.
    movable = [nodes[x].recomputable and all(segments[s + 1].forward[0] <= u <= segments[s + 1].forward[1]
                                             for u in problem.forward_users[x])
               for s, x in enumerate(boundary)]
    recomputed = {v for v in interior if nodes[v].recomputable}
    recomputed |= {x for x, m in zip(boundary, movable, strict=True) if m}

    def sweep_of(s: int) -> tuple[int, ...]:
        """What rebuilds x_s from x_{s-1}: x_s and the recomputed values of segment s it
        reads, directly or through each other."""
        out, todo = set(), [boundary[s]]
        while todo:
            v = todo.pop()
            if v in out or v not in recomputed or (v != boundary[s] and interior.get(v) != s):
                continue
            out.add(v)
            todo.extend(nodes[v].deps)
        return tuple(sorted(out))

    leaves: list[dict[int, int]] = []
    for seg in segments:
        anchor: dict[int, int] = {}
        for v in sorted(seg.interior, reverse=True):  # readers first
            if v not in recomputed:
                continue
            needs = [*problem.backward_uses[v], *(anchor[u] for u in problem.forward_users[v] if u in anchor)]
            if needs:
                anchor[v] = min(needs)
        leaves.append(anchor)
    sweeps = [sweep_of(s) if s < len(boundary) and boundary[s] in recomputed else () for s in range(len(segments))]
    reference = check(problem.with_budget(None), plan_with(problem, {v for v in recomputed if v in interior}))
    own = []
    for k, seg in enumerate(segments):
        if seg.window is None:
            own.append(0)
            continue
        held = sum(nodes[b].size for b in boundary[:k])
        own.append(max(0, max(reference.timeline[seg.window[0]:seg.window[1] + 1]) - held))
    return Chain(
        segments=tuple(segments),
        boundary=boundary,
        movable=tuple(movable),
        sweep=tuple(sweeps),
        leaf=tuple(leaves),
        sweep_time=tuple(sum(nodes[v].time for v in s) for s in sweeps),
        leaf_time=tuple(sum(nodes[v].time for v in a) for a in leaves),
        own=tuple(own),
    )


def groups_model(problem: Problem, chain: Chain) -> tuple[np.ndarray, np.ndarray]:
    """``cost[a, e]`` (seconds) and ``need[a, e]`` (the max term, bytes) of every group
    ``[a, e]`` the chain allows; inf where a boundary inside cannot be recomputed."""
    n = chain.n
    cost = np.full((n, n), np.inf)
    need = np.full((n, n), np.inf)
    for a in range(n):
        held, sweep, leaf, most = 0, 0.0, 0.0, 0
        for e in range(a, n):
            if e > a:
                if not chain.movable[e - 1]:
                    break
                held += problem.nodes[chain.boundary[e - 1]].size
                sweep += chain.sweep_time[e - 1]
            leaf += chain.leaf_time[e]
            most = max(most, held + chain.own[e])
            cost[a, e], need[a, e] = sweep + leaf, most
    return cost, need


def split(problem: Problem, chain: Chain, budget: float) -> list[tuple[int, int]] | None:
    """The groups ``(a, e)`` of least total cost that fit ``budget`` in the model (module
    docstring), first to last; None where no split fits.

    ``best[e]`` after round j is the least cost of j groups covering segments 0..e, the
    last ending at e; ``start[j][e]`` where that last group starts."""
    n = chain.n
    u = max(problem.nodes[x].size for x in chain.boundary)
    cost, need = groups_model(problem, chain)
    best = np.where(need[0] <= budget, cost[0], np.inf)
    starts = [np.zeros(n, dtype=np.int64)]
    totals = [best[n - 1]]
    for j in range(2, n + 1):
        room = budget - (j - 1) * u
        if room < 0 or not np.isfinite(best[:-1]).any():
            break
        before = np.concatenate([[np.inf], best[:-1]])  # groups covering 0..a-1
        candidate = np.where(need <= room, before[:, None] + cost, np.inf)
        starts.append(candidate.argmin(axis=0))
        best = candidate[starts[-1], np.arange(n)]
        totals.append(best[n - 1])
    j = int(np.argmin(totals)) + 1
    if not np.isfinite(totals[j - 1]):
        return None
    groups, e = [], n - 1
    for g in range(j, 0, -1):
        a = int(starts[g - 1][e])
        groups.append((a, e))
        e = a - 1
    return groups[::-1]


def model_peak(problem: Problem, chain: Chain, groups: Sequence[tuple[int, int]]) -> float:
    """The largest left side of the model's memory constraint over ``groups``."""
    u = max(problem.nodes[x].size for x in chain.boundary)
    _, need = groups_model(problem, chain)
    return max((j - 1) * u + need[a, e] for j, (a, e) in enumerate(groups, start=1))


def compose(problem: Problem, chain: Chain, groups: Sequence[tuple[int, int]]) -> Plan:
    """The plan of a split into ``groups`` (module docstring): each group's input saved,
    its sweep scheduled before the first backward step that needs one of its boundaries,
    each segment's leaf at its own anchors; everything else the backward reads saved."""
    kept = {chain.boundary[a - 1] for a, _ in groups if a > 0}
    rec = {v for s in chain.leaf for v in s} | {v for a, e in groups for s in range(a, e) for v in chain.sweep[s]}
    rec -= kept
    while True:  # a recomputed value nothing reads is dropped, and then what only it read
        needed = needed_values(problem, rec)
        if rec <= needed:
            break
        rec &= needed
    decisions = {v: Decision.SAVE for v in needed} | {v: Decision.RECOMPUTE for v in rec}
    entries: list[tuple[int, int]] = []  # (before, value), in the order they run
    for a, e in reversed(groups):
        leaves = [(t, v) for s in range(e, a - 1, -1) for v, t in chain.leaf[s].items() if v in rec]
        if e > a:
            swept = sorted({v for s in range(a, e) for v in chain.sweep[s] if v in rec})
            reads = [t for t, v in leaves if chain.segments[a].forward[1] < v]
            reads += [t for x in chain.boundary[a:e] for t in problem.backward_uses[x]]
            before = min(reads, default=problem.n_forward)
            entries += [(before, v) for v in swept]
        entries += sorted(leaves)
    order = sorted(range(len(entries)), key=lambda k: (entries[k][0], k))
    plan = Plan(decisions, tuple(Step(entries[k][1], entries[k][0]) for k in order))
    while unread := set(unread_entries(problem, plan)):  # a sweep's copy its leaf's replaces
        plan = Plan(decisions, tuple(s for k, s in enumerate(plan.schedule) if k not in unread))
    return plan


def solve(problem: Problem, config: SolverConfig = SolverConfig(), *, chain: Chain | None = None) -> SolveResult:
    """The cheapest grouped plan within ``problem.budget`` that the checker accepts, or
    status UNKNOWN and no plan (no chain, no budget, or no split fits). ``chain``: the
    problem's chain, already measured. Status FEASIBLE: the model's optimum is not the
    flat problem's (no bound is claimed)."""
    t0 = time.perf_counter()
    chain = chain or (measure(problem) if problem.budget is not None else None)
    budget = problem.budget
    if chain is not None and budget is not None:
        target: float = budget
        tried: set[tuple[tuple[int, int], ...]] = set()
        for _ in range(TIGHTEN):
            groups = split(problem, chain, target)
            if groups is None:
                break
            plan = compose(problem, chain, groups)
            report = check(problem, plan)
            if report.fits:
                return SolveResult(status=Status.FEASIBLE, plan=plan, report=report, objective=report.added_time,
                                   bound=0.0, wall_time=time.perf_counter() - t0, solver="multilevel",
                                   stats={"groups": len(groups), "longest_group": max(e - a + 1 for a, e in groups)})
            target -= report.peak - budget
            if tuple(groups) in tried:  # the same split again: below what the model gives it
                target = min(target, model_peak(problem, chain, groups) - 1)
            tried.add(tuple(groups))
    return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=math.inf, bound=0.0,
                       wall_time=time.perf_counter() - t0, solver="multilevel")


def min_peak(problem: Problem, config: SolverConfig = SolverConfig(), *, chain: Chain | None = None) -> SolveResult:
    """The grouped plan of least checked peak among the cheapest splits at a sweep of
    budgets, from the model's least feasible one up; status UNKNOWN and no plan where the
    problem has no chain."""
    t0 = time.perf_counter()
    chain = chain or measure(problem)
    if chain is None:
        return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=math.inf, bound=0.0,
                           wall_time=time.perf_counter() - t0, solver="multilevel-min-peak")
    unbudgeted = problem.with_budget(None)
    _, need = groups_model(problem, chain)
    low, high = float(np.nanmin(np.where(np.isfinite(need), need, np.nan))), float(sum(n.size for n in problem.nodes))
    while split(problem, chain, low) is None and low < high:  # the model's least feasible budget
        low = low * 1.05 + 1
    plans = [compose(problem, chain, g) for b in np.geomspace(max(low, 1), max(low, 1) * 2, 8)
             if (g := split(problem, chain, float(b))) is not None]
    best = min(plans, key=lambda p: check(unbudgeted, p).peak)
    report = check(problem, best)
    return SolveResult(status=Status.FEASIBLE, plan=best, report=report, objective=report.added_time, bound=0.0,
                       wall_time=time.perf_counter() - t0, solver="multilevel-min-peak")
