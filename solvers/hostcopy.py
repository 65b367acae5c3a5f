"""Moving what a plan keeps to host memory where its copies hide under the compute.

A saved value occupies the device from its forward to its last backward read. Offloaded
instead, it occupies the device only until its copy out is done and again from when its
copy back is issued (the checker's copy engines, :func:`solvers.checker.transfer_stalls`).
Those stretches lie inside the saved one, so offloading never raises a plan's peak, and
where both copies finish inside windows of compute long enough to cover them, it adds no
time: a free saving, and at scale a large one (a Llama block's input, 32 MiB, takes 0.67 ms
at 50 GB/s, under a tenth of the block's forward).

:func:`offload_hidden` makes that move for the largest saved values first (or those it is
told to try first), each only if every copy accepted so far still hides with it. Windows
are placed on the clock of the steps' own compute (``Node.time``; no waits, since none
are let in):

* out, as soon as possible: the copies issued at one step go as a batch after the
  engine's earlier work; the window ends at the first step whose end covers the batch,
  which frees the device copy as early as the engine allows;
* back, as late as possible: going from the last deadline (the start of the value's first
  backward consumer) to the first, each copy ends by its deadline and before the next
  one is issued, and is issued at the latest step that starts early enough.

The checker judges the result; a plan whose added time or peak it finds above the
original's is not returned.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Mapping

from solvers.checker import Report, check
from solvers.plan import Decision, Plan, Step, Transfer
from solvers.problem import Problem

MOST_VALUES = 512  # saved values tried, the largest first: each try replays every accepted copy


def offload_hidden(problem: Problem, plan: Plan, *, first: Collection[int] = (),
                   due: Mapping[int, int] | None = None,
                   report: Report | None = None) -> tuple[Plan, Report]:
    """``plan`` with saved values moved to host memory where both their copies hide, and the
    checker's report on it; ``plan`` and ``report`` (computed if not given) where nothing
    moves. Values in ``first`` are tried before the others, each group largest first.
    ``due``: the last step a value's copy out may end at (its device copy freed), where
    the caller counts on it being gone by then; otherwise the forward's last step."""
    report = report if report is not None else check(problem, plan)
    first = set(first)
    if problem.host_bandwidth <= 0 or problem.single_phase:
        return plan, report
    f = problem.n_forward
    pool = [v for v in plan.of(Decision.SAVE)
            if problem.nodes[v].offloadable and problem.nodes[v].size > 0
            and problem.copy_out_from(v) < f]
    pool.sort(key=lambda v: (v not in first, -problem.nodes[v].size, v))
    clock = Clock(problem)
    first_entry: dict[int, int] = {}
    for s in plan.schedule:
        first_entry.setdefault(s.node, s.before)
    anchor = {v: min([*problem.backward_uses[v], *(first_entry[u] for u in problem.forward_users[v]
                                                   if plan.decisions.get(u) is Decision.RECOMPUTE)])
              for v in pool}
    anchor.update({t.node: first_entry[t.node] for t in plan.transfers})
    moving: list[int] = []
    windows: dict[int, tuple[int, int]] = {}
    for v in pool[:MOST_VALUES]:
        trial = _windows(problem, [*(t.node for t in plan.transfers), *moving, v], anchor, clock, due or {})
        if trial is not None:
            moving.append(v)
            windows = trial
    if not moving:
        return plan, report
    reloads = sorted((anchor[v], v) for v in moving)
    entries = [*plan.schedule, *(Step(v, a) for a, v in reloads)]
    schedule = tuple(sorted(entries, key=lambda s: (s.before, s.node not in windows)))  # reloads first in a step
    moved = Plan({**plan.decisions, **dict.fromkeys(moving, Decision.OFFLOAD)}, schedule,
                 tuple(Transfer(v, *windows[v]) for v in sorted(windows)))
    judged = check(problem, moved)
    if judged.added_time > report.added_time * (1 + 1e-9) or judged.peak > report.peak:
        return plan, report
    return moved, judged


class Clock:
    """The steps' own compute on one clock (step k runs from ``starts[k]`` to ``ends[k]``),
    and each value's first step to copy out from and its copy's seconds, computed once."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.ends = list(itertools.accumulate(n.time for n in problem.nodes))
        self.starts = [e - n.time for e, n in zip(self.ends, problem.nodes, strict=True)]
        self._out_from: dict[int, int] = {}
        self._seconds: dict[int, float] = {}

    def out_from(self, v: int) -> int:
        if v not in self._out_from:
            self._out_from[v] = self.problem.copy_out_from(v)
        return self._out_from[v]

    def seconds(self, v: int) -> float:
        if v not in self._seconds:
            self._seconds[v] = self.problem.transfer_time(v)
        return self._seconds[v]


def _windows(problem: Problem, offloaded: list[int], anchor: dict[int, int], clock: Clock,
             due: Mapping[int, int]) -> dict[int, tuple[int, int]] | None:
    """Each offloaded value's ``(offload_at, reload_at)`` (module docstring), or None where
    some copy cannot hide, or ends after its ``due`` step. ``anchor``: each one's first
    backward consumer."""
    f = problem.n_forward
    starts, ends = clock.starts, clock.ends
    out: dict[int, int] = {}
    free = 0.0
    for a, batch in itertools.groupby(sorted(offloaded, key=lambda v: (clock.out_from(v), v)),
                                      key=lambda v: clock.out_from(v)):
        members = list(batch)
        free = max(free, starts[a]) + sum(clock.seconds(v) for v in members)
        x = max(a, bisect.bisect_left(ends, free * (1 - 1e-12)))
        if x >= f or any(x > due.get(v, f) for v in members):
            return None
        out.update(dict.fromkeys(members, x))
    back: dict[int, int] = {}
    latest = float("inf")  # when the copy issued next after this one starts
    for v in sorted(offloaded, key=lambda v: (-anchor[v], -v)):
        finish = min(starts[anchor[v]], latest)
        begin = finish - clock.seconds(v)
        y = min(bisect.bisect_right(starts, begin * (1 + 1e-12)) - 1, anchor[v] - 1)
        if y < f:
            return None
        back[v] = y
        latest = starts[y]
    return {v: (out[v], back[v]) for v in offloaded}
