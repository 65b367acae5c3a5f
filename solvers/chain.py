"""Planning by segments: a step split at its boundaries, each segment planned exactly on
its own once per distinct shape, then one option per segment chosen for the whole step.

A deep model's step is a chain. Its forward splits at the *boundaries*
(:func:`solvers.baselines.segment_boundaries`: values that alone carry the computation
on, such as a residual stream between blocks) into segments; segment ``s`` is the forward
steps after boundary ``s - 1`` up to and including boundary ``s`` (the last one runs to
the end of the forward). Its *interior* is the candidates among those steps that only it
reads in the forward: every boundary, and any value a later segment reads too, is saved.
Its *window* is the backward steps from its interior's first backward read to its last.
Its *region* is its forward steps and its window.

Options. Each segment's region, cut out as a problem of its own (what it reads from
outside becomes resident), is planned by CP-SAT at a sweep of budgets from its least
peak to saving everything, beside recomputing every interior value (what checkpointing
the segment does) and recomputing the free ones. Segments of the same shape share their
options: a 32-layer model has a handful of distinct segments, not 64.

The chain model. Let ``R`` be the plan that recomputes every segment's interior and
``T_R(t)`` its live bytes at step ``t``. Choosing option ``o`` for segment ``s`` changes
the live bytes by ``D[s,o](t)`` inside its region and by ``K[s,o]`` (its saved bytes,
less ``R``'s) at every step between its forward and its window, and nowhere else, since
its values are read only there. Taking these changes to add up, with ``x[s,o]`` choosing
one option per segment, the model is

    minimize    sum_{s,o} time[s,o] * x[s,o]
    subject to  sum_o x[s,o] = 1                                              for every s
                T_R(t) + sum_o D[own(t),o](t) x[own(t),o]
                       + sum_{s alive at t} sum_o K[s,o] x[s,o]  <=  budget    for every step t

where ``own(t)`` is the segment whose region holds ``t`` and ``s`` is alive at ``t`` when
``t`` lies between its forward and its window, outside its region. Steps with the same
owner and the same alive segments share one constraint, at their largest ``T_R + D``,
so there are about two per segment. CP-SAT solves it exactly; the composed plan goes to
the checker, which stays the judge. Where the changes do not add up exactly (windows
that interleave) and the checker finds the plan over budget, the chain model is solved
again with the budget lowered by the excess.

Every segment's boundary is saved, so a plan recomputes each value at most once and the
chain model reaches every plan per-segment checkpointing reaches, and more.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from solvers.baselines import free_plan, plan_with, save_all, segment_boundaries
from solvers.checker import Report, check
from solvers.plan import Decision, Plan, plan_from_decisions
from solvers.problem import Node, Problem
from solvers.result import InfeasibleBudgetError, SolverConfig, SolveResult, Status
from solvers.sat import make_solver

SWEEP = 6  # CP-SAT budgets per distinct segment, evenly from its least peak to saving all
OPTION_SHARE = 0.5  # of the time limit, at most, for the segments' options
TIGHTEN = 4  # chain solves at most, each with the budget lowered by the last one's excess
SUB_LIMIT = 5.0  # seconds, at most, for one CP-SAT solve of a segment


@dataclass(frozen=True)
class Segment:
    """One link of the chain, in the step's own indices."""

    forward: tuple[int, int]  # first and last forward step (the last is its boundary)
    window: tuple[int, int] | None  # first and last backward step reading its interior
    interior: tuple[int, ...]  # the candidates it decides

    @property
    def region(self) -> tuple[int, ...]:
        steps = list(range(self.forward[0], self.forward[1] + 1))
        if self.window is not None:
            steps += range(self.window[0], self.window[1] + 1)
        return tuple(steps)


def find_segments(problem: Problem) -> list[Segment]:
    """The chain of ``problem``'s forward, cut at its boundaries; a problem without a
    backward, or without two segments, has no chain (an empty list)."""
    if problem.single_phase or not problem.candidates:
        return []
    f = problem.n_forward
    cuts = [b for b in segment_boundaries(problem) if b < f - 1]
    if not cuts:
        return []
    firsts = [0, *(b + 1 for b in cuts)]
    lasts = [*cuts, f - 1]
    owner = [0] * f
    for s, (lo, hi) in enumerate(zip(firsts, lasts, strict=True)):
        owner[lo:hi + 1] = [s] * (hi - lo + 1)
    out = []
    candidates = set(problem.candidates)
    for s, (lo, hi) in enumerate(zip(firsts, lasts, strict=True)):
        interior = tuple(v for v in range(lo, hi + (s == len(cuts)))
                         if v in candidates and v not in cuts
                         and all(owner[u] == s for u in problem.forward_users[v]))
        reads = [u for v in interior for u in problem.backward_uses[v]]
        window = (min(reads), max(reads)) if reads else None
        out.append(Segment((lo, hi), window, interior))
    return out


# ---- one segment, cut out ----------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """A segment's region as a problem of its own: ``problem.nodes[j]`` is the step's
    value ``steps[j]``, or (``steps[j]`` negative) a resident stand-in for a value it reads
    from outside."""

    problem: Problem
    steps: tuple[int, ...]
    interior: dict[int, int]  # step index -> local index, for the interior

    @property
    def signature(self) -> str:
        """Equal for segments of the same shape: the same ops, sizes, costs and reads."""
        h = hashlib.blake2b(digest_size=16)
        for n in self.problem.nodes:
            size = 0 if n.resident else n.size  # a resident value costs nothing
            h.update(repr((n.op, n.deps, n.backward, size, round(n.time, 15), n.flops,
                           n.recomputable, n.offloadable, n.resident, n.keep, n.reuses,
                           n.reuses_recomputed, n.inline, n.fused)).encode())
        h.update(repr(sorted(self.interior.values())).encode())
        return h.hexdigest()


def cut(problem: Problem, segment: Segment) -> Cut:
    """The region of ``segment`` as a problem. Its forward values that are not interior, and
    every value read after the region, are kept to its end, so they take no decision."""
    region = segment.region
    inside = set(region)
    outside: dict[int, int] = {}  # step value read from outside -> its stand-in's position
    for g in region:
        for d in problem.nodes[g].deps:
            if d not in inside and d not in outside:
                outside[d] = len(outside)
    local = {g: len(outside) + j for j, g in enumerate(region)}
    local.update(outside)
    interior = set(segment.interior)
    nodes: list[Node] = [Node(name=f"in:{problem.nodes[d].name}", op="input", size=problem.nodes[d].size,
                              resident=True) for d in outside]
    for g in region:
        n = problem.nodes[g]
        read_later = any(u not in inside for u in problem.users[g])
        keep = n.keep or read_later or (not n.backward and g not in interior)
        nodes.append(replace(
            n, deps=tuple(local[d] for d in n.deps),
            reuses=None if n.reuses is None else local[n.reuses],
            keep=keep, fused=n.fused and not keep, resident=n.resident and not n.backward,
        ))
    sub = Problem(nodes=tuple(nodes), budget=None, host_bandwidth=problem.host_bandwidth,
                  name=f"{problem.name}[{segment.forward[0]}:{segment.forward[1]}]")
    return Cut(sub, (*(-1 - d for d in outside), *region), {g: local[g] for g in segment.interior})


# ---- options -------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One way to plan a segment: its decisions (in the cut's indices), what it adds."""

    decisions: dict[int, Decision] = field(hash=False)
    transfers: dict[int, tuple[int, int]] = field(hash=False)
    time: float  # seconds it adds
    saved: int  # bytes of interior values it keeps from the forward to the backward
    timeline: tuple[int, ...]  # the cut's live bytes at each of its steps
    source: str


def options(c: Cut, config: SolverConfig, *, deadline: float) -> list[Option]:
    """The options of one cut: recompute every interior value (first: the chain model's
    reference), save them all, recompute the free ones, and CP-SAT's cheapest plan at
    ``SWEEP`` budgets from the least peak to saving all. Pareto-dominated ones dropped."""
    from solvers import cpsat  # cpsat seeds its search with this module's plans

    p = c.problem
    recomputable = {v for v in p.candidates if p.nodes[v].recomputable}
    plans: list[tuple[str, Plan]] = [("recompute", plan_with(p, recomputable)),
                                     ("save", plan_with(p, set())), ("free", free_plan(p))]
    low = plans[0][1]
    if _in_time(deadline, config):
        least = cpsat.min_feasible_peak(p, replace(config, time_limit=_left(deadline, config)))
        if least.plan is not None:
            plans.append(("least-peak", least.plan))
            low = least.plan
    lo = check(p, low).peak
    hi = check(p, plans[1][1]).peak
    for k in range(1, SWEEP):
        if not _in_time(deadline, config):
            break
        budget = lo + (hi - lo) * k // SWEEP
        try:
            r = cpsat.solve(p.with_budget(budget), replace(config, time_limit=_left(deadline, config)))
        except InfeasibleBudgetError:
            continue
        if r.plan is not None:
            plans.append((f"cpsat@{k}/{SWEEP}", r.plan))
    out: list[Option] = []
    for source, plan in plans:
        report = check(p, plan)
        saved = sum(p.nodes[v].size for v in plan.of(Decision.SAVE) if v in c.interior.values())
        out.append(Option(dict(plan.decisions), {t.node: (t.offload_at, t.reload_at) for t in plan.transfers},
                          report.added_time, saved, report.timeline, source))
    return _pareto(out)


def _left(deadline: float, config: SolverConfig) -> float:
    """The time limit of one segment's solve: ``SUB_LIMIT``, or what is left before the
    deadline. Under ``config.deterministic`` the deadline is not looked at (each solve
    counts its own work), so the options do not depend on the machine's load."""
    if config.deterministic:
        return min(config.time_limit, SUB_LIMIT)
    return max(0.05, min(config.time_limit, SUB_LIMIT, deadline - time.perf_counter()))


def _in_time(deadline: float, config: SolverConfig) -> bool:
    return config.deterministic or time.perf_counter() < deadline


def _pareto(opts: list[Option]) -> list[Option]:
    """Drop each option another beats or ties on time, saved bytes and peak (the first of
    equals stays: the reference, recomputing everything, comes first)."""
    keyed = [(o.time, o.saved, max(o.timeline, default=0)) for o in opts]
    keep = []
    for i, a in enumerate(keyed):
        if not any(j != i and all(x <= y for x, y in zip(b, a, strict=True)) and (b != a or j < i)
                   for j, b in enumerate(keyed)):
            keep.append(opts[i])
    return keep


# ---- the chain model -----------------------------------------------------------------


@dataclass(frozen=True)
class Chain:
    """The chain of a problem and each segment's options, ready for any budget."""

    problem: Problem
    segments: tuple[Segment, ...]
    cuts: tuple[Cut, ...]
    options: tuple[tuple[Option, ...], ...]  # per segment; [0] recomputes its whole interior
    reference: Report  # the checker's verdict on every segment at its option 0
    distinct: int  # segments of distinct shapes, each planned once

    def plan(self, choice: Sequence[int]) -> Plan:
        """The step's plan for one option per segment (an index into each one's options)."""
        return compose(self.problem, self.cuts, [opts[k] for opts, k in zip(self.options, choice, strict=True)])


def compose(problem: Problem, cuts: Sequence[Cut], chosen: Sequence[Option]) -> Plan:
    """The step's plan taking each cut's decisions from its chosen option; everything else
    the backward reads (boundaries, values several segments read) is saved."""
    decisions: dict[int, Decision] = {}
    transfers: dict[int, tuple[int, int]] = {}
    for c, o in zip(cuts, chosen, strict=True):
        for g, j in c.interior.items():
            d = o.decisions.get(j)
            if d is None:
                continue
            decisions[g] = d
            if j in o.transfers:
                out, back = o.transfers[j]
                transfers[g] = (c.steps[out], c.steps[back])
    recomputed = {v for v, d in decisions.items() if d is Decision.RECOMPUTE}
    merged = dict(plan_with(problem, recomputed).decisions)
    merged.update({v: d for v, d in decisions.items() if d is Decision.OFFLOAD and v in merged})
    return plan_from_decisions(problem, merged, transfers)


def build_chain(problem: Problem, config: SolverConfig = SolverConfig(), *,
                deadline: float | None = None) -> Chain | None:
    """The chain of ``problem`` with its segments' options, or None where it has none."""
    segments = find_segments(problem)
    if len(segments) < 2:
        return None
    deadline = deadline if deadline is not None else time.perf_counter() + config.time_limit * OPTION_SHARE
    cuts = tuple(cut(problem, s) for s in segments)
    by_shape: dict[str, list[Option]] = {}
    for c in cuts:
        if c.signature not in by_shape:
            by_shape[c.signature] = options(c, config, deadline=deadline)
    opts = tuple(tuple(by_shape[c.signature]) for c in cuts)
    reference = check(problem.with_budget(None), compose(problem, cuts, [o[0] for o in opts]))
    return Chain(problem, tuple(segments), cuts, opts, reference, distinct=len(by_shape))


@dataclass(frozen=True)
class Group:
    """Steps that share one constraint: the same owner, the same alive segments."""

    owner: int | None
    alive: tuple[int, ...]
    steps: tuple[int, ...]


def groups(chain: Chain) -> list[Group]:
    """The steps of the step, grouped by owner and alive segments."""
    p = chain.problem
    n = len(p.nodes)
    own: list[int | None] = [None] * n
    for s, seg in enumerate(chain.segments):
        for t in seg.region:
            own[t] = s
    spans = [(seg.forward[1], seg.window[0]) for seg in chain.segments if seg.window is not None]
    live_segs = [s for s, seg in enumerate(chain.segments) if seg.window is not None]
    by_key: dict[tuple[int | None, tuple[int, ...]], list[int]] = {}
    for t in range(n):
        alive = tuple(s for s, (lo, hi) in zip(live_segs, spans, strict=True)
                      if lo < t < hi and s != own[t])
        by_key.setdefault((own[t], alive), []).append(t)
    return [Group(o, a, tuple(ts)) for (o, a), ts in by_key.items()]


def solve_chain(chain: Chain, budget: int | None, config: SolverConfig, *,
                minimize_peak: bool = False) -> tuple[list[int], float, bool] | None:
    """One option per segment: the least added time within ``budget`` (or, with
    ``minimize_peak``, the least peak), by CP-SAT on the chain model. Returns the choice,
    the model's bound (seconds, or bytes for the peak) and whether it is proven optimal;
    None where the chain model has no solution."""
    p = chain.problem
    unit = p.scale.bytes_per_unit
    seconds = p.scale.seconds_per_unit
    base = chain.reference.timeline
    local_at = [{g: j for j, g in enumerate(c.steps) if g >= 0} for c in chain.cuts]
    ref_saved = [opts[0].saved for opts in chain.options]
    m = cp_model.CpModel()
    x = [[m.new_bool_var(f"x{s}_{k}") for k in range(len(opts))] for s, opts in enumerate(chain.options)]
    for xs in x:
        m.add_exactly_one(xs)
    kept = [[(o.saved - ref_saved[s]) // unit for o in opts] for s, opts in enumerate(chain.options)]
    total_bytes = sum(n.size for n in p.nodes)
    peak = m.new_int_var(0, total_bytes // unit + 1, "peak")
    for g in groups(chain):
        load: list[cp_model.LinearExprT] = []
        for s in g.alive:
            load += [k * v for k, v in zip(kept[s], x[s], strict=True) if k]
        if g.owner is None:
            top = max(base[t] for t in g.steps)
            m.add(sum(load) + -(-top // unit) <= peak)
            continue
        s = g.owner
        ref = chain.options[s][0].timeline
        tops = []
        for o in chain.options[s]:
            tops.append(max(base[t] + o.timeline[local_at[s][t]] - ref[local_at[s][t]] for t in g.steps))
        m.add(sum(load) + sum(-(-top // unit) * v for top, v in zip(tops, x[s], strict=True)) <= peak)
    if minimize_peak:
        m.minimize(peak)
    else:
        if budget is not None:
            m.add(peak <= budget // unit)
        m.minimize(sum(round(o.time / seconds) * v for opts, xs in zip(chain.options, x, strict=True)
                       for o, v in zip(opts, xs, strict=True)))
    solver = make_solver(replace(config, relative_gap=0.0))
    code = solver.solve(m)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    choice = [next(k for k, v in enumerate(xs) if solver.boolean_value(v)) for xs in x]
    bound = solver.best_objective_bound * (unit if minimize_peak else seconds)
    return choice, bound, code == cp_model.OPTIMAL


def solve(problem: Problem, config: SolverConfig = SolverConfig(), *, chain: Chain | None = None) -> SolveResult:
    """The cheapest plan the chain model finds within ``problem.budget``, judged by the
    checker. Status FEASIBLE with its plan (the chain model's optimum is not the flat
    problem's), INFEASIBLE without one (the chain model proves nothing about the flat
    problem), UNKNOWN on a problem without a chain."""
    t0 = time.perf_counter()
    chain = chain or build_chain(problem, config)
    if chain is None:
        return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=math.inf, bound=0.0,
                           wall_time=time.perf_counter() - t0, solver="chain")
    budget = problem.budget
    stats: dict[str, float | int | str] = {"segments": len(chain.segments), "distinct": chain.distinct,
                                           "options": sum(len(o) for o in chain.options)}
    best: tuple[Plan, Report] | None = None
    target = budget
    for attempt in range(TIGHTEN):
        left = max(0.1, config.time_limit - (time.perf_counter() - t0))
        chosen = solve_chain(chain, target, replace(config, time_limit=left))
        if chosen is None:
            break
        plan = chain.plan(chosen[0])
        report = check(problem, plan)
        stats.update(chain_bound=chosen[1], chain_optimal=int(chosen[2]), chain_solves=attempt + 1)
        if report.fits:
            best = (plan, report)
            break
        assert budget is not None and target is not None
        target -= report.peak - budget
        if target <= 0:
            break
    wall = time.perf_counter() - t0
    if best is None:
        return SolveResult(status=Status.INFEASIBLE, plan=None, report=None, objective=math.inf, bound=0.0,
                           wall_time=wall, solver="chain", stats=stats)
    plan, report = best
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=report, objective=report.added_time,
                       bound=0.0, wall_time=wall, solver="chain", stats=stats)


def min_peak(problem: Problem, config: SolverConfig = SolverConfig(), *, chain: Chain | None = None) -> SolveResult:
    """The least-peak plan of the chain model, judged by the checker (status FEASIBLE: not
    a proof for the flat problem), or status UNKNOWN on a problem without a chain."""
    t0 = time.perf_counter()
    chain = chain or build_chain(problem, config)
    chosen = solve_chain(chain, None, config, minimize_peak=True) if chain is not None else None
    if chosen is None:
        return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=math.inf, bound=0.0,
                           wall_time=time.perf_counter() - t0, solver="chain-min-peak")
    unbudgeted = problem.with_budget(None)
    plan = chain.plan(chosen[0])  # type: ignore[union-attr]
    # The least chain peak may cost more time than needed: re-solve for time at that peak.
    report = check(unbudgeted, plan)
    again = solve(problem.with_budget(report.peak), config, chain=chain)
    if again.plan is not None and again.report is not None and again.report.peak <= report.peak:
        plan, report = again.plan, again.report
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=check(problem, plan),
                       objective=report.added_time, bound=0.0, wall_time=time.perf_counter() - t0,
                       solver="chain-min-peak")


def describe(chain: Chain) -> Iterable[str]:
    """One line per distinct segment: where it first appears, how often, its options."""
    seen: dict[str, int] = {}
    for c in chain.cuts:
        seen[c.signature] = seen.get(c.signature, 0) + 1
    shown: set[str] = set()
    for seg, c, opts in zip(chain.segments, chain.cuts, chain.options, strict=True):
        if c.signature in shown:
            continue
        shown.add(c.signature)
        yield (f"forward {seg.forward[0]}..{seg.forward[1]} x{seen[c.signature]}: "
               f"{len(seg.interior)} interior values, {len(opts)} options "
               + ", ".join(f"{o.source} ({o.saved} B, {o.time * 1e3:.3g} ms)" for o in opts))


__all__ = ["Chain", "Segment", "build_chain", "find_segments", "min_peak", "save_all", "solve"]
