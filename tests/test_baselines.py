"""Baselines: same signature and result type as the exact solver, judged by the checker."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers import Decision, Node, Problem, SolverConfig, Status, check, save_all, solve
from solvers.baselines import (
    LADDER_SCAN,
    checkpoint_every,
    free_recompute,
    greedy,
    holding_ladder,
    knapsack,
    knapsack_choice,
    plan_with,
    recompute_every,
    selective,
    sqrt_n,
)
from solvers.checker import Report
from solvers.floor import baseline
from solvers.problem import chain_problem
from solvers.result import InfeasibleBudgetError
from solvers.segments import segment_boundaries
from tests.test_cpsat import small_problems

BASELINES = {
    "save_all": save_all,
    "greedy": greedy,
    "checkpoint_every_1": partial(checkpoint_every, k=1),
    "checkpoint_every_2": partial(checkpoint_every, k=2),
    "sqrt_n": sqrt_n,
    "knapsack": knapsack,
    "free_recompute": free_recompute,
    "selective": selective,
}


def chain(budget: int | None = None) -> Problem:
    return chain_problem([4] * 8, [1.0] * 8, budget=budget)


def test_chain_boundaries_are_every_value_with_a_later_reader() -> None:
    p = chain()
    # f0..f6 each carry the chain alone; f7 (the last) has no forward reader.
    assert [p.nodes[v].name for v in segment_boundaries(p)] == [f"f{k}" for k in range(7)]


def test_a_constant_every_block_reads_hides_no_boundary() -> None:
    """A value computed from no input (a ``full`` fill value, a causal mask) read by every
    block is live across every step; the blocks' boundaries are still found, and
    checkpointing them lowers the peak."""
    p = chain()
    nodes = [p.nodes[0], Node(name="fill", size=1, time=0.0)]  # the constant at index 1
    for n in p.nodes[1:]:
        deps = tuple(d + (d >= 1) for d in n.deps)  # every later index moves up by one
        nodes.append(replace(n, deps=deps if n.backward else (*deps, 1)))
    q = Problem(nodes=tuple(nodes))
    assert [q.nodes[v].name for v in segment_boundaries(q)] == [f"f{k}" for k in range(7)]
    full, every = save_all(q).report, checkpoint_every(q, k=2).report
    assert full is not None and every is not None and every.peak < full.peak


@pytest.mark.parametrize("name", sorted(BASELINES))
@pytest.mark.parametrize("budget", [None, 36, 24, 20, 1])
def test_baseline_verdict_is_the_checker_s(name: str, budget: int | None) -> None:
    p = chain(budget)
    result = BASELINES[name](p, SolverConfig())
    assert result.report is not None
    if result.status in (Status.OPTIMAL, Status.FEASIBLE):
        assert result.plan is not None
        assert check(p, result.plan) == result.report
        assert result.report.fits
    else:
        assert result.status is Status.INFEASIBLE and result.plan is None
        assert not result.report.fits


def test_checkpointing_every_block_lowers_the_peak_of_a_chain() -> None:
    p = chain()
    full = save_all(p).report
    every = checkpoint_every(p, k=1).report
    assert full is not None and every is not None
    assert every.n_recomputed > 0 and every.added_time > 0


def test_knapsack_saves_within_its_byte_capacity_ignoring_liveness() -> None:
    p = chain(budget=24)
    items = [v for v in p.candidates if p.backward_uses[v]]
    saved = knapsack_choice(p, items, 24)
    capacity = 24 - max(baseline(p))
    assert sum(p.nodes[v].size for v in saved) <= capacity
    assert saved, "some value fits"


@settings(max_examples=40, deadline=None)
@given(small_problems(), st.data())
def test_exact_solver_never_costs_more_than_a_feasible_baseline(p: Problem, data: st.DataObject) -> None:
    full = save_all(p).report
    assert full is not None
    budget = data.draw(st.integers(0, full.peak))
    q = p.with_budget(budget)
    try:
        exact = solve(q, SolverConfig(workers=1))
    except InfeasibleBudgetError:
        for fn in BASELINES.values():
            assert fn(q, SolverConfig()).status is Status.INFEASIBLE
        return
    for name, fn in BASELINES.items():
        r = fn(q, SolverConfig())
        if r.status in (Status.OPTIMAL, Status.FEASIBLE):
            assert exact.objective <= r.objective + 1e-9, name


def test_free_recompute_lowers_the_peak_at_no_time_when_free_values_exist() -> None:
    # f0..f7 with zero-time f1, f3, f5: recomputing them is free and frees memory.
    p = chain_problem([4] * 8, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    full = save_all(p).report
    free = free_recompute(p, free_time=0.0).report
    assert full is not None and free is not None
    assert free.added_time == 0
    assert free.peak <= full.peak


def test_selective_checkpointing_saves_what_has_flops_and_recomputes_the_rest() -> None:
    # A matmul-like value (FLOPs) after each pointwise one: the pointwise ones are recomputed
    # from the matmuls' saved outputs, even where recomputing them does not lower the peak.
    p = chain_problem([4] * 8, [1.0] * 8)
    p = replace(p, nodes=tuple(replace(n, flops=1e6 if not n.backward and i % 2 else 0.0)
                               for i, n in enumerate(p.nodes)))
    result = selective(p)
    assert result.plan is not None and result.solver == "selective"
    recomputed = set(result.plan.of(Decision.RECOMPUTE))
    pointwise = {v for v in p.candidates if p.nodes[v].flops == 0 and p.nodes[v].recomputable}
    assert recomputed and recomputed <= pointwise
    assert not any(p.nodes[v].flops for v in recomputed)


@settings(max_examples=60, deadline=None)
@given(small_problems())
def test_the_holding_ladder_saves_more_for_less_time_at_each_rung(problem: Problem) -> None:
    """Each rung is a plan the checker accepts, recomputes a subset of what the rung below
    recomputes (the first: of the block checkpointed whole) and adds no more time; the
    first rung saves the value whose saving alone takes off the most time per byte."""
    free = problem.with_budget(None)
    whole = recompute_every(free)
    ladder = holding_ladder(free)
    below, time = set(whole.of(Decision.RECOMPUTE)), check(free, whole).added_time
    for plan in ladder:
        report = check(free, plan)
        assert set(plan.of(Decision.RECOMPUTE)) < below
        assert report.added_time <= time + 1e-9
        below, time = set(plan.of(Decision.RECOMPUTE)), report.added_time
    if not ladder:
        return
    base = check(free, whole)
    recomputable = {v for v in free.candidates if free.nodes[v].recomputable}

    def gain(report: Report) -> float:
        saved, added = base.added_time - report.added_time, report.saved_bytes - base.saved_bytes
        return math.inf if added <= 0 else saved / added

    singles = [check(free, plan_with(free, recomputable - {v})) for v in recomputable]
    best = max(gain(r) for r in singles if base.added_time - r.added_time > 0)
    first = check(free, ladder[0])
    assert gain(first) >= best * (1 - 1e-9)


def test_the_holding_ladder_keeps_at_most_its_rungs_spread_along_it() -> None:
    problem = chain_problem([4, 1] * 20, [1.0, 3.0] * 20)
    every = holding_ladder(problem, rungs=1000)
    thinned = holding_ladder(problem, rungs=5)
    assert len(every) > 5 and len(thinned) == 5
    keys = [plan.key for plan in every]
    assert thinned[0].key == keys[0] and thinned[-1].key == keys[-1]
    assert all(plan.key in keys for plan in thinned)


def test_a_ladder_over_many_values_orders_them_without_the_checker() -> None:
    """Past LADDER_SCAN recomputable values (a whole model planned for several calls) the
    ladder orders by each value's own time per byte and builds only its rungs: still at
    most ``rungs`` plans, each recomputing less than the one below and adding no more."""
    problem = chain_problem([4, 1] * 100, [1.0, 3.0] * 100)
    assert sum(problem.nodes[v].recomputable for v in problem.candidates) > LADDER_SCAN
    ladder = holding_ladder(problem, rungs=6)
    assert 2 <= len(ladder) <= 6
    below, time = set(recompute_every(problem).of(Decision.RECOMPUTE)), math.inf
    for plan in ladder:
        report = check(problem.with_budget(None), plan)
        assert set(plan.of(Decision.RECOMPUTE)) < below and report.added_time <= time
        below, time = set(plan.of(Decision.RECOMPUTE)), report.added_time


def test_a_budget_only_a_rung_of_the_ladder_fits_is_planned_not_refused() -> None:
    """transformers' GPT-2, 4 layers, its GELU written out in steps: the flat model counts
    every copy recomputed before one op as alive through it, where the checker follows the
    op's entries. A budget between the flat model's least peak and a rung of the holding
    ladder's was refused, the flat model's figure stated as proven (5,398,536 B, against
    the rung's 4,756,488 B)."""
    import torch
    import transformers

    from rematc.trace import trace
    from solvers import cpsat
    from solvers.planner import least_known_rung, min_feasible_peak
    from tests.realmodels import Wrapped

    cfg = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=2, n_positions=128, vocab_size=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    inner = transformers.GPT2LMHeadModel(cfg)
    inner.config._attn_implementation = "sdpa"
    inner.loss_type = "ForCausalLM"
    ids = torch.randint(64, (4, 128), generator=torch.Generator().manual_seed(1))
    problem = trace(Wrapped(inner, ("input_ids",), lambda out, labels: out.loss, split=False),
                    (ids, ids.clone()), target="eager").problem
    config = SolverConfig(time_limit=3.0, workers=2)
    flat = cpsat.min_peak(problem, config)
    rung = least_known_rung(problem)
    assert flat.report is not None and rung is not None and rung.report is not None
    assert rung.report.peak < flat.report.peak, "the flat model reaches the rung's peak"
    budget = (rung.report.peak + flat.report.peak) // 2
    result = solve(problem.with_budget(budget), config)
    assert result.plan is not None and check(problem.with_budget(budget), result.plan).fits
    least = min_feasible_peak(problem, config)
    assert least.report is not None and least.report.peak <= rung.report.peak
    assert least.status is not Status.OPTIMAL
