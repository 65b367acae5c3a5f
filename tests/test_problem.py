"""The problem IR: derived structure on tiny graphs, then every validation error."""

from __future__ import annotations

import pytest

from solvers import Node, Problem, ProblemError, Scale
from solvers.problem import chain_problem, node


def P(*nodes: Node, budget: int | None = None, host_bandwidth: float = 0.0) -> Problem:
    return Problem(nodes=nodes, budget=budget, host_bandwidth=host_bandwidth, name="t")


# ---- trivial cases first --------------------------------------------------------------


def test_empty_problem_is_valid_and_has_no_structure() -> None:
    p = P()
    assert p.n_forward == 0
    assert p.users == ()
    assert p.candidates == ()
    assert p.scale == Scale(bytes_per_unit=1, seconds_per_unit=1.0)


def test_single_node() -> None:
    p = P(node("a", size=3))
    assert p.n_forward == 1
    assert p.users == ((),)
    assert p.last_forward_use == (0,)
    assert p.candidates == ()  # no backward reads it


def test_single_resident_node_is_no_candidate() -> None:
    p = P(node("w", size=8, resident=True), node("g", 0, backward=True, keep=True))
    assert p.backward_uses == ((1,), ())
    assert p.candidates == ()


# ---- derived structure -----------------------------------------------------------------


def test_chain_structure() -> None:
    # 0 input (resident), 1 f0, 2 f1, 3 f2 | 4 g2(f2), 5 g1(f1, g2), 6 g0(f0, g1) keep
    p = chain_problem([2, 3, 5], [1.0, 2.0, 4.0])
    assert [n.name for n in p.nodes] == ["input", "f0", "f1", "f2", "g2", "g1", "g0"]
    assert p.n_forward == 4
    assert p.last_step == 6
    assert p.users == ((1,), (2, 6), (3, 5), (4,), (5,), (6,), ())
    assert p.last_forward_use[1:4] == (2, 3, 3)
    assert p.backward_uses[1:4] == ((6,), (5,), (4,))
    assert p.forward_users[1:4] == ((2,), (3,), ())
    assert p.candidates == (1, 2, 3)
    assert p.nodes[6].keep and not p.nodes[5].keep
    assert p.index("f1") == 2
    assert p.describe(2) == "#2 f1 (value, forward, 3 B)"


def test_candidates_reach_through_recomputable_forward_values_only() -> None:
    p = P(
        node("x", size=4, resident=True),
        node("a", 0),  # 1: read only by b; needed if b is recomputed
        node("b", 1),  # 2: read by the backward
        node("c", 0),  # 3: read only by d, which cannot be recomputed: never needed
        node("d", 3, recomputable=False),  # 4: read by the backward
        node("e", 0),  # 5: read by nothing after the forward
        node("out", 2, 4, keep=True),  # 6: kept to the end: takes no decision
        node("g", 2, 4, 6, backward=True, keep=True),
    )
    assert p.candidates == (1, 2, 4)


def test_duplicate_deps_count_one_use() -> None:
    p = P(node("a"), node("b", 0, 0), node("g", 1, 1, backward=True))
    assert p.users == ((1,), (2,), ())


def test_scale_is_gcd_of_sizes_and_longest_op() -> None:
    p = P(
        node("w", size=7, resident=True),  # resident: not in the gcd
        node("a", 0, size=12, time=0.5),
        node("b", 1, size=0, time=2.0),  # zero: not in the gcd
        node("c", 2, size=8, time=1.0),
    )
    s = p.scale
    assert s.bytes_per_unit == 4
    assert s.seconds_per_unit == pytest.approx(2.0 / Scale.TIME_RESOLUTION)
    assert s.mem(12) == 3
    assert s.capacity(15) == 3  # rounded down: never above the budget
    assert s.time(0.5) == Scale.TIME_RESOLUTION // 4


def test_with_budget_keeps_everything_else() -> None:
    p = Problem(nodes=(node("a"),), budget=3, host_bandwidth=5.0, name="n", meta={"k": "v"})
    q = p.with_budget(None)
    assert q.budget is None
    assert (q.nodes, q.host_bandwidth, q.name, q.meta) == (p.nodes, 5.0, "n", {"k": "v"})


def test_with_budget_checks_the_budget_and_computes_only_what_depends_on_it() -> None:
    """The structure derived from the nodes is carried over to the new budget's problem;
    the budget in memory units is its own, and a bad budget is refused as at construction."""
    p = chain_problem([4, 8, 4], [1.0, 2.0, 1.0], budget=20)
    derived = (p.users, p.candidates, p.scale, p.n_forward)
    assert p.capacity == 5
    q = p.with_budget(40)
    assert (q.users, q.candidates, q.scale, q.n_forward) == derived and q.users is p.users
    assert q.capacity == 10 == Problem(nodes=p.nodes, budget=40).capacity
    assert p.with_budget(None).capacity == Problem(nodes=p.nodes).capacity
    for bad in (-1, 2.5, True):
        with pytest.raises(ProblemError, match="budget must be a non-negative int"):
            p.with_budget(bad)  # type: ignore[arg-type]
    assert q == Problem(nodes=p.nodes, budget=40, name=p.name) and hash(q) == hash(q.with_budget(40))


def test_index_of_unknown_name_says_which_problem() -> None:
    with pytest.raises(KeyError, match="no value named 'zz' in problem 't'"):
        P(node("a")).index("zz")


def test_chain_helper_builds_autograd_order() -> None:
    p = chain_problem([1], [1.0], budget=3)
    assert [(n.name, n.deps, n.backward, n.keep) for n in p.nodes] == [
        ("input", (), False, False),
        ("f0", (0,), False, False),
        ("g0", (1,), True, True),
    ]
    assert p.budget == 3


# ---- validation -----------------------------------------------------------------------

INVALID: list[tuple[str, object, str]] = [
    ("duplicate name", lambda: P(node("a"), node("a", 0)), r"node #1 'a': the name is used twice"),
    ("empty name", lambda: P(node("")), r"node #0 needs a non-empty str name"),
    ("name not a str", lambda: P(Node(name=3)), r"node #0 needs a non-empty str name, got 3"),  # type: ignore[arg-type]
    ("not a Node", lambda: P("a"), r"node #0 is a str, not a solvers.Node"),  # type: ignore[arg-type]
    ("dep on itself", lambda: P(node("a", 0)), r"node #0 'a': dependency 0 is not an earlier node"),
    ("dep on a later node", lambda: P(node("a", 1), node("b")), r"dependency 1 is not an earlier node; nodes must be listed in topological order"),
    ("negative dep", lambda: P(node("a"), node("b", -1)), r"dependency -1 is not an earlier node"),
    ("dep not an int", lambda: P(Node(name="a", deps=("x",))), r"dependency 'x' is not an earlier node"),  # type: ignore[arg-type]
    ("dep is a bool", lambda: P(node("a"), Node(name="b", deps=(True,))), r"dependency True is not an earlier node"),
    ("deps not a tuple", lambda: P(node("a"), Node(name="b", deps=[0])), r"deps must be a tuple of node indices, got \[0\]"),  # type: ignore[arg-type]
    ("forward reads backward", lambda: P(node("a"), node("g", 0, backward=True), node("b", 1)), r"node #2 'b': a forward value cannot read backward value #1"),
    ("forward after backward", lambda: P(node("a"), node("g", 0, backward=True), node("b")), r"node #2 'b': forward value after the first backward value"),
    ("negative size", lambda: P(node("a", size=-1)), r"node #0 'a': size must be a non-negative int of bytes, got -1"),
    ("size not an int", lambda: P(node("a", size="abc")), r"size must be a non-negative int of bytes, got 'abc'"),  # type: ignore[arg-type]
    ("fractional size", lambda: P(node("a", size=1.5)), r"size must be a non-negative int of bytes, got 1.5"),  # type: ignore[arg-type]
    ("bool size", lambda: P(node("a", size=True)), r"size must be a non-negative int of bytes, got True"),
    ("negative time", lambda: P(node("a", time=-1.0)), r"time must be finite and >= 0 seconds, got -1.0"),
    ("nan time", lambda: P(node("a", time=float("nan"))), r"time must be finite and >= 0 seconds, got nan"),
    ("infinite time", lambda: P(node("a", time=float("inf"))), r"time must be finite and >= 0 seconds, got inf"),
    ("time not a number", lambda: P(node("a", time="fast")), r"time must be finite and >= 0 seconds, got 'fast'"),  # type: ignore[arg-type]
    ("negative flops", lambda: P(node("a", flops=-2.0)), r"flops must be finite and >= 0 FLOPs, got -2.0"),
    ("resident with deps", lambda: P(node("a"), node("w", 0, resident=True)), r"node #1 'w': a resident value must be a forward input with no deps"),
    ("resident backward", lambda: P(node("a"), node("w", backward=True, resident=True)), r"a resident value must be a forward input"),
    ("negative budget", lambda: P(node("a"), budget=-1), r"budget must be a non-negative int of bytes, got -1"),
    ("budget not an int", lambda: P(node("a"), budget="1 GiB"), r"budget must be a non-negative int of bytes, got '1 GiB'"),  # type: ignore[arg-type]
    ("bool budget", lambda: P(node("a"), budget=True), r"budget must be a non-negative int of bytes, got True"),
    ("negative bandwidth", lambda: P(node("a"), host_bandwidth=-1.0), r"host_bandwidth must be >= 0 bytes/s, got -1.0"),
    ("infinite bandwidth", lambda: P(node("a"), host_bandwidth=float("inf")), r"host_bandwidth must be >= 0 bytes/s, got inf"),
    ("bandwidth not a number", lambda: P(node("a"), host_bandwidth="fast"), r"host_bandwidth must be >= 0 bytes/s, got 'fast'"),  # type: ignore[arg-type]
    # Beyond what the solvers' 64-bit integers hold (CP-SAT rejected the model, or raised).
    ("size near 2**63", lambda: P(node("a", size=2**63 - 1)), r"node #0 'a': size 9223372036854775807 is over 2\*\*53 bytes \(8 PiB\)"),
    ("sizes add up over 2**53", lambda: P(node("a", size=2**52), node("b", 0, size=2**52 + 1)),
     r"node #1 'b': the sizes of values #0 to #1 add up to 9007199254740993 bytes, over 2\*\*53 bytes"),
    ("budget over 2**53", lambda: P(node("a"), budget=2**63), r"budget 9223372036854775808 is over 2\*\*53 bytes \(8 PiB\)"),
    ("bandwidth too slow", lambda: P(*chain_problem([8], [1.0]).nodes, host_bandwidth=1e-300),
     r"host_bandwidth 1e-300 bytes/s is too slow for this problem: .* set it to 0 to plan without offloading"),
]


@pytest.mark.parametrize(("build", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_problem_raises_problem_error_naming_the_mistake(build, message: str) -> None:
    with pytest.raises(ProblemError, match=message) as info:
        build()
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_zero_size_and_zero_time_are_valid() -> None:
    p = P(node("a", size=0, time=0.0), node("g", 0, size=0, time=0.0, backward=True))
    assert p.candidates == (0,)
    assert p.scale == Scale(bytes_per_unit=1, seconds_per_unit=1.0)
