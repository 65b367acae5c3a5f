r"""A lower bound on the added time of any plan of a two-phase problem, from what the
memory of single steps forces: a linear program per step.

Notation: candidate :math:`v` (``Problem.candidates``) of :math:`s_v` bytes and
:math:`t_v` seconds, budget :math:`B`, host link :math:`\beta` bytes/s each way,
:math:`T_F` the forward's compute time. Take a backward step :math:`k`. In any plan, a
candidate that the backward reads after :math:`k` (:math:`v \in N_k`) is then read from
a copy that is in memory at :math:`k` (:math:`\ell_v`), or made after :math:`k` by a
recomputation (:math:`r_v`) or by a copy back from the host (:math:`o_v`: its device
copies were freed before :math:`k`). A recomputation after :math:`k` reads each candidate
it depends on in one of the same three ways. :math:`F_k` (:func:`solvers.floor.baseline`)
is what step :math:`k` holds whatever the plan. With :math:`\ell, o, r \in [0, 1]` and
:math:`a` the added time:

.. math::

    \min a \quad \text{s.t.} \quad
    \ell_v + o_v + r_v \le 1,\; = 1 \text{ for } v \in N_k; \qquad
    r_v \le \ell_u + o_u + r_u \text{ for each candidate } u \text{ that } v \text{ reads};

    \sum_v s_v \ell_v \le B - F_k; \qquad
    R = \sum_v t_v r_v \le a; \qquad
    \sum_{v:\, c_v \ge j} s_v o_v \le \beta \, (T_F - T_{<j} + a - R) \;\; \forall j.

The last rows are the copy engine to the host: a copy out starts at :math:`c_v`
(``Problem.copy_out_from``) and ends within the forward, one at a time, and the compute
waits for it only through the stalls, which are at most :math:`a - R` (copies do not
overlap recomputations in the time model: :func:`solvers.checker.transfer_stalls`).
:math:`T_{<j}` is the compute of the steps before :math:`j`. A candidate the op at
:math:`k` reads is in memory there (:math:`o_v = 0`), unless that op writes over it
(``Problem.taken_over``: then it is not counted at :math:`k`, and the rows of the
recomputations that read it leave it out) or computes it itself (an unstored
recomputation, then :math:`r_v`).

At a forward step :math:`k`, :math:`N_k` is the candidates the backward reads whose
forward life (``Problem.forward_end``) has ended: each is kept in memory, copied to the
host by the end of step :math:`k - 1` (the engine's rows end there), or recomputed in the
backward (no dependency rows: when is not known).

Each row holds for every plan within budget (:math:`\ell_v = 1` where the checker counts
:math:`v` at :math:`k`, and so on), multi-level plans included, so each step's optimum
bounds every plan, and so does the largest of them.

It leaves out when each recomputation runs, what it keeps in memory and the copies back,
so it is loose where the budget is loose. Where it is tight it is strong: on a
Llama-2-7B-shaped step at per-block checkpointing's peak, 60.8 ms without the link, where
the flat CP-SAT model's bound after 60 s was 56.5 (docs/scale.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from solvers.floor import baseline
from solvers.hostcopy import Clock
from solvers.problem import Copy, Problem

STEPS = 6  # steps relaxed: those whose memory is most over the budget
ENGINE_ROWS = 32  # rows for the copy engine to the host
LEAST_BUDGET_PRECISION = 0.002  # of the budget searched below
LEAST_BUDGET_STEPS = 3  # steps relaxed at each budget tried
SAFETY = 1e-6  # the LP's optimum is reported this fraction low, for its tolerances


@dataclass(frozen=True)
class Bound:
    seconds: float  # no plan within the budget adds less; inf: no plan fits
    step: int | None  # the step whose relaxation gave it (None: nothing binds)


def lower_bound(problem: Problem, *, steps: int = STEPS, seconds: float = math.inf) -> Bound:
    """The largest of the relaxations (module docstring) at the ``steps`` steps whose fixed
    bytes and needed candidates most exceed the budget, the most pressing first, while
    ``seconds`` last (one step at least); 0 without a budget or where no step is over it,
    ``inf`` where a step's relaxation has no solution (then no plan fits the budget)."""
    if problem.budget is None or problem.single_phase or not problem.candidates:
        return Bound(0.0, None)
    return _largest(problem, baseline(problem), steps, seconds)


def _largest(problem: Problem, fixed: list[int], steps: int, seconds: float) -> Bound:
    """:func:`lower_bound` with :math:`F` given (it does not change with the budget)."""
    t0 = time.perf_counter()
    best = Bound(0.0, None)
    for k in pressing_steps(problem, fixed, steps):
        relaxed = step_bound(problem, k, fixed=fixed)
        if relaxed > best.seconds:
            best = Bound(relaxed, k)
        if math.isinf(relaxed) or time.perf_counter() - t0 > seconds:
            break
    return best


def least_budget(problem: Problem, below: int, *, seconds: float = math.inf) -> int:
    """A budget no plan fits under (every plan's peak is at least it), at most ``below``:
    the least at which every relaxation of :func:`lower_bound` has a solution, found by
    bisection to ``LEAST_BUDGET_PRECISION`` of ``below`` while ``seconds`` last; what
    every plan holds at some step where the time allows no relaxation."""
    fixed = baseline(problem)
    out = max(fixed, default=0)  # every plan holds this at some step
    t0 = time.perf_counter()
    hi = below  # lowest budget not shown to be infeasible
    while hi - out > below * LEAST_BUDGET_PRECISION and time.perf_counter() - t0 < seconds:
        mid = (out + hi) // 2
        if math.isinf(_largest(problem.with_budget(mid), fixed, LEAST_BUDGET_STEPS, math.inf).seconds):
            out = mid + 1
        else:
            hi = mid
    return min(out, below)


def pressing_steps(problem: Problem, fixed: list[int], count: int) -> list[int]:
    """Up to ``count`` steps where :math:`F_k` and the candidates a plan must place at
    :math:`k` (:math:`N_k`, roughly) most exceed the budget, those over it only."""
    assert problem.budget is not None
    # A candidate the backward reads is at stake from the end of its forward life to its last read.
    delta = [0] * (len(problem.nodes) + 1)
    for v in problem.candidates:
        reads = problem.backward_uses[v]
        if reads:
            delta[problem.forward_end(v) + 1] += problem.nodes[v].size
            delta[reads[-1] + 1] -= problem.nodes[v].size
    over: list[tuple[int, int]] = []
    stake = 0
    for k in range(len(problem.nodes)):
        stake += delta[k]
        if fixed[k] + stake > problem.budget:
            over.append((fixed[k] + stake - problem.budget, k))
    return [k for _, k in sorted(over, reverse=True)[:count]]


def step_bound(problem: Problem, k: int, *, fixed: list[int] | None = None) -> float:
    """The relaxation's optimum at step ``k`` in seconds; ``inf`` where it has no solution."""
    assert problem.budget is not None
    fixed = fixed if fixed is not None else baseline(problem)
    room = problem.budget - fixed[k]
    if room < 0:
        return math.inf
    nodes = problem.nodes
    cands = problem.candidates
    if not cands:
        return 0.0
    chosen = set(cands)
    forward = k < problem.n_forward
    # Units: bytes of the budget (or of the largest value) and seconds of the step, so
    # the LP's coefficients stay near 1.
    mem = float(max(problem.budget, max(nodes[v].size for v in cands), 1))
    sec = sum(n.time for n in nodes) or 1.0
    lp = pywraplp.Solver.CreateSolver("GLOP")
    a = lp.NumVar(0.0, lp.infinity(), "a")
    held, hosted, redone = {}, {}, {}
    linked = problem.host_bandwidth > 0
    for v in cands:
        n = nodes[v]
        reads = problem.backward_uses[v]
        # read by the op at k from a copy in memory there, or from a recomputation it makes itself
        present = not forward and k in reads and problem.taken_over.get(v) != k
        held[v] = lp.NumVar(0.0, 1.0, f"l{v}")
        hosted[v] = lp.NumVar(0.0, 1.0 if linked and n.offloadable and not present else 0.0, f"o{v}")
        inline = not n.stores(Copy.RECOMPUTED)
        redone[v] = lp.NumVar(0.0, 1.0 if n.recomputable and (inline or not present) else 0.0, f"r{v}")
        if forward:
            needed = bool(reads) and problem.forward_end(v) < k
        else:
            needed = present or (bool(reads) and reads[-1] > k)
        ways = held[v] + hosted[v] + redone[v]
        lp.Add(ways == 1 if needed else ways <= 1)
        if not forward:  # a recomputation in the backward after k reads its deps then
            for u in sorted(set(n.deps) & chosen):
                # (one inside the op at k may read a dep that op then writes over: not counted at k)
                if problem.taken_over.get(u) != k:
                    lp.Add(redone[v] <= held[u] + hosted[u] + redone[u])
    recompute = lp.Sum([nodes[v].time / sec * redone[v] for v in cands])
    lp.Add(recompute <= a)
    lp.Add(lp.Sum([nodes[v].size / mem * held[v] for v in cands]) <= room / mem)
    if linked:
        add_copy_engine(lp, problem, hosted, until=min(k, problem.n_forward), slack=a - recompute,
                        mem=mem, sec=sec)
    lp.Minimize(a)
    code = lp.Solve()
    if code == pywraplp.Solver.INFEASIBLE:
        return math.inf
    if code != pywraplp.Solver.OPTIMAL:
        return 0.0  # GLOP gave up: nothing proven
    return max(0.0, a.solution_value() * sec * (1 - SAFETY))


def add_copy_engine(lp: pywraplp.Solver, problem: Problem, hosted: dict[int, pywraplp.Variable], *,
                    until: int, slack: pywraplp.LinearExpr, mem: float, sec: float) -> None:
    r"""The rows :math:`\sum_{c_v \ge j} s_v o_v \le \beta (T_F - T_{<j} + a - R)` for up to
    ``ENGINE_ROWS`` starts :math:`j` spread over the distinct ones (fewer rows relax it
    less tightly, never wrongly), as a running sum from the latest start back."""
    f = until  # the copies are done before step ``until`` starts
    before = Clock(problem).starts  # compute of the steps before j: the copies' own clock
    starts: dict[int, list[int]] = {}
    for v in hosted:
        if problem.nodes[v].offloadable:
            starts.setdefault(min(problem.copy_out_from(v), f), []).append(v)
    for v in starts.pop(f, []):  # no forward step left to copy beside
        hosted[v].SetUb(0.0)
    distinct = sorted(starts)
    rows = set(distinct[::-(-len(distinct) // ENGINE_ROWS)] if distinct else [])
    rate = problem.host_bandwidth * sec / mem  # memory units per time unit
    later: pywraplp.LinearExpr | float = 0.0
    for j in reversed(distinct):
        later = later + lp.Sum([problem.nodes[v].size / mem * hosted[v] for v in starts[j]])
        if j in rows:
            total = lp.NumVar(0.0, lp.infinity(), f"q{j}")
            lp.Add(total == later)
            lp.Add(total <= rate * ((before[f] - before[j]) / sec + slack))
            later = total
