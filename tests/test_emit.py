"""Structure of the emitted graphs: the backward recomputes exactly what the plan says,
the forward returns exactly what it saves."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import rematc
from solvers import Decision
from tests.helpers import smallest_feasible_budget, spy_step


def partition(name: str, budget: object) -> tuple[fx.GraphModule, fx.GraphModule, rematc.PartitionRecord]:
    _, spy = spy_step(name, budget=budget)
    fw, bw = spy.graphs[-1]
    return fw, bw, rematc.records()[-1]


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_backward_recomputes_the_plan(name: str) -> None:
    budget = smallest_feasible_budget(name, compiler="eager")
    torch._dynamo.reset()
    fw, bw, record = partition(name, budget)
    fw_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    bw_copies = {n.name for n in bw.graph.nodes if n.op == "call_function" and n.name in fw_ops}
    assert bw_copies, "the smallest budget must recompute something"
    assert bw_copies <= set(record.recomputed)
    # Every recomputed value's producing op is copied into the backward.
    problem, plan = record.problem, record.plan
    heads = {problem.nodes[v].name for v, d in plan.decisions.items() if d is Decision.RECOMPUTE}
    assert heads <= bw_copies
    # The forward returns the saved tensors after its real outputs, and the backward
    # takes them as inputs.
    saved_out = [a.name for a in fw.graph.find_nodes(op="output")[0].args[0][1:] if isinstance(a, fx.Node)]
    assert set(record.saved) <= set(saved_out)
    placeholders = {n.name for n in bw.graph.find_nodes(op="placeholder")}
    assert set(record.saved) <= placeholders
    assert not heads & set(record.saved)


def test_nothing_recomputed_when_everything_fits() -> None:
    fw, bw, record = partition("gpt", None)
    fw_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    assert not [n for n in bw.graph.nodes if n.op == "call_function" and n.name in fw_ops]
    assert record.recomputed == () and record.predicted_peak == record.unconstrained_peak
