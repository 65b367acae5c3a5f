r"""Multi-level recomputation: keep one block input in several and rebuild the others in
the backward by rerunning the blocks from the nearest kept one.

The step's forward is a chain of segments (:func:`solvers.segments.find_segments`), segment
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

The model. With :math:`b_s` the bytes of :math:`x_s`, :math:`F_s` the seconds a sweep
spends in segment s, :math:`B_s` those of its leaf, and :math:`E_s` the bytes live during
segment s's backward besides the boundaries (from the reference plan, which saves every
boundary and recomputes every segment: its largest live bytes over the backward steps the
segment owns, less the boundaries before it still live there; a step is owned by the
segment whose window began last), a group :math:`[a, e]` costs

.. math::

    c(a, e) = \sum_{s=a}^{e-1} F_s + \sum_{s=a}^{e} B_s

and the j-th group fits the budget :math:`M` where, while each of its segments' backward
runs, the inputs kept so far (:math:`K_j`, of groups 2..j), its boundaries not yet
consumed and that segment's own bytes fit:

.. math::

    K_j + \max_{a \le s \le e} \Big(\sum_{a \le r < s} b_r + E_s\Big) \le M,
    \qquad K_j = \sum_{i=2}^{j} b_{a_i - 1}.

A dynamic program over (units of kept inputs, last segment of the last group) finds the
split of least total cost exactly for this model, the kept inputs counted in units of the
median boundary, each rounded up (:func:`input_units`), in :math:`O(n^2)` array operations
of length :math:`M` / unit. A boundary that cannot be recomputed, or that a segment other
than the next reads, ends a group. The composed plan goes to the checker, which stays the
judge; where it finds the plan over budget (the model's :math:`E_s` are the reference
plan's, not the grouped plan's), the split is searched again with the budget lowered by
the excess (below the split's own figure where the same split comes back), up to
``TIGHTEN`` times. Where the model fits no split, the split into single segments (the
least cost of any: no sweeps) goes to the checker as it is.

Recomputing each segment's values twice is what pays at budgets below checkpointing every
segment, where every single-recomputation plan holds at least one group's values at once;
above them the chain model (:mod:`solvers.chain`) is cheaper, and the default planner
takes whichever of its plans is cheapest.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from solvers.baselines import decisions_with, plan_with
from solvers.checker import Report, check, unread_entries, value_intervals
from solvers.deadline import Deadline
from solvers.plan import Decision, Plan, Step
from solvers.problem import Problem
from solvers.result import SolverConfig, SolveResult, Status
from solvers.segments import Segment, find_segments

TIGHTEN = 6  # splits searched at most, each with the budget lowered by the last plan's excess


@dataclass(frozen=True)
class MeasuredChain:
    """A problem's chain of segments, measured for the grouping model (module docstring)."""

    segments: tuple[Segment, ...]
    boundary: tuple[int, ...]  # x_s, the value ending segment s (one fewer than segments)
    size: tuple[int, ...]  # b_s, bytes of x_s
    movable: tuple[bool, ...]  # x_s may be rebuilt by a sweep (a group may run past it)
    sweep: tuple[tuple[int, ...], ...]  # values a sweep through segment s recomputes, in order
    leaf: tuple[dict[int, int], ...]  # value -> the step segment s's leaf recomputes it before
    sweep_time: tuple[float, ...]  # F_s, seconds
    leaf_time: tuple[float, ...]  # B_s, seconds
    own: tuple[int, ...]  # E_s, bytes

    @property
    def n(self) -> int:
        return len(self.segments)

    @functools.cached_property
    def groups(self) -> tuple[np.ndarray, np.ndarray]:
        """``cost[a, e]`` (seconds) and ``need[a, e]`` (the max term, bytes) of every group
        ``[a, e]`` the chain allows; inf where a boundary inside cannot be recomputed.
        Computed once: every split and every check of one reads them."""
        n = self.n
        cost = np.full((n, n), np.inf)
        need = np.full((n, n), np.inf)
        for a in range(n):
            held, sweep, leaf, most = 0, 0.0, 0.0, 0
            for e in range(a, n):
                if e > a:
                    if not self.movable[e - 1]:
                        break
                    held += self.size[e - 1]
                    sweep += self.sweep_time[e - 1]
                leaf += self.leaf_time[e]
                most = max(most, held + self.own[e])
                cost[a, e], need[a, e] = sweep + leaf, most
        return cost, need


def measure(problem: Problem) -> MeasuredChain | None:
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
    reference = plan_with(problem, {v for v in recomputed if v in interior})
    return MeasuredChain(
        segments=tuple(segments),
        boundary=boundary,
        size=tuple(nodes[x].size for x in boundary),
        movable=tuple(movable),
        sweep=tuple(sweeps),
        leaf=tuple(leaves),
        sweep_time=tuple(sum(nodes[v].time for v in s) for s in sweeps),
        leaf_time=tuple(sum(nodes[v].time for v in a) for a in leaves),
        own=own_bytes(problem, segments, boundary, reference),
    )


def own_bytes(problem: Problem, segments: Sequence[Segment], boundary: Sequence[int], reference: Plan
              ) -> tuple[int, ...]:
    """:math:`E_s` for each segment: the most bytes ``reference`` (every boundary saved,
    every segment recomputed) holds at a backward step the segment owns, less the
    boundaries before it still live there. A step belongs to the segment whose window began
    last (a window may reach far: one late read of a segment's value); the steps before
    every window, to the first."""
    unbudgeted = problem.with_budget(None)
    timeline, spans = check(unbudgeted, reference).timeline, value_intervals(unbudgeted, reference)
    f = problem.n_forward
    starts = sorted((seg.window[0], k) for k, seg in enumerate(segments) if seg.window is not None)
    firsts = np.array([w for w, _ in starts] or [0])
    owners = np.array([k for _, k in starts] or [0])
    owner = owners[np.maximum(np.searchsorted(firsts, np.arange(f, len(problem.nodes)), side="right") - 1, 0)]
    held = np.zeros(len(owner))
    for r, x in enumerate(boundary):
        for lo, hi in spans.get(x, ()):
            if max(lo, f) <= hi:
                part = slice(max(lo, f) - f, hi + 1 - f)
                held[part] += problem.nodes[x].size * (owner[part] > r)
    rest = np.array(timeline[f:]) - held
    return tuple(int(rest[owner == k].max()) if (owner == k).any() else 0 for k in range(len(segments)))


def input_units(chain: MeasuredChain) -> tuple[int, list[int]]:
    """The unit :func:`split` counts kept inputs in (the median boundary's bytes) and, for
    each segment a, the units of its input :math:`x_{a-1}` rounded up (0 for the first)."""
    unit = max(1, int(np.median([b for b in chain.size if b] or [1])))
    return unit, [0] + [-(-b // unit) for b in chain.size]


def split(chain: MeasuredChain, budget: float) -> list[tuple[int, int]] | None:
    """The groups ``(a, e)`` of least total cost that fit ``budget`` in the model (module
    docstring), first to last; None where no split fits.

    The kept inputs are counted in units of the median boundary's bytes, each rounded up
    (:func:`input_units`: never below its size). ``best[k, e]`` is the least cost of
    groups covering segments 0..e whose inputs take k units, ``start[k, e]`` where the
    last of them starts."""
    n = chain.n
    unit, weight = input_units(chain)
    # No split keeps more than every input: more units change nothing, and would only
    # grow the arrays (a budget far above the boundaries' bytes).
    units = min(int(budget // unit), sum(weight)) + 1 if budget >= 0 else 0
    if units == 0:
        return None
    cost, need = chain.groups
    best = np.full((units, n), np.inf)
    start = np.full((units, n), -1, dtype=np.int64)
    held = np.arange(units) * unit  # bytes of the kept inputs, k units
    for e in range(n):
        for a in range(e + 1):
            if not np.isfinite(cost[a, e]):
                continue
            w = weight[a]
            if w >= units:
                continue
            before = np.full(units, np.inf)  # groups covering 0..a-1, by the units they keep
            if a == 0:
                before[0] = 0.0
            else:
                before[w:] = best[:units - w, a - 1]
            total = np.where(held + need[a, e] <= budget, before + cost[a, e], np.inf)
            better = total < best[:, e]
            best[better, e] = total[better]
            start[better, e] = a
    k = int(np.argmin(best[:, n - 1]))
    if not np.isfinite(best[k, n - 1]):
        return None
    groups, e = [], n - 1
    while e >= 0:
        a = int(start[k, e])
        groups.append((a, e))
        k -= weight[a]
        e = a - 1
    return groups[::-1]


def model_peak(chain: MeasuredChain, groups: Sequence[tuple[int, int]]) -> float:
    """The largest left side of the model's memory constraint over ``groups`` (kept inputs
    at their bytes)."""
    _, need = chain.groups
    kept, most = 0, 0.0
    for a, e in groups:
        kept += chain.size[a - 1] if a > 0 else 0
        most = max(most, kept + need[a, e])
    return most


def compose(problem: Problem, chain: MeasuredChain, groups: Sequence[tuple[int, int]]) -> Plan:
    """The plan of a split into ``groups`` (module docstring): each group's input saved,
    its sweep scheduled before the first backward step that needs one of its boundaries,
    each segment's leaf at its own anchors; everything else the backward reads saved."""
    kept = {chain.boundary[a - 1] for a, _ in groups if a > 0}
    rec = {v for s in chain.leaf for v in s} | {v for a, e in groups for s in range(a, e) for v in chain.sweep[s]}
    decisions = decisions_with(problem, rec - kept)
    rec = {v for v, d in decisions.items() if d is Decision.RECOMPUTE}
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


def solve(problem: Problem, config: SolverConfig = SolverConfig(), *,
          chain: MeasuredChain | None = None, deadline: Deadline | None = None) -> SolveResult:
    """The cheapest grouped plan within ``problem.budget`` that the checker accepts, or
    status UNKNOWN and no plan (no chain, no budget, or no split fits: neither one the
    model fits nor, where it fits none, every segment a group of its own). ``chain``: the
    problem's chain, already measured. Status FEASIBLE: the model's optimum is not the
    flat problem's (no bound is claimed). Past ``deadline`` (made from ``config`` where
    not given) no split is searched again."""
    t0 = time.perf_counter()
    deadline = deadline or Deadline.of(config)
    chain = chain or (measure(problem) if problem.budget is not None else None)
    budget = problem.budget
    if chain is not None and budget is not None:
        target: float = budget
        tried: set[tuple[tuple[int, int], ...]] = set()
        for tries in range(TIGHTEN):
            if tries and deadline.expired():
                break
            groups = split(chain, target)
            if groups is None:
                break
            plan = compose(problem, chain, groups)
            report = check(problem, plan)
            if report.fits:
                return _found(plan, report, groups, t0)
            target -= report.peak - budget
            if tuple(groups) in tried:  # the same split again: below what the model gives it
                target = min(target, model_peak(chain, groups) - 1)
            tried.add(tuple(groups))
        # The model's figures are bounds (kept inputs rounded up to whole units; a segment's
        # input counted over all its steps, though the checker frees it at its last read):
        # where it refuses every split, the cheapest of all, every segment a group, may still
        # fit. At the save-all peak (a budget of 100%) it refused an MLP's, which fits.
        singles = [(s, s) for s in range(chain.n)]
        plan = compose(problem, chain, singles)
        report = check(problem, plan)
        if report.fits:
            return _found(plan, report, singles, t0)
    return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=math.inf, bound=0.0,
                       wall_time=time.perf_counter() - t0, solver="multilevel")


def _found(plan: Plan, report: Report, groups: Sequence[tuple[int, int]], t0: float) -> SolveResult:
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=report, objective=report.added_time,
                       bound=0.0, wall_time=time.perf_counter() - t0, solver="multilevel",
                       stats={"groups": len(groups), "longest_group": max(e - a + 1 for a, e in groups)})


def min_peak(problem: Problem, config: SolverConfig = SolverConfig(), *,
             chain: MeasuredChain | None = None, deadline: Deadline | None = None) -> SolveResult:
    """The grouped plan of least checked peak among the cheapest splits at a sweep of
    budgets, from the model's least feasible one up; past ``deadline`` (made from
    ``config`` where not given) the search for that budget stops where it is, at one the
    model fits, and the sweep after its first plan. Status UNKNOWN and no plan where the
    problem has no chain."""
    t0 = time.perf_counter()
    deadline = deadline or Deadline.of(config)
    chain = chain or measure(problem)
    if chain is None:
        return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=math.inf, bound=0.0,
                           wall_time=time.perf_counter() - t0, solver="multilevel-min-peak")
    unbudgeted = problem.with_budget(None)
    # The model's least feasible budget, to 0.1% while time is left: every segment a group
    # of its own fits at its own figure, and nothing fits below zero.
    low, high = 0.0, model_peak(chain, [(s, s) for s in range(chain.n)])
    at_high: list[tuple[int, int]] | None = None  # the split found at ``high``, once one is
    while high - low > 1e-3 * high and not deadline.expired():
        mid = (low + high) / 2
        if (found := split(chain, mid)) is not None:
            high, at_high = mid, found
        else:
            low = mid
    low = high
    best: tuple[int, Plan] | None = None  # the least checked peak, its plan
    for i, b in enumerate(np.geomspace(max(low, 1), max(low, 1) * 2, 8)):
        if best is not None and deadline.expired():
            break
        # the sweep's first budget is the search's last: its split is known
        if (g := at_high if i == 0 and at_high is not None and low >= 1 else split(chain, float(b))) is not None:
            plan = compose(problem, chain, g)
            peak = check(unbudgeted, plan).peak
            if best is None or peak < best[0]:
                best = (peak, plan)
    assert best is not None  # the model's least feasible budget has a split
    report = check(problem, best[1])
    return SolveResult(status=Status.FEASIBLE, plan=best[1], report=report, objective=report.added_time, bound=0.0,
                       wall_time=time.perf_counter() - t0, solver="multilevel-min-peak")
