r"""The flat CP-SAT model of a two-phase problem: exact save / recompute / offload planning.

:func:`build` makes the model (one ``add_*`` function per constraint family below),
:func:`prepare` hints it with a given plan and configures its solver, :func:`finish` judges
the search's plan with the checker, and :func:`min_peak` runs the minimum-peak model. This
module imports none of the other solvers: which plan seeds the search, and how an
infeasible budget is explained, is :mod:`solvers.planner`'s.

The model is the checker's memory and time model (:mod:`solvers.checker`) written as
constraints, so that a plan the model accepts is one the checker accepts, and the optimum
of the model is the best plan over all save/recompute/offload assignments with the
canonical schedule and, for each offload, any of the windows its copies may run over
(:func:`transfer_steps`).

Notation. Timeline steps :math:`k = 0..N-1`; the forward is :math:`k < F`. For a forward
value :math:`v`: :math:`s_v` bytes, :math:`t_v` seconds, :math:`lf(v)` its last forward
use, :math:`bu(v)` the backward steps that read it, :math:`fu(v)` its forward users,
:math:`to(v)` the step of the op that takes its storage over (``problem.taken_over``),
:math:`fe(v)` the last step of its forward copy when not kept (``problem.forward_end``:
:math:`lf(v) - 1` where :math:`to(v) = lf(v)`, else :math:`lf(v)`).
:math:`C` is the set of values that may need a decision (``problem.candidates``).
:math:`U_F` and :math:`U_R` are the values whose forward copy and whose recomputed copy
hold no memory (``Node.unstored``: the ops that read such a copy compute it).

Variables, for :math:`v \in C`:

* :math:`S_v \in \{0,1\}`: v is saved across the forward/backward boundary;
* :math:`R_v \in \{0,1\}`: v is recomputed in the backward;
* :math:`P_v \in [F, N-1]`: the backward step v is recomputed before;
* :math:`L_v \in [F, N-1]`: v's last backward consumer;
* :math:`Q_{v,w} \in [F, N-1]`, for each candidate forward user w of v: :math:`P_w` if
  :math:`R_w`, else :math:`N-1` (what the anchor's minimum ranges over);
* :math:`T_v \in \{0,1\}`, where :math:`to(v)` is a backward step: that op is v's last
  consumer, so it writes over v's backward copy, which ends one step earlier; where
  :math:`w = to(v)` is a forward candidate that may be recomputed (not in :math:`U_R`): w's
  recomputation is v's last consumer and writes over v's backward copy (a recomputed
  softmax over its recomputed scores), which ends before :math:`P_w`;
* :math:`Z_{u,j} \in \{0,1\}`, for each stretch j of :func:`unstored_extensions`: u's forward
  copy lives on over it, read by the reader of a value of :math:`U_F` that is not saved.

and, where the problem has a host link and v may be offloaded (``Node.offloadable``, a
forward step after its last forward read, the reads of the readers that compute it included
(``problem.copy_out_from``), and a backward step before its first read):

* :math:`O_v \in \{0,1\}`: v is offloaded (copied to host memory, copied back);
* :math:`out_{v,k}, in_{v,k} \in \{0,1\}`: its copy out must be done when forward step k
  ends (its window is :math:`[o(v), k]`, :math:`o(v)` = ``copy_out_from(v)``), its copy back
  is issued as backward step k starts (its window is :math:`[k, P_v - 1]`);
  :math:`X_v, Y_v` those steps;
* :math:`C_k \ge 0`: when step k starts on the compute stream, waits for copies included;
  :math:`D_{a}` per way: when the copies issued at step a are done.

Constraint families (one ``add_*`` function each):

* one fate:   :math:`S_v + R_v + O_v \le 1`, and :math:`R_v = 0` if v is not recomputable;
* needed:     :math:`S_v + R_v + O_v = 1` if :math:`bu(v) \ne \emptyset`, else
  :math:`S_v + R_v + O_v \le \sum_{w \in fu(v)} R_w` (no decision for a value nobody reads);
* chain:      :math:`R_w \Rightarrow S_u + R_u + O_u \ge 1` for every :math:`u \in deps(w) \cap C`;
* anchor:     :math:`P_v \le \min bu(v)`, :math:`R_w \Rightarrow P_u \le P_w` for
  :math:`u \in deps(w)`, and :math:`R_v \lor O_v \Rightarrow P_v = \min(bu(v) \cup
  \{P_w : w \in fu(v), R_w\})`: recompute (or wait for the copy back) right before the
  first consumer, exactly where the canonical schedule does;
* transfers:  :math:`\sum_k out_{v,k} = O_v`, :math:`out_{v,k} \Rightarrow X_v = k`, the
  same for :math:`in, Y`; :math:`O_v \Rightarrow Y_v < P_v`; the compute stream
  :math:`C_{k+1} \ge C_k + c_k`; one engine each way, running the batches of copies in
  the order they are issued, :math:`D_a \ge C_a + l_a` and :math:`D_b \ge D_a + l_b` for
  consecutive batches a < b, with :math:`l_a = \sum_v d_v [v \text{ issued at } a]` and
  :math:`d_v = s_v / \text{bandwidth}`; and the waits
  :math:`out_{v,k} \Rightarrow D_{o(v)} \le C_{k+1}`, :math:`in_{v,k} \Rightarrow D_k \le C_{P_v}`;
* last use:   :math:`L_v \ge \max bu(v)`, :math:`L_v \ge P_v`, and
  :math:`R_w \Rightarrow L_u \ge P_w`, or :math:`R_w \Rightarrow L_u \ge L_w` where w is
  in :math:`U_R` (its readers compute it, so they read u); :math:`T_v \Rightarrow L_v \le to(v)`
  for a backward :math:`to(v)`, else :math:`T_v \Rightarrow R_w \land L_v \le P_w` with
  :math:`w = to(v)` and :math:`T_v \land R_r \Rightarrow L_r < P_w` for v's readers r in :math:`U_R`;
* memory:     one cumulative constraint, capacity :math:`\lfloor B / q \rfloor` memory
  units (``problem.scale``), over the fixed live intervals of every value (the baseline
  :math:`b_k`: what no decision changes, a candidate's forward copy to :math:`fe(v)`)
  plus, per candidate, the optional intervals :math:`[fe(v)+1, L'_v]` present iff
  :math:`S_v`, :math:`[P_v, L'_v]` present iff :math:`R_v` (none for v in :math:`U_R`),
  and :math:`[fe(v)+1, X_v]`, :math:`[Y_v, L'_v]` present iff :math:`O_v` (the device
  copy lives until its copy out ends, and again from its copy back on), with
  :math:`L'_v = L_v - T_v` (for the recomputed and reloaded copies :math:`L_v` where the
  backward taker overwrites the saved copy only, ``Node.overwrites_copies``). A v in
  :math:`U_F` has no forward copy in the baseline: its saved and offloaded intervals start
  at v. The stretches u's copy lives on for the readers computing values of :math:`U_F`
  add :math:`[a_j, b_j]` present iff :math:`Z_{u,j}`, with
  :math:`Z_{u,j} + S_u + O_u + S_w + O_w \ge 1` for each w in :math:`U_F`
  whose reader reads u at :math:`b_j` or later (u stored covers them itself).

* memory cuts: the rows of the memory constraint at the steps where it can bind,
  restricted to the terms every plan has live there (:func:`add_memory_cuts`); implied
  by the cumulative, they give CP-SAT's LP a bound the cumulative does not.

Objective: :math:`\min T (\sum_{v} t_v R_v + W) + \sum_v (R_v + O_v)` with
:math:`W = C_{N} - C_{o} - \sum_{k \ge o} c_k` the waits for copies (o the first step a copy
may be issued at) and
:math:`T = |R| + |O| + 1` (time in ``problem.scale`` units): the least added time, and
among equal times the fewest rematerializations.

Why intervals and one cumulative (as Moccasin does) rather than Checkmate's
:math:`O(N^2)` stage-by-value booleans: the recompute positions are the only freedom in
time, so two integers per value describe a plan exactly, and the model grows linearly
with the graph. Ends are free to be later than the canonical schedule (that only lengthens
the value's own interval), so every solution maps to a canonical plan whose checker peak
is no higher than the model's. The model counts a copy recomputed before step k through
step k; the checker frees one that only the next recomputations read as soon as they have
run, so its peak may be lower: a proof is at the model's granularity, and the planner
checks a proven least peak or infeasible budget against the holding ladder's plans
(:func:`solvers.baselines.ladder_rungs`). Positions are pinned to the canonical anchor: an earlier
recompute of w would end what w reads earlier (:math:`L_u \ge P_w`), a schedule that the
canonical plan does not run, and the model would undercount its peak.

Why copies run over windows of steps on a clock of the compute stream (as the emitted code
runs them: a copy is issued after its value's last forward read and waited for where its
device copy is freed, and a reload is issued where it is allocated and waited for just
before its first use): a copy rarely hides under one op (a 32 MiB block input takes
0.67 ms at 50 GB/s, longer than most ops of a transformer layer), while a run of ops
hides it easily. Memory stays indexed by steps (a copy frees or claims its device memory
at a window's end or start), so one cumulative still holds it, and only the clock
:math:`C` is new: one integer per step from the first copy on. The batches of one step
finish together, which the emitted code (waiting for each copy on its own) never
exceeds; recomputations are left out of the clock, so the waits are an upper bound.
Each window ends (out) or starts (back) at one of a few steps (``TRANSFER_CHOICES``):
next to the use, or where its compute covers the copy a few times over.

With ``minimize_peak`` the capacity becomes a variable and the objective; that is how an
infeasible budget is explained by the smallest feasible one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from solvers.checker import Report, check
from solvers.deadline import Deadline
from solvers.floor import baseline, unstored_extensions
from solvers.plan import Decision, Plan, plan_from_decisions
from solvers.problem import Copy, Problem
from solvers.result import SolverConfig, SolveResult, Status
from solvers.sat import (
    make_peak_solver,
    make_solver,
    min_peak_result,
    objective_seconds,
    proven_optimal,
    search_stats,
    solved,
    within,
)

log = logging.getLogger(__name__)

MAX_CUT_TERMS = 200_000  # bounds the size of add_memory_cuts: about 10 MB of model
TRANSFER_CHOICES = 6  # steps an offloaded value's copy window may end (out) or start (back) at
# Minimum-peak models this thread keeps (:func:`peak_model`): a solve with a host link whose
# budget no plan fits searches the least peak of two problems (without the link, then
# with it), each twice (for a seed, then for the error that explains the budget).
PEAK_MODELS_KEPT = 2


@dataclass
class Model:
    """The CP-SAT model of one problem, with its variables named as in the math."""

    problem: Problem
    cp: cp_model.CpModel = field(default_factory=cp_model.CpModel)
    S: dict[int, cp_model.IntVar] = field(default_factory=dict)
    R: dict[int, cp_model.IntVar] = field(default_factory=dict)
    P: dict[int, cp_model.IntVar] = field(default_factory=dict)
    L: dict[int, cp_model.IntVar] = field(default_factory=dict)
    O: dict[int, cp_model.IntVar] = field(default_factory=dict)  # noqa: E741  (the math's O_v)
    X: dict[int, cp_model.IntVar] = field(default_factory=dict)
    Y: dict[int, cp_model.IntVar] = field(default_factory=dict)
    out_at: dict[int, dict[int, cp_model.IntVar]] = field(default_factory=dict)  # v -> k -> bool
    in_at: dict[int, dict[int, cp_model.IntVar]] = field(default_factory=dict)
    start: dict[int, cp_model.IntVar] = field(default_factory=dict)  # C_k: when step k starts
    T: dict[int, cp_model.IntVar] = field(default_factory=dict)  # v's last backward reader takes it over
    capacity: cp_model.IntVar | int = 0
    seed: Plan | None = None  # the plan the search was hinted with (:func:`prepare`'s ``start``)

    sizes: dict[str, int] = field(default_factory=dict)  # constraints per family, for logs

    @property
    def tie_break(self) -> int:
        """Objective units per time unit (see :func:`objective`)."""
        return len(self.R) + len(self.O) + 1

    def remat(self, v: int) -> cp_model.LinearExprT:
        """R_v + O_v: v is rematerialized in the backward (recomputed or reloaded)."""
        return cp_model.LinearExpr.sum([self.R[v], self.O[v]]) if v in self.O else self.R[v]

    def kept(self, v: int) -> cp_model.LinearExprT:
        """S_v + R_v + O_v: v is available to the backward, whatever its fate."""
        return cp_model.LinearExpr.sum([self.S[v], self.remat(v)])


def build(problem: Problem, *, minimize_peak: bool = False) -> Model:
    """The model of ``problem`` (see the module docstring), objective included."""
    m = Model(problem)
    add_variables(m)
    for family in (add_one_fate, add_needed, add_chain, add_anchor, add_last_use, add_transfers):
        _timed(m, family.__name__, family)
    _timed(m, "add_memory", lambda m: add_memory(m, minimize_peak=minimize_peak))
    _timed(m, "add_memory_cuts", add_memory_cuts)
    if minimize_peak:
        m.cp.minimize(m.capacity)
    else:
        m.cp.minimize(objective(m))
    return m


def objective(m: Model) -> cp_model.LinearExprT:
    """T·(Σ t_v R_v + W) + Σ R_v + Σ O_v with T = |R| + |O| + 1: least added time
    first, then the fewest rematerializations (zero-time ones included) — lexicographic,
    because Σ R_v + Σ O_v < T."""
    scale = m.problem.scale
    time = sum(scale.time(m.problem.nodes[v].time) * m.R[v] for v in m.R) + waits(m)
    return m.tie_break * time + sum(m.R.values()) + sum(m.O.values())


def add_variables(m: Model) -> None:
    p = m.problem
    f, last = p.n_forward, p.last_step
    candidates = set(p.candidates)
    for v in p.candidates:
        m.S[v] = m.cp.new_bool_var(f"S[{v}]")
        m.R[v] = m.cp.new_bool_var(f"R[{v}]")
        m.P[v] = m.cp.new_int_var(f, last, f"P[{v}]")
        m.L[v] = m.cp.new_int_var(f, last, f"L[{v}]")
        if p.taken_over.get(v, 0) >= f or _recomputed_taker(p, v, candidates) is not None:
            m.T[v] = m.cp.new_bool_var(f"T[{v}]")
        outs, ins = transfer_steps(p, v)
        if outs and ins:
            m.O[v] = m.cp.new_bool_var(f"O[{v}]")
            m.X[v] = m.cp.new_int_var(min(outs), max(outs), f"X[{v}]")
            m.Y[v] = m.cp.new_int_var(min(ins), max(ins), f"Y[{v}]")
            m.out_at[v] = {k: m.cp.new_bool_var(f"out[{v},{k}]") for k in outs}
            m.in_at[v] = {k: m.cp.new_bool_var(f"in[{v},{k}]") for k in ins}


def transfer_steps(problem: Problem, v: int, *, choices: int | None = None) -> tuple[list[int], list[int]]:
    """The steps v's copies' windows may end (out) or start (back) at, if v may be
    offloaded: out, a forward step from ``Problem.copy_out_from`` on; back, a backward step
    before its first backward read. Each way, the window of one step next to the use (no
    memory held longer), then the shortest windows whose compute covers the copy 1, 2, 3,
    5 and 8 times over (room for the copies queued before it), up to ``choices`` in all."""
    p = problem
    node = p.nodes[v]
    choices = choices or TRANSFER_CHOICES
    if p.host_bandwidth <= 0 or not node.offloadable:
        return [], []
    f = p.n_forward
    reads = p.backward_uses[v]
    first_read = min(reads) if reads else p.last_step
    out_window = range(p.copy_out_from(v), f)
    in_window = range(first_read - 1, f - 1, -1)  # from the use back
    if not out_window or not in_window:
        return [], []
    seconds = p.transfer_time(v)

    def pick(window: range) -> list[int]:
        if choices >= len(window):
            return sorted(window)
        picked = [window[0]]
        covered = 0.0
        cover = iter((1, 2, 3, 5, 8))
        goal = next(cover) * seconds
        for k in window:
            covered += p.nodes[k].time
            while covered >= goal and len(picked) < choices:
                if k not in picked:
                    picked.append(k)
                goal = next(cover, math.inf) * seconds
        return sorted(picked)

    return pick(out_window), pick(in_window)


def add_one_fate(m: Model) -> None:
    """S_v + R_v + O_v <= 1; R_v = 0 when v may not be recomputed."""
    for v in m.S:
        m.cp.add(m.kept(v) <= 1)
        if not m.problem.nodes[v].recomputable:
            m.cp.add(m.R[v] == 0)


def add_needed(m: Model) -> None:
    """S_v + R_v + O_v = 1 if the backward reads v; else S_v + R_v + O_v <= sum_{w in fu(v)} R_w."""
    p = m.problem
    for v in m.S:
        if p.backward_uses[v]:
            m.cp.add(m.kept(v) == 1)
        else:
            m.cp.add(m.kept(v) <= sum(m.R[w] for w in p.forward_users[v] if w in m.R))


def add_chain(m: Model) -> None:
    """R_w => S_u + R_u + O_u >= 1 for every candidate u that w reads, written
    S_u + R_u + O_u >= R_w: the same on booleans, and a plain row CP-SAT's LP keeps
    (an enforced one it drops at the default linearization), so the bound knows that a
    recomputation needs its inputs."""
    for w in m.R:
        for u in _candidate_deps(m, w):
            m.cp.add(m.kept(u) >= m.R[w])


def add_anchor(m: Model) -> None:
    """P_v <= min bu(v); R_w => P_u <= P_w for u in deps(w);
    R_v ∨ O_v => P_v = min(bu(v) ∪ {P_w : w in fu(v), R_w}), with Q[v,w] = P_w if R_w
    else N-1."""
    p = m.problem
    f, last = p.n_forward, p.last_step
    for v in m.P:
        if p.backward_uses[v]:
            m.cp.add(m.P[v] <= min(p.backward_uses[v]))
    for w in m.R:
        for u in _candidate_deps(m, w):
            m.cp.add(m.P[u] <= m.P[w]).only_enforce_if(m.R[w])
    for v in m.P:
        # N-1 stands for "no such consumer": every real anchor is at most N-1.
        firsts: list[cp_model.LinearExprT] = [min(p.backward_uses[v], default=last)]
        for w in p.forward_users[v]:
            if w not in m.R:
                continue
            q = m.cp.new_int_var(f, last, f"Q[{v},{w}]")
            m.cp.add(q == m.P[w]).only_enforce_if(m.R[w])
            m.cp.add(q == last).only_enforce_if(~m.R[w])
            firsts.append(q)
        if v in m.O:
            remat = m.cp.new_bool_var(f"M[{v}]")
            m.cp.add(remat == m.R[v] + m.O[v])
        else:
            remat = m.R[v]
        m.cp.add_min_equality(m.P[v], firsts).only_enforce_if(remat)


def add_last_use(m: Model) -> None:
    """L_v >= max bu(v); L_v >= P_v; R_w => L_u >= P_w for u in deps(w), L_u >= L_w where w
    is in U_R; T_v => L_v <= to(v) for a backward taker; for a forward one w = to(v),
    T_v => R_w, L_v <= P_w and, for its readers r in U_R, R_r => L_r < P_w (w's
    recomputation reads v last, alone at its step)."""
    p = m.problem
    for v in m.L:
        if p.backward_uses[v]:
            m.cp.add(m.L[v] >= max(p.backward_uses[v]))
        m.cp.add(m.L[v] >= m.P[v])
    for v, taken in m.T.items():
        w = p.taken_over[v]
        if w >= p.n_forward:
            m.cp.add(m.L[v] <= w).only_enforce_if(taken)
            continue
        # w is v's last reader of all, so no backward op reads v: w's recomputation is
        # the last read when it is the latest, and no reader in U_R reads v at its step.
        m.cp.add_implication(taken, m.R[w])
        m.cp.add(m.L[v] <= m.P[w]).only_enforce_if(taken)
        for r in p.forward_users[v]:
            if r != w and r in m.R and not p.nodes[r].stores(Copy.RECOMPUTED):
                m.cp.add(m.L[r] < m.P[w]).only_enforce_if([taken, m.R[r]])
    for w in m.R:
        read_until = m.P[w] if p.nodes[w].stores(Copy.RECOMPUTED) else m.L[w]
        for u in _candidate_deps(m, w):
            m.cp.add(m.L[u] >= read_until).only_enforce_if(m.R[w])


def add_transfers(m: Model) -> None:
    """Where v's copies run, if offloaded, and how long the compute stream waits for them:

    sum_k out[v,k] = O_v, out[v,k] => X_v = k;  sum_k in[v,k] = O_v, in[v,k] => Y_v = k;
    O_v => Y_v < P_v (back before the first use);
    C_{k+1} >= C_k + c_k (step k starts at C_k and computes for c_k);
    per way, for the batches of copies issued at steps a < b < ... with loads
    l_a = sum_v d_v [v issued at a]: D_a >= C_a + l_a, D_b >= D_a + l_b (one engine, in order);
    out[v,k] => D_{o(v)} <= C_{k+1}; in[v,k] => D_k <= C_{P_v}; W = C_end - C_first - sum_k c_k;
    and, implied, D_last <= C_F for the copies out (F the first backward step),

    with d_v = s_v / bandwidth, o(v) = ``copy_out_from(v)``, c_k step k's compute
    (``nodes[k].time``), all in time units: the checker's :func:`transfer_stalls`, whose
    engines start each batch when both it is issued and the one before is done.
    """
    p = m.problem
    scale = p.scale
    issued: tuple[dict[int, list[cp_model.LinearExprT]], dict[int, list[cp_model.LinearExprT]]] = ({}, {})
    for v in m.O:
        d = scale.time(p.transfer_time(v))
        for choice, chosen in ((m.out_at[v], m.X[v]), (m.in_at[v], m.Y[v])):
            m.cp.add(sum(choice.values()) == m.O[v])
            for k, b in choice.items():
                m.cp.add(chosen == k).only_enforce_if(b)
        issued[0].setdefault(p.copy_out_from(v), []).append(d * m.O[v])
        for k, b in m.in_at[v].items():
            issued[1].setdefault(k, []).append(d * b)
        m.cp.add(m.Y[v] < m.P[v]).only_enforce_if(m.O[v])
    if not m.O:
        return
    compute = [scale.time(n.time) for n in p.nodes]
    first = min(issued[0])
    horizon = sum(compute[first:]) + 2 * sum(scale.time(p.transfer_time(v)) for v in m.O)
    m.start = {k: m.cp.new_int_var(0, horizon, f"C[{k}]") for k in range(first, len(p.nodes) + 1)}
    m.cp.add(m.start[first] == 0)
    for k in range(first, len(p.nodes)):
        m.cp.add(m.start[k + 1] >= m.start[k] + compute[k])
    done: tuple[dict[int, cp_model.IntVar], dict[int, cp_model.IntVar]] = ({}, {})
    for way in (0, 1):
        before: cp_model.IntVar | None = None
        for a in sorted(issued[way]):
            load = cp_model.LinearExpr.sum(issued[way][a])
            done[way][a] = m.cp.new_int_var(0, horizon, f"D[{way},{a}]")
            m.cp.add(done[way][a] >= m.start[a] + load)
            if before is not None:
                m.cp.add(done[way][a] >= before + load)
            before = done[way][a]
    # Implied (every window out ends in the forward), and a row the LP keeps where the
    # reified waits below are dropped: the copies out take no longer than the forward
    # and its waits, which bounds how much offload hides.
    m.cp.add(done[0][max(done[0])] <= m.start[p.n_forward])
    clock = [m.start.get(k, 0) for k in range(len(p.nodes) + 1)]
    for v in m.O:
        for k, b in m.out_at[v].items():
            m.cp.add(done[0][p.copy_out_from(v)] <= m.start[k + 1]).only_enforce_if(b)
        due = m.cp.new_int_var(0, horizon, f"C[P[{v}]]")
        m.cp.add_element(m.P[v], clock, due)
        for k, b in m.in_at[v].items():
            m.cp.add(done[1][k] <= due).only_enforce_if(b)


def waits(m: Model) -> cp_model.LinearExpr:
    """W: the time units the compute stream waits for copies (0 without a host link)."""
    if not m.start:
        return cp_model.LinearExpr.sum([])
    first, end = min(m.start), max(m.start)
    compute = sum(m.problem.scale.time(n.time) for n in m.problem.nodes[first:end])
    return m.start[end] - m.start[first] - compute


def add_memory(m: Model, *, minimize_peak: bool) -> None:
    """cumulative(baseline b_k, [fe(v)+1, L_v'] if S_v, [P_v, L_v'] if R_v,
    [fe(v)+1, X_v] and [Y_v, L_v'] if O_v, [a_j, b_j] if Z_{u,j}) <= floor(B/q), with
    L_v' = L_v - T_v (L_v for the R and O copies where the taker takes the saved copy
    only), and v in place of fe(v)+1 for v in U_F."""
    p = m.problem
    scale = p.scale
    base = baseline(p)
    intervals: list[cp_model.IntervalVar] = []
    demands: list[int] = []
    for lo, hi, level in _segments(base):
        if level:
            intervals.append(m.cp.new_fixed_size_interval_var(lo, hi - lo + 1, f"base[{lo}]"))
            demands.append(scale.mem(level))
    for u, lo, hi, vs in unstored_extensions(p):
        # u's forward copy lives on while a value of U_F that reads it is not saved, unless
        # u is stored itself (saved or offloaded: its stored copy covers these steps)
        own = [x[u] for x in (m.S, m.O) if u in x]
        if not own and any(v not in m.S for v in vs):
            continue  # in the baseline
        on = m.cp.new_bool_var(f"Ext[{u},{lo}]")
        for v in vs:
            m.cp.add(on + sum(own) + sum(x[v] for x in (m.S, m.O) if v in x) >= 1)
        intervals.append(m.cp.new_optional_interval_var(lo, hi - lo + 1, hi + 1, on, f"Ext[{u},{lo}]"))
        demands.append(scale.mem(p.nodes[u].size))
    for v in m.S:
        size = scale.mem(p.nodes[v].size)
        if size == 0:
            continue
        # a forward copy in U_F is there only with the saved or offloaded one
        start = v if p.computed_in(v) is not None else p.forward_end(v) + 1
        end: cp_model.LinearExprT = m.L[v] + 1
        if v in m.T:  # an interval's end must be one variable (affine)
            end = m.cp.new_int_var(p.n_forward, p.last_step + 1, f"end[{v}]")
            m.cp.add(end == m.L[v] + 1 - m.T[v])
        intervals.append(m.cp.new_optional_interval_var(start, end - start, end, m.S[v], f"Save[{v}]"))
        demands.append(size)
        # A copy the backward makes ends where the saved one does, or at L_v where the
        # taker takes the saved copy only.
        made_end = end if backward_copies_taken(p, v) else m.L[v] + 1
        shortest = 0 if v in m.T and backward_copies_taken(p, v) else 1  # recomputed right before its taker
        if p.nodes[v].stores(Copy.RECOMPUTED):
            length = m.cp.new_int_var(shortest, p.last_step - p.n_forward + 1, f"len[{v}]")
            intervals.append(
                m.cp.new_optional_interval_var(m.P[v], length, made_end, m.R[v], f"Recompute[{v}]")
            )
            demands.append(size)
        if v in m.O:
            out_len = m.cp.new_int_var(1, p.n_forward, f"out_len[{v}]")
            intervals.append(m.cp.new_optional_interval_var(start, out_len, m.X[v] + 1, m.O[v], f"Out[{v}]"))
            in_len = m.cp.new_int_var(shortest, p.last_step - p.n_forward + 1, f"in_len[{v}]")
            intervals.append(m.cp.new_optional_interval_var(m.Y[v], in_len, made_end, m.O[v], f"In[{v}]"))
            demands += [size, size]
    floor = scale.mem(max(base, default=0))
    if minimize_peak:
        total = scale.mem(sum(n.size for n in p.nodes if not n.resident))
        m.capacity = m.cp.new_int_var(floor, max(floor, total), "B")
    else:
        m.capacity = p.capacity
    m.cp.add_cumulative(intervals, demands, m.capacity)
    m.sizes["memory_intervals"] = len(intervals)


def add_memory_cuts(m: Model, *, max_terms: int = MAX_CUT_TERMS) -> None:
    """Redundant linear rows of the memory constraint, for CP-SAT's LP bound:

    b_k + sum_{v: fe(v) < k <= e(v)} s_v S_v + sum_{v: min bu(v) <= k <= e(v)} s_v (R_v + O_v)
        + sum_{v: k = fe(v)+1} s_v O_v <= floor(B/q)

    with e(v) = max bu(v) (one less where that op takes v over: for R_v and O_v only where it
    takes the backward's copies too), or F for a value only
    recomputed users read (saved, it lives at least to the backward's first step; F - 1
    where a recomputation may take it over there), and
    no R_v term for v in U_R (its recomputation holds no memory). Each term is live whatever
    the other decisions,
    so the row is implied by the cumulative; the cumulative alone gives CP-SAT no useful
    bound. Rows are added for the steps with the largest save-everything memory first, up
    to ``max_terms`` terms in all.
    """
    p = m.problem
    scale = p.scale
    base = baseline(p)
    rows: dict[int, list[tuple[cp_model.IntVar, int]]] = {}
    for v in m.S:
        size = scale.mem(p.nodes[v].size)
        if size == 0:
            continue
        bu = p.backward_uses[v]
        # A backward taker's step may hold its result only; a value with a recomputed
        # taker has no backward reads, and that recomputation may run before step F.
        backward_taker = v in m.T and p.taken_over[v] >= p.n_forward
        end = max(bu) - backward_taker if bu else p.n_forward - (v in m.T)
        for k in range(p.forward_end(v) + 1, end + 1):
            rows.setdefault(k, []).append((m.S[v], size))
        if bu:
            made_end = end if backward_copies_taken(p, v) else max(bu)
            for k in range(min(bu), made_end + 1):
                if p.nodes[v].stores(Copy.RECOMPUTED):
                    rows.setdefault(k, []).append((m.R[v], size))
                if v in m.O:
                    rows.setdefault(k, []).append((m.O[v], size))
        if v in m.O:
            rows.setdefault(p.forward_end(v) + 1, []).append((m.O[v], size))
        if p.computed_in(v) is not None:  # its forward copy, saved or offloaded
            for k in range(v, p.forward_end(v) + 1):
                rows.setdefault(k, []).extend((x[v], size) for x in (m.S, m.O) if v in x)
    potential = {k: scale.mem(base[k]) + sum(s for _, s in terms) for k, terms in rows.items()}
    used = 0
    for k in sorted(rows, key=lambda k: (-potential[k], k)):
        if used + len(rows[k]) > max_terms:
            break
        m.cp.add(sum(s * x for x, s in rows[k]) + scale.mem(base[k]) <= m.capacity)
        used += len(rows[k])


def two_phase(problem: Problem) -> None:
    """Raise ValueError for a single-phase problem: this model needs a backward."""
    if problem.single_phase:
        raise ValueError("a single-phase problem (no backward) is solved by solvers.singlephase; "
                         "solvers.solve picks the solver for any problem")


def prepare(problem: Problem, config: SolverConfig, *, start: Plan | None = None,
            deadline: Deadline | None = None) -> tuple[Model, cp_model.CpSolver]:
    """The model, hinted with ``start`` where given, and a configured solver whose time
    limit is what is left of ``deadline`` once the model is built (made from ``config``
    where not given). ``config.step_gap`` becomes CP-SAT's absolute gap limit, in
    objective units."""
    two_phase(problem)
    deadline = deadline or Deadline.of(config)
    model = build(problem)
    if start is not None:
        hint(model, start)
        model.seed = start
    solver = make_solver(config)
    within(solver, config, deadline)  # the model counts against the time limit
    if config.step_gap > 0:
        step = problem.scale.time(sum(n.time for n in problem.nodes))
        solver.parameters.absolute_gap_limit = config.step_gap * step * model.tie_break
    return model, solver


def finish(problem: Problem, model: Model, solver: cp_model.CpSolver, code: cp_model.CpSolverStatus, *,
           started: float, stalled: bool = False) -> SolveResult:
    """The result of a finished (or stopped) search: the checker's verdict on its plan, or
    on the seed it was hinted with where that adds less time (or the search found none);
    status OPTIMAL where the search proved its own plan best, INFEASIBLE (no plan) where
    it proved that none fits the budget and the seed does not either, UNKNOWN where there
    is no plan."""
    wall = time.perf_counter() - started
    stats = solve_stats(model, solver, code, stalled=stalled)
    if code == cp_model.INFEASIBLE and (model.seed is None or not check(problem, model.seed).fits):
        # A seed the checker fits is a plan although the model, counting each copy
        # recomputed before an op through it, proves none of its own fits.
        return SolveResult(status=Status.INFEASIBLE, plan=None, report=None, objective=math.inf,
                           bound=math.inf, wall_time=wall, solver="cpsat", stats=stats)
    if code == cp_model.MODEL_INVALID:
        raise RuntimeError(f"CP-SAT rejected the model: {model.cp.validate()}")
    bound = (0.0 if code == cp_model.INFEASIBLE
             else objective_seconds(model.tie_break, problem, solver.best_objective_bound))
    judged: list[tuple[str, Plan, Report]] = []
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        plan = extract_plan(model, solver)
        report = check(problem, plan)
        if not report.fits:  # the model and the checker disagree: a bug, never a silent plan
            raise AssertionError(f"CP-SAT plan peaks at {report.peak} B over budget {problem.budget} B")
        judged.append(("cpsat", plan, report))
    # The search may stop (at the gap limit, the time limit) on a plan dearer than the one
    # it was hinted with: with several workers, on whichever plan one of them reports
    # first. The hint is a plan too, where it fits (the least-peak seed may not).
    if model.seed is not None and (seeded := check(problem, model.seed)).fits:
        judged.append(("seed", model.seed, seeded))
    if not judged:
        return SolveResult(status=Status.UNKNOWN, plan=None, report=None, objective=float("inf"),
                           bound=bound, wall_time=wall, solver="cpsat", stats=stats)
    source, plan, report = min(judged, key=lambda j: j[2].added_time)  # CP-SAT's on a tie
    if source == "seed":
        stats["from_seed"] = 1
    proven = source == "cpsat" and proven_optimal(code, solver, model.tie_break)
    return SolveResult(
        status=Status.OPTIMAL if proven else Status.FEASIBLE, plan=plan, report=report,
        objective=report.added_time, bound=min(report.added_time, bound),
        wall_time=wall, solver="cpsat", stats=stats,
    )


def min_peak(problem: Problem, config: SolverConfig, *, start: Plan | None = None,
             deadline: Deadline | None = None) -> SolveResult:
    """The least-peak plan of the minimum-peak model (:func:`peak_search`, hinted with
    ``start``, within ``deadline``), judged by the checker against ``problem``'s budget:
    status OPTIMAL where its peak is proven least (``report.peak`` is then the smallest
    feasible budget), FEASIBLE where not, UNKNOWN where the search found no plan."""
    t0 = time.perf_counter()
    model, solver, code = peak_search(problem, config, start=start, deadline=deadline)
    return min_peak_result(problem, solver, code, lambda: extract_plan(model, solver), started=t0,
                           name="cpsat-min-peak", stats=solve_stats(model, solver, code))


def peak_search(problem: Problem, config: SolverConfig, *, stop: cp_model.CpSolverSolutionCallback | None = None,
                start: Plan | None = None, deadline: Deadline | None = None
                ) -> tuple[Model, cp_model.CpSolver, cp_model.CpSolverStatus]:
    """Minimize the peak (any added time), with no gap limit (:func:`make_peak_solver`),
    hinted with ``start`` where given, within ``deadline`` (made from ``config`` where not
    given)."""
    deadline = deadline or Deadline.of(config)
    model = peak_model(problem)
    if start is not None:
        hint(model, start)
    solver = make_peak_solver(config)
    within(solver, config, deadline)
    code = solved(solver, model.cp, deadline, stop)
    return model, solver, code


_PEAK_MODELS = threading.local()  # .kept: the last models built, newest last


def peak_model(problem: Problem) -> Model:
    """The minimum-peak model of ``problem`` without its budget (:func:`build`), unhinted.
    The model depends on the nodes and the host link only: the same model again, its hints
    cleared, for a problem with the nodes (the same object) and link of one of the last
    ``PEAK_MODELS_KEPT`` this thread asked for. A build takes 0.3-1 s at 250-600
    decisions, and a solve whose budget no plan fits asked for each model twice."""
    kept: list[Model] = getattr(_PEAK_MODELS, "kept", [])
    for model in kept:
        if model.problem.nodes is problem.nodes and model.problem.host_bandwidth == problem.host_bandwidth:
            model.cp.clear_hints()
            return model
    model = build(problem.with_budget(None), minimize_peak=True)
    _PEAK_MODELS.kept = [*kept, model][-PEAK_MODELS_KEPT:]
    return model


class StopAtMost(cp_model.CpSolverSolutionCallback):
    """Stops a minimization at its first solution of objective at most ``target``."""

    def __init__(self, target: int) -> None:
        super().__init__()
        self.target = target

    def on_solution_callback(self) -> None:
        if self.objective_value <= self.target:
            self.stop_search()


def extract_plan(model: Model, solver: cp_model.CpSolver) -> Plan:
    """Read the decisions; the canonical schedule follows from them."""
    decisions: dict[int, Decision] = {}
    transfers: dict[int, tuple[int, int]] = {}
    for v in model.S:
        if solver.boolean_value(model.S[v]):
            decisions[v] = Decision.SAVE
        elif solver.boolean_value(model.R[v]):
            decisions[v] = Decision.RECOMPUTE
        elif v in model.O and solver.boolean_value(model.O[v]):
            decisions[v] = Decision.OFFLOAD
            transfers[v] = (solver.value(model.X[v]), solver.value(model.Y[v]))
    return plan_from_decisions(model.problem, decisions, transfers)


def hint(model: Model, plan: Plan) -> None:
    """Start the search from ``plan`` (:attr:`Model.seed` records it where it is the seed)."""
    p = model.problem
    anchor: dict[int, int] = {}
    for s in plan.schedule:  # a value recomputed more than once: its first recomputation
        anchor.setdefault(s.node, s.before)
    last: dict[int, int] = {}  # L_v, users first: a user in U_R passes on its own
    for v in sorted(model.S, reverse=True):
        decision = plan.decisions.get(v)
        model.cp.add_hint(model.S[v], decision is Decision.SAVE)
        model.cp.add_hint(model.R[v], decision is Decision.RECOMPUTE)
        if v in model.O:
            model.cp.add_hint(model.O[v], decision is Decision.OFFLOAD)
        if v in anchor:
            model.cp.add_hint(model.P[v], anchor[v])
        consumers = [*p.backward_uses[v], *(
            anchor[w] if p.nodes[w].stores(Copy.RECOMPUTED) else last.get(w, anchor[w])
            for w in p.forward_users[v] if plan.decisions.get(w) is Decision.RECOMPUTE)]
        if decision is not None and consumers:
            last[v] = max(consumers)
            model.cp.add_hint(model.L[v], last[v])
        if v in model.T:
            w = p.taken_over[v]
            if w >= p.n_forward:
                model.cp.add_hint(model.T[v], last.get(v) == w)
            else:  # read last by w's recomputation (no backward op reads v), alone at its step
                alone = all(last.get(r, -1) < anchor.get(w, -1) for r in p.forward_users[v]
                            if r != w and not p.nodes[r].stores(Copy.RECOMPUTED)
                            and plan.decisions.get(r) is Decision.RECOMPUTE)
                model.cp.add_hint(model.T[v], plan.decisions.get(w) is Decision.RECOMPUTE
                                  and last.get(v) == anchor.get(w) and alone)


def backward_copies_taken(p: Problem, v: int) -> bool:
    """Whether the op that takes v's storage over (if any) takes a copy the backward
    makes (recomputed or reloaded) as well as the saved one: not for a backward taker
    without ``Node.overwrites_backward_copies``."""
    w = p.taken_over.get(v)
    return w is None or w < p.n_forward or p.nodes[w].overwrites_backward_copies


def _recomputed_taker(p: Problem, v: int, candidates: set[int]) -> int | None:
    """The forward op that takes v's storage over, where its recomputation may too: a
    candidate that may be recomputed and holds a copy (not in U_R)."""
    w = p.taken_over.get(v)
    if w is None or w >= p.n_forward or w not in candidates:
        return None
    node = p.nodes[w]
    return w if node.recomputable and node.stores(Copy.RECOMPUTED) else None


def _candidate_deps(m: Model, w: int) -> Iterable[int]:
    return (u for u in sorted(set(m.problem.nodes[w].deps)) if u in m.S)


def _segments(levels: list[int]) -> Iterable[tuple[int, int, int]]:
    """Maximal runs ``(first, last, level)`` of equal values."""
    start = 0
    for k in range(1, len(levels) + 1):
        if k == len(levels) or levels[k] != levels[start]:
            yield start, k - 1, levels[start]
            start = k


def _timed(m: Model, name: str, family: Callable[[Model], None]) -> None:
    t0 = time.perf_counter()
    before = len(m.cp.proto.constraints)
    family(m)
    m.sizes[name] = len(m.cp.proto.constraints) - before
    log.debug("%s: %d constraints in %.3f s", name, m.sizes[name], time.perf_counter() - t0)


def solve_stats(
    model: Model, solver: cp_model.CpSolver, code: cp_model.CpSolverStatus, *, stalled: bool = False
) -> dict[str, float | int | str]:
    return {**search_stats(model.cp, solver, code, stalled=stalled),
            **{f"n_{k}": v for k, v in model.sizes.items()}}
