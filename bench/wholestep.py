"""The whole training step on the CPU, predicted against measured.

For the test GPT and two benchmark models (Llama, ResNet-18) at three batch sizes, in
fp32 and under bf16 autocast, one process per configuration runs forward, backward,
``optimizer.step()`` (AdamW) and ``zero_grad()`` of the model compiled by rematc (eager
route, budget 60% of its unconstrained peak), and reports:

* predicted: :func:`rematc.wholestep.breakdown` of the model's inventory, with the
  activations rematc predicted for the plan that ran (its record);
* measured: the bytes of every storage the model and optimizer hold before the step,
  plus the profiler's peak of live bytes over the step (``rematc.memory.profiler_peak``);
* the cross-check: the growth of the process's resident set over the same step
  (``rss_peak``, the process started with ``MALLOC_MMAP_THRESHOLD_=65536``) beside the
  profiler's figure.

    python -m bench.wholestep --out docs/fit-validation.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

CASES = [(model, batch) for model, batches in (("gpt", (1, 4, 16)), ("llama", (1, 2, 4)),
                                               ("resnet", (2, 8, 16))) for batch in batches]
PRECISIONS = ("fp32", "bf16-mixed")


def _model(name: str, batch: int) -> Any:
    if name == "gpt":
        from rematc.models import GPTConfig, make_gpt

        return make_gpt(GPTConfig(n_layer=4, d_model=256, n_head=4, seq_len=256, vocab=8192),
                        batch=batch, seed=0)
    from bench.models import make

    return make(name, batch=batch)


def run_one(name: str, batch: int, precision: str) -> dict[str, Any]:
    """One configuration in this process (the worker side)."""
    import torch

    import rematc
    from rematc.memory import profiler_peak, rss_peak
    from rematc.partition import clear_records, records
    from rematc.wholestep import StepSetup, breakdown, model_states

    torch.manual_seed(0)
    model, inputs = _model(name, batch)
    states = model_states(model)
    compiled = rematc.compile(model, budget="60%", compiler="eager", cache_dir=None)
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = compiled(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()

    clear_records()
    step()
    step()
    graphs = records()
    tensors = [*model.parameters(), *model.buffers(),
               *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    step_peak = profiler_peak(step)
    rss = rss_peak(step)
    activations = sum(r.predicted_peak for r in graphs) if len(graphs) > 1 else graphs[0].predicted_peak
    b = breakdown(states, StepSetup(optimizer="adamw", precision=precision), activations=activations,
                  activations_count_gradients=True)
    return {"model": name, "batch": batch, "precision": precision, "graphs": len(graphs),
            "parameters": states.count, "held": held, "states_predicted": b.states,
            "step_peak": step_peak, "rss_step": rss, "predicted": b.peak, "phase": b.phase,
            "measured": held + step_peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "BATCH", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="write the table (markdown) here too")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args.one[2])))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for name, batch in CASES:
        for precision in PRECISIONS:
            done = subprocess.run([sys.executable, "-m", "bench.wholestep", "--one", name, str(batch), precision],
                                  env=env, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{name} b{batch} {precision}: predicted {r['predicted']:,} measured {r['measured']:,} "
                  f"({r['measured'] / r['predicted']:.4f})", file=sys.stderr)
    lines = ["| model | batch | precision | parameters | peak phase | predicted MiB | measured MiB "
             "| measured / predicted | states held / predicted | RSS growth / profiler peak |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['precision']} | {r['parameters']:,} | {r['phase']} "
            f"| {r['predicted'] / 2**20:,.2f} | {r['measured'] / 2**20:,.2f} "
            f"| {r['measured'] / r['predicted']:.4f} | {r['held'] / r['states_predicted']:.4f} "
            f"| {r['rss_step'] / max(r['step_peak'], 1):.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
