"""Plans for the models people train, beside checkpointing at the same peak.

Llama-2-7B (32 layers), Llama-2-70B (80) and Llama-3-405B (126) shapes from
``rematc/llama.py``, traced on ``meta`` tensors (nothing is allocated) in bf16 under the
H100 profile, with flash attention, batch 1 at sequence 4096 (and 128K for the 405B).
The weight gradients are taken as accumulated in place into ``.grad`` buffers that exist
before the step (as the weights do), so the budgets are about activations.

For each model: the trace (seconds, values, decisions), the least peak any plan can have
(the bytes every plan holds at some step), the baselines (saving everything,
checkpointing every 1, 2 and 4 segments: 2 segments per layer, and selective
checkpointing: matmul and attention outputs saved, the rest recomputed), then at budgets from 70%
of saving everything down to 0.35 of checkpointing every segment: rematc's plan (the
default planner, as the backend runs it, with its time limit), the chain model's alone,
the multi-level plan's alone (:mod:`solvers.multilevel`), and the cheapest baseline that
fits. The traced problems have the H100 profile's 50 GB/s host link, so rematc may
offload. With ``--offload-model``, that model at and below checkpointing's peak
without the link (recomputation alone) against with it (recomputation and offload).
With ``--bounds``, only what no plan can beat at those fractions of checkpointing's peak,
with the link and without it (:mod:`solvers.bound`; seconds per model). With
``--time-bounds``, only the wall seconds each planner path takes at the time limit, counting
wall time and, with ``deterministic``, work (:mod:`solvers.deadline`), beside the machine's
load (docs/solvers.md, "Time").

    python -m bench.scale --models llama2-7b --cache DIR
    python -m bench.scale --models llama2-7b llama2-70b llama3-405b llama3-405b-128k \\
        --offload-model llama2-70b --cache DIR --out docs/scale.md
    python -m bench.scale --bounds --models llama2-7b llama2-70b llama3-405b --cache DIR
    python -m bench.scale --time-bounds --models llama2-70b --time-limit 20 --cache DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from solvers import (
    InfeasibleBudgetError,
    Problem,
    SolverConfig,
    SolveResult,
    bound,
    chain,
    multilevel,
    planner,
)
from solvers.baselines import checkpoint_every, save_all, selective
from solvers.floor import baseline
from solvers.io import load_problem, save_problem

MODELS = {
    "llama2-7b": ("llama2-7b", {}),
    "llama2-70b": ("llama2-70b", {}),
    "llama3-405b": ("llama3-405b", {}),
    "llama3-405b-128k": ("llama3-405b", {"seq_len": 131072}),
}
HOST_LINK = 50e9  # bytes/s each way: PCIe 5 x16 in practice
FRACTIONS = (0.7, 0.3)  # of saving everything
OF_CHECKPOINTING = (1.0, 0.75, 0.6, 0.5, 0.35)  # of checkpointing every segment
OFFLOAD_AT = (1.0, 0.75, 0.6, 0.5, 0.45)  # of checkpointing every segment, for --offload-model
# Of checkpointing every segment's peak, for --time-bounds: below every plan found on the 70B
# (a quarter of it is not: the multi-level plans go lower), so the error's explanation runs.
INFEASIBLE_AT = 1 / 8
MIB = 2**20


def traced(key: str, cache: Path | None) -> tuple[Problem, float]:
    """The model's problem and the seconds its trace took (from the cache when there)."""
    path = cache / f"{key}.json" if cache else None
    if path is not None and path.exists():
        problem = load_problem(str(path))
        return problem, float(problem.meta.get("trace_s", "nan"))
    from rematc.llama import make_llama
    from rematc.trace import trace

    name, overrides = MODELS[key]
    t0 = time.perf_counter()
    model, inputs = make_llama(name, **overrides)
    problem = trace(model, inputs, device="h100", dtype="bfloat16", target="eager", name=key).problem
    seconds = time.perf_counter() - t0
    problem = dataclasses.replace(problem, meta={**problem.meta, "trace_s": f"{seconds:.1f}"})
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_problem(problem, str(path))
    return problem, seconds


def grads_in_place(problem: Problem) -> Problem:
    """The gradients (values the backward keeps to the end) written into buffers that exist
    before the step: they hold no budget, like the weights."""
    nodes = [dataclasses.replace(n, size=0) if n.backward and n.keep else n for n in problem.nodes]
    return Problem(nodes=tuple(nodes), host_bandwidth=problem.host_bandwidth, name=problem.name,
                   meta=dict(problem.meta))


def baselines(problem: Problem) -> dict[str, SolveResult]:
    out = {"save all": save_all(problem)}
    for k in (1, 2, 4):
        out[f"checkpoint every {k}"] = checkpoint_every(problem, k=k)
    out["selective"] = selective(problem)
    return out


def planned(problem: Problem, budget: int, config: SolverConfig) -> tuple[str, float | None, int | None, float]:
    """rematc's default planner at ``budget``: status, added seconds, peak, wall seconds."""
    t0 = time.perf_counter()
    try:
        r = planner.solve(problem.with_budget(budget), config)
    except InfeasibleBudgetError as e:
        least = f" (least found {e.min_feasible / MIB:,.0f} MiB)" if e.min_feasible else ""
        return "infeasible" + least, None, None, time.perf_counter() - t0
    if r.report is None:
        return r.status.value, None, None, time.perf_counter() - t0
    status = r.status.value + ("" if r.gap == 0 else f", gap {r.gap:.0%}")
    return status, r.report.added_time, r.report.peak, time.perf_counter() - t0


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def run_model(key: str, args: argparse.Namespace, out: list[str]) -> None:
    problem, trace_s = traced(key, args.cache)
    problem = grads_in_place(problem)
    step = sum(n.time for n in problem.nodes)
    floor = max(baseline(problem), default=0)
    base = baselines(problem)
    every = base["checkpoint every 1"].report
    top = base["save all"].report
    assert every is not None and top is not None
    config = SolverConfig(time_limit=args.time_limit)
    t0 = time.perf_counter()
    built = chain.build_chain(problem, config, planner=planner.PLANNER)
    chain_s = time.perf_counter() - t0
    measured = multilevel.measure(problem)
    least = multilevel.min_peak(problem, config, chain=measured).report if measured else None
    out += [f"### {key}", "",
            f"Trace {trace_s:.0f} s; {len(problem.nodes):,} values, {len(problem.candidates):,} decisions; "
            f"step {step * 1e3:,.0f} ms (estimated); chain: "
            + (f"{len(built.segments)} segments, {len(built.spans)} spans of {built.distinct} shapes, "
               f"options in {chain_s:.0f} s" if built else "none")
            + f". Every plan holds at least {floor / MIB:,.0f} MiB at some step"
            + (f"; the least-peak multi-level plan peaks at {least.peak / MIB:,.0f} MiB" if least else "")
            + ".", "",
            "| baseline | peak MiB | added ms | added % of step |", "|---|---:|---:|---:|"]
    for name, r in base.items():
        rep = r.report
        assert rep is not None
        out.append(f"| {name} | {rep.peak / MIB:,.0f} | {ms(rep.added_time)} | {rep.added_time / step:.1%} |")
    budgets = [(f"{f:.0%} of save-all", int(top.peak * f)) for f in args.fractions]
    budgets += [(f"{f:g} x checkpoint-every-1", int(every.peak * f)) for f in args.of_checkpointing]
    out += ["", "| budget | MiB | rematc | plan s | added ms | added % of step | chain model ms | "
            "multi-level ms | best baseline that fits | its ms |",
            "|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for label, budget in sorted(budgets, key=lambda b: -b[1]):
        status, added, _, wall = planned(problem, budget, config)
        alone = chain.solve(problem.with_budget(budget), config, chain=built) if built else None
        grouped = multilevel.solve(problem.with_budget(budget), config, chain=measured) if measured else None
        fits = [(n, r.report.added_time) for n, r in base.items() if r.report and r.report.peak <= budget]
        best = min(fits, key=lambda f: f[1], default=None)
        share = "-" if added is None else f"{added / step:.1%}"
        out.append(f"| {label} | {budget / MIB:,.0f} | {status} | {wall:.0f} | {ms(added)} | {share} | "
                   f"{ms(alone.objective if alone and alone.plan else None)} | "
                   f"{ms(grouped.objective if grouped and grouped.plan else None)} | "
                   f"{best[0] if best else '-'} | {ms(best[1] if best else None)} |")
        print(out[-1], file=sys.stderr, flush=True)
    if key in args.offload_model:
        alone = Problem(nodes=problem.nodes, host_bandwidth=0.0, name=problem.name)
        linked = Problem(nodes=problem.nodes, host_bandwidth=HOST_LINK, name=problem.name)
        out += ["", f"Recomputation alone (no host link) against recomputation and offload at "
                f"{HOST_LINK / 1e9:g} GB/s:", "",
                "| budget | MiB | recompute only ms | recompute + offload ms | ratio | offloaded MiB | from |",
                "|---|---:|---:|---:|---:|---:|---|"]
        for f in OFFLOAD_AT:
            budget = int(every.peak * f)
            _, remat_s, _, _ = planned(alone, budget, config)
            try:
                r = planner.solve(linked.with_budget(budget), config)
                both, moved, source = r.objective if r.plan else None, r.report.offloaded_bytes if r.report else 0, r.solver
            except InfeasibleBudgetError:
                both, moved, source = None, 0, "-"
            ratio = f"{both / remat_s:.2f}" if both is not None and remat_s else "-"
            out.append(f"| {f:g} x checkpoint-every-1 | {budget / MIB:,.0f} | {ms(remat_s)} | {ms(both)} | {ratio} | "
                       f"{moved / MIB:,.0f} | {source} |")
            print(out[-1], file=sys.stderr, flush=True)
    out.append("")


def run_bounds(key: str, args: argparse.Namespace, out: list[str]) -> None:
    """What no plan beats at fractions of checkpointing every segment's peak: the step
    relaxation (:mod:`solvers.bound`) without the host link and with it."""
    problem = grads_in_place(traced(key, args.cache)[0])
    every = checkpoint_every(problem).report
    assert every is not None
    out += [f"### {key}: lower bounds", "",
            f"Checkpointing every segment: {every.peak / MIB:,.0f} MiB, {ms(every.added_time)} ms.", "",
            "| budget | MiB | recompute only: bound ms | x checkpointing's | with offload: bound ms "
            "| x checkpointing's | step | s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for f in args.of_checkpointing:
        budget = int(every.peak * f)
        row = [f"{f:g} x checkpoint-every-1", f"{budget / MIB:,.0f}"]
        t0 = time.perf_counter()
        for bandwidth in (0.0, HOST_LINK):
            found = bound.lower_bound(Problem(nodes=problem.nodes, budget=budget, host_bandwidth=bandwidth,
                                              name=problem.name))
            row += [ms(found.seconds), f"{found.seconds / every.added_time:.3f}"]
        row += [str(found.step), f"{time.perf_counter() - t0:.1f}"]
        out.append("| " + " | ".join(row) + " |")
        print(out[-1], file=sys.stderr, flush=True)
    out.append("")


def outcome(run: Callable[[], SolveResult]) -> str:
    """What one planner path ended with: its status and added ms, or the least peak an
    infeasible budget's error stated."""
    try:
        r = run()
    except InfeasibleBudgetError as e:
        return "infeasible" + (f", least found {e.min_feasible / MIB:,.0f} MiB" if e.min_feasible else "")
    if r.report is None:
        return r.status.value
    return f"{r.status.value}, {ms(r.report.added_time)} ms added, peak {r.report.peak / MIB:,.0f} MiB"


def time_paths(problem: Problem, budget: int, config: SolverConfig) -> list[tuple[str, Callable[[], SolveResult]]]:
    """Every planner path, by name, at ``budget`` (checkpointing every segment's peak)."""
    low = int(budget * INFEASIBLE_AT)
    return [
        ("rematc at checkpointing's peak", lambda: planner.solve(problem.with_budget(budget), config)),
        (f"rematc at {INFEASIBLE_AT:g} of it", lambda: planner.solve(problem.with_budget(low), config)),
        ("least peak", lambda: planner.min_feasible_peak(problem, config)),
        ("chain model alone", lambda: chain.solve(problem.with_budget(budget), config, planner=planner.PLANNER)),
        ("multi-level alone, at half of it", lambda: multilevel.solve(problem.with_budget(budget // 2), config)),
        ("multi-level least peak", lambda: multilevel.min_peak(problem, config)),
    ]


def run_time_bounds(key: str, args: argparse.Namespace, out: list[str]) -> None:
    """The wall seconds of every planner path at ``args.time_limit``, counting wall time and
    work (``deterministic``), each beside the machine's load average over the minute before."""
    problem = grads_in_place(traced(key, args.cache)[0])
    every = checkpoint_every(problem).report
    assert every is not None
    out += [f"### {key}: time bounds", "",
            f"{len(problem.candidates):,} decisions; checkpointing every segment peaks at {every.peak / MIB:,.0f} MiB; "
            f"time limit {args.time_limit:g} s.", "",
            "| path | limit counts | wall s | load | outcome |", "|---|---|---:|---:|---|"]
    for deterministic in (False, True):
        config = SolverConfig(time_limit=args.time_limit, deterministic=deterministic)
        for name, run in time_paths(problem, every.peak, config):
            planner.forget_stated()  # each path from scratch, not from a plan an error stated before
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            ended = outcome(run)
            out.append(f"| {name} | {'work' if deterministic else 'wall time'} | {time.perf_counter() - t0:.1f} | "
                       f"{load:.1f} | {ended} |")
            print(out[-1], file=sys.stderr, flush=True)
    out.append("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["llama2-7b"])
    parser.add_argument("--offload-model", nargs="*", default=[], choices=sorted(MODELS))
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per plan (rematc's default)")
    parser.add_argument("--cache", type=Path, help="folder for the traced problems (reused when there)")
    parser.add_argument("--out", type=Path, help="write the tables here (markdown)")
    parser.add_argument("--bounds", action="store_true",
                        help="only the lower bounds below checkpointing's peak (seconds per model)")
    parser.add_argument("--time-bounds", action="store_true",
                        help="only the wall seconds of every planner path at the time limit")
    parser.add_argument("--fractions", nargs="*", type=float, default=list(FRACTIONS),
                        help="budgets as fractions of saving everything's peak")
    parser.add_argument("--of-checkpointing", nargs="*", type=float, default=list(OF_CHECKPOINTING),
                        help="budgets as fractions of checkpointing every segment's peak")
    args = parser.parse_args()
    out = [f"Machine: {os.cpu_count()} cores; time limit {args.time_limit:g} s per plan.", ""]
    for key in args.models:
        (run_time_bounds if args.time_bounds else run_bounds if args.bounds else run_model)(key, args, out)
    text = "\n".join(out)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
