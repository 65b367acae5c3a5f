"""Benchmark configurations side by side in alternating processes: is a point dominated?

A row of ``bench.run`` is one process, and on this kind of machine a step's median moves by
a few percent from one process to the next. Two points a few percent apart in one run's
table (say ``rematc_80%`` and ``amb_0.5``) cannot say which is faster. This runs each
listed configuration once per round in a fresh process (``bench/worker.py``, the same
measurement as ``bench.run``), the order rotated every round so none always runs first, and
reports per configuration:

* the peak (deterministic; the largest of the rounds is shown);
* each round's step median, and the step as a ratio to the first configuration's step **of
  the same round** (paired, so a slow round slows both), with the median of those ratios;
* which other configurations dominate it: lower or equal peak and a lower median ratio, and
  whether that holds *clearly*: in every round the other was faster.

    python -m bench.ab --model unet --configs compile_default amb_0.5 rematc_80% --rounds 3
    python -m bench.ab --model gpt_tiny --configs eager rematc_90% --small --rematc-compiler eager

Prints a Markdown table; ``--out DIR`` also writes ``<model>-ab.md``, ``<model>-ab.csv``
(every process's row, with its round) and ``machine-<model>-ab.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/ab.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import models, run

MiB = 2**20


@dataclass(frozen=True)
class Point:
    """One configuration over the rounds."""

    config: str
    peak: int  # bytes, the largest over the rounds
    steps: tuple[float, ...]  # seconds, each round's median step
    ratios: tuple[float, ...]  # each round's step / the first configuration's in that round
    rounds: tuple[int, ...]  # the rounds those are from (a failed process leaves its round out)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def by_round(self) -> dict[int, float]:
        return dict(zip(self.rounds, self.ratios, strict=True))


def order(config_names: Sequence[str], round_index: int) -> list[str]:
    """The configurations in round ``round_index``: the list rotated by the round."""
    k = round_index % len(config_names)
    return [*config_names[k:], *config_names[:k]]


def points(rows: Sequence[dict[str, Any]], config_names: Sequence[str]) -> list[Point]:
    """Per configuration, its rounds paired with the first configuration's.

    A round where either process failed is left out of that configuration's pairing.
    """
    base = config_names[0]
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r.get("ok"):
            by_round.setdefault(int(r["round"]), {})[r["config"]] = r
    out = []
    for name in config_names:
        paired = [(i, rnd[name], rnd[base]) for i, rnd in sorted(by_round.items()) if name in rnd and base in rnd]
        if not paired:
            continue
        out.append(Point(config=name, peak=max(int(r["peak_bytes"]) for _, r, _ in paired),
                         steps=tuple(float(r["step_s"]) for _, r, _ in paired),
                         ratios=tuple(float(r["step_s"]) / float(b["step_s"]) for _, r, b in paired),
                         rounds=tuple(i for i, _, _ in paired)))
    return out


def dominates(a: Point, b: Point) -> bool:
    """``a`` at no more memory than ``b`` and faster by the median of the paired ratios."""
    return a.peak <= b.peak and a.ratio < b.ratio


def clearly_dominates(a: Point, b: Point) -> bool:
    """``a`` dominates ``b`` and was the faster of the two in every round both ran."""
    ra, rb = a.by_round(), b.by_round()
    shared = ra.keys() & rb.keys()
    return dominates(a, b) and bool(shared) and all(ra[i] < rb[i] for i in shared)


def markdown(model: str, pts: Sequence[Point], args: argparse.Namespace, argv: Sequence[str]) -> str:
    base = args.configs[0]
    lines = [
        f"# {model}: configurations in alternating processes", "",
        f"{models.MODELS[model].note}. {args.rounds} rounds, each configuration once per round in a "
        f"fresh process (order rotated per round), step = median of {args.steps} steps after "
        f"{args.warmup} warm-up, {args.threads or 'default'} torch thread(s); ratio to `{base}` "
        f"of the same round. Dominated by: lower or equal peak and a lower median ratio "
        f"(**bold**: faster in every round). Command: `python -m bench.ab "
        f"{' '.join(run.portable(argv))}`.", "",
        "| config | peak MiB | steps per round, s | ratio per round | median ratio | dominated by |",
        "|---|---:|---|---|---:|---|",
    ]
    for p in pts:
        by = [f"**{q.config}**" if clearly_dominates(q, p) else q.config
              for q in pts if q is not p and dominates(q, p)]
        lines.append(f"| {p.config} | {p.peak / MiB:.1f} | {' / '.join(f'{s:.3f}' for s in p.steps)} "
                     f"| {' / '.join(f'{r:.3f}' for r in p.ratios)} | {p.ratio:.3f}× | {', '.join(by) or '-'} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="unet", choices=sorted(models.MODELS))
    p.add_argument("--configs", nargs="+", required=True,
                   help="configuration names (bench/configs.py); ratios are to the first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the tables and machine facts here")
    run.add_worker_options(p)
    args = p.parse_args(argv)
    if len(args.configs) < 2 or len(set(args.configs)) != len(args.configs):
        p.error("--configs: two or more distinct configurations")
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    run.check_configs(p, args.configs)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    for i in range(args.rounds):
        for name in order(args.configs, i):
            row = {**run.run_worker(args.model, name, args), "round": i}
            rows.append(row)
            print(f"  round {i} {name:<28} {run.row_line(row)}", file=sys.stderr, flush=True)
    pts = points(rows, args.configs)
    table = markdown(args.model, pts, args, argv)
    failed = [f"* round {r['round']} `{r['config']}`: {r.get('error')}" for r in rows if not r.get("ok")]
    if failed:
        table += "\nFailed (their rounds left out of the pairing):\n\n" + "\n".join(failed) + "\n"
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.model}-ab.md").write_text(table)
        run.write_csv(out / f"{args.model}-ab.csv", rows, ("round", *run.COLUMNS))
        info = run.machine_info(argv, module="bench.ab")
        info["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
        (out / f"machine-{args.model}-ab.json").write_text(json.dumps(info, indent=2) + "\n")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
