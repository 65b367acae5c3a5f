"""Which plan the partitioner takes for a problem (``rematc.partition.plan_for``)."""

from __future__ import annotations

import pytest

from rematc.options import Options
from rematc.partition import plan_for
from solvers import save_all
from solvers.baselines import free_recompute
from solvers.budget import Budget
from solvers.problem import chain_problem

# f1, f3, f5 cost one launch (fused pointwise ops): recomputing them is (almost) free.
CHAIN = chain_problem([4] * 8, [1.0, 0.01, 1.0, 0.01, 1.0, 0.01, 1.0, 1.0])


def _plan(budget: int | None, compiler: str):  # type: ignore[no-untyped-def]
    problem = CHAIN.with_budget(budget)
    return plan_for(problem, Options.from_mapping({"budget": budget and Budget(nbytes=budget), "compiler": compiler})).result


def test_the_chain_has_a_free_plan_below_saving_everything() -> None:
    full, free = save_all(CHAIN).report, free_recompute(CHAIN).report
    assert full is not None and free is not None
    assert (full.peak, free.peak) == (36, 24)


@pytest.mark.parametrize("budget", [None, 24, 30, 32, 36, 100])
def test_under_inductor_a_budget_the_free_plan_meets_changes_nothing(budget: int | None) -> None:
    """The no-budget plan (the least peak recomputing only free values) whenever it fits,
    however loose the budget: not the search's plan just under the budget (peak 32 at
    budget 32), nor saving everything when that fits too."""
    result = _plan(budget, "inductor")
    assert result.solver == "free_least_peak" and result.plan is not None
    assert result.report is not None and result.report.peak == 24


def test_under_inductor_a_budget_below_the_free_plan_is_searched() -> None:
    result = _plan(20, "inductor")
    assert result.solver == "cpsat" and result.report is not None
    assert result.report.peak <= 20


@pytest.mark.parametrize(("budget", "solver", "peak"), [(32, "cpsat", 32), (36, "save_all", 36)])
def test_eager_recomputes_nothing_for_free(budget: int, solver: str, peak: int) -> None:
    """Without Inductor a recomputed pointwise op is a kernel of its own, not free: the
    least time under the budget, and saving everything when it fits."""
    result = _plan(budget, "eager")
    assert result.solver == solver and result.report is not None
    assert result.report.peak == peak


def test_a_budget_below_what_free_values_can_reach_skips_their_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes live whatever free-only plan is chosen exceed a budget of 20: straight to
    CP-SAT, without the free values' search (whose minimum-peak phase runs for seconds on
    a real model)."""
    import rematc.partition

    def no_search(*args: object) -> None:
        raise AssertionError("searched free values although no such plan can fit")

    monkeypatch.setattr(rematc.partition, "least_peak_free", no_search)
    result = _plan(20, "inductor")
    assert result.solver == "cpsat"


def test_the_partitioner_pickles_to_its_options_and_copies_to_itself() -> None:
    """Inductor pickles its config, the partitioner included, for its FX graph cache key;
    a lambda in the partitioner made every compile bypass that cache (and log a
    traceback). Its deep copies must be itself: the backend reads the plan from it."""
    import copy
    import pickle

    import torch
    from torch._inductor import config as inductor_config

    import rematc
    from rematc.models import MLPConfig, make_mlp
    from rematc.partition import RematPartitioner

    options = Options.from_mapping({"budget": "1GiB", "compiler": "eager"})
    partitioner = RematPartitioner(options)
    model, inputs = make_mlp(MLPConfig(), batch=8, seed=0)
    torch.compile(model, backend=rematc.Backend(options))(*inputs)  # another partitioner ran
    partitioner.record = rematc.records()[-1]  # what a compile leaves on it
    with inductor_config.patch(custom_partitioner_fn=partitioner):
        blob = inductor_config.save_config()  # what the cache key pickles
    again = pickle.loads(blob)["custom_partitioner_fn"]
    assert again.options == options and again.uuid() == partitioner.uuid()
    assert pickle.dumps(again) == pickle.dumps(partitioner)  # the key does not see the plan
    assert copy.deepcopy(partitioner) is partitioner
