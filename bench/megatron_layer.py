"""GPT-3 175B transformer layers on meta tensors: rematc's plan at the activation memory
of Megatron-LM's selective recomputation, and its extra FLOPs next to Megatron's.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), §4: a layer stores s·b·h·(34 + 5·a·s/h) bytes of activations in 16-bit; selective
recomputation drops the 5·a·s²·b attention-core part (QKᵀ scores, softmax, its dropout
mask and output) and recomputes it in the backward, leaving 34·s·b·h bytes, for 2.7% more
FLOPs on GPT-3 175B (a full model, by its FLOPs formula).

The model: ``--layers`` (4) of rematc's pre-norm GPT block at h = 12288, a = 96 heads,
s = 2048, b = 1, bf16, with explicit softmax(QKᵀ)V attention and no dropout (so no dropout
masks: 2·s·b·h of Megatron's 34 are not there), on the ``meta`` device: nothing is
allocated or computed. Several layers, because in a deep stack what the budget has to
hold is every layer's stored activations plus one layer's backward buffers; one layer's
peak is mostly its own backward buffers. Traced with plain AOTAutograd (``rematc.trace``,
target ``eager``): Inductor's joint-graph passes constant-fold graphs whose tensors are
all on ``meta`` down to ``empty_strided`` calls. Costs: rematc's roofline on the A100
profile (the paper's hardware), without Inductor's fusion. Weight gradients are given
size 0: Megatron accumulates them into preallocated buffers (gradient-accumulation
fusion), so they take no new memory during the step. Extra FLOPs are a fraction of
3 × the forward's FLOPs (forward and backward of trained weights, the convention of
Megatron's formula).

Plans, all judged by rematc's checker (its memory model: recomputations placed before
the same backward op count as live together, an upper bound):

* ``save everything``;
* ``megatron selective``: Megatron's choice as a rematc plan: recompute every value with
  b·a·s² elements (the scores, scaled, masked, softmax), save the rest;
* rematc (CP-SAT) at ``34sbh/layer + floor``: 34·s·b·h bytes per layer on top of the
  floor, the peak of what every plan holds (rematc's budget bounds the step's peak, not
  stored activations alone);
* rematc at the peak of Megatron's plan (the same memory by the same model).

    python -m bench.megatron_layer [--layers 4 --hidden 12288 --heads 96 --seq 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/megatron_layer.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from rematc.models import Block, GPTConfig
from rematc.trace import SHAPES_KEY, trace
from solvers import InfeasibleBudgetError, SolverConfig, save_all, solve
from solvers.baselines import plan_with
from solvers.checker import Report, check
from solvers.floor import baseline
from solvers.problem import Problem

MEGATRON_EXTRA_FLOPS = 0.027  # Korthikanti et al. 2022, Table 4, GPT-3 175B, selective


class Stack(nn.Module):
    """``n`` blocks; the loss is the sum of the output (its gradient is a free expand)."""

    def __init__(self, config: GPTConfig, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(config) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


@dataclass(frozen=True)
class Row:
    name: str
    budget: int | None  # bytes
    peak: int  # bytes, the checker's
    saved: int  # bytes kept from the forward for the backward
    added_flops: float  # fraction of the layer's forward + backward FLOPs
    added_time: float  # seconds, A100 roofline
    recomputed: int  # values
    solve_time: float
    status: str = ""  # the solver's, for rematc's plans


def capture(hidden: int, heads: int, seq: int, batch: int, layers: int) -> Problem:
    config = GPTConfig(n_layer=1, d_model=hidden, n_head=heads, seq_len=seq, vocab=8,
                       attention="math")
    with torch.device("meta"):
        model = Stack(config, layers).to(torch.bfloat16)
    # The layer's input needs a gradient: it is the previous layer's output.
    x = torch.empty(batch, seq, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    problem = trace(model, (x,), device="a100", target="eager", name="gpt3_layer").problem
    return without_weight_grads(problem, f"[{batch}, {seq}, {hidden}]")


def without_weight_grads(problem: Problem, input_shape: str) -> Problem:
    """The problem with zero-size weight gradients: Megatron accumulates them into
    preallocated buffers (gradient-accumulation fusion), so they take no new memory in the
    step, and a stack of layers holds one layer's activations per layer, not its gradients.
    The layer's input gradient (its output to the previous layer) keeps its size."""
    shapes = json.loads(problem.meta[SHAPES_KEY])
    nodes = tuple(
        replace(n, size=0) if n.backward and n.keep and not shapes.get(n.name, "").endswith(input_shape)
        else n
        for n in problem.nodes
    )
    return Problem(nodes=nodes, budget=problem.budget, host_bandwidth=problem.host_bandwidth,
                   name=problem.name, meta=dict(problem.meta))


def attention_core(problem: Problem, *, batch: int, heads: int, seq: int) -> set[int]:
    """Candidate values of shape [b, a, s, s]: what Megatron's selective recomputation drops."""
    shapes = json.loads(problem.meta[SHAPES_KEY])

    def numel(shape: str) -> int:
        dims = shape.partition("[")[2].rstrip("]")
        return math.prod(int(d) for d in dims.split(",")) if dims.strip() else 1

    return {v for v in problem.candidates
            if problem.nodes[v].recomputable and (shape := shapes.get(problem.nodes[v].name, ""))
            and shape.endswith(f"{seq}, {seq}]") and numel(shape) == batch * heads * seq * seq}


def row(name: str, problem: Problem, report: Report, *, total_flops: float, solve_time: float = 0.0,
        status: str = "") -> Row:
    return Row(name, problem.budget, report.peak, report.saved_bytes, report.added_flops / total_flops,
               report.added_time, report.n_recomputed, solve_time, status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=12288)
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4, help="layers stacked (see the docstring)")
    p.add_argument("--time-limit", type=float, default=120.0)
    p.add_argument("--json", help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    s, b, h, heads = a.seq, a.batch, a.hidden, a.heads
    t0 = time.perf_counter()
    problem = capture(h, heads, s, b, a.layers)
    print(f"GPT-3-scale layers ({a.layers}) h={h} a={heads} s={s} b={b} bf16 on meta: {len(problem.nodes)} values, "
          f"traced in {time.perf_counter() - t0:.1f} s")
    # Forward + backward of a layer whose weights train: 3 × the forward's FLOPs (the
    # convention of Megatron's formula, 72·b·s·h² + 12·b·s²·h = 3 × the forward).
    total_flops = 3 * sum(n.flops for n in problem.nodes[: problem.n_forward])
    floor = max(baseline(problem), default=0)
    everything = save_all(problem)
    assert everything.report is not None
    rows = [row("save everything", problem, everything.report, total_flops=total_flops)]
    core = attention_core(problem, batch=b, heads=heads, seq=s)
    megatron = check(problem, plan_with(problem, core))
    rows.append(row("megatron selective", problem, megatron, total_flops=total_flops))
    MiB = 2**20
    print(f"floor (held by every plan) {floor / MiB:.0f} MiB; save-everything activations "
          f"{everything.report.saved_bytes / MiB:.0f} MiB vs Megatron's formula "
          f"{a.layers} × s·b·h·(34 + 5as/h) = {a.layers * s * b * h * (34 + 5 * heads * s / h) / MiB:.0f} MiB")
    budgets = {"34sbh/layer + floor": 34 * s * b * h * a.layers + floor, "megatron plan's peak": megatron.peak}
    for name, budget in budgets.items():
        bounded = problem.with_budget(budget)
        try:
            result = solve(bounded, SolverConfig(time_limit=a.time_limit))
        except InfeasibleBudgetError as e:
            print(f"rematc at {name}: infeasible ({e})")
            continue
        assert result.plan is not None
        rows.append(row(f"rematc at {name}", bounded, check(bounded, result.plan),
                        total_flops=total_flops, solve_time=result.wall_time,
                        status=result.status.value))
    print(f"{'plan':<34} {'budget MiB':>10} {'peak MiB':>9} {'saved MiB':>9} {'sbh/layer':>9} "
          f"{'extra FLOPs':>11} {'extra ms':>8} {'recomputed':>10} {'solve s':>7} status")
    for r in rows:
        budget = f"{r.budget / MiB:.0f}" if r.budget is not None else "-"
        print(f"{r.name:<34} {budget:>10} {r.peak / MiB:>9.0f} {r.saved / MiB:>9.0f} "
              f"{r.saved / (s * b * h * a.layers):>9.1f} {r.added_flops:>11.2%} {r.added_time * 1e3:>8.2f} "
              f"{r.recomputed:>10} {r.solve_time:>7.2f} {r.status}")
    print(f"Megatron's selective recomputation on GPT-3 175B: {MEGATRON_EXTRA_FLOPS:.1%} extra FLOPs "
          "(whole model, its FLOPs formula)")
    if a.json:
        data: dict[str, Any] = {"hidden": h, "heads": heads, "seq": s, "batch": b,
                                "layers": a.layers, "floor": floor,
                                "total_flops": total_flops, "rows": [r.__dict__ for r in rows]}
        Path(a.json).write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
