"""Where a configuration's added step time goes: each op's self time, beside a reference.

Each configuration runs in a fresh ``bench/worker.py`` process (``--mode ops``: the warm-up
and timed steps of ``bench.run``, then one step under the torch profiler), and the table
lists the ops whose self time differs most from the first configuration's, with their
calls, then the step's median and rematc's predicted added time. That sets what a plan's
recomputations cost, op by op, beside what the device model charged for them. Processes
differ by a few percent (an op both configurations run equally often shows how much);
the ops whose calls change show what the plan added.

Inductor's generated kernels are not ops: their time is the generated module's call
(``## Call CompiledFxGraph ##``), and a recomputation fused into a kernel shows there.

    python -m bench.ops --model gpt2_sdpa --configs rematc_none rematc_421067976 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import models
from bench.run import add_worker_options, check_configs, machine_info, run_worker

TOP = 12  # ops listed


def table(rows: Sequence[dict[str, Any]], top: int = TOP) -> str:
    """Markdown: the ``top`` ops by their largest change against the first row, each cell
    seconds (calls) and the change; then the step's median and the predicted added time."""
    ok = [r for r in rows if r.get("ok")]
    if not ok:
        return "no configuration ran\n"
    ref = ok[0]["ops"]
    names = sorted({name for r in ok for name in r["ops"]})

    def change(name: str) -> float:
        base = ref.get(name, [0.0, 0])[0]
        return max(abs(r["ops"].get(name, [0.0, 0])[0] - base) for r in ok)

    shown = sorted(names, key=lambda n: (-change(n), n))[:top]
    head = "| op | " + " | ".join(r["config"] for r in ok) + " |"
    lines = [head, "|---|" + "---:|" * len(ok)]
    for name in shown:
        base = ref.get(name, [0.0, 0])[0]
        cells = []
        for i, r in enumerate(ok):
            seconds, calls = r["ops"].get(name, [0.0, 0])
            delta = "" if i == 0 else f" {seconds - base:+.3f}"
            cells.append(f"{seconds:.3f} ({calls}){delta}")
        lines.append(f"| `{name[:60]}` | " + " | ".join(cells) + " |")
    total = [sum(s for s, _ in r["ops"].values()) for r in ok]
    lines.append("| all ops, self | " + " | ".join(
        f"{t:.3f}" + ("" if i == 0 else f" {t - total[0]:+.3f}") for i, t in enumerate(total)) + " |")
    lines.append("| step (median) | " + " | ".join(
        f"{r['step_s']:.3f}" + ("" if i == 0 else f" {r['step_s'] - ok[0]['step_s']:+.3f}")
        for i, r in enumerate(ok)) + " |")
    lines.append("| rematc predicted added | " + " | ".join(
        f"{r['predicted_added_s']:.3f}" if "predicted_added_s" in r else "" for r in ok) + " |")
    failed = [f"{r['config']}: {r.get('error', '')}" for r in rows if not r.get("ok")]
    return "\n".join(lines) + "\n" + "".join(f"\nfailed: {f}" for f in failed) + ("\n" if failed else "")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(models.MODELS))
    p.add_argument("--configs", nargs="+", required=True, help="the first is the reference")
    p.add_argument("--top", type=int, default=TOP)
    p.add_argument("--out", default=None, help="folder for <model>-ops.md, <model>-ops.json and the machine")
    add_worker_options(p)
    args = p.parse_args(argv)
    check_configs(p, args.configs)
    rows = []
    for name in args.configs:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(run_worker(args.model, name, args, mode="ops"))
    text = table(rows, args.top)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.model}-ops.md").write_text(f"# {args.model}: self time by op\n\n{text}")
        (out / f"{args.model}-ops.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
        info = machine_info(argv, module="bench.ops")
        (out / f"machine-{args.model}-ops.json").write_text(json.dumps(info, indent=2) + "\n")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
