"""Budgets on a GPU: measured peak against rematc's prediction and the budget, and step time
against the default compile and per-block checkpointing, in one process per model.

    python -m bench.gpu_check OUT --model gpt_test|gpt_dropout|gpt2_sdpa|llama_offload|llama_stack
        [--small --device cpu]

For ``gpt_test`` (the GPU tests' GPT) and ``gpt2_sdpa`` the rows are: the default compile,
per-block checkpointing, rematc at three fractions of its everything-saved peak, and rematc
at checkpointing's measured peak. ``llama_offload`` is a Llama-2-7B-shaped stack of two
layers at sequence 4096 in bf16, planned halfway between the default compile's measured
peak and checkpointing's, with offload allowed and without. ``llama_stack`` is eight such
layers (``--batch``), planned at checkpointing's measured peak and at 0.95 and 0.8 of it,
with offload allowed and without (``--only`` picks rows); its
note holds the host link's measured bandwidth (the device profile assumes 50 GB/s each
way), and each rematc row the added time its plan was predicted to cost.
``gpt_dropout`` is the test GPT with dropout, planned with eager's generator (as the GPU
tests compare gradients) and with Inductor's. A rematc row measured more than 2% off its
prediction is followed by what each side holds at its peak, and a row rematc warned about
(a walk of the generated code that failed, say) by the warnings.
Peaks are ``torch.cuda.max_memory_allocated`` above the pre-step live set (gradients set to
None before each step); step times are medians of rounds that alternate the
configurations. Each model appends its rows to ``OUT/gpu.csv`` and writes
``OUT/<model>.md``. ``--small --device cpu`` runs the same code on toy sizes (a dry run).
"""

from __future__ import annotations

import argparse
import csv
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rematc
from bench import configs, models
from rematc import llama
from rematc.memory import measure_peak
from rematc.models import GPTConfig, make_gpt
from solvers import Decision

COLUMNS = ("model", "config", "budget_bytes", "predicted_bytes", "generated_bytes", "measured_bytes",
           "measured_vs_predicted", "measured_vs_budget", "within_budget", "step_ms", "vs_compile",
           "vs_ckpt", "recomputed", "offloaded", "offloaded_bytes", "predicted_added_ms", "added_ms",
           "squeezed_bytes", "undonated_bytes", "generated_at", "diagnosis", "warnings", "error")

# Fractions of rematc's everything-saved peak; each binds (below the peak of the plan without
# a budget) on both GPT models.
FRACTIONS = {"gpt_test": (0.36, 0.30, 0.25), "gpt2_sdpa": (0.45, 0.35, 0.28)}


@dataclass
class Row:
    name: str
    step: Callable[[], None]
    model: nn.Module
    values: dict[str, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)


def make(name: str, *, small: bool, device: str, batch: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A fresh copy (same seed) of model ``name`` on ``device``."""
    if name in ("gpt_test", "gpt_dropout"):
        config = GPTConfig.tiny() if small else GPTConfig(n_layer=4, d_model=256, n_head=4, seq_len=256,
                                                          vocab=2048)
        if name == "gpt_dropout":
            config = replace(config, dropout=0.1)
        model, inputs = make_gpt(config, batch=2 if small else 8, seed=0)
    elif name == "gpt2_sdpa":
        model, inputs = models.make("gpt2_sdpa", small=small)
    elif name in ("llama_offload", "llama_stack"):
        shape = "tiny" if small else "llama2-7b"
        torch.manual_seed(0)
        layers = 2 if name == "llama_offload" else 8
        model, inputs = llama.make_llama(shape, device="cpu" if small else device, n_layer=layers,
                                        **({"batch": batch} if batch else {}))
        if not small:
            model = model.to(torch.bfloat16)
    else:
        raise ValueError(f"unknown model {name!r}")
    inputs = models.to_device(model, inputs, device)
    model.train()
    return model, inputs


def stepper(fn: Callable[..., torch.Tensor], model: nn.Module, inputs: tuple[torch.Tensor, ...],
            device: str) -> Callable[[], None]:
    def step() -> None:
        fn(*inputs).backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return step


def build(model_name: str, config: str, budget: Any, *, small: bool, device: str, batch: int | None = None,
          time_limit: float, host_bandwidth: float | None = None) -> Row:
    """Compile one configuration, run it twice and measure its peak."""
    model, inputs = make(model_name, small=small, device=device, batch=batch)
    before = len(rematc.records())
    if budget is None:
        fn = configs.build(config, model).fn
    else:
        fn = rematc.compile(model, budget=budget, time_limit=time_limit, cache_dir=None,
                            host_bandwidth=host_bandwidth)
    row = Row(config, stepper(fn, model, inputs, device), model)
    t0 = time.perf_counter()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        row.step()
    row.values["compile_s"] = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    gc.collect()
    row.values["measured_bytes"] = measure_peak(row.step, device=device)
    model.zero_grad(set_to_none=True)
    made = rematc.records()[before:]
    if made:
        first, last = made[0], made[-1]
        held = last.held_before
        row.values.update(
            budget_bytes=None if first.budget is None else first.budget + held,
            predicted_bytes=last.predicted_peak + held,
            generated_bytes=None if last.generated_peak is None else last.generated_peak + held,
            recomputed=len(last.plan.of(Decision.RECOMPUTE)),
            offloaded=len(last.plan.of(Decision.OFFLOAD)),
            offloaded_bytes=sum(last.problem.nodes[v].size for v in last.plan.of(Decision.OFFLOAD)),
            predicted_added_ms=1e3 * sum(r.added_time for r in {r.graph: r for r in made}.values()),
            squeezed_bytes=last.squeezed, undonated_bytes=last.undonated,
            generated_at=last.generated_at[:200])
        measured = row.values["measured_bytes"]
        if abs(measured / max(1, last.predicted_peak + held) - 1) > MISMATCH:
            row.values["diagnosis"] = diagnose(last)
    return row


# Measured against predicted beyond this: the row's Markdown names what each side holds.
MISMATCH = 0.02


def diagnose(record: rematc.PartitionRecord) -> str:
    """The largest values alive at the plan's peak step (the model's side) and the largest
    buffers alive at the generated code's peak, for a mismatch."""
    from bench.replay import model_peak

    step, alive = model_peak(record.problem, record.plan)
    model = ", ".join(f"{n} {b / 2**20:.2f}" for n, b in alive[:16])
    code = ", ".join(f"{n} {b / 2**20:.2f}" for n, b in record.generated_alive[:16])
    return (f"model's peak at step {step} ({record.problem.nodes[step].name}): {model}; "
            f"generated peak at {record.generated_at[:120]}: {code} (MiB)")


def time_rows(rows: list[Row], *, rounds: int, steps: int) -> None:
    """Alternate the rows, ``steps`` steps each per round; median step time per row."""
    for _ in range(rounds):
        for row in rows:
            for _ in range(steps):
                row.model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                row.step()
                row.times.append(time.perf_counter() - t0)
    for row in rows:
        row.values["step_ms"] = 1e3 * statistics.median(row.times)


def finish(rows: list[Row], model_name: str) -> list[dict[str, Any]]:
    by_name = {r.name: r.values for r in rows}
    out = []
    for row in rows:
        v = {"model": model_name, "config": row.name, **row.values}
        measured, predicted, budget = v.get("measured_bytes"), v.get("predicted_bytes"), v.get("budget_bytes")
        if measured is not None and predicted:
            v["measured_vs_predicted"] = round(measured / predicted, 4)
        if measured is not None and budget:
            v["measured_vs_budget"] = round(measured / budget, 4)
            v["within_budget"] = measured <= budget
        for base, column in (("compile_default", "vs_compile"), ("ckpt_every", "vs_ckpt")):
            if "step_ms" in v and "step_ms" in by_name.get(base, {}):
                v[column] = round(v["step_ms"] / by_name[base]["step_ms"], 3)
        if "step_ms" in v and "step_ms" in by_name.get("compile_default", {}):
            v["added_ms"] = round(v["step_ms"] - by_name["compile_default"]["step_ms"], 3)
        out.append(v)
    return out


def write(out_dir: Path, model_name: str, table: list[dict[str, Any]], note: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(table)
    mib = 2**20

    def b(x: Any) -> str:
        return "" if x is None else f"{x / mib:.1f}"

    def ms(x: Any) -> str:
        return "" if x is None else f"{x:.2f}"

    header = ("config", "budget MiB", "predicted MiB", "generated MiB", "measured MiB", "measured / predicted",
              "measured / budget", "step ms", "vs compile", "vs ckpt", "added ms", "predicted added ms",
              "recomputed", "offloaded", "offloaded MiB", "squeezed MiB")
    lines = [f"# {model_name}", "", note, "", "| " + " | ".join(header) + " |",
             "|---|" + "---:|" * (len(header) - 1)]
    for v in table:
        if v.get("error"):  # the error in the second column, the rest left empty
            error = " ".join(str(v["error"]).split()).replace("|", "/")
            lines.append(f"| {v['config']} | error: {error} |" + "|" * (len(header) - 2))
            continue
        lines.append(
            f"| {v['config']} | {b(v.get('budget_bytes'))} | {b(v.get('predicted_bytes'))} | "
            f"{b(v.get('generated_bytes'))} | {b(v.get('measured_bytes'))} | "
            f"{v.get('measured_vs_predicted', '')} | {v.get('measured_vs_budget', '')} | "
            f"{v.get('step_ms', float('nan')):.2f} | {v.get('vs_compile', '')} | {v.get('vs_ckpt', '')} | "
            f"{ms(v.get('added_ms'))} | {ms(v.get('predicted_added_ms'))} | "
            f"{v.get('recomputed', '')} | {v.get('offloaded', '')} | {b(v.get('offloaded_bytes'))} | "
            f"{b(v.get('squeezed_bytes'))} |")
    for v in table:
        if v.get("diagnosis"):
            lines += ["", f"{v['config']}: {v['diagnosis']}"]
        if v.get("warnings"):
            lines += ["", f"{v['config']} warned: {' '.join(str(v['warnings']).split())}"]
    (out_dir / f"{model_name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def host_link(device: str, size: int = 2**30, repeats: int = 5) -> str:
    """GB/s of copies between ``device`` and pinned host memory: each way alone, and both
    at once on two streams (the median of ``repeats``); what the device profile's
    ``host_bandwidth`` stands for."""
    if not device.startswith("cuda"):
        return "(no host link on the CPU)"
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    back = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    out_stream, in_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return size / statistics.median(times) / 1e9

    def both() -> None:
        with torch.cuda.stream(out_stream):
            host.copy_(src, non_blocking=True)
        with torch.cuda.stream(in_stream):
            dst.copy_(back, non_blocking=True)

    to_host = timed(lambda: host.copy_(src, non_blocking=True))
    to_device = timed(lambda: dst.copy_(back, non_blocking=True))
    each = timed(both)
    return f"{to_host:.1f} GB/s to host, {to_device:.1f} GB/s to the device, {each:.1f} GB/s each way at once"


def plans(model_name: str, args: argparse.Namespace) -> list[tuple[str, Any, float | None]]:
    """(config, rematc budget or None for a PyTorch configuration, host bandwidth)."""
    if model_name == "llama_stack":  # "ckpt*f": f times checkpointing's measured peak
        return [("compile_default", None, None), ("ckpt_every", None, None),
                ("rematc_at_ckpt_recompute", "ckpt", 0.0), ("rematc_at_ckpt_offload", "ckpt", None),
                ("rematc_95%_ckpt_recompute", "ckpt*0.95", 0.0), ("rematc_95%_ckpt_offload", "ckpt*0.95", None),
                ("rematc_80%_ckpt_recompute", "ckpt*0.8", 0.0), ("rematc_80%_ckpt_offload", "ckpt*0.8", None)]
    if model_name == "llama_offload":
        # Halfway between checkpointing's measured peak and the default compile's.
        return [("compile_default", None, None), ("ckpt_every", None, None),
                ("rematc_mid_recompute", "mid", 0.0), ("rematc_mid_offload", "mid", None)]
    if model_name == "gpt_dropout":  # the GPU tests' model: eager's generator, and Inductor's
        return [("rematc_30%_eager_rng", 0.3, 0.0), ("rematc_30%", 0.3, 0.0),
                ("compile_default", None, None)]
    return [*((f"rematc_{f:.0%}", f, 0.0) for f in FRACTIONS[model_name]),
            ("ckpt_every", None, None), ("rematc_at_ckpt", "ckpt", 0.0),
            ("compile_default", None, None)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", required=True,
                        choices=("gpt_test", "gpt_dropout", "gpt2_sdpa", "llama_offload", "llama_stack"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="toy sizes (a dry run on the CPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds per plan")
    parser.add_argument("--batch", type=int, help="the Llama stacks' batch (their shape's by default)")
    parser.add_argument("--only", nargs="+", metavar="CONFIG", help="these configurations alone")
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds: skip rows after this")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
    t0 = time.perf_counter()
    rows: list[Row] = []
    errors: list[dict[str, Any]] = []
    for config, budget, bandwidth in plans(args.model, args):
        if args.only and config not in args.only:
            continue
        if time.perf_counter() - t0 > args.deadline:
            errors.append({"model": args.model, "config": config, "error": "skipped: deadline"})
            continue
        measured = {r.name: r.values["measured_bytes"] for r in rows}
        if isinstance(budget, str) and budget.startswith("ckpt"):
            if "ckpt_every" not in measured:
                continue
            budget = int(measured["ckpt_every"] * float(budget.partition("*")[2] or 1))
        elif budget == "mid":
            if "ckpt_every" not in measured or "compile_default" not in measured:
                continue
            budget = (measured["ckpt_every"] + measured["compile_default"]) // 2
        try:
            eager_rng = torch._inductor.config.patch(fallback_random=config.endswith("eager_rng"))
            with warnings.catch_warnings(record=True) as caught, eager_rng:
                warnings.simplefilter("always")
                row = build(args.model, config, budget, small=args.small, device=args.device, batch=args.batch,
                            time_limit=args.time_limit, host_bandwidth=bandwidth)
            said = {f"{w.category.__name__}: {w.message}" for w in caught if w.category.__module__.startswith("rematc")}
            if said:  # rematc's own warnings (a walk of the generated code that failed, say)
                row.values["warnings"] = " / ".join(sorted(said))[:600]
            rows.append(row)
        except Exception as e:  # one row's failure is a result, not the end of the run
            errors.append({"model": args.model, "config": config, "error": f"{type(e).__name__}: {e}"[:300]})
        print(f"{args.model} {config}: {time.perf_counter() - t0:.0f} s", flush=True)
    time_rows(rows, rounds=args.rounds, steps=args.steps)
    rows.sort(key=lambda r: (not r.name.startswith("compile"), not r.name.startswith("ckpt")))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    link = f"host link measured {host_link(args.device)}, " if args.model == "llama_stack" else ""
    if args.batch:
        link = f"batch {args.batch}, {link}"
    note = (f"{device}, torch {torch.__version__}, {'toy sizes, ' if args.small else ''}{link}peaks above the "
            f"pre-step live set, step times medians of {args.rounds} alternating rounds of "
            f"{args.steps} steps. 'generated' is the peak of the code Inductor generated "
            "(rematc's post-compile check).")
    write(args.out, args.model, finish(rows, args.model) + errors, note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
