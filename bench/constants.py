"""The planner's constants, each swept beside its neighbouring values on several model families.

The constants of the chain and multi-level planners and of the dispatcher were first set on
one model each (docs/constants.md). Here each is set, in a process of its own, to the value
below and the value above its own, and the default planner (as the backend runs it: a
time limit, a 1% step gap, a stall watch) plans every family at checkpointing every
segment's peak and at a share of it (both found once, with the constants as they are: the
segments move with ``PASSED_OVER``). A constant is well chosen where, on every family and
budget, the plan at its value adds at most 2% more time than the best of its neighbours'.

The families are traced on ``meta`` tensors (nothing is allocated) in bf16 for the H100
profile, with its host link, so plans may offload. Below ``CHAIN_ONLY_CANDIDATES``
decisions, where the flat search plans: transformers' GPT-2 (12 layers) and GPT-2 medium
(24), BERT-large, TinyLlama's layer 12 deep and a ResNet-34-shaped network
(``bench.models``, 224x224, batch 64). Above it, where the chain model plans: a
TinyLlama-shaped transformers Llama, the Llama-2-7B scale shape (``bench.scale``), and
GPT-2 XL's and BERT-large's layers 64 deep and a ResNet of 80 basic blocks, deep enough
for it. The planner runs against the wall clock, so the constants' own values are planned
three times, at the start, middle and end of the run: their spread is the noise any
difference is read against. Nothing else may run meanwhile.

``--deterministic`` plans under a limit of work instead (CP-SAT's deterministic seconds
and the checker's replays, :mod:`solvers.deadline`), with the wall clock's backstop moved
out of reach: the same constants then give the same plan on a busy machine as on a quiet
one. A search is still a path, and a neighbour may land on a better or a worse plan by
where a different constant sends it, as a different random seed would: the own values'
three runs take seeds 0, 1 and 2 (``--seeds``), their spread is that noise, and each
neighbour runs at seed 0 and is read against the own run at seed 0. Its limit counts
work, not seconds, and it has no stall watch (``config.stall_time`` is not swept). Under
it the chain model plans only above ``CHAIN_ONLY_CANDIDATES``, and the step relaxation's
bound, whose work is not counted, takes nothing from the searches (``planner.BOUND_SHARE``
acts under the wall clock only).

    python -m bench.constants --cache DIR --out docs/constants-sweep.md
    python -m bench.constants --cache DIR --only chain.SPAN chain.DEAREST --families gpt2 llama2-7b
    python -m bench.constants --cache DIR --deterministic --time-limit 5 --at 1.0 0.75 \\
        --families tinyllama llama2-7b gpt2-xl-64 bert-large-64 resnet-80
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.scale import grads_in_place
from bench.scale import traced as scale_traced
from solvers import (
    InfeasibleBudgetError,
    Problem,
    SolverConfig,
    chain,
    cpsat,
    multilevel,
    planner,
    segments,
)
from solvers import deadline as deadlines
from solvers.baselines import checkpoint_every
from solvers.io import load_problem, save_problem

# name -> (module, attribute, the value below, the value above)
CONSTANTS: dict[str, tuple[Any, str, float, float]] = {
    "chain.SPAN": (chain, "SPAN", 3, 5),
    "chain.DEAREST": (chain, "DEAREST", 16, 32),
    "chain.SWEEP": (chain, "SWEEP", 4, 8),
    "chain.TIGHTEN": (chain, "TIGHTEN", 4, 8),
    "chain.FAR": (chain, "FAR", 1.1, 1.5),
    "chain.COARSE": (chain, "COARSE", 6, 12),
    "chain.OPTION_SHARE": (chain, "OPTION_SHARE", 0.25, 0.5),
    "chain.SINGLES_SHARE": (chain, "SINGLES_SHARE", 0.15, 0.35),
    "chain.ALL_SHARE": (chain, "ALL_SHARE", 0.5, 0.8),
    "chain.AGAIN_SHARE": (chain, "AGAIN_SHARE", 0.6, 0.9),
    "chain.COARSE_SHARE": (chain, "COARSE_SHARE", 0.35, 0.65),
    "chain.NEXT_SHARE": (chain, "NEXT_SHARE", 0.35, 0.65),
    "chain.PEAK_SHARE": (chain, "PEAK_SHARE", 0.35, 0.65),
    "chain.LOOSEN": (chain, "LOOSEN", 0.005, 0.02),
    "chain.HINT_WORK": (chain, "HINT_WORK", 0.5, 2.0),
    "chain.SUB_LIMIT": (chain, "SUB_LIMIT", 2.5, 10.0),
    "multilevel.TIGHTEN": (multilevel, "TIGHTEN", 4, 8),
    "segments.PASSED_OVER": (segments, "PASSED_OVER", 1 / 16, 1 / 4),
    "planner.CHAIN_MIN_CANDIDATES": (planner, "CHAIN_MIN_CANDIDATES", 130, 300),
    "planner.CHAIN_ONLY_CANDIDATES": (planner, "CHAIN_ONLY_CANDIDATES", 700, 1500),
    "planner.CHAIN_SHARE": (planner, "CHAIN_SHARE", 0.2, 0.4),
    "planner.LATE_GREEDY_SHARE": (planner, "LATE_GREEDY_SHARE", 0.025, 0.1),
    "planner.SEED_SHARE": (planner, "SEED_SHARE", 0.1, 0.3),
    "planner.PEAK_SEED_SHARE": (planner, "PEAK_SEED_SHARE", 0.35, 0.65),
    "planner.RECOMPUTE_FIRST_SHARE": (planner, "RECOMPUTE_FIRST_SHARE", 0.35, 0.65),
    "planner.BOUND_SHARE": (planner, "BOUND_SHARE", 0.025, 0.1),
    "segments.LONG_LIVED": (segments, "LONG_LIVED", 1 / 8, 1 / 2),
    "cpsat.TRANSFER_CHOICES": (cpsat, "TRANSFER_CHOICES", 4, 8),
    "config.stall_time": (None, "stall_time", 5.0, 20.0),
}
WALL_CLOCK_ONLY = ("config.stall_time", "planner.BOUND_SHARE")  # no effect under --deterministic
AT = (1.0, 0.6)  # of checkpointing every segment's peak
WITHIN = 0.02  # a constant's plans add at most this much more time than its best neighbour's
# Under --deterministic, the wall clock's backstop as a multiple of the limit: out of reach,
# so that the work counted, not the machine's load, stops every stage.
BACKSTOP_OUT_OF_REACH = 50.0
BASE = "(as is)"
MIB = 2**20


def _hf(kind: str, **shape: int) -> Callable[[], tuple[Any, tuple[Any, ...]]]:
    def build() -> tuple[Any, tuple[Any, ...]]:
        import torch
        import transformers

        from bench.models import HFCausalLM

        batch, seq = shape.pop("batch"), shape.pop("seq")
        with torch.device("meta"):
            if kind == "gpt2":
                cfg: Any = transformers.GPT2Config(n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0, use_cache=False, **shape)
                inner: Any = transformers.GPT2LMHeadModel(cfg)
                layers, loss = inner.transformer.h, "ForCausalLM"
            elif kind == "bert":
                cfg = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                              max_position_embeddings=seq, **shape)
                inner = transformers.BertForMaskedLM(cfg)
                layers, loss = inner.bert.encoder.layer, "ForMaskedLM"
            else:
                cfg = transformers.LlamaConfig(max_position_embeddings=seq, use_cache=False, **shape)
                inner = transformers.LlamaForCausalLM(cfg)
                layers, loss = inner.model.layers, "ForCausalLM"
            inner.config._attn_implementation = "sdpa"
            inner.loss_type = loss
            inner.train()
            tokens = torch.zeros(batch, seq, dtype=torch.long)
        return HFCausalLM(inner, layers), (tokens, tokens.clone())
    return build


def _resnet(depths: tuple[int, ...]) -> Callable[[], tuple[Any, tuple[Any, ...]]]:
    def build() -> tuple[Any, tuple[Any, ...]]:
        import torch

        from bench.models import ResNet, ResNetConfig

        with torch.device("meta"):
            model = ResNet(ResNetConfig(depths=depths, n_class=1000))
            inputs = (torch.zeros(64, 3, 224, 224), torch.zeros(64, dtype=torch.long))
        return model.train(), inputs
    return build


FAMILIES: dict[str, Callable[[], tuple[Any, tuple[Any, ...]]]] = {
    "gpt2": _hf("gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, batch=8, seq=1024),
    "gpt2-medium": _hf("gpt2", n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, batch=8, seq=1024),
    "bert-large": _hf("bert", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      intermediate_size=4096, batch=16, seq=512),
    "tinyllama": _hf("llama", hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, intermediate_size=5632, vocab_size=32000, batch=4, seq=2048),
    "resnet34": _resnet((3, 4, 6, 3)),
    # TinyLlama's layer 12 deep: a Llama the flat search plans (below CHAIN_ONLY_CANDIDATES)
    "tinyllama-12": _hf("llama", hidden_size=2048, num_hidden_layers=12, num_attention_heads=32,
                        num_key_value_heads=4, intermediate_size=5632, vocab_size=32000, batch=4, seq=2048),
    # Deep enough that only the chain model plans them (past CHAIN_ONLY_CANDIDATES): GPT-2
    # XL's layer and BERT-large's, 64 deep, and a ResNet of 80 basic blocks.
    "gpt2-xl-64": _hf("gpt2", n_embd=1600, n_layer=64, n_head=25, vocab_size=50257, batch=4, seq=1024),
    "bert-large-64": _hf("bert", hidden_size=1024, num_hidden_layers=64, num_attention_heads=16,
                         intermediate_size=4096, batch=16, seq=512),
    "resnet-80": _resnet((3, 8, 66, 3)),
}
SCALE = ("llama2-7b",)  # from bench.scale, traced there


def traced(family: str, cache: Path) -> Problem:
    """The family's problem, traced once and kept in ``cache``."""
    if family in SCALE:
        return grads_in_place(scale_traced(family, cache)[0])
    path = cache / f"{family}.json"
    if not path.exists():
        from rematc.trace import trace

        model, inputs = FAMILIES[family]()
        problem = trace(model, inputs, device="h100", dtype="bfloat16", target="eager", name=family).problem
        cache.mkdir(parents=True, exist_ok=True)
        save_problem(grads_in_place(problem), str(path))
    return load_problem(str(path))


def every_segment(problem: Problem) -> int:
    """The peak of checkpointing every segment."""
    report = checkpoint_every(problem).report
    assert report is not None
    return report.peak


def setting(name: str, value: float) -> Callable[[SolverConfig], SolverConfig]:
    """Sets constant ``name`` to ``value`` for this process; the solver config to use."""
    module, attribute, _, _ = CONSTANTS[name]
    if module is None:
        return lambda config: dataclasses.replace(config, **{attribute: value})
    current = getattr(module, attribute)
    setattr(module, attribute, type(current)(value) if isinstance(current, int) else value)
    return lambda config: config


def worker(args: argparse.Namespace) -> None:
    """One process: every family at every budget with ``--set NAME=VALUE`` (or as is);
    one JSON line per plan on stdout."""
    adjust: Callable[[SolverConfig], SolverConfig] = lambda config: config  # noqa: E731
    if args.set:
        name, value = args.set.split("=")
        adjust = setting(name, float(value))
    config = adjust(SolverConfig(time_limit=args.time_limit, step_gap=0.01, stall_time=10.0,
                                 deterministic=args.deterministic, seed=args.seed))
    if args.deterministic:
        deadlines.WALL_BACKSTOP = BACKSTOP_OUT_OF_REACH
    peaks = dict(zip(args.families, args.peaks, strict=True))
    for family in args.families:
        problem = traced(family, args.cache)
        for at in args.at:
            budget = int(peaks[family] * at)
            t0 = time.perf_counter()
            row: dict[str, Any] = {"family": family, "at": at, "budget": budget, "seed": args.seed}
            try:
                r = planner.solve(problem.with_budget(budget), config)
                row.update(added=r.report.added_time if r.report else None, peak=r.report.peak if r.report else None,
                           source=str(r.stats.get("from", r.solver)))
            except InfeasibleBudgetError as e:
                # Below the least peak: what the error states is the result (the least
                # plan found, and the bound no plan beats where it is not proven).
                row.update(added=None, peak=None, source=f"infeasible (least {e.min_feasible})",
                           least=e.min_feasible, proven=e.proven, at_least=e.at_least)
            row["wall"] = time.perf_counter() - t0
            print(json.dumps(row), flush=True)


def settings(only: list[str], seeds: list[int]) -> list[tuple[str | None, int]]:
    """The processes to run, in order, each a setting (None: as is) and a seed: as is at
    the start, middle and end, at ``seeds``; each constant's value below and above
    interleaved between, at seed 0."""
    changed: list[tuple[str | None, int]] = []
    for name in only:
        _, _, low, high = CONSTANTS[name]
        changed += [(f"{name}={low}", 0), (f"{name}={high}", 0)]
    half = len(changed) // 2
    first, middle, last = seeds
    return [(None, first), *changed[:half], (None, middle), *changed[half:], (None, last)]


def run(setting_: str | None, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "bench.constants", "--worker", "--cache", str(args.cache),
               "--time-limit", str(args.time_limit), "--families", *args.families,
               "--peaks", *(str(p) for p in args.peaks), "--at", *(str(a) for a in args.at),
               "--seed", str(seed)]
    if args.deterministic:
        command.append("--deterministic")
    if setting_:
        command += ["--set", setting_]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def current(name: str) -> float:
    module, attribute, _, _ = CONSTANTS[name]
    if module is None:
        return float(getattr(SolverConfig(time_limit=60.0, step_gap=0.01, stall_time=10.0), attribute))
    return float(getattr(module, attribute))


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def report(results: dict[str, list[list[dict[str, Any]]]], args: argparse.Namespace) -> list[str]:
    """The tables: the as-is runs and their spread, then per constant each case's added
    time at the value below, as is and above, and the ratio of as is to the best of the
    three; and the cases where a neighbour is more than 2% better than the best of the own
    runs too, beyond their spread. As is: the as-is runs' median under the wall clock;
    under ``deterministic`` the as-is run at the neighbours' seed, 0 (a neighbour is then
    compared with the same search but for the constant)."""
    cases = [(f, at) for f in args.families for at in args.at]

    def added(rows: list[dict[str, Any]], case: tuple[str, float]) -> float | None:
        row = next(r for r in rows if (r["family"], r["at"]) == case)
        return row["added"]

    base_runs = results[BASE]
    limit = (f"A limit of {args.time_limit:g} s of work (deterministic), step gap 1%" if args.deterministic
             else f"Time limit {args.time_limit:g} s, step gap 1%, stall watch 10 s")
    seeds = " / ".join(str(rows[0].get("seed", 0)) for rows in base_runs)
    lines = [f"{limit}; added milliseconds of the plan the default planner found. The own values' "
             f"runs at seeds {seeds}, each neighbour's at seed 0.", "",
             f"| family | budget | decisions | as is, {len(base_runs)} runs | spread |", "|---|---|---:|---|---:|"]
    reference: dict[tuple[str, float], float | None] = {}
    best: dict[tuple[str, float], float | None] = {}
    for case in cases:
        values = [added(rows, case) for rows in base_runs]
        known = sorted(v for v in values if v is not None)
        reference[case] = known[len(known) // 2] if len(known) == len(values) else None
        if args.deterministic:  # the own run at the neighbours' seed, where there is one
            reference[case] = next((v for v, rows in zip(values, base_runs, strict=True)
                                    if rows[0].get("seed", 0) == 0), reference[case])
        best[case] = known[0] if known else None
        spread = (known[-1] / known[0] - 1) if known and known[0] > 0 else 0.0
        decisions = args.decisions.get(case[0], 0)
        lines.append(f"| {case[0]} | {case[1]:g}x | {decisions:,} | {' / '.join(ms(v) for v in values)} | "
                     f"{spread:.1%} |")
    lines += ["", "| constant | value below / as is / above | worst ratio of as is to the best | cases over 2% "
              "| of which beyond the own runs' spread |", "|---|---|---:|---|---|"]
    details = ["", "Each case, added ms at the value below / as is / above:", ""]
    for name in args.only:
        low, high = results.get(f"{name}=low"), results.get(f"{name}=high")
        if not low or not high:
            continue
        worst, over, beyond = 1.0, [], []
        cells = []
        for case in cases:
            a, b, c = added(low[0], case), reference[case], added(high[0], case)
            known = [v for v in (a, b, c) if v is not None]
            if b is None:  # no plan as is: worse than any neighbour's, the same where none has one
                ratio = math.inf if known else 1.0
            else:
                ratio = b / min(known) if min(known) > 0 else 1.0
            worst = max(worst, ratio)
            if ratio > 1 + WITHIN:
                over.append(f"{case[0]} {case[1]:g}x ({ratio - 1:+.1%})")
                own = best[case]
                if own is None or (own > 0 and own / min(known) > 1 + WITHIN):
                    beyond.append(f"{case[0]} {case[1]:g}x")
            cells.append(f"{case[0]} {case[1]:g}x: {ms(a)} / {ms(b)} / {ms(c)}")
        _, _, lo, hi = CONSTANTS[name]
        lines.append(f"| `{name}` | {lo:g} / {current(name):g} / {hi:g} | {worst:.3f} | {', '.join(over) or 'none'} "
                     f"| {', '.join(beyond) or 'none'} |")
        details.append(f"* `{name}`: " + "; ".join(cells))
    return lines + details


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, required=True, help="folder of the traced problems")
    p.add_argument("--families", nargs="+", default=[*FAMILIES, *SCALE], choices=[*FAMILIES, *SCALE])
    p.add_argument("--only", nargs="+", default=list(CONSTANTS), choices=list(CONSTANTS))
    p.add_argument("--time-limit", type=float, default=20.0)
    p.add_argument("--at", nargs="+", type=float, default=list(AT),
                   help="budgets, as shares of checkpointing every segment's peak")
    p.add_argument("--out", type=Path, help="append the tables to this markdown file")
    p.add_argument("--json", type=Path, help="keep every run's rows here")
    p.add_argument("--deterministic", action="store_true",
                   help="a limit of work, not of wall time: the plans do not depend on the machine's load")
    p.add_argument("--seeds", nargs=3, type=int,
                   help="the own values' three runs' random seeds (default 0 0 0, and 0 1 2 under --deterministic)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the tables of the runs kept in --json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--set", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--peaks", nargs="+", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.deterministic:  # no stall watch to sweep, and the bound's share takes no work
        args.only = [name for name in args.only if name not in WALL_CLOCK_ONLY]
    problems = {f: traced(f, args.cache) for f in args.families}
    args.decisions = {f: len(problem.candidates) for f, problem in problems.items()}
    results: dict[str, list[list[dict[str, Any]]]] = {}
    if args.report_only:
        if not args.json:
            p.error("--report-only reads the runs kept in --json")
        results = json.loads(args.json.read_text())
    else:
        # The budgets, from checkpointing every segment with the constants as they are: the
        # segments move with PASSED_OVER, and a budget moved with them would be no comparison.
        args.peaks = [every_segment(problems[f]) for f in args.families]
        seeds = args.seeds or ([0, 1, 2] if args.deterministic else [0, 0, 0])
        for s, seed in settings(args.only, seeds):
            t0 = time.perf_counter()
            rows = run(s, seed, args)
            name, _, value = s.partition("=") if s else (BASE, "", "")
            key = name if s is None else name + ("=low" if float(value) < current(name) else "=high")
            results.setdefault(key, []).append(rows)
            print(f"{s or BASE} (seed {seed}): {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(results))
    lines = report(results, args)
    print("\n".join(lines))
    if args.out:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
