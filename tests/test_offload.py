"""Offload plans end to end on the CPU (host-to-host copies): the same loss, gradients and
buffers as eager, the expected ops in the emitted graphs, and random plans that mix all
three decisions over the transformer and the CNN."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rematc
import rematc.partition
from rematc.emit import EmitError, verify_offload
from rematc.offload import OFFLOAD, RELOAD, WAIT
from rematc.options import Options
from rematc.partition import Planned
from solvers import Decision, PlanError, Problem, SolveResult, Status, check, plan_from_decisions
from solvers.plan import needed_values
from tests.helpers import MODELS, Spy, StepResult, assert_same_step, run_step, spy_step

# Copies this fast are free, so any budget the plain peak exceeds is met by offloading.
FAST_LINK = 1e13
EAGER_TOL = {"rtol": 1e-5, "atol": 1e-6}


def compiled_step(name: str, **options: Any) -> tuple[StepResult, StepResult, Spy]:
    """One eager step and one step compiled with rematc's partitioner (eager codegen)."""
    model, inputs = MODELS[name]()
    reference = run_step(model, model, inputs)
    result, spy = spy_step(name, **options)
    return reference, result, spy


def count(gm: fx.GraphModule, op: object) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is op)


# The CNN's floor is its convolution backward's scratch memory (86% of its plain peak), which
# no decision moves, so its budget sits between that floor and the plain peak.
@pytest.mark.parametrize(("name", "budget"), [("gpt", 0.8), ("cnn", 0.9)])
def test_offload_plan_matches_eager_and_emits_one_copy_pair_per_value(name: str, budget: float) -> None:
    reference, result, spy = compiled_step(name, budget=budget, host_bandwidth=FAST_LINK)
    assert_same_step(reference, result, **EAGER_TOL)
    record = rematc.records()[-1]
    assert record.plan is not None
    offloaded = record.plan.of(Decision.OFFLOAD)
    assert offloaded, "with free copies, a budget below the plain peak is met by offloading"
    fw, bw = spy.graphs[-1]
    assert (count(fw, OFFLOAD), count(fw, WAIT)) == (len(offloaded), len(offloaded))
    assert (count(bw, RELOAD), count(bw, WAIT)) == (len(offloaded), len(offloaded))
    names = {record.problem.nodes[v].name for v in offloaded}
    saved = {a.name for a in fw.graph.find_nodes(op="output")[0].all_input_nodes}
    assert not names & saved, "an offloaded tensor is saved as its host copy, not itself"


def test_without_a_host_link_nothing_is_offloaded() -> None:
    reference, result, spy = compiled_step("gpt", budget=0.8)
    assert_same_step(reference, result, **EAGER_TOL)
    plan = rematc.records()[-1].plan
    assert plan is not None and not plan.of(Decision.OFFLOAD)
    fw, bw = spy.graphs[-1]
    assert count(fw, OFFLOAD) == count(bw, RELOAD) == 0


def test_verify_rejects_a_missing_wait() -> None:
    _, _, spy = compiled_step("gpt", budget=0.8, host_bandwidth=FAST_LINK)
    record = rematc.records()[-1]
    fw, bw = spy.graphs[-1]
    emitted = rematc.emit.Emitted(fw, bw, record.saved, record.recomputed,
                                  offloaded=tuple(n.name for n in fw.graph.nodes
                                                  if any(u.target is OFFLOAD for u in n.users)))
    verify_offload(emitted)  # as emitted: fine
    wait = next(n for n in bw.graph.nodes if n.target is WAIT)
    wait.replace_all_uses_with(wait.args[0])
    bw.graph.erase_node(wait)
    with pytest.raises(EmitError, match="needs exactly one copy back and one wait"):
        verify_offload(emitted)


# ---- random plans ----------------------------------------------------------------------


def random_plan(problem: Problem, rng: random.Random) -> SolveResult:
    """A random valid plan: each candidate saved, recomputed or offloaded where allowed,
    decisions kept only for what the backward then reads, offloads it cannot place saved."""
    choice: dict[int, Decision] = {}
    for v in problem.candidates:
        node = problem.nodes[v]
        fates = [Decision.SAVE]
        fates += [Decision.RECOMPUTE] if node.recomputable else []
        fates += [Decision.OFFLOAD] if node.offloadable and problem.host_bandwidth > 0 else []
        choice[v] = rng.choice(fates)
    while True:  # drop decisions nothing reads any more, until nothing changes
        rec = {v for v, d in choice.items() if d is Decision.RECOMPUTE}
        needed = needed_values(problem, rec)
        kept = {v: d for v, d in choice.items() if v in needed}
        if kept == choice:
            break
        choice = kept
    return placed(problem, choice, "random")


def placed(problem: Problem, choice: dict[int, Decision], solver: str) -> SolveResult:
    """``choice`` as a checked plan: its offloads added one at a time, each kept where the
    checker accepts the plan with it and saved where no step can carry its copies (one
    such value must not take the others down with it)."""
    wanted = sorted(v for v, d in choice.items() if d is Decision.OFFLOAD)
    choice = {v: Decision.SAVE if d is Decision.OFFLOAD else d for v, d in choice.items()}
    for v in wanted:
        try:
            check(problem, plan_from_decisions(problem, {**choice, v: Decision.OFFLOAD}))
            choice[v] = Decision.OFFLOAD
        except PlanError:
            pass
    plan = plan_from_decisions(problem, choice)
    report = check(problem, plan)
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=report, objective=report.added_time,
                       bound=0.0, wall_time=0.0, solver=solver)


def offload_plan(problem: Problem) -> SolveResult:
    """Every offloadable value the backward reads offloaded where a step can carry its
    copies, the rest saved: the plan with the most transfers, for checks that need them
    whatever they cost."""
    read = needed_values(problem, set())
    return placed(problem, {v: Decision.OFFLOAD if problem.nodes[v].offloadable else Decision.SAVE
                            for v in problem.candidates if v in read}, "offload-all")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["gpt", "cnn"]), seed=st.integers(0, 2**32 - 1))
def test_random_plans_match_eager(name: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    decided: list[dict[Decision, int]] = []

    def plan_for(problem: Problem, options: Options, *, known: object = None) -> Planned:
        result = random_plan(problem, random.Random(seed))
        assert result.plan is not None
        decided.append({d: len(result.plan.of(d)) for d in Decision})
        return Planned(result, cached=False)

    monkeypatch.setattr(rematc.partition, "plan_for", plan_for)
    torch._dynamo.reset()
    reference, result, _ = compiled_step(name, host_bandwidth=FAST_LINK)
    assert decided, "the partitioner did not run"
    assert_same_step(reference, result, **EAGER_TOL)


@pytest.mark.inductor
def test_offload_plan_under_inductor_matches_eager(same_random_as_eager: None) -> None:
    model, inputs = MODELS["gpt"]()
    reference = run_step(model, model, inputs)
    model, inputs = MODELS["gpt"]()
    # Below the no-budget plan's peak (fused pointwise values recomputed), which under
    # Inductor is taken whenever it fits.
    compiled = rematc.compile(model, budget=0.42, host_bandwidth=FAST_LINK)
    result = run_step(model, compiled, inputs)
    record = rematc.records()[-1]
    assert record.solver == "cpsat" and record.plan is not None and record.plan.of(Decision.OFFLOAD)
    assert_same_step(reference, result, rtol=1e-4, atol=1e-5)
