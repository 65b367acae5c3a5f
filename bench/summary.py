"""What a benchmark run says, read from its rows: rematc against each PyTorch configuration
at that configuration's measured peak, and how close rematc's predicted peaks came.

``bench/run.py --match`` adds the rows this reads (``rematc_<bytes>`` and
``rematc_knapsack_<bytes>`` at the measured peak of each PyTorch configuration); run.py
appends :func:`markdown` to each model's table. To redo the table and the plot of a
finished run from its CSV (after changing this file, say):

    python -m bench.summary bench/results/llama.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/summary.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import configs

MiB = 2**20
INT_COLUMNS = {"batch", "threads", "peak_bytes", "rss_peak_bytes", "budget_bytes",
               "unconstrained_peak_bytes", "predicted_peak_bytes", "graphs", "recomputed",
               "saved", "min_feasible_bytes", "undonated_bytes"}
TEXT_COLUMNS = {"model", "config", "family", "error", "matches", "solver", "status"}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a results CSV, typed as ``bench/run.py`` wrote them."""
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            row: dict[str, Any] = {}
            for k, v in raw.items():
                if k == "ok":
                    row[k] = v == "True"
                elif k in TEXT_COLUMNS:
                    row[k] = v
                elif v == "":
                    row[k] = None
                else:
                    row[k] = int(float(v)) if k in INT_COLUMNS else float(v)
            rows.append(row)
    return rows


def _at(rows: Sequence[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["config"] == name), None)


def _cells(row: dict[str, Any] | None) -> str:
    """Two table cells: the measured peak and the step ratio, or why there are none."""
    if row is None:
        return "not run | |"
    if not row.get("ok"):
        least = row.get("min_feasible_bytes")
        if least is not None:  # an infeasible budget: the worker recorded the smallest feasible
            return f"infeasible (least predicted {least / MiB:.2f} MiB) | |"
        return "no plan | |"
    return f"{row['peak_bytes'] / MiB:.1f} | {_ratio(row)} |"


def _ratio(row: dict[str, Any]) -> str:
    """The step as a ratio to ``compile_default``'s; empty when the run had none (as in the main table)."""
    vs = row.get("vs_compile")
    return "" if vs is None else f"{vs:.2f}×"


def equal_memory(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: each PyTorch configuration, and rematc (CP-SAT, knapsack) at its peak."""
    lines = []
    for r in rows:
        if not r.get("ok") or r.get("family") not in configs.PYTORCH_FAMILIES:
            continue
        peak = int(r["peak_bytes"])
        ours, knap = _at(rows, f"rematc_{peak}"), _at(rows, f"rematc_knapsack_{peak}")
        lines.append(f"| {r['config']} | {peak / MiB:.1f} | {_ratio(r)} | {_cells(ours)} {_cells(knap)}")
    return lines


def prediction(rows: Sequence[dict[str, Any]]) -> str:
    """Measured over predicted peak, over rematc's rows with a prediction."""
    ratios = [r["peak_bytes"] / r["predicted_peak_bytes"] for r in rows
              if r.get("ok") and r.get("predicted_peak_bytes")]
    if not ratios:
        return ""
    over = [r for r in rows if r.get("ok") and r.get("budget_bytes") and r["peak_bytes"] > r["budget_bytes"]]
    return (f"rematc's predicted peak against the measured one: measured / predicted "
            f"{min(ratios):.2f} to {max(ratios):.2f} (median {statistics.median(ratios):.2f}) over "
            f"{len(ratios)} rows; measured above the budget in {len(over)} of them"
            + (": " + ", ".join(f"`{r['config']}` by {100 * (r['peak_bytes'] / r['budget_bytes'] - 1):.1f}%"
                               for r in over) if over else "") + ".")


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The section run.py appends to a model's table (empty without ``--match`` rows)."""
    lines = equal_memory(rows)
    text = prediction(rows)
    if not lines and not text:
        return ""
    out = []
    if lines:
        out += ["", "## At equal memory", "",
                "Each PyTorch configuration, and rematc with its budget set to that configuration's "
                "measured peak (CP-SAT, and PyTorch's knapsack objective on rematc's model):", "",
                "| PyTorch configuration | peak MiB | step vs compile | rematc peak MiB | step vs compile "
                "| rematc knapsack peak MiB | step vs compile |",
                "|---|---:|---:|---:|---:|---:|---:|", *lines]
    if text:
        out += ["", text]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from bench import run

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path, help="a <model>.csv written by bench/run.py")
    p.add_argument("--machine", type=Path, default=None,
                   help="the run's machine JSON (default: machine-<model>.json beside the CSV)")
    a = p.parse_args(argv)
    rows = read_rows(a.csv)
    model = a.csv.stem
    machine = a.machine or a.csv.with_name(f"machine-{model}.json")
    settings = json.loads(machine.read_text()).get("settings", {}) if machine.exists() else {}
    args = run.parse_args([])
    for k, v in settings.items():
        if hasattr(args, k) and k not in ("models", "configs", "out"):
            setattr(args, k, v)
    finished = run.finish(rows)
    (a.csv.parent / f"{model}.md").write_text(run.markdown(model, finished, args) + markdown(finished))
    run.plot(model, finished, a.csv.parent / f"{model}-pareto.png")
    print((a.csv.parent / f"{model}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
