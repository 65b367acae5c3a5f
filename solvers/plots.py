"""Figures of a plan: the memory timeline over the step, and the added-time/budget Pareto
curve. Plain ``matplotlib.figure.Figure`` objects (no pyplot, so no global backend or
figure registry): functions return the figure, so callers (and tests) can inspect it
before :func:`save_png` writes it with the Agg renderer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from solvers import planner
from solvers.baselines import save_all
from solvers.checker import Report
from solvers.problem import Problem
from solvers.result import InfeasibleBudgetError, SolverConfig, Status

MIB = 2**20


@dataclass(frozen=True)
class ParetoPoint:
    budget: int  # bytes
    peak: int  # bytes: the checker's peak of the plan found
    added_time: float  # seconds (or the problem's time unit)
    status: Status


def timeline_figure(problem: Problem, before: Report, after: Report, *, budget: int | None) -> Figure:
    """Live bytes at each step for the save-everything plan and the chosen plan, with the
    budget as a horizontal line labelled ``budget`` and the forward/backward boundary."""
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.subplots()
    steps = range(len(problem.nodes))
    ax.plot(steps, [b / MIB for b in before.timeline], label=f"save all (peak {before.peak / MIB:.1f} MiB)",
            color="tab:gray", linewidth=1.2)
    ax.plot(steps, [b / MIB for b in after.timeline], label=f"plan (peak {after.peak / MIB:.1f} MiB)",
            color="tab:blue", linewidth=1.6)
    if budget is not None:
        ax.axhline(budget / MIB, color="tab:red", linestyle="--", linewidth=1.2, label="budget")
    ax.axvline(problem.n_forward - 0.5, color="black", linestyle=":", linewidth=0.8)
    ax.set_xlabel("step (forward | backward)")
    ax.set_ylabel("live memory (MiB)")
    ax.set_title(f"memory over the step: {problem.name or 'problem'}")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    return fig


def pareto_sweep(problem: Problem, *, points: int, config: SolverConfig) -> list[ParetoPoint]:
    """Solve at ``points`` budgets from the smallest feasible peak to the save-all peak."""
    top = save_all(problem.with_budget(None)).report
    assert top is not None
    low = planner.min_feasible_peak(problem, config)
    bottom = low.report.peak if low.report is not None else top.peak
    count = max(2, points)
    budgets = sorted({math.ceil(bottom + (top.peak - bottom) * k / (count - 1)) for k in range(count)})
    out = []
    for b in budgets:
        try:
            r = planner.solve(problem.with_budget(b), config)
        except InfeasibleBudgetError:
            continue
        if r.report is not None:
            out.append(ParetoPoint(b, r.report.peak, r.objective, r.status))
    return out


def pareto_figure(problem: Problem, points: list[ParetoPoint], *, time_unit: str = "s",
                  budget: int | None = None) -> Figure:
    """Added time against budget; unproven points (time limit) drawn hollow."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    xs = [p.budget / MIB for p in points]
    ys = [p.added_time for p in points]
    ax.plot(xs, ys, color="tab:blue", linewidth=1.2, label="least added time")
    proven = [p for p in points if p.status is Status.OPTIMAL]
    other = [p for p in points if p.status is not Status.OPTIMAL]
    ax.scatter([p.budget / MIB for p in proven], [p.added_time for p in proven], color="tab:blue",
               zorder=3, label="optimal")
    if other:
        ax.scatter([p.budget / MIB for p in other], [p.added_time for p in other],
                   facecolors="none", edgecolors="tab:blue", zorder=3, label="time limit (gap > 0)")
    if budget is not None:
        ax.axvline(budget / MIB, color="tab:red", linestyle="--", linewidth=1.2, label="budget")
    ax.set_xlabel("budget (MiB)")
    ax.set_ylabel(f"added time ({time_unit})")
    ax.set_title(f"added time vs budget: {problem.name or 'problem'}")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    return fig


def save_png(fig: Figure, path: str) -> None:
    FigureCanvasAgg(fig).print_png(path)
