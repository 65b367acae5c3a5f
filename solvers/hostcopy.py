"""Moving what a plan keeps to host memory where its copies hide under the compute.

A saved value occupies the device from its forward to its last backward read. Offloaded
instead, it occupies the device only until its copy out is done and again from when its
copy back is issued (the checker's copy engines, :func:`solvers.checker.transfer_stalls`).
Those stretches lie inside the saved one, so offloading never raises a plan's peak, and
where both copies finish inside windows of compute long enough to cover them, it adds no
time: a free saving, and at scale a large one (a Llama block's input, 32 MiB, takes 0.67 ms
at 50 GB/s, under a tenth of the block's forward).

:func:`offload_hidden` makes that move for the largest saved values first (or in the order
it is given), each only if every copy accepted so far still hides with it. Windows
are placed on the clock of the steps' own compute (``Node.time``; no waits, since none
are let in):

* out, as soon as possible: the copies issued at one step go as a batch after the
  engine's earlier work; the window ends at the first step whose end covers the batch,
  which frees the device copy as early as the engine allows;
* back, as late as possible: going from the last deadline (the start of the value's first
  backward consumer) to the first, each copy begins early enough to end by its deadline
  and by when the next one begins, and is issued at the latest step that starts by then,
  before the next one's (copies issued at one step would finish as one batch).

The checker judges the result; a plan whose added time or peak it finds above the
original's is not returned.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from solvers.checker import Report, check
from solvers.plan import Decision, Plan, Step, Transfer
from solvers.problem import Problem


def offload_hidden(problem: Problem, plan: Plan, *, order: Sequence[int] | None = None,
                   report: Report | None = None) -> tuple[Plan, Report]:
    """``plan`` with saved values moved to host memory where both their copies hide, and the
    checker's report on it; ``plan`` and ``report`` (computed if not given) where nothing
    moves. ``order``: the saved values to try, in that order; by default all of them, the
    largest first."""
    report = report if report is not None else check(problem, plan)
    if problem.host_bandwidth <= 0 or problem.single_phase:
        return plan, report
    f = problem.n_forward
    saved = set(plan.of(Decision.SAVE))
    if order is None:
        order = sorted(saved, key=lambda v: (-problem.nodes[v].size, v))
    pool = [v for v in order if v in saved and problem.nodes[v].offloadable and problem.nodes[v].size > 0
            and problem.copy_out_from(v) < f]
    clock = Clock(problem)
    first_entry: dict[int, int] = {}
    for s in plan.schedule:
        first_entry.setdefault(s.node, s.before)
    anchor = {v: min([*problem.backward_uses[v], *(first_entry[u] for u in problem.forward_users[v]
                                                   if plan.decisions.get(u) is Decision.RECOMPUTE)])
              for v in pool}
    anchor.update({t.node: first_entry[t.node] for t in plan.transfers})
    engines = _Engines(problem, anchor, clock)
    if not all(engines.add(t.node) for t in plan.transfers):
        return plan, report  # the plan's own copies do not hide: no room to judge more by
    moving = [v for v in pool if engines.add(v)]
    if not moving:
        return plan, report
    windows = engines.windows()
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


class _Engines:
    """The two copy engines' work for the values accepted so far (module docstring), kept
    so that trying one more value replays only what it changes.

    Out: the batches issued at each step, in step order; batch ``j`` is done at
    ``F_j = max(F_{j-1}, start_j) + l_j``, that is ``L_j + max_{i <= j}(start_i - L_{i-1})``
    over the running sums ``L`` of the batches' seconds, and its window ends at the first
    step whose end covers ``F_j``. Back: the values from the latest first backward
    consumer to the earliest, each beginning at ``min(its consumer's start, the next
    one's begin) - its seconds`` and issued at the latest step that starts by then,
    before the next one's issue step; each copy then runs from its begin at the latest,
    so ends in time. A new value moves only the copies issued before it, up to the first
    that stays put."""

    def __init__(self, problem: Problem, anchor: Mapping[int, int], clock: Clock) -> None:
        self.anchor, self.clock = anchor, clock
        self.f = problem.n_forward
        self.starts, self.ends = np.asarray(clock.starts), np.asarray(clock.ends)
        self.issue = np.zeros(0, dtype=np.int64)  # out: the batches' issue steps, ascending
        self.seconds = np.zeros(0)  # out: each batch's seconds
        self.ends_at = np.zeros(0, dtype=np.int64)  # out: the step each batch ends at
        self.members: dict[int, list[int]] = {}  # out: issue step -> its batch's values
        self.order: list[tuple[int, int]] = []  # back: (-anchor, -value), ascending
        self.back: list[tuple[int, float]] = []  # back: each one's issue step and begin, in that order

    def add(self, v: int) -> bool:
        """Whether ``v``'s copies hide beside those accepted; if so, ``v`` is accepted."""
        out = self._out_with(v)
        back = self._back_with(v) if out is not None else None
        if out is None or back is None:
            return False
        self.issue, self.seconds, self.ends_at = out
        self.members.setdefault(self.clock.out_from(v), []).append(v)
        k, moved = back
        self.order.insert(k, (-self.anchor[v], -v))
        self.back[k:k + len(moved) - 1] = moved
        return True

    def _out_with(self, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The out engine's arrays with ``v`` added, or None where a batch would end after
        the forward."""
        a = self.clock.out_from(v)
        j = int(np.searchsorted(self.issue, a))
        if j == len(self.issue) or self.issue[j] != a:
            issue, seconds = np.insert(self.issue, j, a), np.insert(self.seconds, j, 0.0)
        else:
            issue, seconds = self.issue, self.seconds.copy()
        seconds[j] += self.clock.seconds(v)
        running = np.cumsum(seconds)
        done = running + np.maximum.accumulate(self.starts[issue] - (running - seconds))
        ends_at = np.maximum(issue, np.searchsorted(self.ends, done * (1 - 1e-12)))
        return (issue, seconds, ends_at) if int(ends_at[-1]) < self.f else None  # ends_at ascends

    def _back_with(self, v: int) -> tuple[int, list[tuple[int, float]]] | None:
        """Where ``v`` goes in the back order, and the ``(issue step, begin)`` of each copy
        from it on up to the first that stays put; None where a copy would be issued
        before the backward."""
        starts = self.clock.starts
        k = bisect.bisect_left(self.order, (-self.anchor[v], -v))
        after = self.back[k - 1] if k else (len(starts), math.inf)  # the next copy's
        out: list[tuple[int, float]] = []
        for i in range(len(self.order) - k + 1):  # v, then those issued before it, nearest first
            u = v if i == 0 else -self.order[k + i - 1][1]
            begin = min(starts[self.anchor[u]], after[1]) - self.clock.seconds(u)
            y = min(bisect.bisect_right(starts, begin * (1 + 1e-12)) - 1, self.anchor[u] - 1, after[0] - 1)
            if y < self.f:
                return None
            out.append((y, begin))
            if i and out[-1] == self.back[k + i - 1]:
                break  # this one, and so every one issued before it, stays put
            after = out[-1]
        return k, out

    def windows(self) -> dict[int, tuple[int, int]]:
        """Each accepted value's ``(offload_at, reload_at)``."""
        out = {v: int(x) for a, x in zip(self.issue, self.ends_at, strict=True) for v in self.members[int(a)]}
        return {-w: (out[-w], y) for (_, w), (y, _) in zip(self.order, self.back, strict=True)}
