"""Ruin-and-recreate local search for single-phase plans (:mod:`solvers.singlephase.anywhere`).

A plan here is a set of recomputations ``Step(v, k)``: value v recomputed before step k,
at most one per value. The *repair* is the greedy of :func:`solvers.singlephase.anywhere.greedy`: at
the peak step k, recompute the value that frees the most bytes there per second of
recomputation, just before its next read after k, and repeat until the plan fits. The
search (:func:`improve`) starts from a plan within budget, then repeatedly

1. *ruins* it: drops a few recomputations at random, or every recomputation that runs
   within a window of steps around a random one (a neighbourhood of interacting ones);
2. *recreates* it with the repair, its ranking perturbed at random;
3. *drops* any recomputation the result can do without, dearest first;

and moves to the result when it fits and costs no more than the best plan so far (moving
along plateaus of equally cheap plans: random n1000 at 80%, 2.81% after 9 s against 2.90%
when only a cheaper plan is taken). The checker judges every candidate
(about a millisecond on a 500-node graph), so the search tries hundreds of plans a second.

Why beside CP-SAT: on the random layered graphs of the public benchmark (250-1000 nodes)
CP-SAT's LP bound stays far from the optimum, and its own LNS, which re-solves a
sub-model per move, runs only a few dozen moves a minute there. This search finds
cheaper plans within seconds (random n500 at 80%: 3.42% against the greedy's 3.86% and
60 s of CP-SAT's 3.63%; n250 at 80%: in 10 s, from every seed tried, the 5.05% that CP-SAT
and a polish reach in 60 s). :func:`solvers.singlephase.anywhere.solve` runs it from the greedy's
plan, runs CP-SAT (hinted with the greedy's plan too), then runs it again from the
cheaper end.

Deterministic for a given seed whenever it stops at ``patience`` (moves in a row without
a better plan) rather than at its time limit, and always when its limit counts work
(``deterministic``): values replayed by the checker, at ``VALUES_PER_SECOND`` to the second.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from solvers.checker import Report, check, value_intervals
from solvers.deadline import VALUES_PER_SECOND  # the checker's pace: a time limit as work
from solvers.plan import Decision, Plan, Step
from solvers.problem import Problem

RUIN_MAX = 6  # recomputations a random ruin drops, at most
WINDOW = 20  # a window ruin spans up to 1/WINDOW of the steps either side
NOISE = 0.5  # the repair's ranking is scaled by a factor in [1, 1 + NOISE)
PATIENCE = 200  # moves without a better plan before the search stops


@dataclass
class Meter:
    """The checker, counting the values it replays: the local search's measure of work."""

    problem: Problem
    values: int = 0

    def check(self, plan: Plan) -> Report:
        self.values += len(self.problem.nodes) + len(plan.schedule)
        return check(self.problem, plan)


def as_plan(steps: list[Step]) -> Plan:
    """The plan of ``steps``, in the order the checker runs them (by step, then value)."""
    ordered = tuple(sorted(steps, key=lambda s: (s.before, s.node)))
    return Plan({s.node: Decision.RECOMPUTE for s in ordered}, ordered)


def recomputable(problem: Problem) -> list[int]:
    """Values a recomputation may be worth: recomputable, taking memory, read by something.
    A value read only at the next step is worth one too, as the input of a recomputed
    reader (a chain)."""
    return [v for v, node in enumerate(problem.nodes)
            if node.recomputable and problem.users[v]
            and not (node.resident or node.keep or node.size == 0)]


def read_steps(problem: Problem, plan: Plan) -> list[set[int]]:
    """The steps at which each value is read: by ops, and by scheduled recomputations."""
    out = [set(users) for users in problem.users]
    for s in plan.schedule:
        for d in problem.nodes[s.node].deps:
            out[d].add(s.before)
    return out


def repair(problem: Problem, steps: list[Step], rng: random.Random | None = None,
           noise: float = 0.0, meter: Meter | None = None) -> tuple[list[Step], Report]:
    """Add recomputations to ``steps`` until the plan fits or no candidate lowers the peak;
    return the last plan's steps and its report, within budget or not. Candidates are
    replayed on the checker in order of seconds per byte freed at the peak step, each rank
    scaled by a random factor in [1, 1 + ``noise``); the first that lowers the peak is
    taken. See docs/solvers.md, "The search on single-phase problems"."""
    p = problem
    judge = (meter or Meter(p)).check
    budget = p.budget if p.budget is not None else sum(n.size for n in p.nodes)
    free = set(recomputable(p)) - {s.node for s in steps}
    steps = list(steps)
    plan = as_plan(steps)
    report = judge(plan)
    while report.peak > budget and free:
        k = report.peak_step
        spans = value_intervals(p, plan)
        live = {v for v, ss in spans.items() if any(lo <= k <= hi for lo, hi in ss)}
        reads = read_steps(p, plan)
        ranked: list[tuple[float, int, tuple[int, ...]]] = []
        for v in sorted(free & live):
            later = [t for t in reads[v] if t > k]
            if v >= k or k in reads[v] or not later:
                continue
            for group in {(v,), chained(p, v, live, free)}:
                seconds, freed = cost_of(p, group, live)
                if freed <= 0:
                    continue
                scale = 1.0 + noise * rng.random() if rng is not None and noise else 1.0
                ranked.append((seconds / freed * scale, min(later), group))
        for _, before, group in sorted(set(ranked)):
            trial = [*steps, *(Step(u, before) for u in group)]
            trial_plan = as_plan(trial)
            after = judge(trial_plan)
            if after.peak < report.peak or (after.peak == report.peak and after.timeline[k] < report.timeline[k]):
                free.difference_update(group)
                steps, plan, report = trial, trial_plan, after
                break
        else:
            break
    return steps, report


def chained(problem: Problem, v: int, live: set[int], free: set[int]) -> tuple[int, ...]:
    """v with the inputs its recomputation would revive that can be recomputed just before
    it instead: inputs dead at the peak step whose own inputs are all live there (or that
    have none). Without this the repair never takes a value whose only input is dead
    (random n250 at 80%: a free source and its cheap reader, recomputed together, spare
    850 bytes for 0.008% of the time; the greedy's plan fell from 8.06% to 6.27%). One
    level only: deeper chains made the search slower and no better (random n1000 at 80%,
    10 s: 2.84% / 3.01% from two seeds against 3.03% / 3.04% with three levels)."""
    group = [v]
    for d in sorted(set(problem.nodes[v].deps)):
        if d in live or d not in free or problem.nodes[d].resident:
            continue
        if all(e in live or problem.nodes[e].resident for e in problem.nodes[d].deps):
            group.append(d)
    return tuple(sorted(group))


def cost_of(problem: Problem, group: tuple[int, ...], live: set[int]) -> tuple[float, int]:
    """Seconds a group's recomputations add, and the bytes they free at the peak step: the
    group's live values less the inputs outside the group they revive (dead there)."""
    inside = set(group)
    revived = {d for u in group for d in problem.nodes[u].deps
               if d not in inside and d not in live and not problem.nodes[d].resident}
    freed = sum(problem.nodes[u].size for u in group if u in live)
    return (sum(problem.nodes[u].time for u in group),
            freed - sum(problem.nodes[d].size for d in revived))


def drop(problem: Problem, steps: list[Step], meter: Meter | None = None) -> list[Step]:
    """``steps`` less every recomputation the plan fits without, tried dearest first."""
    judge = (meter or Meter(problem)).check
    kept = list(steps)
    for s in sorted(steps, key=lambda s: (-problem.nodes[s.node].time, s.before, s.node)):
        trial = [x for x in kept if x != s]
        if judge(as_plan(trial)).fits:
            kept = trial
    return kept


def ruin(problem: Problem, steps: list[Step], rng: random.Random) -> list[Step]:
    """``steps`` less a few at random, or less those within a window around a random one."""
    if not steps:
        return []
    if rng.random() < 0.5:
        gone = set(rng.sample(range(len(steps)), rng.randint(1, min(RUIN_MAX, len(steps)))))
        return [s for i, s in enumerate(steps) if i not in gone]
    centre = rng.choice(steps).before
    width = rng.randint(2, max(3, len(problem.nodes) // WINDOW))
    return [s for s in steps if abs(s.before - centre) > width]


def improve(problem: Problem, start: Plan, *, seconds: float, seed: int = 0,
            patience: int = PATIENCE, on_best: Callable[[Plan, float], None] | None = None,
            deterministic: bool = False) -> Plan | None:
    """The cheapest plan within budget found from ``start`` (repaired first if it does not
    fit) in ``seconds``, or after ``patience`` moves in a row found nothing cheaper
    (``on_best`` is told each better plan and its added seconds, for a progress bar); None
    when no plan within budget was found. Only single recomputations of a value.
    ``deterministic``: ``seconds`` is work, ``seconds * VALUES_PER_SECOND`` values replayed
    by the checker, not time, so the plan does not depend on the machine's speed or load."""
    rng = random.Random(seed)
    meter = Meter(problem)
    deadline = time.perf_counter() + seconds
    work = seconds * VALUES_PER_SECOND

    def more() -> bool:
        return meter.values < work if deterministic else time.perf_counter() < deadline

    first: dict[int, Step] = {}
    for s in start.schedule:  # the search keeps one recomputation per value
        first.setdefault(s.node, s)
    steps, report = repair(problem, list(first.values()), meter=meter)
    best: tuple[float, list[Step], Plan] | None = None
    if report.fits:
        steps = drop(problem, steps, meter)
        plan = as_plan(steps)
        best = (meter.check(plan).added_time, steps, plan)
        if on_best is not None:
            on_best(plan, best[0])
    current = best[1] if best else steps
    idle = 0
    while idle < patience and more():
        idle += 1
        trial, report = repair(problem, ruin(problem, current, rng), rng, NOISE, meter)
        if not report.fits:
            continue
        trial = drop(problem, trial, meter)
        plan = as_plan(trial)
        cost = meter.check(plan).added_time
        if best is None or cost < best[0]:
            best, idle = (cost, trial, plan), 0
            if on_best is not None:
                on_best(plan, cost)
        if cost <= best[0]:  # moves on along plans as cheap as the best (a plateau), too
            current = trial
    return best[2] if best else None
