"""The ``rematc`` command line.

    rematc demo [--compiler eager] [--budgets 100% 75% 55%]
    rematc solve PROBLEM.json --budget 512MiB [--time-limit 30] [--json]

Bad input is a one-line message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from solvers import InfeasibleBudgetError, SolverConfig, save_all, solve
from solvers.budget import format_bytes, parse_budget


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rematc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p_demo = sub.add_parser("demo", help="train a small GPT at several budgets, predicted vs measured")
    p_demo.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p_demo.add_argument("--budgets", nargs="+", default=["100%", "75%", "55%"])
    p_demo.add_argument("--steps", type=int, default=5, help="timed steps per configuration")

    p_solve = sub.add_parser("solve", help="plan a rematc problem file under a budget")
    p_solve.add_argument("problem", help="problem JSON (see docs/problem-format.md)")
    p_solve.add_argument("--budget", required=True, help="bytes, '512MiB', '2GB' or '40%%'")
    p_solve.add_argument("--time-limit", type=float, default=60.0)
    p_solve.add_argument("--workers", type=int, default=0)
    p_solve.add_argument("--seed", type=int, default=0)
    p_solve.add_argument("--json", action="store_true", help="machine-readable output")
    p_solve.add_argument("--out", help="write the plan as JSON here")

    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from rematc.demo import demo

            for b in args.budgets:
                parse_budget(b)
            demo(args.budgets, compiler=args.compiler, steps=args.steps)
            return 0
        return _solve(args)
    except (ValueError, OSError) as e:  # ProblemError and InfeasibleBudgetError included
        print(f"rematc: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rematc: interrupted", file=sys.stderr)
        return 130


def _solve(args: argparse.Namespace) -> int:
    from solvers.io import load_problem

    problem = load_problem(args.problem)
    unconstrained = save_all(problem).report
    assert unconstrained is not None
    budget = parse_budget(args.budget).resolve(unconstrained.peak)
    config = SolverConfig(time_limit=args.time_limit, workers=args.workers, seed=args.seed)
    try:
        result = solve(problem.with_budget(budget), config)
    except InfeasibleBudgetError as e:
        print(f"rematc: infeasible: {e}", file=sys.stderr)
        return 1
    report = result.report
    summary = {
        "status": result.status.value,
        "budget": budget,
        "peak_before": unconstrained.peak,
        "peak_after": report.peak if report else None,
        "added_time_s": result.objective,
        "added_flops": report.added_flops if report else None,
        "recomputed": report.n_recomputed if report else None,
        "gap": result.gap,
        "solve_time_s": result.wall_time,
    }
    if args.out and result.plan is not None:
        with open(args.out, "w") as f:
            json.dump(result.plan.to_json(), f)
    if args.json:
        print(json.dumps(summary))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"rematc solve {problem.name or args.problem}")
        table.add_column("")
        table.add_column("", justify="right")
        for key, value in summary.items():
            if key in ("budget", "peak_before", "peak_after") and isinstance(value, int):
                value = format_bytes(value)
            table.add_row(key, str(value))
        Console().print(table)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
