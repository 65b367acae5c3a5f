r"""Re-solve a window of steps exactly, the rest of a single-phase plan fixed.

On the random layered graphs of the public benchmark the interval model of
:mod:`solvers.singlephase.anywhere` finds plans, but its bound stays far below them and it allows one
recomputation per value (Moccasin's two copies). This model is the other classic
formulation, Checkmate's, by value and step, but over a window of :math:`W` steps only:
the plan outside the window is the incumbent's, and inside it any value may be dropped
and recomputed as often as pays. Over the values the incumbent holds around the window
(:math:`V_W` below) CP-SAT proves a window of 32 steps optimal in 0.1-5 s (random n250 at
80%: steps 218-249, 5.008% to 4.897% with a value recomputed twice and another kept
instead of recomputed, the bridge family), where the interval model over the whole graph
proves nothing in minutes.

Notation. Window :math:`[a, b]`; :math:`\lambda_{v,k} \in \{0,1\}`: a copy of v is in
memory at step k in the incumbent plan (:func:`solvers.checker.value_intervals`);
:math:`e_v`: the last step v can be read at, by an op or by the recomputation of a
reader (:func:`reach`); :math:`K_v = [\max(a, v), \min(b, e_v)]`; :math:`s_v, t_v` its
bytes and seconds; :math:`m_k` the incumbent's bytes at step k (the checker's timeline).
:math:`V_W` (:func:`held`): the values the incumbent holds at a step of :math:`[a-1, b+1]`,
or that an op of the window reads. Only these get variables: a value outside stays out of
memory over the window, as in the incumbent. Over every value that could be read in the
window (234 of 250 on random n250 at steps 218-249: 7,500 :math:`L` and 7,400 :math:`C`)
CP-SAT closed nothing in 60 s; over :math:`V_W` (100 values) it proves that window
optimal in 3 s.

Variables, for :math:`v \in V_W` with :math:`K_v \ne \emptyset`, :math:`k \in K_v`:

* :math:`L_{v,k} \in \{0,1\}`: a copy of v is in memory at step k;
* :math:`C_{v,k} \in \{0,1\}`, for recomputable v and :math:`k \ge v + 2`: v is recomputed
  before step k (right after its own step it is still in memory).

Constraint families (one ``add_*`` function each):

* release: for v whose copy in memory at a-1 the incumbent makes by a recomputation
  before step :math:`h_v < a` and reads nowhere in :math:`[h_v, a-1]`, :math:`D_v \in
  \{0,1\}`: that recomputation is undone (:math:`-t_v` in the objective) and the copy is
  not in memory at a-1. Without it such a copy pins memory at the start of the window:
  on n250 at 80% the 5.008% plan recomputes a value before step 196 that nothing reads
  before step 208, and the 4.897% plan needs it made at 205; no window of that plan
  moved it (over [203, 249] the window was proven optimal at 5.008% without this
  family, and reaches 4.897% with it);
* bridge: for v < a that the incumbent drops before the window (:math:`\lambda_{v,a-1} =
  0`) and reads in it (by an op, or by a recomputation it runs there),
  :math:`B_v \in \{0,1\}`: the copy the incumbent frees after :math:`g_v`, its last step
  in memory before a, is kept instead, and :math:`m_k + \sum_v s_v B_v - \sum_{v: h_v \le
  k} s_v D_v \le \lfloor B/q \rfloor` at each :math:`k \in (g_v, a-1]`. Without it a
  recomputation inside the window of a value dropped before it can move, never be
  undone: the plan at 4.897% on n250 at 80% keeps a value the 5.008% plan recomputes at
  step 238, and no window of that plan held it;
* made:   :math:`L_{v,v} = 1`; :math:`L_{v,k} \le L_{v,k-1} + C_{v,k}`, with
  :math:`L_{v,a-1} := B_v` where bridged, :math:`1 - D_v` where released, else
  :math:`\lambda_{v,a-1}`: a copy is in memory only from where it is made;
  :math:`C_{v,k} \Rightarrow L_{v,k}` and :math:`C_{v,k} + L_{v,k-1} \le 1` (no
  recomputation of a value in memory: the checker would serve the reads from the new copy
  anyway, so it only costs);
* read:   :math:`L_{v,u} = 1` for each op u in the window that reads v, and
  :math:`C_{w,k} \Rightarrow L_{v,k}` for each v that w reads;
* leave:  :math:`L_{v,b} = 1` where :math:`\lambda_{v,b+1} = 1` and the incumbent does not
  recompute v before step b+1: the plan after the window reads what it did;
* free:   :math:`L_{v,k} \le \rho_{v,k} + L_{v,k+1} - C_{v,k+1}` for :math:`k > v` where
  no op reads v at k, :math:`\rho_{v,k} = \sum_{w \ni v} C_{w,k}` the recomputations
  at k that read v, and :math:`L_{v,b+1} := 1` where leave holds v, else 0: a copy stays
  only until its last read, as the checker frees it. Implied at an optimum (a plan with
  longer copies is no cheaper), it removes those copies' many equal-cost solutions and
  tightens the memory rows (random n250 at 80%, window [208, 249]: the 4.897% plan found
  after 1.9-2.0 s over two seeds, 4.1-16.2 s without);
* memory: :math:`\sum_v s_v L_{v,k} + f_k \le \lfloor B/q \rfloor` at each :math:`k \in
  [a, b]`, :math:`f_k` the values no decision moves (kept to the end).

Objective: :math:`\min T (\sum t_v C_{v,k} - \sum t_v D_v) + \sum C_{v,k} - \sum D_v`,
:math:`T = |C| + |D| + 1`: the least added time, then the fewest recomputations.

The plan is the incumbent's recomputations outside the window, less the released ones,
and :math:`\{(v, k) : C_{v,k}\}` inside. Reads before the window are the incumbent's
(a released copy served none) and reads after it are served as they were (leave), so
memory after the window is at most the incumbent's, and before it at most the
incumbent's plus the bridged copies less the released ones (bridge); inside, the
model's memory is the checker's (free). The checker judges the result either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ortools.sat.python import cp_model

from solvers.checker import check, value_intervals
from solvers.plan import Plan, Step
from solvers.problem import Node, Problem
from solvers.result import SolverConfig
from solvers.sat import limit, make_solver
from solvers.singlephase.local import as_plan, read_steps, recomputable

# Steps per window, to start with. On the random graphs at 80% a 32-step window is proven
# optimal in 0.1-5 s, so a pass covers the steps that matter within seconds; 24-step ones
# missed n500's first gain (steps 409-440, 3.420% to 3.371%). The polish widens windows by
# half when a pass finds nothing: n250 at 80% has a 4.897% plan that differs from one of
# its 5.008% plans from step 205 to 248 (given the release family), which a 48-step window
# over [202, 249] finds in 2-20 s.
WIDTH = 32


@dataclass
class Window:
    """The model of one window, with its variables named as in the math."""

    problem: Problem
    first: int  # a
    last: int  # b
    cp: cp_model.CpModel = field(default_factory=cp_model.CpModel)
    L: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    C: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    lam: list[set[int]] = field(default_factory=list)  # λ: the incumbent's values in memory per step
    read: list[set[int]] = field(default_factory=list)  # the steps the incumbent reads each value at
    B: dict[int, cp_model.IntVar] = field(default_factory=dict)
    D: dict[int, cp_model.IntVar] = field(default_factory=dict)
    made_at: dict[int, int] = field(default_factory=dict)  # h_v: where the copy D_v undoes is made


def unmoved(node: Node) -> bool:
    """No decision moves this value in memory: resident, empty, or kept to the end (f_k)."""
    return node.resident or node.size == 0 or node.keep


def reach(problem: Problem) -> list[int]:
    """:math:`e_v`: v's last reader's step, or later where a recomputation of a reader,
    which may run as late as that reader's own reach, reads v."""
    can = set(recomputable(problem))
    out = [0] * len(problem.nodes)
    for v in range(len(problem.nodes) - 1, -1, -1):
        out[v] = max([problem.fixed_end(v), *(out[w] for w in problem.users[v] if w in can)])
    return out


def live(problem: Problem, plan: Plan) -> list[set[int]]:
    """:math:`\\lambda`: the values in memory at each step under ``plan``."""
    at: list[set[int]] = [set() for _ in problem.nodes]
    for v, spans in value_intervals(problem, plan).items():
        for lo, hi in spans:
            for k in range(lo, hi + 1):
                at[k].add(v)
    return at


def build(problem: Problem, plan: Plan, first: int, last: int, ends: list[int] | None = None) -> Window:
    """The model of window ``[first, last]`` around ``plan`` (see the module docstring)."""
    w = Window(problem, first, last, lam=live(problem, plan), read=read_steps(problem, plan))
    ends = ends if ends is not None else reach(problem)
    add_release(w, plan)
    add_bridge(w, plan)
    add_made(w, ends, held(problem, w.lam, first, last))
    add_read(w)
    add_leave(w, plan)
    add_free(w, plan)
    add_memory(w)
    scale = problem.scale
    added = (sum(scale.time(problem.nodes[v].time) * c for (v, _), c in w.C.items())
             - sum(scale.time(problem.nodes[v].time) * d for v, d in w.D.items()))
    count = sum(w.C.values()) - sum(w.D.values())  # in [-|D|, |C|]
    w.cp.minimize((len(w.C) + len(w.D) + 1) * added + count)
    return w


def add_release(w: Window, plan: Plan) -> None:
    """D_v: the incumbent's recomputation of v before h_v < a, whose copy is in memory
    over [h_v, a-1] and read nowhere there, is undone: L_{v,a-1} := 1 - D_v."""
    p, a = w.problem, w.first
    latest: dict[int, int] = {}  # the copy in memory at a-1, if any, is the latest made before a
    for s in plan.schedule:
        if s.before < a:
            latest[s.node] = max(latest.get(s.node, -1), s.before)
    for v, h in sorted(latest.items()):
        if unmoved(p.nodes[v]) or not all(v in w.lam[k] for k in range(h, a)):
            continue
        if any(h <= k < a for k in w.read[v]):
            continue
        w.D[v] = w.cp.new_bool_var(f"D[{v}]")
        w.made_at[v] = h


def add_bridge(w: Window, plan: Plan) -> None:
    """B_v: L_{v,a-1} := B_v for v < a not in memory at a-1 and read in the window by the
    incumbent; m_k + Σ_v s_v B_v <= floor(B/q) at each k in (g_v, a-1]."""
    p, a = w.problem, w.first
    if a == 0:
        return
    gap: dict[int, list[cp_model.LinearExprT]] = {}
    for v in range(a):
        node = p.nodes[v]
        if v in w.lam[a - 1] or unmoved(node) or not any(a <= k <= w.last for k in w.read[v]):
            continue
        last = max(k for k in range(v, a) if v in w.lam[k])  # g_v
        b = w.B[v] = w.cp.new_bool_var(f"B[{v}]")
        for k in range(last + 1, a):
            gap.setdefault(k, []).append(p.scale.mem(node.size) * b)
    timeline = check(p, plan).timeline
    cap = p.capacity
    for k, terms in gap.items():
        # An undone copy frees its bytes from h_v on (sizes are whole units: exact).
        terms += [-p.scale.mem(p.nodes[v].size) * d for v, d in w.D.items() if w.made_at[v] <= k]
        # m_k in units, rounded up: never below the bytes the checker counts there.
        w.cp.add(sum(terms) + p.scale.mem(timeline[k]) <= cap)


def held(problem: Problem, lam: list[set[int]], first: int, last: int) -> set[int]:
    """:math:`V_W`: the values the incumbent holds at a step of [a-1, b+1], or that an op of
    the window reads."""
    out = set().union(*lam[max(0, first - 1):last + 2])
    for u in range(first, last + 1):
        out.update(problem.nodes[u].deps)
    return out


def add_made(w: Window, ends: list[int], values: set[int]) -> None:
    """L_{v,v} = 1; L_{v,k} <= L_{v,k-1} + C_{v,k}; C_{v,k} => L_{v,k}; C_{v,k} + L_{v,k-1} <= 1."""
    p, a = w.problem, w.first
    can = set(recomputable(p))
    for v in sorted(values):
        if unmoved(p.nodes[v]):
            continue  # keep: in memory from its step to the end, in f_k
        for k in range(max(a, v), min(w.last, ends[v]) + 1):
            w.L[v, k] = w.cp.new_bool_var(f"L[{v},{k}]")
            if k == v:
                w.cp.add(w.L[v, k] == 1)
                continue
            # Only at k = a is L_{v,k-1} outside the window: a bridge, an undone copy, or
            # the incumbent's.
            before: cp_model.LinearExpr | int = w.L.get((v, k - 1), w.B.get(v, int(v in w.lam[k - 1])))
            if k == a and v in w.D:
                before = 1 - w.D[v]
            if v in can and k >= v + 2:
                c = w.C[v, k] = w.cp.new_bool_var(f"C[{v},{k}]")
                w.cp.add(w.L[v, k] <= before + c)
                w.cp.add_implication(c, w.L[v, k])
                w.cp.add(c + before <= 1)
            else:
                w.cp.add(w.L[v, k] <= before)


def add_read(w: Window) -> None:
    """L_{v,u} = 1 for an op u that reads v; C_{w,k} => L_{v,k} for v that w reads."""
    p = w.problem
    for u in range(w.first, w.last + 1):
        for v in set(p.nodes[u].deps):
            if (v, u) in w.L:
                w.cp.add(w.L[v, u] == 1)
    for (r, k), c in w.C.items():
        for v in set(p.nodes[r].deps):
            if (v, k) in w.L:
                w.cp.add_implication(c, w.L[v, k])
            elif not unmoved(p.nodes[v]):
                w.cp.add(c == 0)  # v cannot be in memory there


def leaving(w: Window, plan: Plan) -> set[int]:
    """The values the incumbent has in memory at b+1 and does not make there."""
    b = w.last
    if b + 1 >= len(w.problem.nodes):
        return set()
    return w.lam[b + 1] - {s.node for s in plan.schedule if s.before == b + 1}


def add_leave(w: Window, plan: Plan) -> None:
    """L_{v,b} = 1 where the incumbent has v in memory at b+1 and does not make it there."""
    for v in leaving(w, plan):
        if (v, w.last) in w.L:
            w.cp.add(w.L[v, w.last] == 1)


def add_free(w: Window, plan: Plan) -> None:
    """L_{v,k} <= ρ_{v,k} + L_{v,k+1} - C_{v,k+1} for k > v not a step whose op reads v,
    ρ_{v,k} = Σ_{w reads v} C_{w,k}; past the window L_{v,b+1} := 1 where leave holds v,
    else 0."""
    p, b = w.problem, w.last
    held_on = leaving(w, plan)
    readers: dict[tuple[int, int], list[cp_model.IntVar]] = {}
    for (r, k), c in w.C.items():
        for v in set(p.nodes[r].deps):
            readers.setdefault((v, k), []).append(c)
    for (v, k), x in w.L.items():
        if k == v or k in p.users[v]:
            continue  # made or read here: in memory whatever follows
        after: cp_model.LinearExprT
        if (v, k + 1) in w.L:
            after = w.L[v, k + 1] - w.C.get((v, k + 1), 0)
        else:  # past the window, or past the last step v can be read at
            after = int(k == b and v in held_on)
        w.cp.add(x <= sum(readers.get((v, k), [])) + after)


def add_memory(w: Window) -> None:
    """Σ_v s_v L_{v,k} + f_k <= floor(B/q) at each step of the window."""
    p = w.problem
    scale = p.scale
    cap = p.capacity
    kept = [v for v, n in enumerate(p.nodes) if n.keep and not n.resident and n.size]
    at: dict[int, list[cp_model.LinearExprT]] = {k: [] for k in range(w.first, w.last + 1)}
    for (v, k), x in w.L.items():
        at[k].append(scale.mem(p.nodes[v].size) * x)
    for k, terms in at.items():
        fixed = sum(scale.mem(p.nodes[v].size) for v in kept if v <= k)
        w.cp.add(sum(terms) + fixed <= cap)


class Solved(NamedTuple):
    """What one window's solve returns."""

    plan: Plan | None  # the best plan found; None when CP-SAT found none
    seconds: float  # CP-SAT's deterministic seconds under ``config.deterministic``, else wall time


def solve_window(problem: Problem, plan: Plan, first: int, last: int, config: SolverConfig, seconds: float,
                 ends: list[int] | None = None) -> Solved:
    """The cheapest plan that keeps ``plan`` outside ``[first, last]`` found in ``seconds``,
    hinted with ``plan``."""
    t0 = time.perf_counter()
    w = build(problem, plan, first, last, ends)
    made = {(s.node, s.before) for s in plan.schedule}
    for (v, k), c in w.C.items():
        w.cp.add_hint(c, (v, k) in made)
    for (v, k), x in w.L.items():
        w.cp.add_hint(x, v in w.lam[k])
    for b in [*w.B.values(), *w.D.values()]:
        w.cp.add_hint(b, False)
    solver = make_solver(config)
    # Building a wide window's model takes a while: it counts against ``seconds`` too.
    limit(solver, config, seconds if config.deterministic else max(0.05, seconds - (time.perf_counter() - t0)))
    code = solver.solve(w.cp)
    took = solver.response_proto.deterministic_time if config.deterministic else time.perf_counter() - t0
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solved(None, took)
    undone = {(v, w.made_at[v]) for v, d in w.D.items() if solver.boolean_value(d)}
    outside = [s for s in plan.schedule if not first <= s.before <= last and (s.node, s.before) not in undone]
    inside = [Step(v, k) for (v, k), c in w.C.items() if solver.value(c)]
    return Solved(as_plan(outside + inside), took)


def windows(problem: Problem, plan: Plan, width: int) -> list[tuple[int, int]]:
    """Windows of ``width`` steps, one every quarter width and one ending at the last step,
    over the steps from the first where the plan recomputes or runs within 5% of the
    budget to the end; the ones where the plan spends most recomputation time first, the
    widest of those first. A gain needs one window to cover all its changes: at this
    stride every span of three quarters of the width lies in one (half-overlapping windows
    cover half), and a restricted window takes 0.1-5 s."""
    n = len(problem.nodes)
    timeline = check(problem, plan).timeline
    budget = problem.budget if problem.budget is not None else max(timeline, default=0)
    hot = [k for k, m in enumerate(timeline) if m >= 0.95 * budget] + [s.before for s in plan.schedule]
    if not hot or n < 2:
        return []
    start = max(1, min(hot) - width // 2)
    stride = max(1, width // 4)
    out = [(a, min(n - 1, a + width - 1)) for a in range(start, n, stride)]
    # And one of full width at the end, where windows laid out from the start are cut
    # short and most reads are (n250 at 80% needs [202, 249] at width 48). Laying them all
    # out from the end instead moved the others: n500 at 80% ended at 3.274%, not 3.209%.
    out.append((max(start, n - width), n - 1))
    out = sorted({(a, b) for a, b in out if b >= a})

    def spent(w: tuple[int, int]) -> float:
        return sum(problem.nodes[s.node].time for s in plan.schedule if w[0] <= s.before <= w[1])

    # Of windows where the plan spends as much, the widest first: it allows their moves and
    # more. n250 at 80% needs [202, 249]; solved after [211, 249] (10-14 s, no gain) it
    # was cut short.
    return sorted(out, key=lambda w: (-spent(w), w[0] - w[1], -w[0]))


def polish(problem: Problem, plan: Plan, config: SolverConfig, seconds: float, *,
           width: int | None = None) -> Plan:
    """``plan`` improved window by window (:func:`windows`) for up to ``seconds`` (counted
    as :func:`solve_window` counts them), each window's best accepted when the checker
    finds it within budget and cheaper. Passes repeat while a pass improves, skipping the
    windows already solved on the current plan; after a pass that does not improve, the
    windows grow by half (a doubling skipped the 48-step window that n250 at 80% needs),
    until one spans every step."""
    left = seconds
    width = width or WIDTH
    ends = reach(problem)
    cost = check(problem, plan).added_time
    # The windows solved since the plan last changed: solving one again starts from the
    # same hint and model. Repeating them took a third of the windows' time on n250 at
    # 80% (a gain in a pass's first window left its ten others to be solved again), and
    # the 48-step window it needed then ran out of time.
    solved: set[tuple[int, int]] = set()
    while left > 0.5:  # under half a second a wide window's model alone may use it up
        improved = False
        for first, last in windows(problem, plan, width):
            if left <= 0.5:
                break
            if (first, last) in solved:
                continue
            # A window CP-SAT cannot close in a third of the share would starve the rest.
            found = solve_window(problem, plan, first, last, config, min(left, seconds / 3), ends)
            left -= found.seconds
            solved.add((first, last))
            if found.plan is None:
                continue
            report = check(problem, found.plan)
            if report.fits and report.added_time < cost - 1e-12:
                plan, cost, improved = found.plan, report.added_time, True
                solved = {(first, last)}
        if not improved:
            if width >= len(problem.nodes):
                break
            width = max(width + 1, width * 3 // 2)
    return plan
