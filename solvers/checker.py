"""The plan checker: the only judge of a plan's feasibility, peak memory and cost.

It replays a plan on the memory model of :mod:`solvers.problem`, step by step, without
any solver. Each value lives over one or two closed intervals of timeline steps:

* a forward value: from its step to its last forward use; if SAVED, on to its last
  backward consumer; if ``keep``, to the end;
* a RECOMPUTED value again from the backward step it is recomputed before to its last
  backward consumer;
* an OFFLOADED value, instead of its saved stretch, on to the end of the forward step its
  copy out runs beside (``Transfer.offload_at``), and again from the backward step its copy
  back runs beside (``Transfer.reload_at``) to its last backward consumer;
* a backward value: from its step to its last use (the end if ``keep``).

A value's backward consumers are the backward steps that read it and the anchor steps of
the recomputed forward values that read it. Values rematerialized before the same step
all count as live during that step, which bounds from above what the emitted code holds.

Added time is the compute time of every recomputation plus the transfer time compute
does not hide: step k lasts max(c_k, out_k, in_k), where c_k is its compute time and
out_k, in_k the seconds of the copies to and from the host that run beside it (one copy
engine each way, at ``host_bandwidth``), so it adds max(0, out_k - c_k, in_k - c_k).
Recomputations that run before step k could hide copies too; they are not counted, so
the exposed time is an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from solvers.plan import Decision, Plan, PlanError, needed_values
from solvers.problem import Problem


@dataclass(frozen=True)
class Report:
    peak: int  # bytes: the largest sum of live value sizes over the step
    peak_step: int  # timeline step where it is reached (first such)
    added_time: float  # seconds of recomputation and exposed transfers
    added_flops: float
    saved_bytes: int  # bytes kept on the device across the forward/backward boundary
    offloaded_bytes: int
    n_recomputed: int
    n_offloaded: int
    timeline: tuple[int, ...]  # live bytes at each step
    budget: int | None

    @property
    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.budget


def check(problem: Problem, plan: Plan) -> Report:
    """Replay ``plan`` on ``problem``; raise :class:`PlanError` if it cannot run."""
    _validate(problem, plan)
    intervals = live_intervals(problem, plan)
    n = len(problem.nodes)
    delta = [0] * (n + 1)
    for lo, hi, size in intervals:
        delta[lo] += size
        delta[hi + 1] -= size
    timeline: list[int] = []
    live = 0
    for k in range(n):
        live += delta[k]
        timeline.append(live)
    peak = max(timeline, default=0)
    rec = plan.of(Decision.RECOMPUTE)
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


def transfer_loads(problem: Problem, plan: Plan) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of copies to the host and back that run beside each step."""
    out: dict[int, float] = {}
    back: dict[int, float] = {}
    for t in plan.transfers:
        seconds = problem.transfer_time(t.node)
        out[t.offload_at] = out.get(t.offload_at, 0.0) + seconds
        back[t.reload_at] = back.get(t.reload_at, 0.0) + seconds
    return out, back


def exposed_transfer_time(problem: Problem, plan: Plan) -> float:
    """Seconds of copies to and from the host that no compute hides:
    sum_k max(0, out_k - c_k, in_k - c_k)."""
    out, back = transfer_loads(problem, plan)
    return sum(
        max(0.0, out.get(k, 0.0) - problem.nodes[k].time, back.get(k, 0.0) - problem.nodes[k].time)
        for k in sorted(out.keys() | back.keys())
    )


def live_intervals(problem: Problem, plan: Plan) -> list[tuple[int, int, int]]:
    """``(first_step, last_step, bytes)`` for every stretch a value occupies memory."""
    end = problem.last_step
    anchor = {s.node: s.before for s in plan.schedule}
    moves = {t.node: t for t in plan.transfers}
    # Last backward consumer of each forward value (direct reads and recomputed users).
    last_bw: dict[int, int] = {}
    for i in range(problem.n_forward):
        steps = list(problem.backward_uses[i])
        steps += [
            anchor[u]
            for u in problem.forward_users[i]
            if plan.decisions.get(u) is Decision.RECOMPUTE
        ]
        if steps:
            last_bw[i] = max(steps)
    out: list[tuple[int, int, int]] = []
    for i, node in enumerate(problem.nodes):
        if node.resident or node.size == 0:
            continue
        if node.keep:
            out.append((i, end, node.size))
            continue
        if node.backward:
            out.append((i, max([i, *problem.users[i]]), node.size))
            continue
        fwd_end = problem.last_forward_use[i]
        decision = plan.decisions.get(i)
        if decision is Decision.SAVE:
            fwd_end = max(fwd_end, last_bw[i])
        elif decision is Decision.RECOMPUTE:
            out.append((anchor[i], last_bw[i], node.size))
        elif decision is Decision.OFFLOAD:
            fwd_end = moves[i].offload_at
            out.append((moves[i].reload_at, last_bw[i], node.size))
        out.append((i, fwd_end, node.size))
    return out


def _validate(problem: Problem, plan: Plan) -> None:
    f = problem.n_forward
    for i, d in plan.decisions.items():
        if not 0 <= i < f:
            raise PlanError(f"decision for #{i}: only forward values (0..{f - 1}) take decisions")
        node = problem.nodes[i]
        if node.resident or node.keep:
            what = "resident" if node.resident else "kept to the end of the step"
            raise PlanError(f"{problem.describe(i)} is {what}; it takes no decision")
        if d is Decision.RECOMPUTE and not node.recomputable:
            raise PlanError(f"{problem.describe(i)} cannot be recomputed (random or must-save)")
        if d is Decision.OFFLOAD and problem.host_bandwidth <= 0:
            raise PlanError(
                f"{problem.describe(i)} is offloaded but the problem has no host link "
                "(host_bandwidth is 0)"
            )
        if d is Decision.OFFLOAD and not node.offloadable:
            raise PlanError(f"{problem.describe(i)} cannot be offloaded (a view or not a tensor)")
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
    # Schedule: every rematerialized value exactly once, before its first consumer and
    # after what it reads.
    remat = {i for i, d in plan.decisions.items() if d is not Decision.SAVE}
    position: dict[int, tuple[int, int]] = {}
    last_before = f
    for k, s in enumerate(plan.schedule):
        if s.node not in remat:
            raise PlanError(f"schedule step {k} rematerializes #{s.node}, which is not recomputed or offloaded")
        if s.node in position:
            raise PlanError(f"schedule rematerializes {problem.describe(s.node)} twice")
        if not f <= s.before <= problem.last_step:
            raise PlanError(f"schedule step {k}: {s.before} is not a backward step")
        if s.before < last_before:
            raise PlanError(f"schedule step {k} goes back to backward step {s.before}; steps must be in order")
        last_before = s.before
        position[s.node] = (s.before, k)
    for i in remat - set(position):
        done = "recomputed" if plan.decisions[i] is Decision.RECOMPUTE else "offloaded"
        raise PlanError(f"{problem.describe(i)} is {done} but never scheduled")
    _validate_transfers(problem, plan, {i: before for i, (before, _) in position.items()})
    for i, (before, k) in position.items():
        for b in problem.backward_uses[i]:
            if b < before:
                raise PlanError(f"{problem.describe(i)} is read at step {b}, before it is rematerialized at {before}")
        if plan.decisions[i] is Decision.RECOMPUTE:
            for j in problem.nodes[i].deps:
                dep = problem.nodes[j]
                if dep.resident or dep.keep or plan.decisions.get(j) is Decision.SAVE:
                    continue
                if j not in position or position[j][1] > k:
                    raise PlanError(
                        f"recomputing {problem.describe(i)} reads {problem.describe(j)}, "
                        "which is not available yet"
                    )


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
        lo = problem.last_forward_use[t.node] + 1
        if not lo <= t.offload_at < f:
            raise PlanError(
                f"{problem.describe(t.node)} is copied out beside step {t.offload_at}; it must be "
                f"a forward step after its last forward use ({lo}..{f - 1})"
            )
        if not f <= t.reload_at < anchor[t.node]:
            raise PlanError(
                f"{problem.describe(t.node)} is copied back beside step {t.reload_at}; it must be "
                f"a backward step before its first use ({f}..{anchor[t.node] - 1})"
            )
    for i in sorted(offloaded - seen):
        raise PlanError(f"{problem.describe(i)} is offloaded but has no transfer")
