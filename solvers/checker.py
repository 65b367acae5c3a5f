"""The plan checker: the only judge of a plan's feasibility, peak memory and cost.

It replays a plan on the memory model of :mod:`solvers.problem`, step by step, without
any solver. Each value lives over one or two closed intervals of timeline steps:

* a forward value: from its step to its last forward use (the forward's last step if
  ``returned``); if SAVED, on to its last backward consumer; if ``keep``, to the end;
* a RECOMPUTED value again from the backward step it is recomputed before to its last
  backward consumer;
* an OFFLOADED value, instead of its saved stretch, on to the end of the forward step its
  copy out must be done by (``Transfer.offload_at``), and again from the backward step its
  copy back is issued at (``Transfer.reload_at``) to its last backward consumer;
* a backward value: from its step to its last use (the end if ``keep``);
* a copy whose last read is by the op that takes the value's storage over
  (``Problem.taken_over``), or by that op's recomputation, ends one step before that
  read: a recomputed softmax writes over its recomputed scores as the op did in the
  forward, so a chain recomputed before one step holds one buffer, not one per value
  (a backward op whose ``overwrites_copies`` is the forward copy only takes the saved
  forward copy only).

A value's backward consumers are the backward steps that read it and the anchor steps of
the recomputed forward values that read it. The recomputations before one step are
followed entry by entry (:func:`value_copies`): a copy made and last read by entries
before the same step lives only between them (GPT-2's GELU, written out in four steps,
recomputed before the backward op that reads its output), the others from their entry
on.
Copies named in ``Node.unstored`` (two-phase problems) hold no memory. An unstored
recomputation's reads of its deps happen at each read it serves instead of at its own
step; an unstored forward copy (a value neither saved nor offloaded) is computed by its
one forward reader, which reads its deps.

Added time is the compute time of every recomputation plus the time the compute stream
waits for copies to and from the host (:func:`transfer_stalls`). Copies run on one copy
engine each way, at ``host_bandwidth``, in the order they are issued, beside a window of
compute steps:

* out: issued as step ``copy_out_from(v)`` starts (after v's last forward read), waited for
  when step ``offload_at`` ends, where the device copy is freed;
* back: issued as step ``reload_at`` starts (where the device copy is allocated), waited
  for when the step before its first backward consumer ends.

Copies issued at the same step form one batch, each done when the whole batch is (the
emitted code waits for each copy on its own, so never longer); compute steps last their
own ``time``. Recomputations that run before a step lengthen the real window, so the
waits are an upper bound. A copy whose window's compute covers it, and the copies queued
before it, costs nothing.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass

from solvers.plan import Decision, Plan, PlanError, needed_values
from solvers.problem import Copy, Problem


@dataclass(frozen=True)
class Report:
    peak: int  # bytes: the largest sum of live value sizes over the step
    peak_step: int  # timeline step where it is reached (first such)
    added_time: float  # seconds of recomputation and exposed transfers
    added_flops: float
    saved_bytes: int  # bytes kept on the device across the forward/backward boundary
    offloaded_bytes: int
    n_recomputed: int  # recomputations run (a value recomputed twice counts twice)
    n_offloaded: int
    timeline: tuple[int, ...]  # live bytes at each step
    budget: int | None

    @property
    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.budget


_REPLAYS = threading.local()  # values replayed by this thread's checker, in ``values``


def replayed() -> int:
    """The values (and schedule steps) this thread's checker has replayed so far: the
    measure of its work a deterministic time limit counts (:mod:`solvers.deadline`)."""
    return getattr(_REPLAYS, "values", 0)


def check(problem: Problem, plan: Plan) -> Report:
    """Replay ``plan`` on ``problem``; raise :class:`PlanError` if it cannot run."""
    _REPLAYS.values = replayed() + len(problem.nodes) + len(plan.schedule)
    _validate(problem, plan)
    spans, passing = value_copies(problem, plan)
    n = len(problem.nodes)
    delta = [0] * (n + 1)
    for i, stretches in spans.items():
        for lo, hi in stretches:
            delta[lo] += problem.nodes[i].size
            delta[hi + 1] -= problem.nodes[i].size
    extra = passing_peaks(problem, passing)
    timeline: list[int] = []
    live = 0
    for k in range(n):
        live += delta[k]
        timeline.append(live + extra.get(k, 0))
    peak = max(timeline, default=0)
    rec = recomputations(plan)
    off = plan.of(Decision.OFFLOAD)
    return Report(
        peak=peak,
        peak_step=timeline.index(peak) if timeline else 0,
        added_time=sum(problem.nodes[i].time for i in rec) + exposed_transfer_time(problem, plan),
        added_flops=sum(problem.nodes[i].flops for i in rec),
        saved_bytes=sum(problem.nodes[i].size for i in plan.of(Decision.SAVE)),
        offloaded_bytes=sum(problem.nodes[i].size for i in off),
        n_recomputed=len(rec),
        n_offloaded=len(off),
        timeline=tuple(timeline),
        budget=problem.budget,
    )


def recomputations(plan: Plan) -> list[int]:
    """The value of every recomputation the schedule runs (a value recomputed twice, twice)."""
    return [s.node for s in plan.schedule if plan.decisions.get(s.node) is Decision.RECOMPUTE]


def transfer_stalls(problem: Problem, plan: Plan) -> dict[int, float]:
    """Seconds the compute stream waits for copies at the end of each step (steps without
    a wait left out), replaying the copy engines of the module docstring.

    A plan whose copies each run beside one step (``offload_at == copy_out_from(v)``,
    ``reload_at`` the step before the first consumer) waits max(0, out_k - c_k, in_k - c_k)
    at step k: the copies beside it against its compute."""
    if not plan.transfers:
        return {}
    anchor = {s.node: s.before for s in plan.schedule if plan.decisions.get(s.node) is Decision.OFFLOAD}
    issued: tuple[dict[int, float], dict[int, float]] = ({}, {})  # way -> step -> seconds issued
    due: dict[int, list[tuple[int, int]]] = {}  # step -> (way, issue step) done when it ends
    for t in plan.transfers:
        seconds = problem.transfer_time(t.node)
        for way, issue, last in ((0, problem.copy_out_from(t.node), t.offload_at),
                                 (1, t.reload_at, anchor[t.node] - 1)):
            issued[way][issue] = issued[way].get(issue, 0.0) + seconds
            due.setdefault(last, []).append((way, issue))
    clock = 0.0
    free = [0.0, 0.0]  # when each engine has run what was issued so far
    done: tuple[dict[int, float], dict[int, float]] = ({}, {})  # way -> issue step -> batch done
    stalls: dict[int, float] = {}
    for k in range(min(min(issued[0]), min(issued[1])), max(due) + 1):
        for way in (0, 1):
            if k in issued[way]:
                free[way] = max(free[way], clock) + issued[way][k]
                done[way][k] = free[way]
        end = clock + problem.nodes[k].time
        ready = max((done[way][start] for way, start in due.get(k, ())), default=end)
        if ready > end * (1 + 1e-12):  # not a rounding of sums that hide the copies exactly
            stalls[k] = ready - end
            end = ready
        clock = end
    return stalls


def exposed_transfer_time(problem: Problem, plan: Plan) -> float:
    """Seconds the compute stream waits for copies to and from the host (:func:`transfer_stalls`)."""
    return sum(transfer_stalls(problem, plan).values())


@dataclass(frozen=True)
class Passing:
    """A copy made by schedule entry ``first`` before ``step`` (see :func:`value_copies`)
    and last read by entry ``last`` before the same step; ``last`` is None for a copy that
    lives on through the step's op (its stretch counts it from then on)."""

    node: int
    step: int
    first: int
    last: int | None


def value_intervals(problem: Problem, plan: Plan) -> dict[int, list[tuple[int, int]]]:
    """The closed step intervals each value occupies memory over, one per copy (the
    passing copies of :func:`value_copies` aside)."""
    return value_copies(problem, plan)[0]


def passing_peaks(problem: Problem, passing: list[Passing]) -> dict[int, int]:
    """For each step with passing copies, the bytes its entries hold above its op: the
    most live at one entry, counting each copy made before the step from its entry on,
    less what the whole-step stretches already count (the copies that live on)."""
    events: dict[int, list[tuple[int, int]]] = {}
    arriving: dict[int, int] = {}
    for c in passing:
        size = problem.nodes[c.node].size
        events.setdefault(c.step, []).append((c.first, size))
        if c.last is None:
            arriving[c.step] = arriving.get(c.step, 0) + size
        else:
            events[c.step].append((c.last + 1, -size))
    out = {}
    for step, changes in events.items():
        if len(changes) == 1 or all(change > 0 for _, change in changes):
            continue  # nothing passes: every copy lives on, counted by its stretch
        live = most = 0
        for _, change in sorted(changes):
            live += change
            most = max(most, live)
        out[step] = max(0, most - arriving.get(step, 0))
    return out


def value_copies(problem: Problem, plan: Plan) -> tuple[dict[int, list[tuple[int, int]]], list[Passing]]:
    """The closed step intervals each value occupies memory over, one per copy, and the
    copies that pass within the entries before one step.

    A value has one copy per materialization: the op at its own step, then each
    recomputation (or reload) the schedule runs. Every read is served by the latest copy
    made before it, and a copy lives from its start to the last read it serves. A read is
    an op at a later step, or a scheduled recomputation of a value that reads it; a
    recomputation before step k comes before the op at k, and schedule entries before the
    same step run in schedule order.

    Within a step, a two-phase plan is followed at the granularity of the schedule's
    entries: a recomputed copy made by an entry and last read by a later entry before the
    same step is *passing*: it lives from its entry to that read, not over the whole step
    (a transient of a recomputed chain; in a multi-level plan, the blocks between two kept
    inputs rerun to rebuild each input in turn); and the other copies made before a step
    count from their entry on. The emitted code frees each copy after its last read. The
    flat CP-SAT model counts whole steps, which is never below this figure.
    """
    end = problem.last_step
    moves = {t.node: t for t in plan.transfers}
    Key = tuple[int, int, int]  # (step, 0 for a scheduled entry / 1 for the op, order)
    copies: dict[int, list[tuple[Key, int]]] = {}  # value -> (made at, first live step)
    # value -> reads besides its readers' own ops: by scheduled recomputations, and by the
    # op that computes a value whose forward copy is unstored
    other_reads: dict[int, list[Key]] = {}
    inline: dict[int, Key] = {}  # value with an unstored recomputation -> its first entry
    unstored: set[int] = set()  # values without a forward copy
    for v, reader in problem.computed_by.items():
        if plan.decisions.get(v) in (Decision.SAVE, Decision.OFFLOAD):
            continue
        unstored.add(v)
        for d in set(problem.nodes[v].deps):
            other_reads.setdefault(d, []).append((reader, 1, 0))
    for k, s in enumerate(plan.schedule):
        key = (s.before, 0, k)
        move = moves.get(s.node)
        copies.setdefault(s.node, []).append((key, move.reload_at if move else s.before))
        if plan.decisions.get(s.node) is not Decision.RECOMPUTE:
            continue
        if not problem.nodes[s.node].stores(Copy.RECOMPUTED) and not problem.single_phase:
            inline.setdefault(s.node, key)
            continue
        for d in set(problem.nodes[s.node].deps):
            other_reads.setdefault(d, []).append(key)
    # An unstored recomputation reads its deps at each read it serves (every later read: it
    # is the value's last copy). Readers come after what they read, so going down the
    # values, each one's reads are complete before they pass to its deps.
    served_at: dict[int, set[int]] = {}  # value -> steps an unstored recomputation reads it at
    for v in sorted(inline, reverse=True):
        served = [r for r in [*((u, 1, 0) for u in problem.users[v]), *other_reads.get(v, ())]
                  if r > inline[v]]
        for d in set(problem.nodes[v].deps):
            other_reads.setdefault(d, []).extend(served)
            served_at.setdefault(d, set()).update(r[0] for r in served)
    out: dict[int, list[tuple[int, int]]] = {}
    passing: list[Passing] = []
    by_entry = not problem.single_phase
    for i, node in enumerate(problem.nodes):
        if node.resident or node.size == 0:
            continue
        if node.keep:
            out[i] = [(i, end)]
            continue
        users = problem.users[i]
        if i not in copies and i not in other_reads and i not in unstored:  # one copy, read by ops only
            out[i] = [(i, problem.fixed_end(i))]
            continue
        made = [((i, 1, 0), i), *sorted(copies.get(i, ()))]
        keys = [key for key, _ in made]
        last_read: list[Key | None] = [None] * len(made)
        for r in [*((u, 1, 0) for u in users), *other_reads.get(i, ())]:
            j = bisect.bisect_left(keys, r) - 1  # the latest copy made before the read
            if j >= 0:
                last_read[j] = max(r, last_read[j] or r)
        last = [start if r is None else max(start, r[0]) for (_, start), r in zip(made, last_read, strict=True)]
        if node.returned:  # the forward copy is handed over at the forward's last step
            last[0] = max(last[0], problem.n_forward - 1)
        if i in moves:  # the device copy lives until its copy to the host has run
            last[0] = max(last[0], moves[i].offload_at)
        taker = problem.taken_over.get(i)
        # A backward taker that overwrites no backward copy writes over the forward copy only.
        takes = (len(made) if taker is None or taker < problem.n_forward
                 or problem.nodes[taker].overwrites_backward_copies else 1)
        if taker is not None:
            for j, r in enumerate(last_read[:takes]):
                # The last reader, the taker's op or its recomputation, writes its result
                # over this copy; not where an unstored recomputation reads the copy at the
                # same step (it runs inside an op there, in an order steps do not resolve).
                if r is not None and last[j] == r[0] and (r == (taker, 1, 0) or (
                        r[1] == 0 and plan.schedule[r[2]].node == taker and r[0] not in served_at.get(i, ()))):
                    last[j] = r[0] - 1
        if i in inline:  # every recomputed copy is computed inside its readers
            made, last, last_read = made[:1], last[:1], last_read[:1]
        stretches = []
        for (key, start), hi, r in zip(made, last, last_read, strict=True):
            if (by_entry and key[1] == 0 and r is not None and r[1] == 0 and r[0] == key[0]
                    and plan.decisions.get(i) is Decision.RECOMPUTE):
                # ends one entry early where its last reader writes over it (hi < r[0])
                if (upto := r[2] - (hi < r[0])) >= key[2]:
                    passing.append(Passing(i, key[0], key[2], upto))
                continue
            if (key == (i, 1, 0) and i in unstored) or start > hi:
                continue
            if by_entry and key[1] == 0 and start == key[0]:
                passing.append(Passing(i, key[0], key[2], None))
            stretches.append((start, hi))
        out[i] = stretches
    return out, passing


def _validate(problem: Problem, plan: Plan) -> None:
    if problem.single_phase:
        _validate_single_phase(problem, plan)
        return
    f = problem.n_forward
    for i, d in plan.decisions.items():
        if not 0 <= i < f:
            raise PlanError(f"decision for #{i}: only forward values (0..{f - 1}) take decisions")
        _validate_decision(problem, i, d)
    rec = plan.of(Decision.RECOMPUTE)
    needed = needed_values(problem, rec)
    missing = needed - set(plan.decisions)
    if missing:
        i = min(missing)
        raise PlanError(f"{problem.describe(i)} is read by the backward but has no decision")
    extra = set(plan.decisions) - needed
    if extra:
        i = min(extra)
        raise PlanError(
            f"{problem.describe(i)} has a decision but nothing in the backward reads it"
        )
    # Schedule: every rematerialized value before its first consumer and after what it
    # reads; an offloaded value reloaded once, a recomputed one recomputed once or more
    # (each later recomputation serving a read: the blocks of a multi-level plan).
    remat = {i for i, d in plan.decisions.items() if d is not Decision.SAVE}
    position: dict[int, tuple[int, int]] = {}  # value -> its first entry (step, index)
    entries: dict[int, list[int]] = {}  # value -> the indices of its entries
    last_before = f
    for k, s in enumerate(plan.schedule):
        if s.node not in remat:
            raise PlanError(f"schedule step {k} rematerializes #{s.node}, which is not recomputed or offloaded")
        if s.node in position and plan.decisions[s.node] is Decision.OFFLOAD:
            raise PlanError(f"schedule reloads {problem.describe(s.node)} twice")
        if not f <= s.before <= problem.last_step:
            raise PlanError(f"schedule step {k}: {s.before} is not a backward step")
        if s.before < last_before:
            raise PlanError(f"schedule step {k} goes back to backward step {s.before}; steps must be in order")
        last_before = s.before
        position.setdefault(s.node, (s.before, k))
        entries.setdefault(s.node, []).append(k)
    for i in remat - set(position):
        done = "recomputed" if plan.decisions[i] is Decision.RECOMPUTE else "offloaded"
        raise PlanError(f"{problem.describe(i)} is {done} but never scheduled")
    _validate_transfers(problem, plan, {i: before for i, (before, _) in position.items()})
    for i, (before, _) in position.items():
        for b in problem.backward_uses[i]:
            if b < before:
                raise PlanError(f"{problem.describe(i)} is read at step {b}, before it is rematerialized at {before}")
    for k, s in enumerate(plan.schedule):
        if plan.decisions[s.node] is not Decision.RECOMPUTE:
            continue
        for j in problem.nodes[s.node].deps:
            dep = problem.nodes[j]
            if dep.resident or dep.keep or plan.decisions.get(j) is Decision.SAVE:
                continue
            if j not in position or position[j][1] > k:
                raise PlanError(
                    f"recomputing {problem.describe(s.node)} (schedule step {k}) reads "
                    f"{problem.describe(j)}, which is not available yet"
                )
    _validate_repeats(problem, plan, entries)


def _validate_repeats(problem: Problem, plan: Plan, entries: dict[int, list[int]]) -> None:
    """A value recomputed more than once: each copy must serve a read."""
    unread = unread_entries(problem, plan, entries)
    if unread:
        k = unread[0]
        raise PlanError(
            f"schedule step {k} recomputes {problem.describe(plan.schedule[k].node)}, but nothing "
            "reads that copy before its next recomputation"
        )


def unread_entries(problem: Problem, plan: Plan, entries: dict[int, list[int]] | None = None) -> list[int]:
    """The schedule entries of values recomputed more than once whose copy serves no read:
    no backward step reads the value, and no recomputation of a reader is scheduled,
    between the entry and the value's next one. ``entries``: each value's entry indices."""
    if entries is None:
        entries = {}
        for k, s in enumerate(plan.schedule):
            entries.setdefault(s.node, []).append(k)
    repeated = {i: ks for i, ks in entries.items() if len(ks) > 1}
    if not repeated:
        return []
    end = len(plan.schedule)  # a backward op at step b reads after every entry before b
    reads: dict[int, list[tuple[int, int]]] = {i: [(b, end) for b in problem.backward_uses[i]] for i in repeated}
    for k, s in enumerate(plan.schedule):
        for j in set(problem.nodes[s.node].deps) & repeated.keys():
            reads[j].append((s.before, k))
    out = []
    for i, ks in repeated.items():
        bounds = [(plan.schedule[k].before, k) for k in ks] + [(problem.last_step + 1, 0)]
        for (lo, k), hi in itertools.pairwise(bounds):
            if not any((lo, k) < r < hi for r in reads[i]):
                out.append(k)
    return sorted(out)


def _validate_decision(problem: Problem, i: int, d: Decision) -> None:
    node = problem.nodes[i]
    if node.resident or node.keep:
        what = "resident" if node.resident else "kept to the end of the step"
        raise PlanError(f"{problem.describe(i)} is {what}; it takes no decision")
    if d is Decision.RECOMPUTE and not node.recomputable:
        raise PlanError(f"{problem.describe(i)} cannot be recomputed (random or must-save)")
    if d is Decision.OFFLOAD and problem.single_phase:
        raise PlanError(f"{problem.describe(i)} is offloaded, but the problem has no backward "
                        "to reload it for (offload needs a forward/backward split)")
    if d is Decision.OFFLOAD and problem.host_bandwidth <= 0:
        raise PlanError(
            f"{problem.describe(i)} is offloaded but the problem has no host link "
            "(host_bandwidth is 0)"
        )
    if d is Decision.OFFLOAD and not node.offloadable:
        raise PlanError(f"{problem.describe(i)} cannot be offloaded (a view or not a tensor)")


def _validate_single_phase(problem: Problem, plan: Plan) -> None:
    """A problem without a backward: any value may be recomputed, as often as the schedule
    says, before any step after its own; a value without a decision is saved (it lives from
    its step to its last read). Each read takes the latest copy, so no order within a step
    is wrong, only more or less costly in memory."""
    n = len(problem.nodes)
    for i, d in plan.decisions.items():
        if not 0 <= i < n:
            raise PlanError(f"decision for #{i}: no such value (0..{n - 1})")
        _validate_decision(problem, i, d)
    if plan.transfers:
        raise PlanError(f"transfer for #{plan.transfers[0].node}, but the problem has no backward")
    scheduled: set[int] = set()
    last_before = 0
    for k, s in enumerate(plan.schedule):
        if plan.decisions.get(s.node) is not Decision.RECOMPUTE:
            raise PlanError(f"schedule step {k} recomputes #{s.node}, which is not recomputed")
        if not s.node < s.before <= problem.last_step:
            raise PlanError(
                f"schedule step {k} recomputes {problem.describe(s.node)} before step {s.before}; "
                f"it must be a step after the value's own ({s.node + 1}..{problem.last_step})"
            )
        if s.before < last_before:
            raise PlanError(f"schedule step {k} goes back to step {s.before}; steps must be in order")
        last_before = s.before
        scheduled.add(s.node)
    for i in sorted(set(plan.of(Decision.RECOMPUTE)) - scheduled):
        raise PlanError(f"{problem.describe(i)} is recomputed but never scheduled")


def _validate_transfers(problem: Problem, plan: Plan, anchor: dict[int, int]) -> None:
    """One transfer per offloaded value: out beside a forward step after its last forward
    use, back beside a backward step before its anchor."""
    f = problem.n_forward
    offloaded = set(plan.of(Decision.OFFLOAD))
    seen: set[int] = set()
    for t in plan.transfers:
        if t.node not in offloaded:
            raise PlanError(f"transfer for #{t.node}, which is not offloaded")
        if t.node in seen:
            raise PlanError(f"{problem.describe(t.node)} has two transfers")
        seen.add(t.node)
        lo = problem.copy_out_from(t.node)
        if not lo <= t.offload_at < f:
            raise PlanError(
                f"{problem.describe(t.node)} is copied out beside step {t.offload_at}; it must be "
                f"a forward step after its last forward read ({lo}..{f - 1})"
            )
        if not f <= t.reload_at < anchor[t.node]:
            raise PlanError(
                f"{problem.describe(t.node)} is copied back beside step {t.reload_at}; it must be "
                f"a backward step before its first use ({f}..{anchor[t.node] - 1})"
            )
    for i in sorted(offloaded - seen):
        raise PlanError(f"{problem.describe(i)} is offloaded but has no transfer")
