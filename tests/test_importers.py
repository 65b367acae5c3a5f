"""Public benchmark graphs as problems, and per-value live intervals against the checker."""

from __future__ import annotations

from pathlib import Path

import pytest

from solvers import SolverConfig, check, save_all, solve
from solvers.checker import value_intervals
from solvers.importers import load_node_link
from solvers.problem import chain_problem

GRAPHS = Path(__file__).parents[1].parent / "shared" / "bench-data" / "checkmate-graphs"
FCN8 = GRAPHS / "fcn_8_vgg_32_416x608_train_nx.json"


@pytest.fixture(scope="module")
def fcn8() -> Path:
    if not FCN8.exists():
        pytest.skip(f"public benchmark graphs not present ({GRAPHS.name} next to the repository)")
    return FCN8


def published_peak(path: Path) -> int:
    """The memory model of docs/memory-model.md, replayed on networkx's order: at step j,
    every earlier value with a consumer at j or later, plus the value computed at j."""
    import json

    import networkx as nx

    graph = nx.node_link_graph(json.loads(path.read_text()), directed=True, multigraph=False, edges="links")
    order = list(nx.topological_sort(graph))
    step = {v: k for k, v in enumerate(order)}
    peak = 0
    for j, v in enumerate(order):
        live = graph.nodes[v]["cost_ram"] + sum(
            graph.nodes[u]["cost_ram"] for u in order[:j]
            if any(step[w] >= j for w in graph.successors(u)))
        peak = max(peak, live)
    return peak


def test_fcn8_maps_faithfully(fcn8: Path) -> None:
    problem = load_node_link(fcn8)
    assert len(problem.nodes) == 73 and problem.n_forward == 36
    assert not any(n.resident or n.keep for n in problem.nodes)
    assert sum(len(n.deps) for n in problem.nodes) == 149  # every edge kept
    assert save_all(problem).report.peak == published_peak(fcn8)


def test_value_intervals_add_up_to_the_checker(fcn8: Path) -> None:
    chain = chain_problem([(7 * k) % 13 + 1 for k in range(30)], [(5 * k) % 11 + 1.0 for k in range(30)])
    for problem in (load_node_link(fcn8), chain):
        budget = int(0.7 * save_all(problem).report.peak)
        result = solve(problem.with_budget(budget), SolverConfig(time_limit=10, workers=1))
        assert result.plan is not None
        report = check(problem.with_budget(budget), result.plan)
        timeline = [0] * len(problem.nodes)
        for i, spans in value_intervals(problem, result.plan).items():
            for lo, hi in spans:
                for k in range(lo, hi + 1):
                    timeline[k] += problem.nodes[i].size
        assert tuple(timeline) == report.timeline


def random_layered_doc(order: list[int] | None) -> dict[str, object]:
    """A four-node graph in the random layered family's format: ``name`` ids, edges keyed
    "0" / "1", ``duration`` / ``out_cost`` named by the graph's tags, an optional order."""
    graph: dict[str, object] = {"node_duration_tag": "duration", "node_output_cost_tag": "out_cost"}
    if order is not None:
        graph["order"] = order
    return {
        "directed": True, "multigraph": False, "graph": graph,
        "nodes": [{"name": k, "duration": 10 * k, "out_cost": k + 1, "param_cost": 99} for k in range(4)],
        "links": [{"0": 0, "1": 2}, {"0": 0, "1": 1}, {"0": 1, "1": 3}, {"0": 2, "1": 3}],
    }


def test_random_layered_graphs_keep_their_given_order() -> None:
    from solvers.importers import problem_from_node_link

    problem = problem_from_node_link(random_layered_doc([0, 2, 1, 3]))
    assert problem.single_phase and [n.name for n in problem.nodes] == ["0", "2", "1", "3"]
    assert [n.size for n in problem.nodes] == [1, 3, 2, 4]  # out_cost; param_cost ignored
    assert [n.time for n in problem.nodes] == [0.0, 20.0, 10.0, 30.0]
    assert problem.nodes[3].deps == (1, 2)
    assert problem.meta["order"] == "graph.order"
    assert problem_from_node_link(random_layered_doc(None)).meta["order"] == "topological sort"


@pytest.mark.parametrize(
    ("order", "words"),
    [([0, 3, 1, 2], "not a topological order"), ([0, 1, 2], "every node once"), ([0, 1, 2, 9], "not the id")],
)
def test_a_bad_given_order_is_named(order: list[int], words: str) -> None:
    from solvers.importers import problem_from_node_link
    from solvers.problem import ProblemError

    with pytest.raises(ProblemError, match=words):
        problem_from_node_link(random_layered_doc(order))
