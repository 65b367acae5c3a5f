"""Measure one (model, configuration) in this process and print one JSON line.

Started by ``bench/run.py``, one fresh process per configuration (PyTorch's config and
rematc's solver hook are process-wide; Inductor caches are off so every compile runs).

``--mode time`` (default malloc): ``warmup`` steps (the first one compiles; its time less
the median is the compile time), the median of ``steps`` timed steps, then the peak of one
more step by ``rematc.memory.profiler_peak`` on the CPU, or ``rematc.memory.cuda_peak``
(``torch.cuda.max_memory_allocated``) with ``--device cuda``, where every timed step ends
with a synchronize and fp32 matmuls run on TF32 tensor cores, the rate rematc's GPU
profiles assume. ``--mode rss`` (started with
``MALLOC_MMAP_THRESHOLD_=65536``): warm-up, then the peak by ``rematc.memory.rss_peak``, as
a cross-check. ``--mode ops``: as ``time``, then each op's self CPU time in one more
step, profiled (``bench.ops``). In all, ``zero_grad(set_to_none=True)`` runs before each
step, outside the timed or measured region; the weights do not change between steps (no
optimizer: every step computes the same loss).

    python -m bench.worker --model gpt_tiny --config rematc_60% --rematc-compiler eager
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
os.environ.setdefault("REMATC_CACHE_DIR", "off")

if __package__ in (None, ""):  # run as ``python bench/worker.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import rematc
from bench import configs, models
from rematc.memory import measure_peak, rss_peak
from solvers import Decision


def measure(model_name: str, config: str, *, batch: int | None, steps: int, warmup: int,
            mode: str, settings: configs.Settings, small: bool = False,
            device: str = "cpu") -> dict[str, Any]:
    """Everything measured for one configuration (a JSON-able dict)."""
    torch.manual_seed(0)
    model, inputs = models.make(model_name, batch=batch, small=small)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        if mode != "time":
            raise ValueError(f"--mode {mode} measures the CPU; on {device} only --mode time")
        inputs = models.to_device(model, inputs, device)
    model.train()
    built = configs.build(config, model, settings)
    out: dict[str, Any] = {"model": model_name, "config": config, "family": built.family,
                           "budget_arg": built.budget, "mode": mode, "device": device,
                           "batch": int(inputs[0].shape[0]), "threads": torch.get_num_threads(),
                           "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    rematc.clear_records()

    def step() -> torch.Tensor:
        loss = built.fn(*inputs)
        loss.backward()
        if cuda:  # the step's kernels and copies finish inside its time
            torch.cuda.synchronize(device)
        return loss

    times: list[float] = []
    first = math.nan
    for k in range(max(1, warmup) + (steps if mode in ("time", "ops") else 0)):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step()
        elapsed = time.perf_counter() - t0
        if k == 0:
            first = elapsed
        elif k >= max(1, warmup):
            times.append(elapsed)
    model.zero_grad(set_to_none=True)
    gc.collect()
    if mode in ("time", "ops"):
        out["peak_bytes"] = measure_peak(step, device=device)
        median = statistics.median(times) if times else math.nan
        out.update(first_step_s=first, step_s=median, step_min_s=min(times, default=math.nan),
                   step_times_s=times, compile_s=first - median)
    else:
        out["rss_peak_bytes"] = rss_peak(step)
    if mode == "ops":
        model.zero_grad(set_to_none=True)
        out["ops"] = op_times(step)
    out["loss"] = float(built.fn(*inputs).detach())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    out["grad_norm"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else math.nan
    out.update(rematc_summary())
    return out


def op_times(step: Callable[[], object]) -> dict[str, list[float]]:
    """Each op's self CPU time in one profiled step, in seconds, and its calls: ``{name:
    [seconds, calls]}``. Inductor's generated kernels have no op of their own; their time
    is the self time of the generated module's call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return {e.key: [e.self_cpu_time_total / 1e6, e.count] for e in prof.key_averages() if e.self_cpu_time_total > 0}


def rematc_summary() -> dict[str, Any]:
    """rematc's plans in this process: predicted peak and overhead, solve time, solver."""
    recs = rematc.records()
    if not recs:
        return {}
    total_time = sum(n.time for r in recs for n in r.problem.nodes)
    total_flops = sum(n.flops for r in recs for n in r.problem.nodes)
    return {
        "graphs": len(recs),
        # Graphs of one step share the budget (docs/reliability.md, "Graph breaks"); with one
        # graph these are that graph's figures.
        "budget_bytes": recs[-1].budget if recs[-1].budget is None else recs[-1].budget + recs[-1].held_before,
        "unconstrained_peak_bytes": max(r.unconstrained_peak + r.held_before for r in recs),
        "predicted_peak_bytes": max(r.predicted_peak + r.held_before for r in recs),
        "predicted_added_s": sum(r.added_time for r in recs),
        "predicted_overhead": sum(r.added_time for r in recs) / total_time if total_time else math.nan,
        "added_flops_frac": sum(r.added_flops for r in recs) / total_flops if total_flops else math.nan,
        "solve_s": sum(r.solve_time for r in recs),
        "partition_s": sum(r.partition_time for r in recs),
        "solver": "+".join(sorted({r.solver for r in recs})),
        "status": "+".join(sorted({r.status for r in recs})),
        "recomputed": sum(len(r.recomputed) for r in recs),
        "offloaded": sum(len(r.plan.of(Decision.OFFLOAD)) for r in recs if r.plan is not None),
        "saved": sum(len(r.saved) for r in recs),
        # Saved values the plans let a backward kernel write over that were not donated:
        # the measured peak may exceed the prediction by this much (rematc.donation).
        "undonated_bytes": sum(r.undonated for r in recs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(models.MODELS))
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, default=None, help="default: the model's benchmark batch")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mode", choices=("time", "rss", "ops"), default="time")
    p.add_argument("--small", action="store_true", help="toy sizes of the model (tests)")
    p.add_argument("--rematc-compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (peak by max_memory_allocated)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    settings = configs.Settings(rematc_compiler=a.rematc_compiler, time_limit=a.time_limit,
                                workers=a.workers)
    try:
        result = measure(a.model, a.config, batch=a.batch, steps=a.steps, warmup=a.warmup,
                         mode=a.mode, settings=settings, small=a.small, device=a.device)
        result["ok"] = True
    except Exception as e:  # one failed configuration is a row, not the end of the run
        # Dynamo wraps backend errors (BackendCompilerFailed); report the backend's own.
        cause = getattr(e, "inner_exception", None) or e.__cause__ or e
        lines = str(cause).strip().splitlines()
        result = {"model": a.model, "config": a.config, "mode": a.mode, "ok": False,
                  "error": f"{type(cause).__name__}: {lines[0] if lines else ''}"[:300]}
        if isinstance(cause, rematc.InfeasibleBudgetError):
            result["min_feasible_bytes"] = cause.min_feasible
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
