"""``rematc demo``: train a small GPT for a few steps on CPU at several budgets.

For the default ``torch.compile`` and for rematc at each budget it reports, side by side
in one run: the peak memory rematc predicted and the peak measured (torch profiler
allocator events, see :mod:`rematc.memory`), the median step time and its ratio to the
default compile, the solver's time and the loss after training.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import rematc
from rematc._torch_compat import BackendCompilerFailed
from rematc.errors import NoPlanError
from rematc.memory import profiler_peak
from rematc.models import GPTConfig, make_gpt
from solvers import InfeasibleBudgetError
from solvers.budget import format_bytes

DEMO_CONFIG = GPTConfig(n_layer=2, d_model=128, n_head=4, seq_len=128, vocab=512, dropout=0.1)
DEMO_BATCH = 4
WARMUP = 2  # steps before timing: the first compiles, the second settles caches


@dataclass(frozen=True)
class Row:
    label: str
    budget: int | None
    predicted: int | None
    measured: int
    step_time: float
    solve_time: float | None
    recomputed: int | None
    loss: float


def run_config(label: str, make_compiled: Callable[[torch.nn.Module], Any], *, steps: int,
               config: GPTConfig, batch: int) -> Row:
    torch._dynamo.reset()
    # The same dropout seeds for every configuration: Inductor draws each step's seed from
    # the global generator, so the losses of the rows agree.
    torch.manual_seed(0)
    model, inputs = make_gpt(config, batch=batch, seed=0)
    compiled = make_compiled(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = len(rematc.records())

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
        budget=record.budget if record else None,
        predicted=record.predicted_peak if record else None,
        measured=measured,
        step_time=statistics.median(times),
        solve_time=record.solve_time if record else None,
        recomputed=len(record.recomputed) if record else None,
        loss=loss,
    )


def demo(budgets: Sequence[str | float | None] = (None, "75%", "55%"), *, compiler: str = "inductor",
         steps: int = 5, config: GPTConfig = DEMO_CONFIG, batch: int = DEMO_BATCH,
         print_fn: Callable[[Any], None] | None = None) -> list[Row]:
    """Run the demo and print a table; returns the rows."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    out = print_fn or console.print
    out(f"GPT: {config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads, "
        f"T {config.seq_len}, batch {batch}, dropout {config.dropout}; {WARMUP}+{steps} SGD steps per config, step time the median of the last {steps}")
    base_compiler = None if compiler == "inductor" else "aot_eager"
    baseline = base_compiler or "inductor"

    def default_compile(m: torch.nn.Module) -> Any:
        return torch.compile(m, backend=baseline)

    def rematc_compile(budget: str | float | None) -> Callable[[torch.nn.Module], Any]:
        return lambda m: rematc.compile(m, budget=budget, compiler=compiler)

    rows = [run_config(f"torch.compile ({baseline})", default_compile, steps=steps,
                       config=config, batch=batch)]
    for b in budgets:
        rows.append(run_config(f"rematc {b or 'no budget'}", rematc_compile(b), steps=steps, config=config,
                               batch=batch))
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
    return rows
