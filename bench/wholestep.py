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

On a GPU (``--device cuda``) the same steps run on CUDA, AdamW foreach (torch's default
there) and fused, with the eager route and Inductor; measured is the caching allocator's
``max_memory_allocated`` over the step (which counts every live tensor, the model states
included), predicted the breakdown for ``device_type="cuda"`` with no reserve and the
device profile's workspaces.

    python -m bench.wholestep --device cuda --out OUT/wholestep-cuda.md
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
# On CUDA: (model, batch, precision, optimizer, compiler).
CUDA_CASES = [("gpt", 16, "fp32", "adamw", "eager"), ("gpt", 16, "bf16-mixed", "adamw", "eager"),
              ("gpt", 16, "fp32", "adamw-fused", "eager"), ("llama", 4, "bf16-mixed", "adamw", "eager"),
              ("gpt", 16, "bf16-mixed", "adamw", "inductor")]


def _model(name: str, batch: int) -> Any:
    if name == "gpt":
        from rematc.models import GPTConfig, make_gpt

        return make_gpt(GPTConfig(n_layer=4, d_model=256, n_head=4, seq_len=256, vocab=8192),
                        batch=batch, seed=0)
    from bench.models import make

    return make(name, batch=batch)


def _optimizer(name: str, params: Any) -> Any:
    import torch

    if name == "adamw-fused":
        return torch.optim.AdamW(params, fused=True)
    assert name == "adamw", name
    return torch.optim.AdamW(params)


def run_one(name: str, batch: int, precision: str, *, device: str = "cpu", optimizer: str = "adamw",
            compiler: str = "eager") -> dict[str, Any]:
    """One configuration in this process (the worker side)."""
    import torch

    import rematc
    from rematc.memory import profiler_peak, rss_peak
    from rematc.partition import clear_records, records
    from rematc.wholestep import StepSetup, breakdown, model_states

    torch.manual_seed(0)
    model, inputs = _model(name, batch)
    model, inputs = model.to(device), tuple(t.to(device) for t in inputs)
    states = model_states(model)
    inputs_held = sum(t.untyped_storage().nbytes() for t in inputs) if device == "cuda" else 0
    compiled = rematc.compile(model, budget="60%", compiler=compiler, cache_dir=None)
    opt = _optimizer(optimizer, model.parameters())

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = compiled(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()

    clear_records()
    step()
    step()
    graphs = records()
    activations = sum(r.predicted_peak for r in graphs) if len(graphs) > 1 else graphs[0].predicted_peak
    workspace = 0
    if device == "cuda":
        from rematc.devices import profile_for

        workspace = profile_for(None, device_type="cuda", device_name=torch.cuda.get_device_name()).workspace
    b = breakdown(states, StepSetup(optimizer=optimizer, precision=precision, device_type=device,
                                    workspace=workspace),
                  activations=activations, activations_count_gradients=True)
    row = {"model": name, "batch": batch, "precision": precision, "optimizer": optimizer,
           "compiler": compiler, "graphs": len(graphs), "parameters": states.count,
           "states_predicted": b.states, "predicted": b.peak, "phase": b.phase,
           "predicted_activations": activations}
    if device == "cuda":
        torch.cuda.synchronize()
        row["held"] = torch.cuda.memory_allocated()
        # What persists beyond the model states and the inputs: the math libraries'
        # workspaces, which the first step allocates (predicted: b.workspace).
        row["held_beyond_states"] = row["held"] - b.states - inputs_held
        row["workspace_predicted"] = b.workspace
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        row["measured"] = torch.cuda.max_memory_allocated()
        row["reserved"] = torch.cuda.max_memory_reserved()
        return row
    tensors = [*model.parameters(), *model.buffers(),
               *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    step_peak = profiler_peak(step)
    rss = rss_peak(step)
    return {**row, "held": held, "step_peak": step_peak, "rss_step": rss, "measured": held + step_peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", nargs=5, metavar=("MODEL", "BATCH", "PRECISION", "OPTIMIZER", "COMPILER"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cases", help="on CUDA, indices into CUDA_CASES to run (comma-separated; all by default)")
    parser.add_argument("--out", help="write the table (markdown) here too")
    args = parser.parse_args()
    if args.one:
        name, batch, precision, optimizer, compiler = args.one
        print(json.dumps(run_one(name, int(batch), precision, device=args.device, optimizer=optimizer,
                                 compiler=compiler)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    chosen = CUDA_CASES if args.cases is None else [CUDA_CASES[int(i)] for i in args.cases.split(",")]
    cases = (chosen if args.device == "cuda" else
             [(name, batch, precision, "adamw", "eager") for name, batch in CASES for precision in PRECISIONS])
    rows = []
    for case in cases:
        done = subprocess.run([sys.executable, "-m", "bench.wholestep", "--device", args.device,
                               "--one", *map(str, case)], env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"{case}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(json.dumps(r))
        print(f"{case}: predicted {r['predicted']:,} measured {r['measured']:,} "
              f"({r['measured'] / r['predicted']:.4f})", file=sys.stderr)
    if args.device == "cuda":
        lines = ["| model | batch | precision | optimizer | compiler | parameters | peak phase | predicted MiB "
                 "| of which activations MiB | measured MiB | measured / predicted | reserved MiB "
                 "| held beyond states and inputs MiB |",
                 "|---|---:|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['precision']} | {r['optimizer']} | {r['compiler']} "
                  f"| {r['parameters']:,} | {r['phase']} | {r['predicted'] / 2**20:,.2f} "
                  f"| {r['predicted_activations'] / 2**20:,.2f} | {r['measured'] / 2**20:,.2f} "
                  f"| {r['measured'] / r['predicted']:.4f} | {r['reserved'] / 2**20:,.2f} "
                  f"| {r['held_beyond_states'] / 2**20:,.2f} |" for r in rows]
    else:
        lines = ["| model | batch | precision | parameters | peak phase | predicted MiB | measured MiB "
                 "| measured / predicted | states held / predicted | RSS growth / profiler peak |",
                 "|---|---:|---|---:|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['precision']} | {r['parameters']:,} | {r['phase']} "
                  f"| {r['predicted'] / 2**20:,.2f} | {r['measured'] / 2**20:,.2f} "
                  f"| {r['measured'] / r['predicted']:.4f} | {r['held'] / r['states_predicted']:.4f} "
                  f"| {r['rss_step'] / max(r['step_peak'], 1):.3f} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
