"""``rematc demo``: the trade-off rematc makes, on a small GPT trained for a few steps on
the CPU, beside what a PyTorch user would pick instead.

Rows, measured side by side in one run (:func:`run_config`): the default
``torch.compile``; PyTorch's own ways to save memory (checkpointing each block with
``torch.utils.checkpoint``, and the partitioner's ``activation_memory_budget``); then
rematc without a budget and at budgets that bind, spread evenly from that plan's predicted
peak down to the smallest budget rematc states feasible (:func:`least_feasible`). Each row
gives the peak rematc predicted (rematc rows), the peak measured (torch profiler allocator
events above the pre-step live set, :mod:`rematc.memory`), the median step time and its
ratio to the default compile's, the solver's time and the loss after training. The peaks
and step times are also drawn as a Pareto picture (:func:`draw`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import rematc
from rematc._torch_compat import BackendCompilerFailed, functorch_config
from rematc.errors import NoPlanError
from rematc.memory import profiler_peak
from rematc.models import GPTConfig, make_gpt
from solvers import InfeasibleBudgetError
from solvers.budget import format_bytes

DEMO_CONFIG = GPTConfig(n_layer=2, d_model=128, n_head=4, seq_len=128, vocab=512, dropout=0.1)
DEMO_BATCH = 4
WARMUP = 2  # steps before timing: the first compiles, the second settles caches
# Where the chosen budgets lie between the smallest feasible budget (0) and the no-budget
# plan's predicted peak (1): each below the latter, so each binds.
BINDING = (0.75, 0.5, 0.25, 0.0)
PROBE_BUDGET = 4096  # bytes: under any step's need, so a compile at it states the smallest
MEMORY_BUDGETS = (0.5, 0.1)  # the partitioner's activation_memory_budget rows


@dataclass(frozen=True)
class Row:
    label: str
    rematc: bool  # a rematc plan (else the default compile or a PyTorch option)
    budget: int | None
    predicted: int | None
    measured: int
    step_time: float
    solve_time: float | None
    recomputed: int | None
    loss: float


def run_config(label: str, make_compiled: Callable[[nn.Module], Any], *, steps: int, config: GPTConfig,
               batch: int, setting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
               ) -> Row:
    """Train ``make_compiled(model)`` for ``WARMUP + steps`` SGD steps under ``setting()``,
    then measure one more step's peak. The row's rematc fields come from the last record
    rematc made for it (none for a row that is not rematc's)."""
    torch._dynamo.reset()
    # The same dropout seeds for every configuration: Inductor draws each step's seed from
    # the global generator, so the losses of the rows agree.
    torch.manual_seed(0)
    model, inputs = make_gpt(config, batch=batch, seed=0)
    before = len(rematc.records())
    with setting():
        compiled = make_compiled(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step() -> torch.Tensor:
            try:
                loss = compiled(*inputs)
            except BackendCompilerFailed as e:
                # No plan fits the budget: rematc's answer, not a failure of the compile, and
                # the command line says it in one line (exit status 1).
                inner = e.inner_exception
                if isinstance(inner, (InfeasibleBudgetError, NoPlanError)):
                    raise inner from inner.__cause__
                raise
            loss.backward()
            return loss

        times, loss = [], float("nan")
        for k in range(WARMUP + steps):  # the first step compiles
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = step().item()
            if k >= WARMUP:
                times.append(time.perf_counter() - t0)
            opt.step()
        opt.zero_grad(set_to_none=True)
        measured = profiler_peak(step)
    new = rematc.records()[before:]
    record = new[-1] if new else None
    return Row(
        label=label,
        rematc=record is not None,
        budget=record.budget if record else None,
        predicted=record.predicted_peak if record else None,
        measured=measured,
        step_time=statistics.median(times),
        solve_time=record.solve_time if record else None,
        recomputed=len(record.recomputed) if record else None,
        loss=loss,
    )


def least_feasible(*, compiler: str, config: GPTConfig, batch: int) -> int:
    """The smallest budget rematc states feasible for the demo's step: what its compile at
    :data:`PROBE_BUDGET` says (the figure its error gives users, which holds when used)."""
    torch._dynamo.reset()
    model, inputs = make_gpt(config, batch=batch, seed=0)
    compiled = rematc.compile(model, budget=PROBE_BUDGET, compiler=compiler)
    try:
        compiled(*inputs).backward()
    except BackendCompilerFailed as e:
        inner = e.inner_exception
        if isinstance(inner, InfeasibleBudgetError) and inner.min_feasible is not None:
            return inner.min_feasible
        raise
    except InfeasibleBudgetError as e:
        if e.min_feasible is not None:
            return e.min_feasible
        raise
    raise RuntimeError(f"the demo's step fits in {PROBE_BUDGET} bytes: it cannot show a trade-off")


class Checkpointed(nn.Module):
    """A block whose activations ``torch.utils.checkpoint`` recomputes in the backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.block, x, use_reentrant=False)
        return out


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """``model`` (a :class:`rematc.models.GPT`) with each block checkpointed, in place."""
    blocks = model.blocks
    assert isinstance(blocks, nn.ModuleList)
    for i, block in enumerate(blocks):
        blocks[i] = Checkpointed(block)
    return model


def demo(budgets: Sequence[str | float | None] | None = None, *, compiler: str = "inductor",
         steps: int = 3, config: GPTConfig = DEMO_CONFIG, batch: int = DEMO_BATCH,
         plot: str | Path | None = None, print_fn: Callable[[Any], None] | None = None) -> list[Row]:
    """Run the demo, print its table and, with ``plot``, draw it there (a PNG); returns the
    rows. ``budgets`` None: no budget, then the budgets of :data:`BINDING`."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    out = print_fn or console.print
    out(f"GPT: {config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads, "
        f"T {config.seq_len}, batch {batch}, dropout {config.dropout}; {WARMUP}+{steps} SGD steps "
        f"per config, step time the median of the last {steps}")
    baseline = "inductor" if compiler == "inductor" else "aot_eager"
    # The partitioner that reads activation_memory_budget: Inductor's, or the same with
    # aot_eager's codegen for the eager route (its decompositions draw dropout's masks
    # otherwise, so its losses differ from the other rows' there).
    partitioned = "inductor" if compiler == "inductor" else "aot_eager_decomp_partition"

    def default_compile(m: nn.Module) -> Any:
        return torch.compile(m, backend=baseline)

    def rematc_compile(budget: str | float | int | None) -> Callable[[nn.Module], Any]:
        return lambda m: rematc.compile(m, budget=budget, compiler=compiler)

    def memory_budget(fraction: float) -> Callable[[], contextlib.AbstractContextManager[None]]:
        return lambda: functorch_config.patch(activation_memory_budget=fraction)

    def run(label: str, make: Callable[[nn.Module], Any], **kw: Any) -> Row:
        return run_config(label, make, steps=steps, config=config, batch=batch, **kw)

    rows = [run(f"torch.compile ({baseline})", default_compile),
            run("checkpoint each block", lambda m: default_compile(checkpoint_blocks(m)))]
    rows += [run(f"activation_memory_budget {f}", lambda m: torch.compile(m, backend=partitioned),
                 setting=memory_budget(f)) for f in MEMORY_BUDGETS]
    if budgets is None:
        free = run("rematc no budget", rematc_compile(None))
        assert free.predicted is not None
        least = least_feasible(compiler=compiler, config=config, batch=batch)
        chosen = sorted({round(least + (free.predicted - least) * f) for f in BINDING}, reverse=True)
        rows += [free] + [run(f"rematc {format_bytes(b)}", rematc_compile(b)) for b in chosen]
    else:
        rows += [run(f"rematc {b or 'no budget'}", rematc_compile(b)) for b in budgets]
    base = rows[0].step_time
    table = Table(title=f"rematc demo ({compiler} codegen; memory above the pre-step live set)")
    for col in ("config", "budget", "predicted peak", "measured peak", "step", "vs compile",
                "solve", "recomputed", "loss"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        table.add_row(
            r.label,
            format_bytes(r.budget) if r.budget is not None else "-",
            format_bytes(r.predicted) if r.predicted is not None else "-",
            format_bytes(r.measured),
            f"{r.step_time * 1e3:.1f} ms",
            f"{r.step_time / base:.2f}x",
            f"{r.solve_time:.2f} s" if r.solve_time is not None else "-",
            str(r.recomputed) if r.recomputed is not None else "-",
            f"{r.loss:.4f}",
        )
    out(table)
    if plot is not None:
        draw(rows, plot, title=f"{config.n_layer}-layer GPT, batch {batch}, {compiler} codegen")
        out(f"wrote {plot}")
    return rows


def draw(rows: Sequence[Row], path: str | Path, *, title: str) -> None:
    """Measured peak against step time, one point a row, as a PNG at ``path``: rematc's
    plans joined by a line (its frontier), the other rows as labelled points."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    mib = 2.0**20
    ours = sorted((r for r in rows if r.rematc), key=lambda r: r.measured)
    ax.plot([r.measured / mib for r in ours], [r.step_time * 1e3 for r in ours], "o-", color="tab:blue",
            label="rematc (budget)")
    for r in ours:
        ax.annotate(format_bytes(r.budget) if r.budget is not None else "no budget",
                    (r.measured / mib, r.step_time * 1e3), textcoords="offset points", xytext=(4, 4),
                    fontsize=7, color="tab:blue")
    others = [r for r in rows if not r.rematc]
    for k, r in enumerate(others):
        ax.plot(r.measured / mib, r.step_time * 1e3, "s", color="tab:orange")
        # Labels stagger downwards: the PyTorch rows often lie close together.
        ax.annotate(r.label, (r.measured / mib, r.step_time * 1e3), textcoords="offset points",
                    xytext=(4, -10 - 9 * (k % 4)), fontsize=7, color="tab:orange")
    ax.set_xlabel("measured peak of a training step (MiB)")
    ax.set_ylabel("step time (ms, median)")
    ax.set_title(title)
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)

