"""The benchmark's configurations: each turns ``(model, settings)`` into the callable one
training step runs (``fn(*inputs)`` returns the loss; the step calls ``.backward()``).

Names (``--configs``):

| name | what |
| --- | --- |
| ``eager`` | the model as it is |
| ``eager_ckpt_every`` | ``torch.utils.checkpoint`` on every block, not compiled |
| ``compile_default`` | ``torch.compile`` (Inductor, default min-cut partitioner) |
| ``amb_<f>`` | ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = f`` (default knapsack solver) |
| ``ckpt_every`` / ``ckpt_every_other`` | ``checkpoint(block, ..., use_reentrant=False)`` on every (every other) block, then ``torch.compile`` |
| ``sac_matmul`` | selective activation checkpointing on every block: save matmuls, convolutions and the SDPA kernel, recompute the rest; then ``torch.compile`` |
| ``rematc_<b>`` | ``rematc.compile(model, budget=b)``; ``b`` is ``none``, a percentage (``60%``), a fraction (``0.6``), a size (``700MiB``) or bytes |
| ``rematc_knapsack_<b>`` | the same, with PyTorch's knapsack choice (``solvers.baselines.knapsack``) in place of CP-SAT |

Every configuration mutates process-wide state (PyTorch's config, rematc's solver hook),
so each runs in its own process (``bench/worker.py``).

rematc has no solver option, so ``rematc_knapsack_<b>`` replaces the ``solve`` that
``rematc.partition`` calls, in the worker process only, by :func:`knapsack_within_budget`:
the knapsack at the budget; if the checker finds that the plan's peak (which the knapsack
never models) overshoots the budget, the knapsack's capacity is tuned until its plan fits,
as a PyTorch user tunes ``activation_memory_budget`` until the step fits. The record's
``solver`` field says which: ``knapsack`` or ``knapsack_tuned``. Neither runs when rematc's
no-budget plan (the least peak recomputing fused pointwise values only) fits the budget: that plan is taken,
as PyTorch runs its knapsack only when its min-cut plan is over the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import rematc
import rematc.partition
from solvers import SolverConfig, SolveResult, Status
from solvers.baselines import knapsack, knapsack_choice, plan_with, save_all
from solvers.budget import parse_budget
from solvers.checker import Report, check
from solvers.floor import baseline
from solvers.plan import Plan
from solvers.problem import Problem

# What runs without a budget-sweep argument, in this order (compile_default first: the
# step-time ratios are to it). The rematc fractions are of rematc's own unconstrained peak.
DEFAULT_CONFIGS = (
    "compile_default", "eager", "amb_0.5", "amb_0.3", "amb_0.1", "amb_0.0",
    "ckpt_every", "ckpt_every_other", "sac_matmul",
    "rematc_none", "rematc_80%", "rematc_60%", "rematc_45%",
    "rematc_knapsack_80%", "rematc_knapsack_60%", "rematc_knapsack_45%",
)

# Families, for the plot's markers and for --match (which configs' peaks rematc matches).
PYTORCH_FAMILIES = ("compile", "pytorch budget", "checkpoint")

# Ops the ``sac_matmul`` policy saves (torchtitan's policy saves the matmuls and the
# attention kernel); convolution is the CNNs' matmul.
_aten = torch.ops.aten
SAC_SAVE = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.convolution.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
})


@dataclass(frozen=True, kw_only=True)
class Settings:
    # Codegen of rematc's graphs: "inductor", or "eager" (plain FX, no ~20 s compile:
    # for smoke tests).
    rematc_compiler: str = "inductor"
    # CP-SAT seconds per graph; the bench's graphs solve in seconds.
    time_limit: float = 60.0
    # CP-SAT workers; 0 = 8, its full portfolio (sharing the cores).
    workers: int = 0


@dataclass(frozen=True)
class Built:
    fn: Callable[..., torch.Tensor]  # fn(*inputs) -> loss
    family: str  # eager, compile, pytorch budget, checkpoint, rematc, rematc knapsack
    budget: str | None = None  # rematc's budget argument as given, "none" for no budget


def family(name: str) -> str:
    """The family of configuration ``name`` (``ValueError`` for an unknown name)."""
    if name in ("eager", "eager_ckpt_every"):
        return "eager" if name == "eager" else "checkpoint"
    if name == "compile_default":
        return "compile"
    if name.startswith("amb_"):
        return "pytorch budget"
    if name in ("ckpt_every", "ckpt_every_other", "sac_matmul"):
        return "checkpoint"
    if name.startswith("rematc_knapsack_"):
        return "rematc knapsack"
    if name.startswith("rematc_"):
        return "rematc"
    raise ValueError(
        f"unknown configuration {name!r}; expected eager, eager_ckpt_every, compile_default, "
        "amb_<fraction>, ckpt_every, ckpt_every_other, sac_matmul, rematc_<budget> or "
        "rematc_knapsack_<budget>"
    )


def build(name: str, model: nn.Module, settings: Settings = Settings()) -> Built:
    """The step callable of configuration ``name`` for ``model`` (modified in place: the
    checkpointing configurations wrap its ``blocks``)."""
    fam = family(name)
    if name == "eager":
        return Built(model, fam)
    if name == "eager_ckpt_every":
        return Built(wrap_blocks(model, every=1), fam)
    if name == "compile_default":
        return Built(torch.compile(model), fam)
    if name.startswith("amb_"):
        fraction = float(name.removeprefix("amb_"))
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name}: activation_memory_budget must be in [0, 1]")
        # Read when the graph is partitioned, at the first call; the process is fresh.
        torch._functorch.config.activation_memory_budget = fraction
        return Built(torch.compile(model), fam)
    if name in ("ckpt_every", "ckpt_every_other"):
        return Built(torch.compile(wrap_blocks(model, every=1 if name == "ckpt_every" else 2)), fam)
    if name == "sac_matmul":
        context = partial(create_selective_checkpoint_contexts, save_matmuls)
        return Built(torch.compile(wrap_blocks(model, every=1, context_fn=context)), fam)
    knap = fam == "rematc knapsack"
    arg = name.removeprefix("rematc_knapsack_" if knap else "rematc_")
    budget = rematc_budget(arg)
    if knap:
        use_knapsack()
    fn = rematc.compile(model, budget=budget, compiler=settings.rematc_compiler, cache_dir=None,
                        time_limit=settings.time_limit, workers=settings.workers)
    return Built(fn, fam, arg)


def rematc_budget(arg: str) -> Any:
    """``none`` -> None; ``0.6`` -> the fraction; anything else as ``rematc.parse_budget``
    reads it (``60%``, ``700MiB``, bytes)."""
    if arg.lower() == "none":
        return None
    try:
        value: Any = float(arg) if "." in arg and arg.replace(".", "", 1).isdigit() else arg
        parse_budget(value)
    except ValueError as e:
        raise ValueError(f"rematc_{arg}: {e}") from e
    return value


# ------------------------------------------------------------------ checkpointing


class Checkpointed(nn.Module):
    """``block`` run under ``torch.utils.checkpoint`` (non-reentrant), optionally with a
    ``context_fn`` (selective checkpointing)."""

    def __init__(self, block: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Keywords pass through: transformers' decoder layers take the mask and the rotary
        # tables as keywords.
        options = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(self.block, *args, use_reentrant=False, **options, **kwargs)


def wrap_blocks(model: nn.Module, *, every: int,
                context_fn: Callable[[], Any] | None = None) -> nn.Module:
    """Wrap blocks 0, every, 2·every, ... of ``model.blocks`` (or ``model.layers``) in
    :class:`Checkpointed`."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `blocks` or `layers` ModuleList to checkpoint")
    for i in range(0, len(blocks), every):
        blocks[i] = Checkpointed(blocks[i], context_fn)
    return model


def save_matmuls(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``sac_matmul`` policy: save the outputs of :data:`SAC_SAVE` ops, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


# ------------------------------------------------------------- knapsack baseline


def knapsack_within_budget(problem: Problem, config: SolverConfig = SolverConfig(), *,
                           rounds: int = 16) -> SolveResult:
    """PyTorch's knapsack choice (:func:`solvers.baselines.knapsack`) at the budget; if the
    checker's peak of that plan (which the knapsack never models) overshoots the budget,
    the knapsack with its capacity tuned: of ``rounds`` capacities evenly spaced from the
    floor to the unconstrained peak, the plan that fits with the least added time (peak is
    not monotone in the capacity, so a scan, not a bisection). Same signature as every
    solver; status INFEASIBLE and no plan when no capacity fits."""
    t0 = time.perf_counter()
    first = knapsack(problem, config)
    if first.plan is not None or problem.budget is None:
        return first
    items = [v for v in problem.candidates
             if problem.backward_uses[v] and problem.nodes[v].recomputable]
    floor = max(baseline(problem), default=0)
    everything = save_all(problem).report
    top = max(floor, everything.peak if everything is not None else floor)
    best: tuple[Plan, Report, int] | None = None
    for k in range(rounds):
        capacity = floor + (top - floor) * k // max(1, rounds - 1)
        saved = knapsack_choice(problem, items, capacity)
        plan = plan_with(problem, {v for v in items if v not in saved})
        report = check(problem, plan)
        if report.fits and (best is None or report.added_time < best[1].added_time):
            best = (plan, report, capacity)
    if best is None:
        return replace(first, wall_time=time.perf_counter() - t0)
    plan, report, capacity = best
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=report,
                       objective=report.added_time, bound=0.0,
                       wall_time=time.perf_counter() - t0, solver="knapsack_tuned",
                       stats={"capacity": capacity})


def use_knapsack() -> None:
    """Make rematc's partitioner plan with :func:`knapsack_within_budget` (this process)."""
    rematc.partition.solve = knapsack_within_budget
