"""bench/constants.py's bookkeeping: which processes run, what each sets and records, and
the report's reading of the constants' own runs against their neighbours'."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import constants
from solvers import InfeasibleBudgetError, SolverConfig, chain, planner
from tests.graphs import chain as chain_graph


def test_the_own_values_run_first_in_the_middle_and_last_at_their_seeds() -> None:
    order = constants.settings(["chain.SPAN", "chain.FAR"], [0, 1, 2])
    assert order == [(None, 0), ("chain.SPAN=3", 0), ("chain.SPAN=5", 0), (None, 1), ("chain.FAR=1.1", 0),
                     ("chain.FAR=1.5", 0), (None, 2)]


def test_a_setting_sets_the_constant_with_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chain, "SPAN", chain.SPAN)
    constants.setting("chain.SPAN", 5.0)
    assert chain.SPAN == 5 and isinstance(chain.SPAN, int)
    config = constants.setting("config.stall_time", 5.0)(constants.SolverConfig(stall_time=10.0))
    assert config.stall_time == 5.0


def rows(low: float, high: float, seed: int = 0) -> list[dict[str, object]]:
    return [{"family": "f", "at": at, "added": v, "seed": seed} for at, v in zip(constants.AT, (low, high), strict=True)]


def sweep(*, deterministic: bool, time_limit: float = 10.0) -> argparse.Namespace:
    """The arguments of a sweep of chain.SPAN on one family "f" of 7 decisions."""
    return argparse.Namespace(families=["f"], only=["chain.SPAN"], time_limit=time_limit, decisions={"f": 7},
                              at=list(constants.AT), deterministic=deterministic)


def test_the_report_reads_the_median_of_the_own_runs_against_each_neighbour() -> None:
    """A neighbour 10% cheaper than the median of the own runs is flagged; one within 2%
    is not; the own runs' spread is reported."""
    results = {constants.BASE: [rows(1.00, 2.0), rows(1.10, 2.0), rows(1.20, 2.0)],
               "chain.SPAN=low": [rows(1.00, 1.98)], "chain.SPAN=high": [rows(1.2, 2.5)]}
    text = "\n".join(constants.report(results, sweep(deterministic=False)))
    assert "| f | 1x | 7 | 1,000.0 / 1,100.0 / 1,200.0 | 20.0% |" in text
    assert "| `chain.SPAN` | 3 / 4 / 5 | 1.100 | f 1x (+10.0%) | none |" in text


def test_a_neighbour_better_than_every_own_run_is_beyond_the_spread() -> None:
    """Over 2% better than the own runs' median but not than their best is within the
    search's noise; over 2% better than their best is not."""
    results = {constants.BASE: [rows(1.00, 2.0), rows(1.10, 2.2), rows(1.20, 2.2)],
               "chain.SPAN=low": [rows(0.95, 2.1)], "chain.SPAN=high": [rows(1.2, 2.05)]}
    text = "\n".join(constants.report(results, sweep(deterministic=False)))
    assert "| `chain.SPAN` | 3 / 4 / 5 | 1.158 | f 1x (+15.8%), f 0.6x (+7.3%) | f 1x |" in text


def test_a_deterministic_neighbour_is_read_against_the_own_run_at_its_seed() -> None:
    """Under a limit of work the neighbours run at seed 0, and the own run at seed 0 is
    what each is compared with; the other seeds give the spread."""
    results = {constants.BASE: [rows(1.00, 2.3, seed=0), rows(1.10, 2.0, seed=1), rows(1.20, 2.2, seed=2)],
               "chain.SPAN=low": [rows(1.00, 2.1)], "chain.SPAN=high": [rows(1.2, 2.5)]}
    text = "\n".join(constants.report(results, sweep(deterministic=True)))
    assert "own values' runs at seeds 0 / 1 / 2" in text
    assert "| `chain.SPAN` | 3 / 4 / 5 | 1.095 | f 0.6x (+9.5%) | none |" in text


def test_a_budget_no_value_plans_is_no_case_against_the_constant() -> None:
    """Below a family's least no value has a plan: that case agrees, while a neighbour
    with a plan where the own value has none is the worst case there is."""
    none = [{"family": "f", "at": at, "added": None} for at in constants.AT]
    args = sweep(deterministic=True, time_limit=5.0)
    text = "\n".join(constants.report({constants.BASE: [none] * 3, "chain.SPAN=low": [none],
                                        "chain.SPAN=high": [none]}, args))
    assert "| `chain.SPAN` | 3 / 4 / 5 | 1.000 | none | none |" in text
    assert text.startswith("A limit of 5 s of work (deterministic)")
    text = "\n".join(constants.report({constants.BASE: [none] * 3, "chain.SPAN=low": [rows(1.0, 2.0)],
                                        "chain.SPAN=high": [none]}, args))
    assert "| `chain.SPAN` | 3 / 4 / 5 | inf |" in text


def test_every_swept_constant_names_a_setting_between_its_neighbours() -> None:
    """A renamed or moved constant fails here rather than in an hour-long sweep; each sits
    strictly between the values it is compared with."""
    for name, (_, _, low, high) in constants.CONSTANTS.items():
        assert low < constants.current(name) < high, name


def test_below_the_least_peak_a_run_records_the_budget_and_bound_the_error_states(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A budget no plan fits is the case ``planner.BOUND_SHARE`` acts on: the worker's row
    keeps the smallest budget the error states and its bound, not only a text."""
    problem = chain_graph()
    monkeypatch.setattr(constants, "traced", lambda family, cache: problem)
    args = argparse.Namespace(set=None, time_limit=1.0, deterministic=True, seed=0, families=["f"],
                              peaks=[10**9], at=[1e-9], cache=None)
    constants.worker(args)
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    with pytest.raises(InfeasibleBudgetError) as stated:
        planner.solve(problem.with_budget(1), SolverConfig(time_limit=1.0, deterministic=True))
    assert row["added"] is None and row["least"] == stated.value.min_feasible > 1
    assert row["proven"] == stated.value.proven and row["at_least"] == stated.value.at_least
