"""The ``rematc`` command line (also ``python -m rematc``).

    rematc export model.pt2 -o model.json --device h100 --dtype bfloat16
    rematc export mypkg.models:make -o model.json
    rematc solve model.json --budget 40% [--solver cpsat] [--out plan.json] [--json]
    rematc explain model.json --budget 512MiB
    rematc plot model.json --budget 40% --out-dir plots/
    rematc fit rematc.llama:llama3_8b --device h100 --precision bf16-mixed --batch 1,2,4 --seq 8192
    rematc demo [--compiler eager]

A FILE is a ``.pt2`` (``torch.export.save``), a rematc problem JSON, a networkx
node-link benchmark graph (``*_train_nx.json``), or a factory ``module:function``
returning ``(model, example_inputs)``.

Exit status: 0 done; 1 no plan fits the budget; 2 bad input (a one-line message, never
a traceback); 130 interrupted (the best plan so far is still reported).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from rematc.errors import NoPlanError
from rematc.sources import SHAPES_KEY, is_factory
from rematc.wholestep import OPTIMIZERS, PRECISIONS
from solvers import (
    InfeasibleBudgetError,
    Plan,
    Problem,
    ProblemError,
    SolverConfig,
    SolveResult,
    check,
    save_all,
)
from solvers.budget import MIN_BYTES, format_bytes, parse_budget, parse_size
from solvers.problem import MAX_BYTES, MAX_BYTES_TEXT
from solvers.sat import MAX_SEED, MAX_WORKERS

if TYPE_CHECKING:
    from rematc.trace import Traced

# cpsat: the default planner; chain: the chain model alone (solvers.chain); checkpoint:
# keep each segment boundary, recompute the rest (torch.utils.checkpoint around every
# block); checkpoint-2, -4: keep every 2nd, 4th; selective: save the outputs of ops with
# FLOPs (matmuls, attention), recompute the rest; multilevel: keep one block input in
# several, rerun the blocks between from the nearest kept one (solvers.multilevel);
# greedy; save_all.
SOLVERS = ("cpsat", "chain", "checkpoint", "checkpoint-2", "checkpoint-4", "selective", "multilevel", "greedy",
           "save_all")
# The baselines: their plan is the same at every budget, so with none they show their own
# peak and time.
FIXED_PLANS = ("checkpoint", "checkpoint-2", "checkpoint-4", "selective", "save_all")
DEVICES = ("cpu", "a100", "h100", "h200", "l4")  # rematc.devices.PROFILES
DTYPES = ("float32", "float16", "bfloat16", "float64")  # rematc.trace.DTYPES
TARGETS = ("inductor", "eager")  # rematc.trace.TARGETS
EXIT_OK, EXIT_NO_PLAN, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad command-line arguments; reported like every other bad input."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (``rematc: error: ...``, exit 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


# ---- the parser ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rematc", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, examples: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=examples,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p = command("demo", "train a small GPT at budgets that bind and beside PyTorch's options: "
                "predicted and measured peaks, step times, a Pareto picture",
                "example:\n  rematc demo --compiler eager --plot demo.png")
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--budgets", nargs="+", default=None,
                   help="budgets to run ('none' for no limit); default: no budget, then four that "
                        "bind, down to the smallest feasible")
    p.add_argument("--steps", type=_ranged(int, low=1), default=3, help="timed steps per configuration")
    p.add_argument("--plot", default="rematc-demo.png", metavar="PNG",
                   help="where to draw peak against step time (default %(default)s; 'none': no picture)")

    p = command("export", "write the problem file of a model's training step",
                "examples:\n  rematc export model.pt2 -o model.json --device h100 --dtype bfloat16\n"
                "  rematc export mypkg.models:make_model -o model.json\n\n"
                "A .pt2 module returning one scalar is the loss; otherwise its first output\n"
                "is reduced with .sum(). A factory takes no arguments and returns\n"
                "(model, example_inputs); the model's forward returns the loss.")
    _model_source(p)
    p.add_argument("-o", "--out", required=True, help="problem JSON to write")

    p = command("solve", "plan a training step under a memory budget",
                "examples:\n  rematc solve model.json --budget 40%\n"
                "  rematc solve model.pt2 --budget 2GiB --out plan.json --dump-dir dump/\n"
                "  rematc solve fcn_8_vgg_32_416x608_train_nx.json --budget 80% --json")
    _model_source(p)
    _planning(p)
    p.add_argument("--out", help="write the plan here (rematc.plan JSON)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a table")
    p.add_argument("--dump-dir", help="write the CP-SAT model, the plan and the graphs before/after here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")

    p = command("explain", "why each value is saved, recomputed or offloaded",
                "examples:\n  rematc explain model.json --budget 512MiB\n"
                "  rematc explain model.pt2 --budget 1MiB   # infeasible: the smallest budget and why")
    _model_source(p)
    _planning(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--limit", type=_ranged(int), default=0, help="show only the N largest values (0: all)")

    p = command("plot", "PNGs of the memory timeline and the added-time/budget Pareto curve",
                "example:\n  rematc plot model.json --budget 40% --out-dir plots/ --points 8")
    _model_source(p)
    _planning(p)
    p.add_argument("--out-dir", default=".", help="folder for <name>-timeline.png and <name>-pareto.png")
    p.add_argument("--points", type=_ranged(int, low=2), default=8,
                   help="budgets in the Pareto sweep, its two ends included (at least 2)")
    p.add_argument("--sweep-time-limit", type=_ranged(float, positive=True), default=5.0,
                   help="seconds per sweep solve")

    p = command("fit", "will the training step fit a device? memory by part, step time and the fastest setting",
                "examples:\n  rematc fit rematc.llama:llama3_8b --device h100 --precision bf16-mixed "
                "--batch 1,2,4,8 --seq 4096,8192\n"
                "  rematc fit config.json --device h100 --fsdp 8 --batch 1,2 --seq 4096 --json\n\n"
                "SOURCE is a factory module:function called as function(batch=B, seq=S) and\n"
                "returning (model, example_inputs), or a transformers config.json (file or\n"
                "folder): rematc builds the causal LM on meta, with no weights, and its inputs.\n"
                "Exit status 1 when no setting fits.")
    p.add_argument("source", metavar="SOURCE", help="module:function or a transformers config.json")
    p.add_argument("--device", choices=DEVICES, default="h100", help="device profile (memory, speed)")
    p.add_argument("--memory", help="device memory per rank, e.g. 80GiB (default: the profile's)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                   help="torch.optim's, at its defaults (foreach on a GPU); adamw-fused: fused=True")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed",
                   help="fp32; bf16-mixed: fp32 weights and optimizer, bf16 autocast; bf16: all bf16")
    p.add_argument("--fsdp", type=_ranged(int, low=1), default=1, help="ranks FSDP2 shards the model over")
    p.add_argument("--batch", type=_int_list, default=[1], help="micro-batches, e.g. 1,2,4,8")
    p.add_argument("--seq", type=_int_list, default=[2048], help="sequence lengths, e.g. 4096,8192")
    p.add_argument("--reserve", type=_ranged(float), help="fraction of the peak kept for the allocator's "
                   "fragmentation (default 0.05 on a GPU, 0 on the CPU)")
    p.add_argument("--time-limit", type=_ranged(float, positive=True),
                   help="seconds per plan (default 6)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", metavar="DIR", help="write <name>-fit.png here: memory by part, tokens/s")
    return parser


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers from 1 up, got {text!r}")
    return values


def _model_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="FILE",
                   help=".pt2, problem JSON, node-link graph JSON, or module:function")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="device profile for op times (models only)")
    p.add_argument("--dtype", choices=DTYPES, help="cast the model and floating inputs (models only)")
    p.add_argument("--target", choices=TARGETS,
                   help="codegen the costs assume: Inductor fuses recomputed pointwise ops (models only; "
                        "default inductor, eager for a model on meta)")


def _planning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", help="a size ('512MiB', '2GB', bytes; at least 1 KiB) or a fraction of the "
                                    "save-all peak ('40%%', 0.4; 1.0 is 100%%) (default: the budget in "
                                    "the problem file)")
    p.add_argument("--solver", choices=SOLVERS, default="cpsat")
    p.add_argument("--time-limit", type=_ranged(float, positive=True), default=60.0, help="seconds (CP-SAT)")
    p.add_argument("--workers", type=_ranged(int, high=MAX_WORKERS), default=0,
                   help=f"CP-SAT workers, at most {MAX_WORKERS}; 0: 8, its full portfolio")
    p.add_argument("--seed", type=_ranged(int, high=MAX_SEED), default=0,
                   help=f"CP-SAT random seed, at most {MAX_SEED} (a 32-bit int)")
    p.add_argument("--stall-time", type=_ranged(float), default=0.0,
                   help="stop once no better plan has been found for this many seconds (0: never)")
    p.add_argument("--deterministic", action="store_true",
                   help="same plan on every run for a seed and worker count: --time-limit then "
                        "counts CP-SAT's deterministic seconds (several wall seconds each), "
                        "--stall-time is not used")


def _ranged(kind: type[int] | type[float], *, low: int = 0, positive: bool = False,
            high: int | None = None) -> Any:
    """An argparse type: a finite ``kind`` >= ``low`` (> 0 when ``positive``), at most ``high``."""
    if positive:
        what = f"a positive {kind.__name__}"
    elif low == 0:
        what = f"a non-negative {kind.__name__}"
    else:
        what = f"an {kind.__name__} >= {low}"
    if high is not None:
        what += f" at most {high}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        ok = math.isfinite(value) and value >= low and (value > 0 or not positive)
        if not ok or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


# ---- main ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    # torch is imported only for a model (a .pt2 or a factory) and the demo: a problem
    # file is planned without it, and a Ctrl-C during its import is one line too.
    try:
        args = build_parser().parse_args(_negative_values(sys.argv[1:] if argv is None else argv))
        if args.command == "demo":
            budgets = None if args.budgets is None else [None if b.lower() == "none" else b
                                                          for b in args.budgets]
            for b in budgets or ():
                if b is not None:
                    parse_budget(b)
            from rematc.demo import demo

            demo(budgets, compiler=args.compiler, steps=args.steps,
                 plot=None if args.plot.lower() == "none" else args.plot)
            return EXIT_OK
        run = {"export": _export, "solve": _solve, "explain": _explain, "plot": _plot,
               "fit": _fit}[args.command]
        return run(args)
    except InfeasibleBudgetError as e:
        _error(f"infeasible: {e}")
        return EXIT_NO_PLAN
    except NoPlanError as e:  # the demo's compile found no plan in its time limit
        _error(_one_line(e))
        return EXIT_NO_PLAN
    except (UsageError, ValueError, OSError) as e:  # ProblemError, PlanError, TraceError too
        _error(_one_line(e))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED


def _negative_values(argv: Sequence[str]) -> list[str]:
    """``--budget -5GiB`` as ``--budget=-5GiB``: argparse takes a value that starts with
    ``-`` for an option ("expected one argument"); joined, the value's own check says it
    is negative."""
    out: list[str] = []
    for arg in argv:
        if (out and out[-1].startswith("--") and out[-1] != "--" and "=" not in out[-1]
                and re.match(r"^-\.?[0-9]", arg)):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def print_json(value: Any, *, indent: int | None = None) -> None:
    """Print ``value`` as strict JSON, the only way ``--json`` output is written: NaN and
    Infinity are no JSON numbers (``json.dumps`` writes them, strict parsers refuse them),
    so every non-finite float is written as null."""
    print(json.dumps(finite(value), indent=indent, allow_nan=False))


def finite(value: Any) -> Any:
    """``value`` with every non-finite float in its dicts, lists and tuples replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _error(message: str) -> None:
    print(f"rematc: error: {message}", file=sys.stderr)


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or type(e).__name__}"
    text = " ".join(str(e).split())
    return text or type(e).__name__


# ---- inputs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    problem: Problem
    traced: Traced | None  # the captured model when the input is one (for shapes and FX dumps)


def load_source(args: argparse.Namespace) -> Source:
    """The problem of FILE, whatever its kind (see the module docstring)."""
    spec: str = args.source
    from_model = spec.endswith(".pt2")
    if not from_model and not os.path.exists(spec):
        from_model = is_factory(spec)
    if from_model:
        traced = _trace(spec, args)
        return Source(traced.problem, traced)
    return Source(_load_problem_file(spec), None)


def _trace(spec: str, args: argparse.Namespace) -> Traced:
    from rematc.trace import load_factory, load_pt2, trace

    if spec.endswith(".pt2"):
        if os.path.isdir(spec):
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a torch.export.save file", spec)
        if not os.path.isfile(spec):
            raise FileNotFoundError(errno.ENOENT, "No such file", spec)
        model, inputs = load_pt2(spec)
        name = os.path.basename(spec).removesuffix(".pt2")
    else:
        model, inputs = load_factory(spec)
        name = spec.rpartition(":")[2]
    return trace(model, inputs, device=args.device, target=args.target, dtype=args.dtype, name=name)


def _load_problem_file(path: str) -> Problem:
    """A rematc problem file or a node-link graph, told apart by their contents."""
    from solvers.importers import is_node_link, problem_from_node_link, read_json
    from solvers.io import problem_from_json

    data = read_json(path)
    try:
        if isinstance(data, dict) and "format" in data:
            return problem_from_json(data)
        if is_node_link(data):
            return problem_from_node_link(data, name=os.path.basename(path).removesuffix(".json"))
    except ProblemError as e:
        raise ProblemError(f"{path}: {e}") from None
    raise ProblemError(f"{path}: neither a rematc problem (no \"format\" key) nor a networkx "
                       "node-link graph (no \"nodes\" and \"links\")")


@dataclass(frozen=True)
class Budgeted:
    problem: Problem  # with the budget in bytes
    unconstrained: int  # bytes: the save-all peak
    config: SolverConfig


def with_budget(problem: Problem, args: argparse.Namespace) -> Budgeted:
    """The problem at ``--budget``, else at its file's budget; a baseline (``FIXED_PLANS``)
    runs without one, every other solver needs one."""
    before = save_all(problem.with_budget(None)).report
    assert before is not None
    budget: int | None
    if args.budget is None:
        if problem.budget is None and args.solver not in FIXED_PLANS:
            raise UsageError(f"no budget: pass --budget (e.g. --budget 40% or --budget 512MiB); "
                             f"without one only the baselines run ({', '.join(FIXED_PLANS)})")
        budget = problem.budget
    else:
        budget = parse_budget(args.budget).resolve(before.peak)
    config = SolverConfig(time_limit=args.time_limit, workers=args.workers, seed=args.seed,
                          stall_time=args.stall_time, deterministic=args.deterministic)
    return Budgeted(problem.with_budget(budget), before.peak, config)


# ---- export -------------------------------------------------------------------------


def _check_folder(path: str, flag: str) -> None:
    """``path`` can be the folder ``flag`` writes into: one, or creatable (no file in the
    way). Checked before any work, not after the solve ("File exists" named no flag)."""
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        blocker = "" if here == os.path.abspath(path) else f": {here} is a file"
        raise UsageError(f"{flag} {path} is not a folder{blocker}; name a folder (it is created "
                         f"if missing), or move the file away")


def _refuse_overwrite(source: str, out: str | None, flag: str) -> None:
    """The output must not be the input file: the result would silently replace it."""
    if out is not None and os.path.exists(source) and os.path.exists(out) and os.path.samefile(source, out):
        raise UsageError(f"{flag} {out} is the input file; write to another path")


def _export(args: argparse.Namespace) -> int:
    from solvers.io import save_problem

    spec: str = args.source
    _refuse_overwrite(spec, args.out, "--out")
    if not (spec.endswith(".pt2") or not os.path.exists(spec)):
        raise UsageError(f"export reads a model: a .pt2 file or module:function, got {spec!r}")
    traced = load_source(args).traced
    if traced is None:
        raise UsageError(f"export reads a model: a .pt2 file or module:function, got {spec!r}")
    save_problem(traced.problem, args.out)
    p = traced.problem
    peak = save_all(p).report
    assert peak is not None
    print(f"wrote {args.out}: {len(p.nodes)} values ({p.n_forward} forward), "
          f"{len(p.candidates)} decisions, save-all peak {format_bytes(peak.peak)}")
    return EXIT_OK


# ---- solve --------------------------------------------------------------------------


@dataclass(frozen=True)
class Solved:
    result: SolveResult
    interrupted: bool
    model: Any  # solvers.cpsat.Model when CP-SAT ran


def run_solver(problem: Problem, solver: str, config: SolverConfig, *, progress: bool) -> Solved:
    """One solve; CP-SAT with a progress bar (on a terminal) and Ctrl-C support."""
    if solver == "save_all":
        return Solved(save_all(problem, config), False, None)
    if solver == "greedy":
        from solvers.baselines import greedy

        return Solved(greedy(problem, config), False, None)
    if solver == "selective":
        from solvers.baselines import selective

        return Solved(selective(problem, config), False, None)
    if solver.startswith("checkpoint"):
        from solvers.baselines import checkpoint_every

        _, _, every = solver.partition("-")
        return Solved(checkpoint_every(problem, config, k=int(every or 1)), False, None)
    if solver == "chain":
        from solvers import chain
        from solvers.planner import PLANNER

        return Solved(chain.solve(problem, config, planner=PLANNER), False, None)
    if solver == "multilevel":
        from solvers import multilevel

        return Solved(multilevel.solve(problem, config), False, None)
    from solvers.progress import solve_watched

    if not progress:
        w = solve_watched(problem, config)
        return Solved(w.result, w.interrupted, w.model)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("CP-SAT"), BarColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[state]}"))
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("solve", total=config.time_limit or 1.0, state="searching")
        unit = _time_unit(problem)

        def update(s: Any) -> None:
            if s.objective is None:
                state = "no plan yet"
            else:
                state = (f"incumbent +{_fmt_time(s.objective, unit)}  bound +{_fmt_time(s.bound, unit)}  "
                         f"gap {s.gap:.1%}")
            bar.update(task, completed=min(s.elapsed, config.time_limit), state=state)

        w = solve_watched(problem, config, on_progress=update)
    return Solved(w.result, w.interrupted, w.model)


def _solve(args: argparse.Namespace) -> int:
    _refuse_overwrite(args.source, args.out, "--out")
    if args.dump_dir:
        _check_folder(args.dump_dir, "--dump-dir")
    source = load_source(args)
    b = with_budget(source.problem, args)
    problem = b.problem
    from rich.console import Console

    progress = not args.json and not args.no_progress and Console(stderr=True).is_terminal
    solved = run_solver(problem, args.solver, b.config, progress=progress)
    result = solved.result
    if args.out and result.plan is not None:
        from solvers.io import save_plan

        save_plan(result.plan, args.out)
    if args.dump_dir:
        dump(args.dump_dir, source, problem, result.plan, solved.model)
    summary = summarize(problem, b.unconstrained, solved)
    if args.json:
        print_json(summary)
    else:
        _print_summary(problem, summary, source=args.source)
    if solved.interrupted:
        gap = "-" if result.plan is None else f"{result.gap:.2%}"
        _error(f"interrupted: {'no plan found yet' if result.plan is None else 'best plan so far'}, gap {gap}")
        return EXIT_INTERRUPTED
    if result.plan is None:
        if args.solver != "cpsat":
            _error(f"{args.solver} found no plan within {format_bytes(problem.budget or 0)}; try --solver cpsat")
        else:
            _error("no plan found within the time limit; raise --time-limit")
        return EXIT_NO_PLAN
    return EXIT_OK


def summarize(problem: Problem, unconstrained: int, solved: Solved) -> dict[str, Any]:
    """The numbers of a solve, in real units (bytes, seconds or the problem's time unit)."""
    result = solved.result
    report = result.report if result.plan is not None else None
    step_time = sum(n.time for n in problem.nodes)
    return {
        "problem": problem.name,
        "solver": result.solver,
        "status": result.status.value,
        "interrupted": solved.interrupted,
        "budget": problem.budget,
        "peak_before": unconstrained,
        "peak_after": report.peak if report else None,
        "added_time": report.added_time if report else None,
        "added_time_fraction": (report.added_time / step_time if report and step_time else 0.0)
        if report else None,
        "time_unit": _time_unit(problem),
        "added_flops": report.added_flops if report else None,
        "recomputed": report.n_recomputed if report else None,
        "offloaded_bytes": report.offloaded_bytes if report else None,
        "saved_bytes": report.saved_bytes if report else None,
        "solve_time_s": result.wall_time,
        "gap": result.gap if report else None,
        "plan": result.plan.to_json() if result.plan is not None else None,
    }


def _print_summary(problem: Problem, s: dict[str, Any], *, source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    unit = s["time_unit"]
    table = Table(title=f"rematc solve {problem.name or source}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    status = s["status"] + (" (interrupted)" if s["interrupted"] else "")
    rows = [
        ("status", status),
        ("solver", s["solver"]),
        ("peak before (save all)", format_bytes(s["peak_before"])),
        ("peak after", _opt(s["peak_after"], format_bytes)),
        ("budget", _opt(s["budget"], format_bytes)),
        ("added time", _opt(s["added_time"], lambda t: f"+{_fmt_time(t, unit)}")
         + (f" ({s['added_time_fraction']:.2%} of the step)" if s["added_time"] else "")),
        ("added FLOPs", _opt(s["added_flops"], lambda f: f"{f:.3g}")),
        ("recomputed values", _opt(s["recomputed"], str)),
        ("offloaded", _opt(s["offloaded_bytes"], format_bytes)),
        ("solve time", f"{s['solve_time_s']:.2f} s"),
        ("gap", _opt(s["gap"], lambda g: f"{g:.2%}")),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


def _opt(value: Any, fmt: Any) -> str:
    return "-" if value is None else str(fmt(value))


def _time_unit(problem: Problem) -> str:
    return "units" if "time_unit" in problem.meta else "s"


def _fmt_time(t: float, unit: str) -> str:
    if unit != "s":
        return f"{t:.4g} {unit}"
    for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(t) >= scale:
            return f"{t / scale:.3g} {name}"
    return f"{t * 1e9:.3g} ns" if t else "0 s"


# ---- dumps --------------------------------------------------------------------------


def dump(folder: str, source: Source, problem: Problem, plan: Plan | None, model: Any) -> None:
    """The CP-SAT model (text proto), the plan, and the graphs before and after."""
    from solvers.io import save_plan, save_problem

    os.makedirs(folder, exist_ok=True)
    if model is None:
        from solvers import cpsat

        model = cpsat.build(problem)
    with open(os.path.join(folder, "model.pb.txt"), "w", encoding="utf-8") as f:
        f.write(str(model.cp.proto))
    save_problem(problem, os.path.join(folder, "problem.json"))
    with open(os.path.join(folder, "before.dot"), "w", encoding="utf-8") as f:
        f.write(to_dot(problem, None))
    if plan is not None:
        save_plan(plan, os.path.join(folder, "plan.json"))
        with open(os.path.join(folder, "after.dot"), "w", encoding="utf-8") as f:
            f.write(to_dot(problem, plan))
    if source.traced is not None:
        traced = source.traced
        _write(os.path.join(folder, "joint.py"), traced.joint.code)
        if plan is not None:
            emitted = traced.emit(plan)
            _write(os.path.join(folder, "forward.py"), emitted.forward.code)
            _write(os.path.join(folder, "backward.py"), emitted.backward.code)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


_COLORS = {"save": "palegreen", "recompute": "orange", "offload": "lightblue"}


def to_dot(problem: Problem, plan: Plan | None) -> str:
    """GraphViz DOT of the problem; with a plan, values are colored by decision and each
    rematerialization is an edge to the backward step it runs before."""
    lines = [f"digraph {json.dumps(problem.name or 'problem')} {{", "  rankdir=TB;", "  node [shape=box, style=filled, fillcolor=white];"]
    for i, n in enumerate(problem.nodes):
        d = plan.decisions.get(i) if plan is not None else None
        color = _COLORS[d.value] if d is not None else ("lightgray" if n.backward else "white")
        label = f"#{i} {n.name}\\n{n.op or 'value'}\\n{format_bytes(n.size)}"
        if d is not None:
            label += f"\\n{d.value}"
        lines.append(f"  n{i} [label={json.dumps(label)}, fillcolor={color}];")
    for i, n in enumerate(problem.nodes):
        for dep in n.deps:
            lines.append(f"  n{dep} -> n{i};")
    if plan is not None:
        for s in plan.schedule:
            lines.append(f"  n{s.node} -> n{s.before} [style=dashed, color=orange];")
    lines.append("}")
    return "\n".join(lines).replace("\\\\n", "\\n") + "\n"


# ---- explain ------------------------------------------------------------------------


def _shapes(problem: Problem) -> dict[str, str]:
    raw = problem.meta.get(SHAPES_KEY)
    if raw is None:
        return {}
    try:
        shapes = json.loads(raw)
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in shapes.items()} if isinstance(shapes, dict) else {}


def _explain(args: argparse.Namespace) -> int:
    from solvers.explain import explain

    source = load_source(args)
    b = with_budget(source.problem, args)
    problem = b.problem
    shapes = _shapes(problem)
    unit = _time_unit(problem)
    try:
        solved = run_solver(problem, args.solver, b.config, progress=False)
    except InfeasibleBudgetError as e:
        return _explain_infeasible(problem, b, e, shapes, json_out=args.json)
    result = solved.result
    if result.plan is None or result.report is None:
        _error(f"{args.solver} found no plan within {format_bytes(problem.budget or 0)}")
        return EXIT_NO_PLAN
    report = check(problem, result.plan)
    rows = explain(problem, result.plan, report, unconstrained_peak=b.unconstrained)
    if args.limit:
        rows = rows[: args.limit]
    if args.json:
        print_json({"budget": problem.budget, "peak": report.peak, "peak_step": report.peak_step,
                    "added_time": report.added_time, "time_unit": unit,
                    "values": [{**dataclasses.asdict(r), "decision": r.decision.value,
                                "shape": shapes.get(r.name, "-")} for r in rows]})
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rematc explain {problem.name}: peak {format_bytes(report.peak)} at step "
                        f"{report.peak_step}, budget {_opt(problem.budget, format_bytes)}, "
                        f"+{_fmt_time(report.added_time, unit)}")
    for col, justify in (("#", "right"), ("value", "left"), ("decision", "left"), ("op", "left"),
                         ("dtype[shape]", "left"), ("bytes", "right"), ("recompute", "right"),
                         ("why", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(str(r.index), r.name, r.decision.value, r.op or "-", shapes.get(r.name, "-"),
                      format_bytes(r.size), _fmt_time(r.time, unit), r.why)
    Console(width=max(160, Console().width)).print(table)
    return EXIT_OK


def _explain_infeasible(problem: Problem, b: Budgeted, e: InfeasibleBudgetError,
                        shapes: dict[str, str], *, json_out: bool) -> int:
    from solvers.explain import culprits
    from solvers.planner import min_feasible_peak

    low = min_feasible_peak(problem, b.config)
    rows = culprits(problem, low.plan, low.report) if low.plan and low.report else []
    if json_out:
        print_json({"budget": problem.budget, "feasible": False, "min_feasible": e.min_feasible,
                    "culprits": [{**dataclasses.asdict(c), "shape": shapes.get(c.name, "-")}
                                 for c in rows]})
        return EXIT_NO_PLAN
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(140, Console().width))
    smallest = "unknown" if e.min_feasible is None else f"{format_bytes(e.min_feasible)} ({e.min_feasible} B)"
    console.print(f"budget {format_bytes(problem.budget or 0)} cannot be met; the smallest feasible "
                  f"budget is {smallest}.")
    if low.report is not None:
        table = Table(title=f"what is live at the peak (step {low.report.peak_step}) of the smallest-peak plan")
        for col in ("#", "value", "op", "dtype[shape]", "bytes", "why it cannot be freed"):
            table.add_column(col)
        for c in rows:
            table.add_row(str(c.index), c.name, c.op or "-", shapes.get(c.name, "-"), format_bytes(c.size), c.why)
        console.print(table)
    return EXIT_NO_PLAN


# ---- plot ---------------------------------------------------------------------------


def _plot(args: argparse.Namespace) -> int:
    try:
        from solvers.plots import pareto_figure, pareto_sweep, save_png, timeline_figure
    except ImportError as e:
        raise UsageError(f"plot needs matplotlib ({e}); pip install matplotlib") from None
    _check_folder(args.out_dir, "--out-dir")
    source = load_source(args)
    b = with_budget(source.problem, args)
    problem = b.problem
    solved = run_solver(problem, args.solver, b.config, progress=False)
    if solved.result.plan is None:
        _error(f"{args.solver} found no plan within {format_bytes(problem.budget or 0)}")
        return EXIT_NO_PLAN
    before, after = save_all(problem).report, solved.result.report
    assert before is not None and after is not None  # every solver reports its plan
    os.makedirs(args.out_dir, exist_ok=True)
    stem = _safe(problem.name or "problem")
    timeline = os.path.join(args.out_dir, f"{stem}-timeline.png")
    save_png(timeline_figure(problem, before, after, budget=problem.budget), timeline)
    sweep = SolverConfig(time_limit=args.sweep_time_limit, workers=args.workers, seed=args.seed,
                         deterministic=args.deterministic)
    points = pareto_sweep(problem, points=args.points, config=sweep)
    pareto = os.path.join(args.out_dir, f"{stem}-pareto.png")
    save_png(pareto_figure(problem, points, time_unit=_time_unit(problem), budget=problem.budget), pareto)
    print(f"wrote {timeline}\nwrote {pareto}")
    return EXIT_OK


def _memory(text: str) -> int:
    """``--memory``: bytes of device memory per rank, from 1 KiB (a bare ``80`` is a slip)."""
    example = "give bytes per rank, e.g. 80GiB, 81559MiB or 85520809984"
    try:
        size = parse_size(text)
    except ValueError as e:
        raise UsageError(f"--memory {e}; {example}") from None
    if size is None:
        raise UsageError(f"--memory {text!r} is not a size: {example}")
    if size <= 0:
        raise UsageError(f"--memory {text!r} is {'zero' if size == 0 else 'negative'}: {example}")
    if not size <= MAX_BYTES:
        raise UsageError(f"--memory {text!r} is over {MAX_BYTES_TEXT}: {example}")
    if size < MIN_BYTES:
        raise UsageError(f"--memory {text!r} is {math.floor(size)} B, under 1 KiB: did you mean "
                         f"'{text.strip()}GiB'?")
    return math.floor(size)


def _fit(args: argparse.Namespace) -> int:
    memory = None if args.memory is None else _memory(args.memory)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise UsageError(f"--plot needs matplotlib ({e}); pip install matplotlib") from None
        _check_folder(args.plot, "--plot")
    from rematc import fit as fitting
    from rematc.devices import profile_for
    from rematc.wholestep import StepSetup

    if is_factory(args.source):
        source: Any = fitting.load_fit_factory(args.source)
        name = args.source.rpartition(":")[2]
    else:
        source = fitting.load_config(args.source)
        name = _safe(os.path.basename(os.path.normpath(args.source)).removesuffix(".json"))
    on_gpu = args.device != "cpu"
    setup = StepSetup(optimizer=args.optimizer, precision=args.precision, fsdp=args.fsdp,
                      device_type="cuda" if on_gpu else "cpu",
                      reserve=args.reserve if args.reserve is not None else (0.05 if on_gpu else 0.0),
                      workspace=profile_for(args.device).workspace)
    report = fitting.fit(source, device=args.device, memory=memory, setup=setup, batches=args.batch,
                         seqs=args.seq, name=name,
                         config=(fitting.DEFAULT_CONFIG if args.time_limit is None
                                 else SolverConfig(time_limit=args.time_limit)))
    if args.json:
        print_json(report.to_json(), indent=2)
    else:
        print("\n".join(fitting.describe(report)))
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        path = os.path.join(args.plot, f"{_safe(name)}-fit.png")
        fitting.save_plot(report, path)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return EXIT_OK if report.best() is not None else EXIT_NO_PLAN


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "problem"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
