"""Measured peak memory against step time, per model and configuration.

Each (model, configuration) runs in a fresh process (``bench/worker.py``, Inductor caches
off). For every model it writes ``<model>.csv``, ``<model>.md`` and ``<model>-pareto.png``
(peak against step time, Pareto front marked) under ``--out``, and ``machine-<model>.json`` (CPU,
cores, memory, library versions, date, the command line). Configurations are listed in
``bench/configs.py``; step-time ratios are to ``compile_default`` of the same run.

    python -m bench.run --models gpt2_sdpa --out bench/results/
    python -m bench.run --models gpt2_sdpa gpt2_math llama resnet unet --match --rss
    python -m bench.run --models gpt_tiny --configs eager rematc_90% --rematc-compiler eager

``--match`` adds, after the listed configurations, rematc (CP-SAT and knapsack) at the
measured peak of every PyTorch configuration of the run (compile, its memory budget,
checkpointing), so the two can be compared at equal memory.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/run.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import configs, models, summary

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20

# The CSV's columns, in order. Bytes and seconds; ratios as fractions.
COLUMNS = (
    "model", "config", "family", "ok", "error", "matches", "batch", "threads",
    "peak_bytes", "rss_peak_bytes", "step_s", "vs_compile", "step_min_s", "first_step_s",
    "compile_s", "loss", "grad_norm", "budget_bytes", "unconstrained_peak_bytes",
    "predicted_peak_bytes", "predicted_added_s", "predicted_overhead", "added_flops_frac",
    "solve_s", "partition_s", "solver", "status", "graphs", "recomputed", "saved",
    "offloaded", "min_feasible_bytes", "device", "undonated_bytes",
)


def run_worker(model: str, config: str, args: argparse.Namespace, *, mode: str = "time") -> dict[str, Any]:
    """One configuration in a fresh process; its JSON line, or an error row."""
    cmd = [sys.executable, "-m", "bench.worker", "--model", model, "--config", config,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--mode", mode,
           "--rematc-compiler", args.rematc_compiler, "--time-limit", str(args.time_limit),
           "--workers", str(args.workers), "--threads", str(args.threads), "--device", args.device]
    if args.batch is not None:
        cmd += ["--batch", str(args.batch)]
    if args.small:
        cmd.append("--small")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    env["REMATC_CACHE_DIR"] = "off"
    if mode == "rss":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave RSS (rematc.memory)
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)  # time with default malloc
    with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"model": model, "config": config, "ok": False,
                    "error": f"timed out after {args.timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [""]
    return {"model": model, "config": config, "ok": False,
            "error": f"worker exited with status {proc.returncode}: {tail[0][:300]}"}


def run_model(model: str, config_names: Sequence[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    todo = list(config_names)
    matched = False
    while todo:
        name = todo.pop(0)
        row = run_worker(model, name, args)
        if args.rss and row.get("ok"):
            rss = run_worker(model, name, args, mode="rss")
            row["rss_peak_bytes"] = rss.get("rss_peak_bytes")
        row.setdefault("family", configs.family(name))
        rows.append(row)
        print(f"  {name:<28} {row_line(row)}", flush=True)
        write_tables(model, rows, args)  # after every row: a crash keeps what ran
        if not todo and args.match and not matched:
            matched = True
            todo = match_configs(rows)
    return rows


def match_configs(rows: Sequence[dict[str, Any]]) -> list[str]:
    """rematc and its knapsack at the measured peak of each PyTorch configuration."""
    out: list[str] = []
    for r in rows:
        if r.get("ok") and r.get("family") in configs.PYTORCH_FAMILIES:
            for prefix in ("rematc_", "rematc_knapsack_"):
                name = f"{prefix}{int(r['peak_bytes'])}"
                if name not in out and all(x["config"] != name for x in rows):
                    out.append(name)
                    MATCHES[name] = r["config"]
    return out


MATCHES: dict[str, str] = {}  # config name -> the PyTorch config whose peak it takes


def row_line(row: dict[str, Any]) -> str:
    """One measured row as a progress line: peak and step, rematc's prediction and solve."""
    if not row.get("ok"):
        return f"failed: {row.get('error')}"
    text = f"peak {row['peak_bytes'] / MiB:8.1f} MiB  step {row['step_s']:.3f} s"
    if row.get("predicted_peak_bytes") is not None:
        text += f"  (predicted {row['predicted_peak_bytes'] / MiB:.1f} MiB, solve {row['solve_s']:.2f} s)"
    return text


# ----------------------------------------------------------------------- outputs


def finish(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with the derived columns (ratio to compile_default, the matched config)."""
    base = next((r.get("step_s") for r in rows if r["config"] == "compile_default" and r.get("ok")), None)
    out = []
    for r in rows:
        r = dict(r)
        r["matches"] = MATCHES.get(r["config"], r.get("matches") or "")
        if base and r.get("ok") and r.get("step_s") is not None:
            r["vs_compile"] = r["step_s"] / base
        out.append(r)
    return out


def write_tables(model: str, rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = finish(rows)
    write_csv(out / f"{model}.csv", rows, COLUMNS)
    (out / f"{model}.md").write_text(markdown(model, rows, args) + summary.markdown(rows))


def write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """``rows`` as CSV, ``columns`` in order (missing values empty, floats to 6 digits)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in columns})


def _csv_value(v: Any) -> Any:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return "" if v is None else v


def _mib(v: Any) -> str:
    return "" if v is None else f"{v / MiB:.1f}"


def _pct(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def _secs(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def markdown(model: str, rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    spec = models.MODELS[model]
    batch = next((r["batch"] for r in rows if r.get("batch")), args.batch or spec.batch)
    cuda = args.device.startswith("cuda")
    where = ("CUDA (TF32 matmuls). Peak: `torch.cuda.max_memory_allocated` during one step"
             if cuda else "CPU. Peak: `rematc.memory.profiler_peak` of one step")
    lines = [
        f"# {model}", "",
        f"{spec.note}; batch {batch}{' (toy sizes)' if args.small else ''}, fp32, {where}, "
        f"bytes above the pre-step live set "
        f"(includes the gradients). Step: median of {args.steps} steps after {args.warmup} "
        f"warm-up, default malloc, {args.threads or 'default'} torch thread(s); ratio to "
        f"`compile_default` of the same run. Compile: first "
        f"step less the median. Each configuration in a fresh process, Inductor caches off. "
        f"rematc codegen: {args.rematc_compiler}. Machine and versions: `machine-{model}.json`.", "",
        "| config | peak MiB | " + ("RSS MiB | " if args.rss else "")
        + "step s | vs compile | compile s | rematc predicted peak MiB | predicted overhead "
        "| added FLOPs | solve s | solver | loss |",
        "|---|---:|" + ("---:|" if args.rss else "") + "---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    failed = []
    for r in rows:
        name = r["config"] + (f" (= {r['matches']})" if r.get("matches") else "")
        if not r.get("ok"):
            failed.append(f"* `{r['config']}`: {r.get('error')}")
            continue
        cells = [name, _mib(r.get("peak_bytes"))]
        if args.rss:
            cells.append(_mib(r.get("rss_peak_bytes")))
        vs = r.get("vs_compile")
        cells += [_secs(r.get("step_s")), "" if vs is None else f"{vs:.2f}×",
                  _secs(r.get("compile_s")), _predicted(r),
                  _pct(r.get("predicted_overhead")), _pct(r.get("added_flops_frac")),
                  _secs(r.get("solve_s")), r.get("solver") or "",
                  "" if r.get("loss") is None else f"{r['loss']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if failed:
        lines += ["", "Failed:", "", *failed]
    return "\n".join(lines) + "\n"


def _predicted(row: dict[str, Any]) -> str:
    """The predicted peak, and the bytes of lost donations it may be exceeded by."""
    lost = row.get("undonated_bytes") or 0
    return _mib(row.get("predicted_peak_bytes")) + (f" (+{lost / MiB:.1f} undonated)" if lost else "")


MARKERS = {"eager": ("s", "tab:gray"), "compile": ("D", "black"), "pytorch budget": ("^", "tab:orange"),
           "checkpoint": ("v", "tab:green"), "rematc": ("o", "tab:blue"),
           "rematc knapsack": ("x", "tab:purple")}


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both time and peak, by increasing time."""
    front: list[tuple[float, float]] = []
    for t, m in sorted(points):
        if not front or m < front[-1][1]:
            front.append((t, m))
    return front


def point_labels(rows: Sequence[dict[str, Any]], *, spread: float = 0.02) -> list[tuple[str, float, float]]:
    """``(text, step, MiB)`` per point to name: each PyTorch configuration, and one label
    for each cluster of rematc rows whose peaks lie within ``spread`` of the cluster's
    lowest, at the fastest of them with their count (at loose budgets many rows take one
    plan, and their names would print over each other)."""
    labels: list[tuple[str, float, float]] = []
    clusters: list[list[dict[str, Any]]] = []
    for r in sorted(rows, key=lambda r: r["peak_bytes"]):
        if not str(r.get("family", "")).startswith("rematc"):
            labels.append((r["config"], r["step_s"], r["peak_bytes"] / MiB))
        elif clusters and r["peak_bytes"] <= clusters[-1][0]["peak_bytes"] * (1 + spread):
            clusters[-1].append(r)
        else:
            clusters.append([r])
    for members in clusters:
        fastest = min(members, key=lambda r: r["step_s"])
        text = fastest["config"]
        if len(members) > 1:
            lo, hi = members[0]["peak_bytes"] / MiB, members[-1]["peak_bytes"] / MiB
            span = f"{lo:.1f} MiB" if hi - lo < 0.05 else f"{lo:.1f}-{hi:.1f} MiB"
            text = f"rematc, {len(members)} rows at {span}"
        labels.append((text, fastest["step_s"], fastest["peak_bytes"] / MiB))
    return labels


def plot(model: str, rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("ok") and r.get("step_s") is not None]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for fam, (marker, color) in MARKERS.items():
        pts = [r for r in ok if r.get("family") == fam]
        if pts:
            ax.scatter([r["step_s"] for r in pts], [r["peak_bytes"] / MiB for r in pts],
                       marker=marker, color=color, label=fam, zorder=3)
    for text, x, y in point_labels(ok):
        ax.annotate(text, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    front = pareto_front([(r["step_s"], r["peak_bytes"] / MiB) for r in ok])
    if len(front) > 1:
        xs, ys = zip(*front, strict=True)
        ax.step(xs, ys, where="post", color="lightgray", linestyle="--", zorder=1, label="Pareto front")
    ax.set_xlabel("step time, median (s)")
    ax.set_ylabel("measured peak above pre-step live set (MiB)")
    ax.set_title(f"{model}: peak memory against step time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_info(argv: Sequence[str], module: str = "bench.run") -> dict[str, Any]:
    """What the numbers were measured on, and the command (``python -m <module> <argv>``)."""
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    mem = None
    try:
        kb = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                  if ln.startswith("MemTotal:"))
        mem = kb * 1024
    except (OSError, StopIteration):
        pass
    versions: dict[str, str | None] = {}
    for pkg in ("torch", "ortools", "rematc", "numpy", "matplotlib", "transformers"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    commit: str | None
    dirty: bool | None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    import torch

    versions["torch"] = torch.__version__  # with its build (+cpu, +cu130), which the package's metadata omits
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu, "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(), "memory_bytes": mem,
        "platform": platform.platform(), "python": platform.python_version(),
        "versions": versions, "rematc_commit": commit, "rematc_dirty": dirty,
        "command": ["python", "-m", module, *portable(argv)],
    }


def portable(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--out`` relative to the repository (no machine's paths recorded)."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--out":
            path = Path(out[i + 1]).resolve()
            out[i + 1] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2_sdpa"], choices=sorted(models.MODELS))
    p.add_argument("--configs", nargs="+", default=list(configs.DEFAULT_CONFIGS),
                   help="configuration names (bench/configs.py); default: %(default)s")
    p.add_argument("--match", action="store_true",
                   help="then rematc and its knapsack at each PyTorch configuration's measured peak")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--rss", action="store_true",
                   help="cross-check the peak by RSS in a second process per configuration")
    add_worker_options(p)
    args = p.parse_args(argv)
    check_configs(p, args.configs)
    return args


def check_configs(p: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """A usage error for an unknown configuration name, before any process runs (not
    after an hour of runs)."""
    for name in names:
        try:
            configs.family(name)
        except ValueError as e:
            p.error(str(e))


def add_worker_options(p: argparse.ArgumentParser) -> None:
    """The options :func:`run_worker` reads: how each configuration's process measures."""
    p.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing; the first compiles")
    p.add_argument("--batch", type=int, default=None, help="default: each model's benchmark batch")
    p.add_argument("--small", action="store_true", help="toy sizes of each model (tests)")
    p.add_argument("--rematc-compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT seconds per graph")
    p.add_argument("--workers", type=int, default=0, help="CP-SAT workers; 0 = 8, its full portfolio")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker; 0 = default")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda: peak by torch.cuda.max_memory_allocated, TF32 matmuls")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(argv)
    info["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    for model in args.models:
        (out / f"machine-{model}.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"{model}: {models.MODELS[model].note}", flush=True)
        rows = run_model(model, args.configs, args)
        plot(model, finish(rows), out / f"{model}-pareto.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
