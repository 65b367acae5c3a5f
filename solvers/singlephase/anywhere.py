r"""Exact rematerialization on single-phase graphs: recompute any value before any later step.

Graphs without a forward/backward split (:attr:`Problem.single_phase`, e.g. the random
layered graphs of the Checkmate / Moccasin / FastSA benchmarks) run in their fixed order,
and any value may be freed and recomputed before any later step, more than once where that
pays. This is Moccasin's problem (Bartan et al., 2023); the model is Moccasin's too —
retention intervals and one cumulative constraint — with the checker's semantics
(:func:`solvers.checker.value_intervals`): every read takes the latest copy made before it.

Notation. Steps :math:`k = 0..N-1`; value :math:`v` computed at step :math:`v`, of
:math:`s_v` bytes and :math:`t_v` seconds. Up to :math:`C` copies per value (``copies``):
copy 0 is the op at step :math:`v`, copies :math:`c \ge 1` are recomputations. A *read* of
:math:`v` is either the op at a later step :math:`u` that reads it (time :math:`\tau_r = u`,
always present) or a recomputation :math:`c'` of a value :math:`w` that reads it (time
:math:`\tau_r = P_{w,c'}`, present iff :math:`R_{w,c'}`). :math:`\pi_r` is the read's
presence literal.

Variables:

* :math:`R_{v,c} \in \{0,1\}`, :math:`c \ge 1`: the c-th recomputation of v runs
  (only for recomputable values read more than one step after their own);
* :math:`P_{v,c} \in [v+1, N-1]`: the step it runs before;
* :math:`E_{v,c}`: the last step copy c lives (copy 0: :math:`E_{v,0} \ge v`);
* :math:`z_{r,c} \in \{0,1\}`: read r is served by copy c.

Constraint families (one ``add_*`` function each):

* copies:  :math:`R_{v,c+1} \Rightarrow R_{v,c}` and :math:`R_{v,c+1} \Rightarrow
  P_{v,c+1} > P_{v,c}`; :math:`E_{v,c} \ge P_{v,c}` (copies in order, no gaps);
* serve:   :math:`\sum_c z_{r,c} = \pi_r`; :math:`z_{r,c} \Rightarrow R_{v,c}`,
  :math:`z_{r,c} \Rightarrow P_{v,c} \le \tau_r` (made before the read; a recomputation
  before step k runs before the op at k, and recomputations before one step run in value
  order, so a value's copy exists for a reader recomputed before the same step);
  :math:`z_{r,c} \Rightarrow E_{v,c} \ge \tau_r` (lives until it);
* latest:  :math:`z_{r,c} \land R_{v,c+1} \Rightarrow P_{v,c+1} > \tau_r`: a read takes
  the newest copy, as the checker and the emitted code do;
* memory:  one cumulative over the intervals :math:`[v, E_{v,0}]` (demand :math:`s_v`)
  and :math:`[P_{v,c}, E_{v,c}]` present iff :math:`R_{v,c}`, capacity
  :math:`\lfloor B/q \rfloor` memory units (``problem.scale``);
* memory cuts: at step k, the values read at k (or computed at k) are live, and a value
  computed before k and read after k is live unless it is recomputed:
  :math:`\sum_{v \in A_k} s_v + \sum_{v \in S_k} s_v (1 - R_{v,1}) \le \lfloor B/q \rfloor`.
  Implied by the cumulative; they give CP-SAT's LP the knapsack bound the cumulative
  does not (:func:`add_memory_cuts`).

Objective: :math:`\min T \sum_{v,c} t_v R_{v,c} + \sum_{v,c} R_{v,c}` with
:math:`T = |R| + 1`: the least added time, then the fewest recomputations.

Why intervals rather than Checkmate's stage-by-value booleans: the latter need
:math:`O(N^2)` variables (a million at N = 1000); here a value has :math:`3C` integers and a
boolean per read and copy, linear in the graph. Why the latest-copy rule is a constraint
rather than a choice: without it a plan could keep an old copy alive past a newer one, a
schedule the checker (and emitted code) would not run as modelled. Interval ends may be
later than the last read they serve; that only overstates memory, so every solution's
checker peak is at most the model's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from solvers.checker import check
from solvers.plan import Plan, Step
from solvers.problem import Problem
from solvers.result import InfeasibleBudgetError, SolverConfig, SolveResult, Status
from solvers.sat import (
    Watch,
    limit,
    make_peak_solver,
    make_solver,
    min_peak_result,
    objective_seconds,
    proven_optimal,
    search,
    search_stats,
    spent,
)
from solvers.singlephase import local, window
from solvers.singlephase.bound import lower_bound, stakes
from solvers.singlephase.local import recomputable

COPIES = 2  # copies per value: the op and one recomputation (Moccasin's C = 2)
MAX_CUT_TERMS = 200_000  # bounds add_memory_cuts: about 10 MB of model
LOCAL_SHARE = 0.15  # of the time limit, for the local search before CP-SAT and again after
# Of the time limit, for CP-SAT's search, whatever the local search before it used. Over
# the public random graphs at 60 s its plan beat the local search's only on n500 at 90%
# (0.744% to 0.701%, found 5-7 s into the solve), and its bound never beat the
# relaxation's (BOUND_SHARE), which it reached on n1000 only after some 20 s. The window
# polish gets what is left (WINDOW_SHARE under ``config.deterministic``) and made every
# other gain there: on n250 at 80% the 48-step window [202, 249] reached 4.897% in 6 of 6
# polishes with 43 s for the windows (CP-SAT at 15%), 5 of 8 with 31 s (at 35%).
SEARCH_SHARE = 0.15
WINDOW_SHARE = 0.5
# Of the time limit, at most, for the relaxation's bound (:mod:`solvers.singlephase.bound`): it is
# proven in 0.1-1.5 s on the public random graphs.
BOUND_SHARE = 0.05


@dataclass(frozen=True)
class Read:
    """One read of value ``value``: at fixed step ``step``, or by recomputation ``copy`` of
    ``reader`` (``step`` is then -1 and the time is ``P[reader, copy]``)."""

    value: int
    reader: int
    step: int = -1
    copy: int = 0


@dataclass
class Model:
    """The CP-SAT model of one single-phase problem, with its variables named as in the math."""

    problem: Problem
    copies: int
    cp: cp_model.CpModel = field(default_factory=cp_model.CpModel)
    R: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    P: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    E: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    z: dict[tuple[Read, int], cp_model.IntVar] = field(default_factory=dict)
    reads: list[Read] = field(default_factory=list)
    capacity: cp_model.IntVar | int = 0
    seed: Plan | None = None  # the local search's plan within budget, if it found one

    @property
    def tie_break(self) -> int:
        return len(self.R) + 1

    def copies_of(self, v: int) -> range:
        """Copy indices v may have: 0 alone, or 0..C-1 when v may be recomputed."""
        return range(self.copies) if (v, 1) in self.R else range(1)

    def when(self, read: Read) -> cp_model.LinearExprT:
        return read.step if read.step >= 0 else self.P[read.reader, read.copy]

    def present(self, read: Read) -> cp_model.LinearExprT:
        return 1 if read.step >= 0 else self.R[read.reader, read.copy]


def build(problem: Problem, *, copies: int = COPIES, minimize_peak: bool = False) -> Model:
    """The model of ``problem`` (see the module docstring), objective included."""
    m = Model(problem, copies)
    add_variables(m)
    add_copies(m)
    add_serve(m)
    add_memory(m, minimize_peak=minimize_peak)
    add_memory_cuts(m)
    if minimize_peak:
        m.cp.minimize(m.capacity)
    else:
        m.cp.minimize(objective(m))
    return m


def objective(m: Model) -> cp_model.LinearExprT:
    """T·Σ t_v R_{v,c} + Σ R_{v,c}, T = |R| + 1 (time in ``problem.scale`` units)."""
    scale = m.problem.scale
    added = sum(scale.time(m.problem.nodes[v].time) * r for (v, _), r in m.R.items())
    return m.tie_break * added + sum(m.R.values())


def add_variables(m: Model) -> None:
    p = m.problem
    last = p.last_step
    for v in recomputable(p):
        for c in range(1, m.copies):
            m.R[v, c] = m.cp.new_bool_var(f"R[{v},{c}]")
            m.P[v, c] = m.cp.new_int_var(v + 1, last, f"P[{v},{c}]")
            m.E[v, c] = m.cp.new_int_var(v + 1, last, f"E[{v},{c}]")
    for v, node in enumerate(p.nodes):
        if node.resident or node.size == 0:
            continue
        if node.keep:
            m.E[v, 0] = m.cp.new_constant(last)
            continue
        m.E[v, 0] = m.cp.new_int_var(v, last, f"E[{v},0]")
    for u, node in enumerate(p.nodes):
        for v in sorted(set(node.deps)):
            if (v, 0) in m.E:
                m.reads.append(Read(v, u, step=u))
                m.reads += [Read(v, u, copy=c) for c in range(1, m.copies) if (u, c) in m.R]
    for r in m.reads:
        for c in m.copies_of(r.value):
            m.z[r, c] = m.cp.new_bool_var(f"z[{r.value}<-{r.reader}.{r.copy}@{r.step},{c}]")


def add_copies(m: Model) -> None:
    """R_{v,c+1} => R_{v,c}; R_{v,c+1} => P_{v,c+1} > P_{v,c}; E_{v,c} >= P_{v,c}."""
    for (v, c), r in m.R.items():
        m.cp.add(m.E[v, c] >= m.P[v, c])
        if c + 1 < m.copies:
            m.cp.add_implication(m.R[v, c + 1], r)
            m.cp.add(m.P[v, c + 1] > m.P[v, c]).only_enforce_if(m.R[v, c + 1])


def add_serve(m: Model) -> None:
    """Σ_c z_{r,c} = π_r; z_{r,c} => R_{v,c}, P_{v,c} <= τ_r, E_{v,c} >= τ_r;
    z_{r,c} ∧ R_{v,c+1} => P_{v,c+1} > τ_r (the latest copy)."""
    for r in m.reads:
        v, t = r.value, m.when(r)
        options = m.copies_of(v)
        m.cp.add(sum(m.z[r, c] for c in options) == m.present(r))
        for c in options:
            z = m.z[r, c]
            if c > 0:
                m.cp.add_implication(z, m.R[v, c])
                m.cp.add(m.P[v, c] <= t).only_enforce_if(z)
            m.cp.add(m.E[v, c] >= t).only_enforce_if(z)
            if c + 1 in options:
                m.cp.add(m.P[v, c + 1] > t).only_enforce_if([z, m.R[v, c + 1]])


def add_memory(m: Model, *, minimize_peak: bool) -> None:
    """cumulative([v, E_{v,0}], [P_{v,c}, E_{v,c}] if R_{v,c}; demand s_v) <= floor(B/q)."""
    p = m.problem
    scale = p.scale
    intervals: list[cp_model.IntervalVar] = []
    demands: list[int] = []
    for (v, c), end in m.E.items():
        size = scale.mem(p.nodes[v].size)
        if c == 0:
            length = m.cp.new_int_var(1, p.last_step - v + 1, f"len[{v},0]")
            intervals.append(m.cp.new_interval_var(v, length, end + 1, f"Copy[{v},0]"))
        else:
            length = m.cp.new_int_var(1, p.last_step - v, f"len[{v},{c}]")
            intervals.append(m.cp.new_optional_interval_var(
                m.P[v, c], length, end + 1, m.R[v, c], f"Copy[{v},{c}]"))
        demands.append(size)
    if minimize_peak:
        floor = max((scale.mem(p.nodes[k].size) for k in range(len(p.nodes))), default=0)
        total = scale.mem(sum(n.size for n in p.nodes if not n.resident))
        m.capacity = m.cp.new_int_var(floor, max(floor, total), "B")
    else:
        m.capacity = p.capacity
    m.cp.add_cumulative(intervals, demands, m.capacity)


def add_memory_cuts(m: Model, *, max_terms: int = MAX_CUT_TERMS) -> None:
    """Σ_{v ∈ A_k} s_v + Σ_{v ∈ S_k} s_v (1 - R_{v,1}) <= floor(B/q) at each step k, where
    A_k are the values live at k whatever the plan and S_k those computed before k and read
    after k, live unless recomputed (:func:`solvers.singlephase.bound.stakes`). Rows go in for the
    steps with the most memory at stake first, up to ``max_terms`` terms."""
    p = m.problem
    scale = p.scale
    fixed_bytes, spans = stakes(p, {v for v, _ in m.R})
    fixed = [scale.mem(b) for b in fixed_bytes]
    potential = {k: fixed[k] + sum(scale.mem(p.nodes[v].size) for v in vs) for k, vs in spans.items()}
    used = 0
    for k in sorted(spans, key=lambda k: (-potential[k], k)):
        if used + len(spans[k]) > max_terms:
            break
        m.cp.add(fixed[k] + sum(scale.mem(p.nodes[v].size) * (1 - m.R[v, 1]) for v in spans[k])
                 <= m.capacity)
        used += len(spans[k])
    for k in range(len(p.nodes)):  # steps where nothing may be freed: a constant bound
        if k not in spans and fixed[k]:
            m.cp.add(fixed[k] <= m.capacity)


def extract_plan(m: Model, solver: cp_model.CpSolver) -> Plan:
    """Recomputed values and their steps; within a step, in value order (what the model's
    tie rule assumes)."""
    return local.as_plan([Step(v, solver.value(m.P[v, c])) for (v, c), r in m.R.items()
                          if solver.boolean_value(r)])


def greedy(problem: Problem, config: SolverConfig = SolverConfig()) -> SolveResult:
    """Recompute, at the peak step, the value that frees the most bytes there per second
    of recomputation, just before its next read; repeat until the plan fits (at most one
    recomputation per value; :func:`solvers.singlephase.local.repair`). A baseline, and where the
    local search before CP-SAT starts."""
    t0 = time.perf_counter()
    steps, report = local.repair(problem, [])
    fits = report.fits
    return SolveResult(status=Status.FEASIBLE if fits else Status.UNKNOWN,
                       plan=local.as_plan(steps) if fits else None, report=report if fits else None,
                       objective=report.added_time if fits else float("inf"), bound=0.0,
                       wall_time=time.perf_counter() - t0, solver="greedy-anywhere")


def hint(m: Model, plan: Plan) -> None:
    """Start the search from ``plan``: every variable as the checker reads the plan (each
    read served by the latest copy made before it)."""
    made: dict[int, list[int]] = {}  # value -> the steps its recomputations run before
    for s in plan.schedule:
        made.setdefault(s.node, []).append(s.before)
    for (v, c), runs_var in m.R.items():
        runs = c <= len(made.get(v, []))
        m.cp.add_hint(runs_var, runs)
        if runs:
            m.cp.add_hint(m.P[v, c], made[v][c - 1])
    ends: dict[tuple[int, int], int] = {}
    for r in m.reads:
        if r.step >= 0:
            t = r.step
        elif r.copy <= len(made.get(r.reader, [])):
            t = made[r.reader][r.copy - 1]
        else:
            t = -1  # that recomputation does not run: no read
        served = sum(1 for q in made.get(r.value, []) if q <= t) if t >= 0 else -1
        for c in m.copies_of(r.value):
            m.cp.add_hint(m.z[r, c], c == served)
        if t >= 0:
            ends[r.value, served] = max(ends.get((r.value, served), t), t)
    for (v, c), e in m.E.items():
        if m.problem.nodes[v].keep:  # a constant end
            continue
        start = v if c == 0 else (made[v][c - 1] if c <= len(made.get(v, [])) else v + 1)
        m.cp.add_hint(e, max(start, ends.get((v, c), start)))


def prepare(problem: Problem, config: SolverConfig, *, copies: int = COPIES,
            on_best: Callable[[Plan, float], None] | None = None) -> tuple[Model, cp_model.CpSolver]:
    """The model, hinted with the greedy's plan, and a configured solver
    (``config.step_gap`` as an absolute gap limit); the local search's best plan, from
    the same start in up to ``LOCAL_SHARE`` of the time limit, is kept as ``m.seed`` for
    :func:`finish`. CP-SAT gets ``SEARCH_SHARE`` of the limit, less the model's building.

    Why not hint the search's plan: CP-SAT then stayed near it (random n500 at 90%: 0.744%
    after 60 s against 0.701% from the greedy's)."""
    steps, _ = local.repair(problem, [])
    start = local.as_plan(steps)
    # Before the model: its many Python objects slow the search's allocations (n1000 at
    # 80%: 2.91% found in the same 9 s after the model was built, 2.79% before).
    seed = local.improve(problem, start, seconds=config.time_limit * LOCAL_SHARE, seed=config.seed,
                         on_best=on_best, deterministic=config.deterministic)
    t1 = time.perf_counter()
    m = build(problem, copies=copies)
    m.seed = seed
    hint(m, start)  # over budget, it still points the search at the right values
    solver = make_solver(config)
    # Building the model counts against the search's share (no work under deterministic).
    limit(solver, config, max(0.1, config.time_limit * SEARCH_SHARE - spent(config, t1, 0.0)))
    if config.step_gap > 0:
        step = problem.scale.time(sum(n.time for n in problem.nodes))
        solver.parameters.absolute_gap_limit = config.step_gap * step * m.tie_break
    return m, solver


def finish(problem: Problem, config: SolverConfig, m: Model, solver: cp_model.CpSolver,
           code: cp_model.CpSolverStatus, *, started: float, stalled: bool = False,
           interrupted: bool = False) -> SolveResult:
    """As :func:`solvers.planner.finish`: the checker's verdict on the best plan,
    :class:`InfeasibleBudgetError` with the smallest feasible budget, or status UNKNOWN.

    The best plan is CP-SAT's or the local search's seed, whichever adds less time; unless
    CP-SAT proved it optimal or the search was ``interrupted`` (Ctrl-C asks for the best
    plan now), the local search then starts from it for up to ``LOCAL_SHARE`` of the time
    limit, and last :func:`solvers.singlephase.window.polish` re-solves windows of steps exactly for
    what is left of the limit (``WINDOW_SHARE`` of it under ``config.deterministic``,
    where the clock must not count), where a value may be recomputed more than
    ``copies - 1`` times. The bound is the larger of this model's, over plans with at most
    ``copies`` copies, and the relaxation's of :mod:`solvers.singlephase.bound`, over every plan."""
    stats = search_stats(m.cp, solver, code, stalled=stalled)
    if code == cp_model.INFEASIBLE:
        assert problem.budget is not None
        low = min_feasible_peak(problem, config, copies=m.copies)
        raise InfeasibleBudgetError(problem.budget, low.report.peak if low.report else None,
                                    proven=low.status is Status.OPTIMAL, plan=low.plan)
    if code == cp_model.MODEL_INVALID:
        raise RuntimeError(f"CP-SAT rejected the model: {m.cp.validate()}")
    found = code in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    # CP-SAT's bound holds whether or not it found a plan (the local search may have),
    # over plans of at most ``m.copies`` copies; the relaxation's over every plan.
    bound = max(0.0, objective_seconds(m.tie_break, problem, solver.best_objective_bound))
    if not interrupted:
        relaxed = lower_bound(problem, {v for v, _ in m.R}, config, config.time_limit * BOUND_SHARE)
        bound = max(bound, relaxed)
    sources = [("CP-SAT", extract_plan(m, solver))] if found else []
    if m.seed is not None:
        sources.append(("local search", m.seed))
    if not sources:
        return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=float("inf"),
                           bound=bound, wall_time=time.perf_counter() - started,
                           solver="cpsat-anywhere", stats=stats)
    judged = [(name, p, check(problem, p)) for name, p in sources]
    for name, _, r in judged:
        if not r.fits:  # a solver and the checker disagree: a bug, never a silent plan
            raise AssertionError(f"{name} plan peaks at {r.peak} B over budget {problem.budget} B")
    optimal = found and proven_optimal(code, solver, m.tie_break)
    _, plan, report = min(judged, key=lambda j: j[2].added_time)  # CP-SAT's on a tie
    if not (optimal or interrupted):
        better = local.improve(problem, plan, seconds=config.time_limit * LOCAL_SHARE, seed=config.seed,
                               deterministic=config.deterministic)
        if better is not None and (after := check(problem, better)).added_time < report.added_time:
            plan, report = better, after
            stats["polished"] = 1
        # Last: the local search keeps one recomputation per value, the windows do not.
        # They get what is left of the limit: the local search often stops early.
        left = config.time_limit * WINDOW_SHARE
        if not config.deterministic:  # less a second: CP-SAT's workers take a while to stop
            left = config.time_limit - (time.perf_counter() - started) - 1.0
        better = window.polish(problem, plan, config, max(0.0, left))
        if (after := check(problem, better)).added_time < report.added_time:
            plan, report = better, after
            stats["windows"] = 1
    return SolveResult(
        status=Status.OPTIMAL if optimal else Status.FEASIBLE,
        plan=plan, report=report, objective=report.added_time,
        bound=min(report.added_time, bound), wall_time=time.perf_counter() - started,
        solver="cpsat-anywhere", stats=stats,
    )


def solve(problem: Problem, config: SolverConfig = SolverConfig(), *, copies: int = COPIES) -> SolveResult:
    """The cheapest recompute plan within ``problem.budget``, up to ``copies`` copies of a
    value (see :func:`solvers.planner.solve` for the statuses and the infeasible case)."""
    t0 = time.perf_counter()
    m, solver = prepare(problem, config, copies=copies)
    watch = Watch()
    code = search(solver, m.cp, config, watch)
    return finish(problem, config, m, solver, code, started=t0, stalled=watch.stalled)


def min_feasible_peak(problem: Problem, config: SolverConfig = SolverConfig(), *,
                      copies: int = COPIES) -> SolveResult:
    """The plan with the smallest checker peak (any added time)."""
    t0 = time.perf_counter()
    m = build(problem.with_budget(None), copies=copies, minimize_peak=True)
    solver = make_peak_solver(config)
    code = solver.solve(m.cp)
    return min_peak_result(problem, solver, code, lambda: extract_plan(m, solver), started=t0,
                           name="cpsat-anywhere-min-peak", stats=search_stats(m.cp, solver, code))
