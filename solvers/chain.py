"""Planning by segments: a step split at its boundaries, each segment planned exactly on
its own once per distinct shape, then one option per segment chosen for the whole step.

A deep model's step is a chain: its forward cut at its *boundaries* into segments, each
with its *interior*, *window* and *region* (:mod:`solvers.segments`).

Options. Each segment's region, cut out as a problem of its own (what it reads from
outside becomes resident), is planned by the planner the chain model is handed
(:class:`solvers.result.Planner`) at a sweep of budgets from its least peak to saving
everything, beside recomputing every interior value (what checkpointing the segment
does), recomputing the free ones, and saving the values dearest to recompute for their
bytes up to each ``1 / DEAREST`` of what it could save. Segments of the same
shape share their options: a 32-layer model has a handful of distinct segments, not 64.

Spans. A *span* is one to ``SPAN`` consecutive segments planned as one: inside it, the
boundaries between its segments are decided like any value (a span of two layers whose
middle boundary is recomputed keeps one block input in two). Its options are those of
its cut; the first, its *reference*, recomputes each segment's interior and saves the
boundaries inside it.

The chain model. Let ``R`` be the plan that recomputes every segment's interior and saves
every boundary, and ``T_R(t)`` its live bytes at step ``t``. Where the problem has a host
link, every composed plan, ``R`` included, offloads the boundaries (then what its options
save) whose copies hide under the compute around them (:mod:`solvers.hostcopy`): a block
input then holds the device only while it is copied out and from when it is copied back,
and ``T_R`` counts it so; a plan with fewer of them offloaded is over ``T_R``'s account,
and the checker says so. Each step has an *owner*:
the segment whose forward holds it, or in the backward the segment whose window began
last. Choosing option ``o`` of span ``I`` changes the live bytes by ``D[I,o](t)`` at the
steps of its cut (its option's timeline less its reference's), and by ``K[I,o]`` (its
saved bytes less its reference's) at every step after its forward and before its
window, and nowhere else, since its values are read only there. Taking these changes to
add up, with ``x[I,o]`` choosing spans that cover every segment once and one option each,
and ``S[s]`` the bytes the spans before segment ``s`` keep,

    minimize    sum_{I,o} time[I,o] * x[I,o]
    subject to  sum_{I contains s} sum_o x[I,o] = 1                         for every s
                S[0] = 0,  S[s+1] = S[s] + sum_{I ends at s} (sum_o K[I,o] x[I,o] - H[I])
                Q[-1] = 0,  Q[s] >= Q[s-1] + sum_{I ends at s} H[I] - c[s],
                            Q[s] >= sum_{I ends at s} H[I],  Q[s] >= 0,  Q[last] = 0
                S[s] + Q[s-1] + sum_{I contains s} sum_o F[I,o,s] x[I,o]  <=  budget
                S[s] +          sum_{I contains s} sum_o B[I,o,s] x[I,o]  <=  budget
                sum_o min(0, h[I,o] - h[I,ref], -g[I,o]) x[I,o]  <=  H[I]  <=  sum_o (h[I,o] - h[I,ref]) x[I,o]
                sum_{I starts at s or later} H[I]  <=  later[s]              for every s

where ``F[I,o,s]`` and ``B[I,o,s]`` are the largest ``T_R(t) + D[I,o](t)`` over the
steps ``s`` owns in the forward and in the backward (steps no segment owns come after
every span's forward and before its window: ``S`` of all plus their largest ``T_R``), and
``H[I]`` the bytes of what span ``I`` saves that go to host memory beyond what its
reference's do (``T_R`` counts those offloaded): at most ``h[I,o] - h[I,ref]``, with
``h`` an option's saved bytes that may be offloaded, which is negative where the option
saves less of it than its reference (a span that recomputes a block input between its
segments does not copy it out either): then ``H[I]`` is exactly that, and the sums of the
last rows may be below 0 (the spans from ``s`` on send less than R's). It is at least
``-g[I,o]``, the bytes of the boundaries inside the span that R offloads and the option
no longer saves (``Chain.given_back``): an option may give back one such copy and save a
larger value to offload, and ``H[I] = 0`` would then count the first off the device,
where ``T_R`` counts it, while nothing sends it. An option that
recomputes a boundary inside its span reads what it recomputes it from early in the
backward, for the later segment's window, so R's copy of a value from before the span may
no longer hide: those bytes (``Chain.lost``) count on the device at the later segments'
steps, and come off ``h`` with the boundaries it saves inside the span. At those steps
``T_R`` has a boundary R offloads off the device and the span's cut has it on, so what its
reference saves to offload and the option does not (at least ``g[I,o]``) counts there too
(``Chain.later_in``). Every composed plan tries R's offloads first, so that what the
options save does not take their place on the link.

The copy engine out. ``Q[s]`` is what waits for the engine out after segment ``s``'s
forward: still on the device, so counted at the next segment's forward steps (it is
empty by the backward). The copies of what a span saves are taken as issued at its
forward's end, at the latest, and the engine carries ``c[s]`` during segment ``s``'s
forward: the link's bandwidth times its compute, less R's copies issued there
(:func:`drains`; a block input's copy is issued only once the block after it has read
it for the last time). Every copy is out by the forward's end. The copies back:
``later[s]`` is what the link brings back before the window of segment ``s`` (or, for a
segment without one, of the next one with one) and carries out after its forward
(:func:`link_rooms`), less R's copies of those segments.

Options never offload: every copy shares the one link, which only this level sees.
CP-SAT solves the model over one-segment spans first, a much smaller model, then over
all spans from that plan; the composed plan goes to the checker, which stays the judge.
Where the changes do not add up exactly (windows that interleave, copies the greedy
placement of :func:`solvers.hostcopy.offload_hidden` does not reach) and the checker
finds the plan over budget, the chain model is solved again with the budget lowered by
the excess, then twice it, and so on; a plan that fits close under the budget has its
search go on from it while time is left, and a one-segment plan far above the model's
bound (or with none proven, or no plan found in the time) is searched again once, from
no hint and with most of the time left.

Options found before. Inside :func:`sharing_options`, the options of each cut are kept
by its *structure* (its ops, reads and flags, without sizes or times), and a cut of the
same structure in a later problem, such as the same step traced once and read again at
another batch size, re-judges those options' decisions with the checker on its own
sizes and times instead of searching again: at sizes that all scale together, the
cheapest plan under a budget scaled likewise takes the same decisions. It searches no
span the first problem did not reach, and spends its time on the chain-level choice.

Its plans recompute each value at most once: a boundary recomputed inside a span is
recomputed with the segment before it for the backward of the segment after it, and that
segment's values then live until their own backward. The chain model reaches every plan
per-segment checkpointing reaches (every span one segment at its reference), and the
plans that keep one boundary in up to ``SPAN``. Plans that recompute a segment's values
twice, to hold fewer of them at once, are :mod:`solvers.multilevel`'s.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import contextvars
import functools
import hashlib
import math
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from ortools.sat.python import cp_model

from solvers.baselines import free_plan, plan_with
from solvers.checker import Report, check
from solvers.deadline import Deadline
from solvers.hostcopy import Clock, offload_hidden
from solvers.plan import Decision, Plan, PlanError, plan_from_decisions
from solvers.problem import Copy, Node, Problem
from solvers.result import InfeasibleBudgetError, Planner, SolverConfig, SolveResult, Status
from solvers.sat import LEAST_SOLVE, make_solver, solved, within
from solvers.segments import Segment, find_segments

# The constants below are swept on five model families in docs/constants.md (bench/constants.py).
SWEEP = 6  # CP-SAT budgets per distinct segment, evenly from its least peak to saving all
# Plans per distinct segment that save its values dearest to recompute for their bytes, up to
# k / DEAREST of what it could save: the trade of kept bytes for time the chain level makes
DEAREST = 24
SPAN = 4  # segments, at most, planned as one (two layers of a transformer)
OPTION_SHARE = 0.35  # of the time limit, at most, for the segments' options
PEAK_SHARE = 0.5  # of what is left, at most, for the least-peak search; the search for time at its peak gets the rest
TIGHTEN = 6  # chain solves at most per phase, each with the budget moved by the last one's excess or slack
# (or halfway between the highest target whose plan fitted and the lowest whose plan did not)
LOOSEN = 0.01  # of the budget: a plan further under it is searched again with the model's budget raised
COARSE = 8  # where one-segment spans fit no plan, the search over all spans first keeps every COARSE-th option (solve)
# Of the time left, for each search of solve's phases: one-segment spans; that search again
# from no hint; all spans with few options; the first search over all options (keeping time
# for a budget moved by its excess); each later one (or all of it where the search only
# goes on from its last plan)
SINGLES_SHARE, AGAIN_SHARE, COARSE_SHARE, ALL_SHARE, NEXT_SHARE = 0.25, 0.75, 0.5, 2 / 3, 0.5
FAR = 1.25  # times the model's bound: a one-segment plan adding more is searched again, from no hint
HINT_WORK = 1.0  # CP-SAT's deterministic seconds, at most, to complete a chain search's hint
SUB_LIMIT = 5.0  # seconds, at most, for one CP-SAT solve of a segment


def span(problem: Problem, segments: Sequence[Segment], first: int, last: int) -> Segment:
    """Segments ``first..last`` as one: their interiors and the boundaries between them
    (those only the span reads in the forward), their windows' hull."""
    chosen = segments[first:last + 1]
    lo, hi = chosen[0].forward[0], chosen[-1].forward[1]
    candidates = set(problem.candidates)
    inner = [s.forward[1] for s in chosen[:-1]
             if s.forward[1] in candidates and all(lo <= u <= hi for u in problem.forward_users[s.forward[1]])]
    windows = [s.window for s in chosen if s.window is not None]
    window = (min(w[0] for w in windows), max(w[1] for w in windows)) if windows else None
    inner_reads = [u for b in inner for u in problem.backward_uses[b]]
    if inner_reads:
        reads = [*(window or ()), *inner_reads]
        window = (min(reads), max(reads))
    interior = tuple(sorted({*(v for s in chosen for v in s.interior), *inner}))
    return Segment((lo, hi), window, interior)


# ---- one segment, cut out ----------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """A segment's region as a problem of its own: ``problem.nodes[j]`` is the step's
    value ``steps[j]``, or (``steps[j]`` negative) a resident stand-in for a value it reads
    from outside."""

    problem: Problem
    steps: tuple[int, ...]
    interior: dict[int, int]  # step index -> local index, for the interior
    boundaries: frozenset[int] = frozenset()  # local indices of the boundaries inside a span

    @property
    def signature(self) -> str:
        """Equal for segments of the same shape: the same ops, sizes, costs and reads."""
        return self._digest(sized=True)

    @property
    def structure(self) -> str:
        """Equal for segments of the same structure: :attr:`signature` without sizes and
        costs (the same segment at another batch size has the same structure)."""
        return self._digest(sized=False)

    def _digest(self, *, sized: bool) -> str:
        h = hashlib.blake2b(digest_size=16)
        for n in self.problem.nodes:
            size = 0 if n.resident else n.size  # a resident value costs nothing
            costs = (size, round(n.time, 15), n.flops) if sized else ()
            h.update(repr((n.op, n.deps, n.backward, *costs,
                           n.recomputable, n.offloadable, n.resident, n.keep, n.returned, n.overwrites,
                           sorted(c.value for c in n.overwrites_copies),
                           sorted(c.value for c in n.unstored))).encode())
        h.update(repr((sorted(self.interior.values()), sorted(self.boundaries))).encode())
        return h.hexdigest()


def _stand_in(n: Node, saved: bool) -> Node:
    """What a cut reads from outside. A forward value outside that the reference plan does
    not save may become a saved value when a recomputation inside reads it, so it keeps
    its size and is saved when needed (it cannot be recomputed: what it reads is not in
    the cut). Parameters, inputs, backward values and values the reference saves anyway
    are resident."""
    if n.resident or n.backward or saved:
        return Node(name=f"in:{n.name}", op="input", size=n.size, resident=True)
    return Node(name=f"in:{n.name}", op="input", size=n.size, recomputable=False, offloadable=False)


def cut(problem: Problem, segment: Segment, boundaries: Iterable[int] = (),
        saved: Collection[int] = ()) -> Cut:
    """The region of ``segment`` (a span) as a problem. Its forward values that are not
    interior, and every value read after the region, are kept to its end, so they take no
    decision. ``boundaries``: its inner boundaries; ``saved``: the values the reference
    plan saves (both in the step's indices)."""
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
    nodes = [_stand_in(problem.nodes[d], d in saved) for d in outside]
    for g in region:
        n = problem.nodes[g]
        read_later = any(u not in inside for u in problem.users[g])
        # A returned value lives to the step's forward end, past the region's: kept, here.
        keep = n.keep or n.returned or read_later or (not n.backward and g not in interior)
        nodes.append(replace(
            n, deps=tuple(local[d] for d in n.deps),
            overwrites=None if n.overwrites is None else local[n.overwrites],
            keep=keep, returned=False, unstored=n.unstored - {Copy.FORWARD} if keep else n.unstored,
            resident=n.resident and not n.backward,
        ))
    sub = Problem(nodes=tuple(nodes), budget=None, host_bandwidth=problem.host_bandwidth,
                  name=f"{problem.name}[{segment.forward[0]}:{segment.forward[1]}]")
    return Cut(sub, (*(-1 - d for d in outside), *region), {g: local[g] for g in segment.interior},
               frozenset(local[b] for b in boundaries if b in interior))


# ---- options -------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One way to plan a segment: its decisions (in the cut's indices), what it adds."""

    decisions: dict[int, Decision] = field(hash=False)
    time: float  # seconds it adds
    saved: int  # bytes it keeps from the forward to the backward (the values it reads too)
    timeline: tuple[int, ...]  # the cut's live bytes at each of its steps
    source: str
    # Of ``saved``, the bytes of values that may be offloaded (their last forward read is
    # at the cut's last forward step at the latest, and the step's forward goes on after
    # it); 0 without a host link
    hostable: int = 0


def options(c: Cut, config: SolverConfig, *, deadline: Deadline, planner: Planner) -> list[Option]:
    """The options of one cut: its reference (recompute every interior value but the inner
    boundaries; first), save them all, recompute the free ones, recompute all (inner
    boundaries too), the dearest values kept at each ``1 / DEAREST`` of the bytes
    (:func:`_fixed_plans`), and ``planner``'s cheapest plan at ``SWEEP`` budgets from the
    least peak to saving all; none offloads. Pareto-dominated ones dropped, the reference
    kept. An option is its decisions, so plans that recompute a value more than once are
    neither sought nor kept (their schedule is more than their decisions)."""
    p = c.problem
    # No option offloads: its copies would share the step's link with every other span's,
    # which only the chain level sees (``H``, :func:`compose`).
    unlinked = replace(p, host_bandwidth=0.0)
    # Under ``deterministic`` one CP-SAT worker: on these small models the interleaved
    # portfolio's deterministic seconds undercount its time many times over (the least peak
    # of a 45-decision span of Llama-2-70B: 45 s for 2.9 deterministic seconds with 8
    # workers, 0.1 s with one).
    config = replace(config, multilevel=False, workers=1 if config.deterministic else config.workers)
    plans = _fixed_plans(c)
    low = plans[0][1]
    if not deadline.expired():
        sub = _sub(deadline, config)
        least = planner.min_feasible_peak(unlinked, replace(config, time_limit=sub.seconds), deadline=sub)
        if least.plan is not None and not least.plan.multilevel:
            plans.append(("least-peak", least.plan))
            low = least.plan
    lo = check(p, low).peak
    hi = check(p, plans[1][1]).peak
    for k in range(1, SWEEP):
        if deadline.expired():
            break
        budget = lo + (hi - lo) * k // SWEEP
        sub = _sub(deadline, config)
        try:
            r = planner.solve(unlinked.with_budget(budget), replace(config, time_limit=sub.seconds), deadline=sub)
        except InfeasibleBudgetError:
            continue
        if r.plan is not None and not r.plan.multilevel:
            plans.append((f"cpsat@{k}/{SWEEP}", r.plan))
    return _judged(p, plans)


def _fixed_plans(c: Cut) -> list[tuple[str, Plan]]:
    """The options every cut has, reference first (:func:`options`); beside them, the plans
    that save the values dearest to recompute for their bytes, up to ``k / DEAREST`` of
    what the interior could save, and recompute the rest: the trade of kept bytes for time
    the chain level makes, which CP-SAT's sweep (of the cut's own peak) need not offer, and
    where the host link carries the kept bytes off (the chain model's ``H``), what pays.
    Where the link is what limits the plan, each byte it carries should go to the dearest
    value left, so the steps of that trade must be fine (docs/scale.md)."""
    p = c.problem
    recomputable = {v for v in p.candidates if p.nodes[v].recomputable}
    plans: list[tuple[str, Plan]] = [("recompute", plan_with(p, recomputable - c.boundaries)),
                                     ("save", plan_with(p, set())), ("free", free_plan(p))]
    if c.boundaries:
        plans.append(("recompute-all", plan_with(p, recomputable)))
    inner = recomputable - c.boundaries
    dearest = sorted(inner, key=lambda v: (-p.nodes[v].time / max(p.nodes[v].size, 1), v))
    total = sum(p.nodes[v].size for v in inner)
    for k in range(1, DEAREST):
        kept: set[int] = set()
        room = total * k // DEAREST
        for v in dearest:
            if p.nodes[v].size <= room:
                kept.add(v)
                room -= p.nodes[v].size
        plans.append((f"keep-dearest@{k}/{DEAREST}", plan_with(p, inner - kept)))
    return plans


def _judged(p: Problem, plans: Sequence[tuple[str, Plan]]) -> list[Option]:
    """Each plan as an option, by the checker; the first, then the Pareto set of all."""
    return _front([_option(p, source, plan, check(p, plan)) for source, plan in plans])


def _option(p: Problem, source: str, plan: Plan, report: Report) -> Option:
    saved = sum(p.nodes[v].size for v in plan.of(Decision.SAVE))
    # The step's forward goes on after the cut's: a value read last by the cut's last
    # forward step (a block input the last residual add reads) may be copied out then.
    hostable = sum(p.nodes[v].size for v in plan.of(Decision.SAVE)
                   if p.host_bandwidth > 0 and p.nodes[v].offloadable and p.copy_out_from(v) <= p.n_forward)
    return Option(dict(plan.decisions), report.added_time, saved, report.timeline, source, hostable)


def _front(options: list[Option]) -> list[Option]:
    """The first option, then the Pareto set of all."""
    return [options[0], *(o for o in _pareto(options) if o is not options[0])]


def rejudged(c: Cut, known: Sequence[Option]) -> list[Option]:
    """The options of ``c`` from those of a cut of the same structure (:attr:`Cut.structure`):
    its own fixed ones, and each searched one's decisions judged again on ``c``'s sizes
    and times. A decision set that no longer makes a valid plan here is dropped."""
    p = c.problem
    plans = _fixed_plans(c)
    fixed = {source for source, _ in plans}
    options = [_option(p, source, plan, check(p, plan)) for source, plan in plans]
    for o in known:
        if o.source in fixed:
            continue
        try:
            plan = plan_from_decisions(p, o.decisions)
            report = check(p, plan)
        except PlanError:
            continue
        options.append(_option(p, o.source, plan, report))
    return _front(options)


class OptionBank:
    """Options of cuts planned before, by :attr:`Cut.structure` (module docstring)."""

    def __init__(self) -> None:
        self.by_structure: dict[str, list[Option]] = {}
        self.reused = 0  # cuts whose options came from here


_BANK: contextvars.ContextVar[OptionBank | None] = contextvars.ContextVar("chain_option_bank", default=None)


@contextlib.contextmanager
def sharing_options() -> Iterator[OptionBank]:
    """Within the block, :func:`build_chain` keeps each cut's options by its structure and
    re-judges them for a cut of the same structure (module docstring), in this context
    only. For problems that differ in sizes alone, such as one step at several batch sizes."""
    bank = OptionBank()
    token = _BANK.set(bank)
    try:
        yield bank
    finally:
        _BANK.reset(token)


def _sub(deadline: Deadline, config: SolverConfig) -> Deadline:
    """The deadline of one segment's solve: ``SUB_LIMIT`` (and the config's limit), or
    what is left of the options' ``deadline`` where that is less."""
    return deadline.part(min(config.time_limit, SUB_LIMIT))


def _pareto(opts: list[Option]) -> list[Option]:
    """Drop each option another beats or ties on time, saved bytes, peak and saved bytes
    that may not be offloaded (the first of equals stays)."""
    keyed = [(o.time, o.saved, max(o.timeline, default=0), o.saved - o.hostable) for o in opts]
    keep = []
    for i, a in enumerate(keyed):
        if not any(j != i and all(x <= y for x, y in zip(b, a, strict=True)) and (b != a or j < i)
                   for j, b in enumerate(keyed)):
            keep.append(opts[i])
    return keep


# ---- the chain model -----------------------------------------------------------------


@dataclass(frozen=True)
class Chain:
    """The chain of a problem, its spans and each span's options, ready for any budget."""

    problem: Problem
    segments: tuple[Segment, ...]
    spans: tuple[tuple[int, int], ...]  # first and last segment of each span
    cuts: tuple[Cut, ...]  # per span
    options: tuple[tuple[Option, ...], ...]  # per span; [0] is its reference
    reference: Report  # the checker's verdict on R: every one-segment span at its reference
    distinct: int  # spans of distinct shapes, each planned once
    # Bytes R's plan offloads of the values each segment's forward makes (the link's time
    # they take is not the options' to count again): all 0 without a host link.
    hosted: tuple[int, ...] = ()
    # Bytes the copy engine out may carry during each segment's forward beyond R's copies
    # issued there (:func:`drains`): all 0 without a host link.
    drains: tuple[int, ...] = ()
    # Seconds one plan took to compose and check (R's, or with a host link the slower of
    # R's and the one whose options save most to offload): a solve keeps that much of its
    # time limit for its last plan (half a second on a 405B-shaped step).
    judge_s: float = 0.0
    # For each span and option, the bytes of what R's plan offloads that the option reads
    # early (it recomputes a boundary inside the span, and with it the first segment's
    # values, for the later segment's backward: what that reads from before the span must
    # be back from the host that much sooner, and its copies may no longer hide); counted
    # on the device at the later segments' steps and after the span (:func:`lost`). Empty
    # without a host link.
    lost: tuple[tuple[int, ...], ...] = ()
    # The values R's plan offloads: every composed plan tries them first (:func:`compose`).
    hosted_values: frozenset[int] = frozenset()

    @functools.cached_property
    def step_owners(self) -> tuple[int | None, ...]:
        """:func:`owners`, computed once per chain (every solve and prediction reads it)."""
        return tuple(owners(self))

    @functools.cached_property
    def highs(self) -> tuple[tuple[dict[int, tuple[int, ...]] | None, dict[int, tuple[int, ...]] | None], ...]:
        """For each segment ``s``, over the steps it owns in the forward and then in the
        backward (None where it owns none): for each span containing ``s``, the most live
        bytes at those steps with each of its options (``F`` and ``B`` of the module
        docstring). Computed once per chain: every chain solve reads them."""
        f = self.problem.n_forward
        base = self.reference.timeline
        steps_of: list[list[int]] = [[] for _ in self.segments]
        for t, s in enumerate(self.step_owners):
            if s is not None:
                steps_of[s].append(t)
        local_at = [{g: j for j, g in enumerate(c.steps) if g >= 0} for c in self.cuts]
        covering: list[list[int]] = [[] for _ in self.segments]
        for i, (first, last) in enumerate(self.spans):
            for s in range(first, last + 1):
                covering[s].append(i)

        def most(s: int, steps: list[int]) -> dict[int, tuple[int, ...]] | None:
            if not steps:
                return None
            out = {}
            for i in covering[s]:
                ref, at = self.options[i][0].timeline, local_at[i]
                early = self.later_in(i) if s > self.spans[i][0] else (0,) * len(self.options[i])
                out[i] = tuple(max(base[t] + (o.timeline[at[t]] - ref[at[t]] if t in at else 0) for t in steps) + e
                               for o, e in zip(self.options[i], early, strict=True))
            return out

        return tuple((most(s, [t for t in steps if t < f]), most(s, [t for t in steps if t >= f]))
                     for s, steps in enumerate(steps_of))

    def early(self, i: int) -> tuple[int, ...]:
        """:attr:`lost` of span ``i``, by option (all 0 where not computed)."""
        return self.lost[i] if self.lost else (0,) * len(self.options[i])

    def later_in(self, i: int) -> tuple[int, ...]:
        """Bytes each option of span ``i`` adds to ``T_R`` at the steps of its segments
        after the first: what of R's copies it reads early (:attr:`lost`) and, where the
        problem has a host link, what its reference saves to offload and it does not
        (``T_R`` counts a boundary inside the span R offloads off the device there, and
        its cut's reference on it, so their difference would take it off twice; at least
        :meth:`given_back`)."""
        if self.problem.host_bandwidth <= 0:
            return (0,) * len(self.options[i])
        ref = self.options[i][0].hostable
        return tuple(e + max(0, ref - o.hostable, self.given_back(i, k)) + self.inner_saved(i, k)
                     for k, (e, o) in enumerate(zip(self.early(i), self.options[i], strict=True)))

    def inner_saved(self, i: int, k: int) -> int:
        """Where option ``k`` of span ``i`` recomputes a boundary inside the span, the
        bytes of those inside it that it saves and that may be offloaded: one of them is
        read early, for the recomputation of the next, so its copies may no longer hide."""
        return self._inner_saved[i][k]

    @functools.cached_property
    def _inner_saved(self) -> tuple[tuple[int, ...], ...]:
        """:meth:`inner_saved` of every span and option, computed once per chain (every
        chain solve reads it for each option)."""
        def saved(option: Option, c: Cut) -> int:
            if not any(option.decisions.get(b) is Decision.RECOMPUTE for b in c.boundaries):
                return 0
            return sum(c.problem.nodes[b].size for b in c.boundaries
                       if option.decisions.get(b) is Decision.SAVE and c.problem.nodes[b].offloadable)

        return tuple(tuple(saved(o, c) for o in opts) for opts, c in zip(self.options, self.cuts, strict=True))

    def more(self, i: int, k: int) -> int:
        """Bytes option ``k`` of span ``i`` saves that may go to the host beyond what its
        reference's do (``h[I,o] - h[I,ref]``), less what of R's offloaded values it reads
        early (:attr:`lost`) and, where it recomputes a boundary inside the span, the
        boundaries inside it that it saves: one of them is read early too, for the
        recomputation of the next."""
        option = self.options[i][k]
        return option.hostable - self.options[i][0].hostable - self.early(i)[k] - self.inner_saved(i, k)

    def least_hosted(self, i: int, k: int) -> int:
        """The least ``H[I]`` of option ``k`` of span ``i``: where it sends nothing beyond R's
        copies, what of those it no longer sends, the boundaries inside the span R offloads
        and it recomputes (:meth:`given_back`), or :meth:`more` where that is less. An option
        may recompute one boundary R offloads and save a larger value to offload: ``more``
        is then above 0, and still the copy of the first is no longer on the link, nor its
        bytes off the device at the steps ``T_R`` counts them off."""
        return min(0, self.more(i, k), -self.given_back(i, k))

    def given_back(self, i: int, k: int) -> int:
        """The bytes of the boundaries inside span ``i`` that R's plan offloads and its
        reference saves, and that option ``k`` does not save."""
        return self._given_back[i][k]

    @functools.cached_property
    def _given_back(self) -> tuple[tuple[int, ...], ...]:
        def back(option: Option, ref: Option, c: Cut) -> int:
            return sum(c.problem.nodes[b].size for b in c.boundaries
                       if c.steps[b] in self.hosted_values and ref.decisions.get(b) is Decision.SAVE
                       and option.decisions.get(b) is not Decision.SAVE)

        return tuple(tuple(back(o, opts[0], c) for o in opts) for opts, c in zip(self.options, self.cuts, strict=True))

    @functools.cached_property
    def rooms(self) -> tuple[int, ...]:
        """:func:`link_rooms`, computed once per chain (every chain solve reads them)."""
        return tuple(link_rooms(self))

    def plan(self, choice: Sequence[tuple[int, int]]) -> Plan:
        """The step's plan for ``(span, option)`` pairs whose spans cover every segment once.
        Covers that recompute the same values inside the same cuts make the same plan: it
        is composed once per chain."""
        cuts, chosen = [self.cuts[i] for i, _ in choice], [self.options[i][k] for i, k in choice]
        key = (recomputed_inside(cuts, chosen), interior_of(cuts))
        if key not in self._plans:
            self._plans[key] = composed(self.problem, *key, first=self.hosted_values)
        return self._plans[key]

    @functools.cached_property
    def _plans(self) -> dict[tuple[frozenset[int], frozenset[int]], Plan]:
        return {}

    def predict(self, choice: Sequence[tuple[int, int]]) -> list[int]:
        """The chain model's live bytes at each step for ``(span, option)`` pairs where no
        span offloads more than its reference: ``T_R``, plus each chosen span's change at
        the steps its segments own (where its cut has them, and :meth:`later_in` at those
        of its later segments), plus its kept bytes, less ``H`` at its least
        (:meth:`least_hosted`), at the steps owned by later segments or by none (and
        beyond them, what its cut holds there). Never below the
        checker's timeline where the changes add up (the tests check it, with a host link
        on random covers)."""
        out = np.array(self.reference.timeline, dtype=np.int64)
        for i, k in choice:
            out += self._change(i, k)
        return [int(b) for b in out]

    def _change(self, i: int, k: int) -> np.ndarray:
        """What option ``k`` of span ``i`` adds to ``T_R`` at each step (:meth:`predict`'s
        terms of one chosen span), computed once per chain."""
        key = (i, k)
        if key not in self._changes:
            own = self.step_owners
            out = np.zeros(len(own), dtype=np.int64)
            linked = self.problem.host_bandwidth > 0
            f = self.problem.n_forward
            first, last = self.spans[i]
            option, ref = self.options[i][k], self.options[i][0]
            kept = option.saved - ref.saved - (self.least_hosted(i, k) if linked else 0)
            early = self.later_in(i)[k]
            at = {g: j for j, g in enumerate(self.cuts[i].steps) if g >= 0}
            for t, s in enumerate(own):
                if s is not None and first <= s <= last:
                    if t in at:
                        out[t] += option.timeline[at[t]] - ref.timeline[at[t]]
                    if s > first:
                        out[t] += early
                elif s is None or s > last:
                    # where the cut has the step (a boundary inside the span first read in a
                    # later segment's window is recomputed there), what it holds beyond the
                    # bytes it keeps
                    out[t] += kept + (max(0, option.timeline[at[t]] - ref.timeline[at[t]] - option.saved + ref.saved)
                                      if t in at and t >= f else 0)
            self._changes[key] = out
        return self._changes[key]

    @functools.cached_property
    def _changes(self) -> dict[tuple[int, int], np.ndarray]:
        return {}

    def singles(self) -> list[int]:
        """The one-segment span of each segment, in order."""
        by = {first: i for i, (first, last) in enumerate(self.spans) if first == last}
        return [by[s] for s in range(len(self.segments))]


def recomputed_inside(cuts: Sequence[Cut], chosen: Sequence[Option]) -> frozenset[int]:
    """The step's values each cut's chosen option recomputes."""
    return frozenset(g for c, o in zip(cuts, chosen, strict=True) for g, j in c.interior.items()
                     if o.decisions.get(j) is Decision.RECOMPUTE)


def interior_of(cuts: Sequence[Cut]) -> frozenset[int]:
    """The step's values inside the cuts."""
    return frozenset(g for c in cuts for g in c.interior)


def compose(problem: Problem, cuts: Sequence[Cut], chosen: Sequence[Option], *,
            first: Collection[int] = ()) -> Plan:
    """The step's plan taking each cut's decisions from its chosen option; everything else
    the backward reads (boundaries between spans, values several segments read) is saved,
    or, where the problem has a host link, offloaded where its copies hide
    (:func:`solvers.hostcopy.offload_hidden`), the values in ``first`` (R's offloads,
    which ``T_R`` counts off the device) tried before the others."""
    return composed(problem, recomputed_inside(cuts, chosen), interior_of(cuts), first=first)


def composed(problem: Problem, recomputed: frozenset[int], interior: frozenset[int], *,
             first: Collection[int] = ()) -> Plan:
    """:func:`compose` from what it depends on: the values the chosen options recompute and
    the values inside the cuts."""
    plan = plan_with(problem, recomputed)
    if problem.host_bandwidth <= 0:
        return plan
    # What R offloads (T_R counts it off the device, and the chain model counts an option
    # on that), then the other boundaries, then what the options save; each the latest
    # first: the copies of the last segments have the least compute left to hide under,
    # and the chain model counts on the room it gave them (``link_rooms``). A boundary
    # inside a span is interior to its cut, and without R's offloads first, a larger value
    # an option saves after it could take its place on the link.
    order = sorted(plan.of(Decision.SAVE), key=lambda v: (v not in first, v in interior, -v))
    return offload_hidden(problem, plan, order=order)[0]


def build_chain(problem: Problem, config: SolverConfig = SolverConfig(), *, planner: Planner,
                deadline: Deadline | None = None) -> Chain | None:
    """The chain of ``problem`` with its spans' options, or None where it has none. Spans
    of one segment are planned first, by ``planner`` (:func:`options`); longer ones,
    shortest first, while ``deadline`` has time left (by default ``OPTION_SHARE`` of the
    config's time limit).
    Inside :func:`sharing_options`, options are re-judged where a cut's structure was
    planned before, and after the first problem no longer span is searched."""
    segments = find_segments(problem)
    if len(segments) < 2:
        return None
    deadline = deadline or Deadline.of(config).part(config.time_limit * OPTION_SHARE)
    interior = {v for seg in segments for v in seg.interior if problem.nodes[v].recomputable}
    saved = frozenset(plan_with(problem, interior).of(Decision.SAVE))  # by the reference R
    bank = _BANK.get()
    # A later problem of a shared bank takes the spans the first one reached and searches
    # no longer ones: its time goes to the chain-level choice, which it has to itself.
    later = bank is not None and bool(bank.by_structure)
    spans: list[tuple[int, int]] = []
    cuts: list[Cut] = []
    by_shape: dict[str, list[Option]] = {}
    for length in range(1, SPAN + 1):
        if length > 1 and deadline.expired():
            break
        for first in range(len(segments) - length + 1):
            last = first + length - 1
            if length > 1 and not any(segments[k].interior for k in range(first, last + 1)):
                continue  # nothing to decide but boundaries a longer span would hold alone
            inner = [segments[k].forward[1] for k in range(first, last)]
            c = cut(problem, span(problem, segments, first, last), inner, saved)
            if length > 1 and not c.boundaries:
                continue  # no boundary inside to decide: the one-segment spans say it all
            if c.signature not in by_shape:
                known = bank.by_structure.get(c.structure) if bank is not None else None
                if bank is not None and known is not None:
                    by_shape[c.signature] = rejudged(c, known)
                    bank.reused += 1
                else:
                    if length > 1 and (later or deadline.expired()):
                        continue
                    by_shape[c.signature] = options(c, config, deadline=deadline, planner=planner)
                    if bank is not None:
                        bank.by_structure[c.structure] = by_shape[c.signature]
            spans.append((first, last))
            cuts.append(c)
    opts = tuple(tuple(by_shape[c.signature]) for c in cuts)
    singles = [i for i, (a, b) in enumerate(spans) if a == b]
    t0 = time.perf_counter()
    r_plan = compose(problem, [cuts[i] for i in singles], [opts[i][0] for i in singles])
    reference = check(problem.with_budget(None), r_plan)
    judge_s = time.perf_counter() - t0
    if problem.host_bandwidth > 0:  # offloading what the options save costs most where they save most
        t0 = time.perf_counter()
        most = [max(opts[i], key=lambda o: o.hostable) for i in singles]
        check(problem.with_budget(None), compose(problem, [cuts[i] for i in singles], most))
        judge_s = max(judge_s, time.perf_counter() - t0)
    return Chain(problem, tuple(segments), tuple(spans), tuple(cuts), opts, reference,
                 distinct=len(by_shape), hosted=tuple(offloaded_by_segment(problem, segments, r_plan)),
                 drains=tuple(drains(problem, segments, r_plan)), judge_s=judge_s,
                 lost=lost(problem, cuts, opts, r_plan), hosted_values=frozenset(r_plan.of(Decision.OFFLOAD)))


def lost(problem: Problem, cuts: Sequence[Cut], options: Sequence[Sequence[Option]], reference: Plan
         ) -> tuple[tuple[int, ...], ...]:
    """:attr:`Chain.lost`: for each span's cut and option, where the option recomputes a
    boundary inside the span, the bytes of the values from before the span that it reads
    and ``reference`` (R's plan) offloads; 0 otherwise, and all empty without a host link."""
    if problem.host_bandwidth <= 0:
        return ()
    hosted = set(reference.of(Decision.OFFLOAD))
    out = []
    for c, opts in zip(cuts, options, strict=True):
        read = sum(problem.nodes[-1 - g].size for g in c.steps if g < 0 and -1 - g in hosted)
        out.append(tuple(read if read and any(o.decisions.get(b) is Decision.RECOMPUTE for b in c.boundaries)
                         else 0 for o in opts))
    return tuple(out)


def drains(problem: Problem, segments: Sequence[Segment], plan: Plan) -> list[int]:
    """Bytes the copy engine out may carry during each segment's forward beyond what
    ``plan`` copies out there: the link's bandwidth times the segment's compute, less the
    copies issued in it (a value's copy is issued once its last forward reader has run,
    so a block input's goes out a block or two after its own; the result may be negative)."""
    if problem.host_bandwidth <= 0:
        return [0] * len(segments)
    issued = offloaded_by_segment(problem, segments, plan, issued=True)
    return [int(problem.host_bandwidth * sum(problem.nodes[k].time for k in range(seg.forward[0], seg.forward[1] + 1)))
            - issued[s] for s, seg in enumerate(segments)]


def offloaded_by_segment(problem: Problem, segments: Sequence[Segment], plan: Plan, *,
                         issued: bool = False) -> list[int]:
    """The bytes ``plan`` offloads of the values each segment's forward makes, or with
    ``issued`` of those whose copy out each segment's forward issues."""
    starts = [seg.forward[0] for seg in segments]
    out = [0] * len(segments)
    for v in plan.of(Decision.OFFLOAD):
        at = min(problem.copy_out_from(v), problem.n_forward - 1) if issued else v
        s = bisect.bisect_right(starts, at) - 1
        if s >= 0 and at <= segments[s].forward[1]:
            out[s] += problem.nodes[v].size
    return out


def owners(chain: Chain) -> list[int | None]:
    """The segment that owns each step: the one whose forward holds it; in the backward,
    the one whose window began last (None before the first window)."""
    p = chain.problem
    own: list[int | None] = [None] * len(p.nodes)
    for s, seg in enumerate(chain.segments):
        own[seg.forward[0]:seg.forward[1] + 1] = [s] * (seg.forward[1] - seg.forward[0] + 1)
    starts = sorted((seg.window[0], s) for s, seg in enumerate(chain.segments) if seg.window is not None)
    current: int | None = None
    k = 0
    for t in range(p.n_forward, len(p.nodes)):
        while k < len(starts) and starts[k][0] <= t:
            current = starts[k][1]
            k += 1
        own[t] = current
    return own


def solve_chain(chain: Chain, budget: int | None, config: SolverConfig, *, minimize_peak: bool = False,
                singles: bool = False, coarse: int | None = None, hint: Sequence[tuple[int, int]] | None = None,
                hosts_at_most: Mapping[tuple[int, int], int] | None = None, deadline: Deadline | None = None,
                fixed: Sequence[tuple[int, int]] = (),
                ) -> tuple[list[tuple[int, int]], float, bool] | None:
    """Spans covering the chain and one option each: the least added time within
    ``budget`` (or, with ``minimize_peak``, the least peak), by CP-SAT on the chain model;
    with ``singles``, one-segment spans only; with ``coarse``, of each span's options only
    its reference, the one that keeps least and every ``coarse``-th; ``hint``: pairs to
    start the search from;
    ``hosts_at_most``: for some pairs, the most ``H`` may count (what a composed plan with
    that option offloaded beyond R); ``fixed``: pairs every solution takes (with
    ``minimize_peak``, the model's least peak of one cover). Returns the ``(span, option)``
    pairs, the model's bound (seconds, or bytes for the peak) and whether it is proven
    optimal; None where
    the chain model has no solution (or none was found within ``deadline``, made from
    ``config`` where not given: building the model and its hint count against it)."""
    deadline = deadline or Deadline.of(config)
    p = chain.problem
    unit = p.scale.bytes_per_unit
    seconds = p.scale.seconds_per_unit
    n = len(chain.segments)
    base = chain.reference.timeline
    unowned = [t for t, s in enumerate(chain.step_owners) if s is None]

    m = cp_model.CpModel()
    x = [[m.new_bool_var(f"x{i}_{k}") for k in range(len(opts))]
         if not singles or chain.spans[i][0] == chain.spans[i][1] else []
         for i, opts in enumerate(chain.options)]
    covering: list[list[int]] = [[] for _ in range(n)]
    ending: list[list[int]] = [[] for _ in range(n)]
    for i, (first, last) in enumerate(chain.spans):
        if not x[i]:
            continue  # left out (singles)
        for s in range(first, last + 1):
            covering[s].append(i)
        ending[last].append(i)
    for s in range(n):
        m.add_exactly_one(v for i in covering[s] for v in x[i])
    if coarse is not None:
        for opts, xs in zip(chain.options, x, strict=True):
            least = min(range(len(opts)), key=lambda k: (opts[k].saved, opts[k].time)) if xs else 0
            for k, v in enumerate(xs):
                if k % coarse and k != least:
                    m.add(v == 0)
    for i, k in fixed:
        m.add(x[i][k] == 1)
    top = sum(nd.size for nd in p.nodes) // unit + 1
    peak = m.new_int_var(0, top, "peak")
    hosted_from: list[list[cp_model.IntVar]] = [[] for _ in range(n)]  # H[I] by I's first segment
    caps = hosts_at_most or {}
    kept: cp_model.LinearExprT = 0  # S[s]: what the spans before segment s keep
    linked = p.host_bandwidth > 0
    queue: cp_model.IntVar | int = 0  # Q[s - 1]
    for s in range(n):
        # The steps s owns in the forward, where the queue is still on the device, and in
        # the backward, where it is empty.
        for highs, waiting in zip(chain.highs[s], (queue, 0), strict=True):
            if highs is not None:
                extra = [-(-h // unit) * v for i in covering[s] for h, v in zip(highs[i], x[i], strict=True)]
                m.add(kept + waiting + sum(extra) <= peak)
        saved0 = [chain.options[i][0].saved for i in ending[s]]
        change = [(o.saved - s0) // unit * v for i, s0 in zip(ending[s], saved0, strict=True)
                  for o, v in zip(chain.options[i], x[i], strict=True) if o.saved != s0]
        issued = []
        for i in ending[s]:  # H[I]: what span I saves that its copies to the host carry off
            # beyond its reference's, which T_R counts offloaded already
            more = [min(chain.more(i, k), caps.get((i, k), top * unit)) // unit
                    for k in range(len(chain.options[i]))]
            most = sum(h * v for h, v in zip(more, x[i], strict=True))
            # and no less than what of R's copies it no longer sends: no span gives back
            # bytes R never sent, which would free the link for the others
            fewest = [min(h, chain.least_hosted(i, k) // unit) for k, h in enumerate(more)] if linked else []
            if linked and (any(more) or any(fewest)):
                hosted = m.new_int_var(-top, top, f"H{i}")
                m.add(hosted <= most)
                m.add(hosted >= sum(lo * v for lo, v in zip(fewest, x[i], strict=True)))
                change.append(-hosted)
                issued.append(hosted)
                hosted_from[chain.spans[i][0]].append(hosted)
        if linked:  # Q[s]: what waits for the copy engine after segment s's forward
            after_q = m.new_int_var(0, top, f"Q{s}")
            m.add(after_q >= queue + sum(issued) - chain.drains[s] // unit)
            m.add(after_q >= sum(issued))  # issued at the segment's end, at the latest
            queue = after_q
        if change:  # S[s + 1] as a variable of its own: the model stays linear in the segments
            after = m.new_int_var(-top, top, f"S{s + 1}")
            m.add(after == kept + sum(change))
            kept = after
    if linked:
        m.add(queue == 0)  # every copy out done by the forward's end
    if unowned:
        m.add(kept + -(-max(base[t] for t in unowned) // unit) <= peak)
    # What spans from segment s on carry off goes out between its forward's end and the
    # forward's, and comes back before its window begins: for the last segments, little.
    later: cp_model.LinearExprT = 0
    for s, room in reversed(list(enumerate(chain.rooms))):
        if hosted_from[s]:
            total = m.new_int_var(-top, room // unit, f"L{s}")  # a variable, as S[s] is; below 0 where
            # the spans from s on carry less than R (they recompute a boundary R offloads)
            m.add(total == later + sum(hosted_from[s]))
            later = total
    if minimize_peak:
        m.minimize(peak)
    else:
        if budget is not None:
            m.add(peak <= budget // unit)
        m.minimize(sum(round(o.time / seconds) * v for opts, xs in zip(chain.options, x, strict=True)
                       if xs for o, v in zip(opts, xs, strict=True)))
    if hint is not None:
        hinted = set(hint)
        _hint(m, [v for xs in x for v in xs], [(i, k) in hinted for i, xs in enumerate(x) for k in range(len(xs))],
              deadline)
    # Under ``deterministic`` one worker, as for the options: the interleaved portfolio
    # checks its work limit only between batches of its workers' tasks, and on a
    # 53-segment chain (TinyLlama) it ran 4-6x past limits of 0.2-1.6 deterministic
    # seconds, leaving the tightening searches after it none of their share.
    solver = make_solver(replace(config, relative_gap=0.0, workers=1 if config.deterministic else config.workers))
    within(solver, config, deadline)  # building the model counted (seconds on a 405B step's spans)
    code = solved(solver, m, deadline)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    choice = [(i, k) for i, xs in enumerate(x) for k, v in enumerate(xs) if solver.boolean_value(v)]
    bound = solver.best_objective_bound * (unit if minimize_peak else seconds)
    return choice, bound, code == cp_model.OPTIMAL


def _hint(m: cp_model.CpModel, choices: Sequence[cp_model.IntVar], values: Sequence[bool],
          deadline: Deadline) -> None:
    """Hint ``m``'s search with ``choices`` at ``values`` and, where the model allows that
    choice, every other variable at a value that completes it (found with the choices
    fixed: a search that only has to place ``H``, ``Q``, ``S`` and ``L``). CP-SAT takes a
    complete, feasible hint as its first solution at once; the choices alone, it may
    leave after the first conflict. Its search counts against ``deadline``."""
    fixed = m.clone()
    for v, on in zip(choices, values, strict=True):
        fixed.add(fixed.get_bool_var_from_proto_index(v.index) == int(on))
    fixed.clear_objective()
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = min(HINT_WORK, deadline.left()) if deadline.deterministic else HINT_WORK
    solver.parameters.max_time_in_seconds = max(LEAST_SOLVE, deadline.wall_left() if deadline.deterministic
                                                else deadline.left())
    solver.parameters.catch_sigint_signal = False
    if solved(solver, fixed, deadline) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for j in range(len(m.proto.variables)):
            v = m.get_int_var_from_proto_index(j)
            m.add_hint(v, solver.value(v))
    else:
        for v, on in zip(choices, values, strict=True):
            m.add_hint(v, on)


def link_rooms(chain: Chain) -> list[int]:
    """For each segment ``s``, the bytes the spans from it on may take to the host beyond
    what R's plan does: the link's bandwidth times the shorter of the forward's compute
    after ``s``'s and the backward's before ``s``'s window (for a segment without one, the
    next segment's that has one), less what R's plan offloads of those segments' values
    (0 at least). One engine each way that finishes every copy out by the forward's end,
    and every copy back by its window's start, needs no more."""
    p = chain.problem
    f = p.n_forward
    ends = Clock(p).ends  # the steps' own compute, on the clock the copies run on
    rooms = []
    before = 0.0  # a segment without a window: what comes back by the next one's window
    for s in reversed(range(len(chain.segments))):
        seg = chain.segments[s]
        after = ends[f - 1] - ends[seg.forward[1]]
        if seg.window is not None:
            before = ends[seg.window[0] - 1] - ends[f - 1]
        rooms.append(max(0, int(p.host_bandwidth * min(after, before)) - sum(chain.hosted[s:])))
    return rooms[::-1]


def solve(problem: Problem, config: SolverConfig = SolverConfig(), *, chain: Chain | None = None,
          planner: Planner | None = None, deadline: Deadline | None = None) -> SolveResult:
    """The cheapest plan the chain model finds within ``problem.budget``, judged by the
    checker. Status FEASIBLE with its plan (the chain model's optimum is not the flat
    problem's), INFEASIBLE without one (the chain model proves nothing about the flat
    problem), UNKNOWN on a problem without a chain. ``chain``: built before; else it is
    built with ``planner`` (:func:`build_chain`). Within ``deadline`` (made from
    ``config`` where not given), building the chain included."""
    t0 = time.perf_counter()
    deadline = deadline or Deadline.of(config)
    chain = _built(problem, config, chain, planner, deadline)
    if chain is None:
        return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=math.inf, bound=0.0,
                           wall_time=time.perf_counter() - t0, solver="chain")
    budget = problem.budget
    stats: dict[str, float | int | str] = {"segments": len(chain.segments), "distinct": chain.distinct,
                                           "options": sum(len(o) for o in chain.options)}
    best: tuple[Plan, Report] | None = None
    reserve = 0.0 if config.deterministic else chain.judge_s
    # One-segment spans first: a much smaller model, whose windows do not interleave, so
    # that it counts what the checker counts. Its plan then starts the search over all
    # spans, which has the rest of the time. Where it has no plan that fits, all spans are
    # searched next with few of their options (COARSE): a model that reaches as low, whose
    # plan starts the search over all options (on Llama-2-70B at 0.75x and 0.6x of
    # checkpointing's peak CP-SAT found no plan of the whole model in 15-18 s from none,
    # in most runs; with every eighth option it found one in 2 s and 8 s).
    # Each search starts from the model's choice at the highest target not above its own
    # (one it allows, unless a cap learnt since forbids it), else at the lowest; the first
    # from none (hinted with R, the least the model keeps, CP-SAT stayed near it on the
    # 405B-shaped step).
    found: dict[int, list[tuple[int, int]]] = {}
    caps: dict[tuple[int, int], int] = {}  # hosts_at_most, learnt from composed plans
    solves = 0
    phases = []
    for phase in ("singles", "coarse", "all"):
        if phase == "coarse" and (best is not None or max(len(o) for o in chain.options) <= COARSE):
            continue  # a plan that fits already, or no span with more options than that
        phases.append(phase)
        singles, first = phase == "singles", phase != "all"
        target = budget
        # The model and the checker disagree by an amount that changes with the plan, so
        # between a target whose plan fitted and one whose plan did not, the next is halfway.
        fitted: int | None = None  # the highest target whose plan fitted
        over: int | None = None  # the lowest target whose plan did not
        going_on = False  # the last plan fitted, close enough: the search goes on from it
        # One-segment spans: CP-SAT's first plans on a long chain stay near R for seconds, and
        # a search from R stays there. A first search that ends far above the model's bound,
        # with no bound proven, or with no plan, is run once again from no hint.
        again = retried = False
        for tries in range(TIGHTEN):
            left = deadline.left() - reserve
            if left <= 0:
                break
            solves += 1
            below = [t for t in found if target is None or t <= target]
            hint = found[max(below) if below else min(found)] if found else None
            # The search again from no hint gets most of what is left: a long chain's search
            # over all spans does not start in less.
            this_again, again = again, False
            if this_again:
                hint, share, retried = None, AGAIN_SHARE, True
            else:
                share = (SINGLES_SHARE if singles else COARSE_SHARE if first else 1.0 if going_on
                         else ALL_SHARE if tries == 0 else NEXT_SHARE)
            chosen = solve_chain(chain, target, config, singles=singles, coarse=COARSE if phase == "coarse" else None,
                                 hint=hint, hosts_at_most=caps,
                                 deadline=deadline.part(left * share))
            if chosen is None:
                if singles and not retried and best is None:
                    again = True  # no plan in the time (or none at all)
                    continue
                break
            plan = chain.plan(chosen[0])
            report = check(problem, plan)
            stats.update(chain_bound=chosen[1], chain_optimal=int(chosen[2]), chain_solves=solves,
                         chain_phases=",".join(phases))
            better = report.fits and (best is None or report.added_time < best[1].added_time)
            if not (this_again and report.fits and not better):  # the search again keeps the better start
                found[target if target is not None else 2**62] = chosen[0]
            if report.fits:
                if better:
                    best = (plan, report)
                if singles and not retried and not chosen[2] and report.added_time > FAR * max(chosen[1], 0.0):
                    again = True  # far above the model's bound, or no bound proven
                    continue
                if budget is None or target is None or first:
                    break  # a plan that fits: the search over all spans and options starts from it
                if budget - report.peak <= budget * LOOSEN:
                    if chosen[2] or (going_on and not better):
                        break  # optimal, or a search that went on found nothing better
                    going_on = True  # the same target again, the search going on from its plan
                    continue
                # The model counted more than the checker found (the link carried off more,
                # or sooner, than the model's engine did): the budget it plans within is
                # raised by the slack.
                fitted = target if fitted is None else max(fitted, target)
                target += budget - report.peak
            else:
                assert budget is not None and target is not None
                over = target if over is None else min(over, target)
                # Where the link carried off less than the model counted, it counts no more for
                # those options; and the budget is lowered by the excess, then twice it, four
                # times...: where the model's peak is under the target already, lowering it by
                # the excess alone may change nothing.
                carried = offloaded_by_segment(problem, chain.segments, plan)
                for i, k in chosen[0]:
                    a, b = chain.spans[i][0], chain.spans[i][1] + 1
                    beyond = sum(carried[a:b]) - sum(chain.hosted[a:b])
                    caps[(i, k)] = min(caps.get((i, k), beyond), beyond)
                target = max(0, target - (report.peak - budget) * 2**tries)
            if fitted is not None and over is not None and fitted < over:
                if over - fitted <= budget * LOOSEN:
                    break
                # no further than halfway from the side the last plan was on
                halfway = (fitted + over) // 2
                target = min(target, halfway) if report.fits else max(target, halfway)
    wall = time.perf_counter() - t0
    if best is None:
        return SolveResult(status=Status.INFEASIBLE, plan=None, report=None, objective=math.inf, bound=0.0,
                           wall_time=wall, solver="chain", stats=stats)
    plan, report = best
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=report, objective=report.added_time,
                       bound=0.0, wall_time=wall, solver="chain", stats=stats)


def min_peak(problem: Problem, config: SolverConfig = SolverConfig(), *, chain: Chain | None = None,
             planner: Planner | None = None, deadline: Deadline | None = None) -> SolveResult:
    """The least-peak plan of the chain model, judged by the checker (status FEASIBLE: not
    a proof for the flat problem), or status UNKNOWN on a problem without a chain.
    ``chain``, ``planner`` and ``deadline`` as for :func:`solve`: the least-peak search
    gets ``PEAK_SHARE`` of what is left, the search for time at its peak the rest."""
    t0 = time.perf_counter()
    deadline = deadline or Deadline.of(config)
    chain = _built(problem, config, chain, planner, deadline)
    chosen = (solve_chain(chain, None, config, minimize_peak=True, deadline=deadline.part(deadline.left() * PEAK_SHARE))
              if chain is not None else None)
    if chosen is None:
        return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=math.inf, bound=0.0,
                           wall_time=time.perf_counter() - t0, solver="chain-min-peak")
    unbudgeted = problem.with_budget(None)
    plan = chain.plan(chosen[0])  # type: ignore[union-attr]
    # The least chain peak may cost more time than needed: re-solve for time at that peak.
    report = check(unbudgeted, plan)
    again = solve(problem.with_budget(report.peak), config, chain=chain, deadline=deadline)
    if again.plan is not None and again.report is not None and again.report.peak <= report.peak:
        plan, report = again.plan, again.report
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=check(problem, plan),
                       objective=report.added_time, bound=0.0, wall_time=time.perf_counter() - t0,
                       solver="chain-min-peak")


def _built(problem: Problem, config: SolverConfig, chain: Chain | None,
           planner: Planner | None, deadline: Deadline) -> Chain | None:
    """``chain``, or else ``problem``'s chain built with ``planner``, its options given
    ``OPTION_SHARE`` of the time limit within ``deadline``."""
    if chain is not None:
        return chain
    if planner is None:
        raise TypeError("the chain model plans its segments with the planner: pass "
                        "planner=solvers.planner.PLANNER, or a chain built before (chain=build_chain(...))")
    return build_chain(problem, config, planner=planner, deadline=deadline.part(config.time_limit * OPTION_SHARE))


def describe(chain: Chain) -> Iterable[str]:
    """One line per distinct span: where it first appears, how often, its options."""
    seen = collections.Counter(c.signature for c in chain.cuts)
    shown: set[str] = set()
    for (first, last), c, opts in zip(chain.spans, chain.cuts, chain.options, strict=True):
        if c.signature in shown:
            continue
        shown.add(c.signature)
        seg = chain.segments[first]
        yield (f"segments {first}..{last} (forward from step {seg.forward[0]}) x{seen[c.signature]}: "
               f"{len(c.interior)} interior values, {len(opts)} options: "
               + ", ".join(f"{o.source} ({o.saved} B, {o.time * 1e3:.3g} ms)" for o in opts))


__all__ = ["Chain", "build_chain", "min_peak", "solve"]
