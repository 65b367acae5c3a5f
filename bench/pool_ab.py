"""One rematc plan under three rules for Inductor's buffer pool, in alternating processes.

Under a budget rematc decides which dead buffers Inductor's generated code may hold for a
later allocation of the same size (:mod:`rematc.reuse`). This measures what that rule
costs or saves against the two it replaces, for the same model, budget and plan:

* ``planned``: rematc's rule (the plan's timeline has room, Inductor's estimate agrees);
* ``next``: only the very next kernel takes a freed buffer (rematc's earlier rule);
* ``inductor``: Inductor's own rule (its estimate of the graph's peak).

Each (round, rule) is a fresh process (``--one``), the rules alternating within a round,
one torch thread, measured as ``bench.run`` measures (:func:`bench.worker.measure`,
Inductor's and rematc's caches off): step time is the median of ``--steps`` steps after
two warm-up steps, the peak is ``rematc.memory.profiler_peak`` of one more step. Prints
a Markdown table.

    python -m bench.pool_ab --model unet --budget 80% --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

RULES = ("next", "planned", "inductor")


def measure(model_name: str, budget: str, rule: str, steps: int, batch: int | None,
            small: bool) -> dict[str, Any]:
    """One process's measurement: ``bench.worker``'s, with the pool under ``rule``."""
    import torch
    from torch._inductor.codegen.wrapper import AllocateLine

    import rematc.reuse as reuse
    from bench import configs, worker

    torch.set_num_threads(1)
    inductor_rule = AllocateLine.should_reuse_buffer
    planned = reuse.Rule.allows
    counts = {"held": 0, "refused": 0}

    def allows(self: reuse.Rule, alloc: Any, free_line: Any, size: int) -> bool:
        if reuse.holds_nothing(alloc, free_line):
            return True
        if rule == "planned":
            ok = planned(self, alloc, free_line, size)
        else:
            ok = rule == "inductor" and bool(inductor_rule(alloc, free_line, size))
        counts["held" if ok else "refused"] += 1
        return ok

    reuse.Rule.allows = allows  # type: ignore[method-assign]
    out = worker.measure(model_name, f"rematc_{budget}", batch=batch, steps=steps, warmup=2,
                         mode="time", settings=configs.Settings(), small=small)
    return {"rule": rule, "step": out["step_s"], "peak": out["peak_bytes"],
            "predicted": out["predicted_peak_bytes"], "budget": out["budget_bytes"], **counts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="unet")
    parser.add_argument("--budget", default="80%")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--small", action="store_true", help="the model's toy sizes (a smoke run)")
    parser.add_argument("--one", choices=RULES, help=argparse.SUPPRESS)  # a worker process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.budget, args.one, args.steps, args.batch, args.small)))
        return 0
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "OMP_NUM_THREADS": "1"}
    rows: dict[str, list[dict[str, Any]]] = {r: [] for r in RULES}
    for _ in range(args.rounds):
        for rule in RULES:
            cmd = [sys.executable, "-m", "bench.pool_ab", "--model", args.model, "--budget", args.budget,
                   "--steps", str(args.steps), "--one", rule]
            if args.batch is not None:
                cmd += ["--batch", str(args.batch)]
            if args.small:
                cmd.append("--small")
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            rows[rule].append(json.loads(out.strip().splitlines()[-1]))
            print(f"  {rule:9} step {rows[rule][-1]['step']:.3f} s", file=sys.stderr, flush=True)
    mib = 2**20
    print(f"`{args.model}` at `{args.budget}`, {args.rounds} rounds, median of {args.steps} steps each\n")
    print("| pool rule | buffers held / refused | peak MiB | predicted MiB | steps, s | median |")
    print("|---|---:|---:|---:|---|---:|")
    for rule in RULES:
        rs = rows[rule]
        steps = " / ".join(f"{r['step']:.3f}" for r in rs)
        print(f"| `{rule}` | {rs[0]['held']} / {rs[0]['refused']} | {max(r['peak'] for r in rs) / mib:.1f} "
              f"| {rs[0]['predicted'] / mib:.1f} | {steps} | {statistics.median(r['step'] for r in rs):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
