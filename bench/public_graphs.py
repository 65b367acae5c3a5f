"""rematc's exact solvers on the public rematerialization graphs, beside published results.

For each public graph (``../shared/bench-data/checkmate-graphs/``: Checkmate's framework
graphs ``*_train_nx.json`` and the random layered graphs ``random_layered_*.json``) at
budgets of 90% and 80% of the plain order's peak (``ceil(f * peak)``), prints the cost
increase (added cost / total cost of all nodes), the memory reached (% of the plain peak),
the solve time and the proven gap, next to the Checkmate / Moccasin / FastSA numbers
republished in that folder's README. Skips cleanly when the data folder is absent.

The framework graphs have a forward/backward split: rematc's model recomputes forward
values in the backward, what a training graph needs, while Checkmate and Moccasin may
also recompute within the forward. The random layered graphs have none: they run in
``graph["order"]`` and any value may be recomputed before any later step
(:mod:`solvers.singlephase.anywhere`, Moccasin's problem with two copies per value). FastSA also
reorders operators, so a lower FastSA cost can come from a larger search space.

    python bench/public_graphs.py [--all] [--time-limit 60] [--workers 2]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from solvers import InfeasibleBudgetError, SolverConfig, save_all, solve
from solvers.importers import load_node_link

DATA = Path(__file__).resolve().parents[2] / "shared" / "bench-data" / "checkmate-graphs"

# (graph file stem, budget) -> (Checkmate, Moccasin, FastSA) as "CI% / mem% / s", from the
# data folder's README (Moccasin's table as reproduced in FastSA's Table 1).
RANDOM = {100: "random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14",
          250: "random_layered_n250_w0.43_nlv0.75_ed0.2_scd0.14",
          500: "random_layered_n500_w0.36_nlv0.75_ed0.2_scd0.14",
          1000: "random_layered_n1000_w0.31_nlv0.75_ed0.2_scd0.14"}
PUBLISHED: dict[tuple[str, int], tuple[str, str, str]] = {
    (RANDOM[100], 90): ("0.8 / 89.2 / 18.5", "0.8 / 88.1 / 9.3", "0.0 / 79.4 / 11.7"),
    (RANDOM[100], 80): ("2.3 / 79.5 / 22.7", "2.3 / 79.5 / 9.5", "0.3 / 79.4 / 11.5"),
    (RANDOM[250], 90): ("0.9 / 90.0 / 685.1", "0.9 / 89.8 / 55.0", "0.0 / 77.3 / 15.1"),
    (RANDOM[250], 80): ("TLE", "4.9 / 80.0 / 639.5", "0.0 / 72.2 / 15.0"),
    (RANDOM[500], 90): ("TLE", "0.7 / 90.0 / 1803.3", "0.03 / 87.4 / 21.0"),
    (RANDOM[500], 80): ("TLE", "3.4 / 80.0 / 1804.8", "2.3 / 78.6 / 20.9"),
    (RANDOM[1000], 90): ("TLE", "0.7 / 90.0 / 3612.9", "0.4 / 87.5 / 36.0"),
    (RANDOM[1000], 80): ("TLE", "3.4 / 80.0 / 3611.8", "2.5 / 78.4 / 36.3"),
    ("fcn_8_vgg_32_416x608_train_nx", 90): ("0.0 / 88.4 / 6.3", "0.0 / 88.4 / 3.1", "0.1 / 75.3 / 9.4"),
    ("fcn_8_vgg_32_416x608_train_nx", 80): ("0.1 / 76.9 / 5.6", "0.1 / 78.9 / 3.1", "0.1 / 75.1 / 9.7"),
    ("ResNet50_256_224x224_train_nx", 90): ("0.1 / 89.0 / 434.1", "0.2 / 89.9 / 65.2", "0.2 / 86.2 / 10.9"),
    ("ResNet50_256_224x224_train_nx", 80): ("0.3 / 79.7 / 485.3", "0.3 / 80.0 / 69.3", "0.4 / 76.6 / 10.9"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="every *_train_nx graph, not only the published ones")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=0, help="CP-SAT workers (0: its 8-worker portfolio)")
    args = parser.parse_args()
    if not DATA.is_dir():
        print(f"skipped: benchmark graphs not found ({DATA.name} folder absent)")
        return 0
    files = sorted(DATA.glob("*_train_nx.json")) + [DATA / f"{RANDOM[n]}.json" for n in sorted(RANDOM)]
    files = [f for f in files if f.exists()]
    if not args.all:
        files = [f for f in files if any(f.stem == k[0] for k in PUBLISHED)]
    config = SolverConfig(time_limit=args.time_limit, workers=args.workers)
    label = 34
    header = (f"{'graph':<{label}} {'budget':>6} {'rematc CI% / mem% / s':>24} {'status':>9} {'gap':>6}"
              f"   {'Checkmate':>19} {'Moccasin':>19} {'FastSA':>19}")
    print(header)
    for path in files:
        problem = load_node_link(path)
        base = save_all(problem).report
        assert base is not None
        total = sum(n.time for n in problem.nodes)
        for frac in (90, 80):
            budget = math.ceil(frac / 100 * base.peak)
            try:
                r = solve(problem.with_budget(budget), config)
            except InfeasibleBudgetError as e:
                ours, status, gap = f"infeasible (min {e.min_feasible})", "infeas.", "-"
            else:
                if r.report is None:  # the time limit came before any plan
                    ours, status, gap = f"no plan in {r.wall_time:.0f} s", r.status.value, "-"
                else:
                    ours = (f"{100 * r.objective / total:.2f} / {100 * r.report.peak / base.peak:.1f} / "
                            f"{r.wall_time:.1f}")
                    status, gap = r.status.value, f"{r.gap:.1%}"
            pub = PUBLISHED.get((path.stem, frac), ("-", "-", "-"))
            print(f"{path.stem[:label]:<{label}} {frac:>5}% {ours:>24} {status:>9} {gap:>6}   "
                  f"{pub[0]:>19} {pub[1]:>19} {pub[2]:>19}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
