r"""A lower bound on the added time of any plan of a single-phase problem.

Notation as in :mod:`solvers.singlephase.anywhere`: value :math:`v` computed at step :math:`v`, of
:math:`s_v` bytes and :math:`t_v` seconds, budget :math:`B`. At step :math:`k`,
:math:`A_k` are the values that must be in memory whatever the plan (computed or read at
k, kept to the end, or not recomputable and not yet past their last read), and
:math:`S_k` the recomputable values computed before k and read after k but not at k
(:func:`stakes`). A value of :math:`S_k` out of memory at k needs a copy made after k
for its next read, so it is recomputed at least once. With :math:`x_v \in \{0, 1\}`
standing for "v is recomputed at all":

.. math::

    \min \sum_v t_v x_v \quad \text{s.t.} \quad
    \sum_{v \in S_k} s_v x_v \;\ge\; \sum_{v \in A_k} s_v + \sum_{v \in S_k} s_v - B
    \quad \forall k.

Every plan within budget gives a solution (:math:`x_v = 1` where it recomputes v) of at
most its cost, however many times it recomputes a value, so this relaxation's optimum, or
CP-SAT's bound on it when stopped early, bounds every plan: the interval model's of
:mod:`solvers.singlephase.anywhere` (whose own bound holds only for its two copies) and the windows'
of :mod:`solvers.singlephase.window`. It drops when recomputations run and what they read, so it is
small: CP-SAT proves it optimal in 0.1-1.5 s on the public random graphs, where the
interval model over the same rows (:func:`solvers.singlephase.anywhere.add_memory_cuts`) reaches the
same bound on random n1000 at 80% (0.78% of the step) only some 20 s into its search.
"""

from __future__ import annotations

import math

from ortools.sat.python import cp_model

from solvers.problem import Problem
from solvers.result import SolverConfig
from solvers.sat import limit, make_solver


def stakes(problem: Problem, movable: set[int]) -> tuple[list[int], dict[int, list[int]]]:
    """At each step k, the bytes of :math:`A_k` and the values of :math:`S_k` (only steps
    where it is not empty), for the values of ``movable`` that a plan may recompute."""
    fixed = [0] * len(problem.nodes)
    spans: dict[int, list[int]] = {}
    for v, node in enumerate(problem.nodes):
        if node.resident or node.size == 0:
            continue
        reads = set(problem.users[v])
        last = problem.last_step if node.keep else max(reads, default=v)
        for k in range(v, last + 1):
            if k == v or k in reads or node.keep or v not in movable:
                fixed[k] += node.size
            else:
                spans.setdefault(k, []).append(v)
    return fixed, spans


def lower_bound(problem: Problem, movable: set[int], config: SolverConfig, seconds: float) -> float:
    """The relaxation's optimum in seconds, or CP-SAT's bound on it after ``seconds``
    (see the module docstring): 0 without a budget, infinity where some step's
    :math:`A_k` alone exceeds it."""
    if problem.budget is None:
        return 0.0
    scale = problem.scale  # memory units: sizes are exact multiples of one
    cap = problem.capacity
    fixed, spans = stakes(problem, movable)
    if scale.mem(max(fixed, default=0)) > cap:
        return math.inf
    cp = cp_model.CpModel()
    x: dict[int, cp_model.IntVar] = {}
    for k, values in spans.items():
        need = scale.mem(fixed[k]) + sum(scale.mem(problem.nodes[v].size) for v in values) - cap
        if need <= 0:
            continue
        for v in values:
            if v not in x:
                x[v] = cp.new_bool_var(f"x[{v}]")
        cp.add(sum(scale.mem(problem.nodes[v].size) * x[v] for v in values) >= need)
    if not x:
        return 0.0
    # Times rounded down to whole units, so that a bound on them bounds the true times,
    # after a part in 10^9 more: a whole number of units may divide out as n - 1e-11.
    unit = scale.seconds_per_unit
    cp.minimize(sum(math.floor(problem.nodes[v].time / unit * (1 + 1e-9)) * xv for v, xv in x.items()))
    solver = make_solver(config)
    limit(solver, config, seconds)
    code = solver.solve(cp)
    if code == cp_model.INFEASIBLE:  # even recomputing every value of S_k leaves A_k
        return math.inf
    return max(0.0, solver.best_objective_bound * unit)
