"""Problem and plan files: round trips, one error per kind of malformed input, and fuzzing
that shows nothing but ProblemError / PlanError ever comes out of the loaders."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from solvers import (
    Decision,
    Node,
    Plan,
    PlanError,
    Problem,
    ProblemError,
    Step,
    Transfer,
    load_plan,
    load_problem,
    plan_from_json,
    plan_to_json,
    problem_from_json,
    problem_to_json,
    save_plan,
    save_problem,
)
from solvers.problem import EVERY_COPY, Copy, chain_problem, node

Doc = dict[str, object]


def P(*nodes: Node, **kw: object) -> Problem:
    return Problem(nodes=nodes, **kw)  # type: ignore[arg-type]


def rich() -> Problem:
    """Every field away from its default somewhere."""
    return P(
        node("w", size=64, time=0.0, resident=True, op="placeholder"),
        node("x", 0, size=12, time=0.25, flops=1e9, op="aten.mm"),
        node("m", 1, size=4, time=0.5, recomputable=False, op="aten.rand_like"),
        node("y", 1, 2, size=0, time=0.0, keep=True, op="aten.mul"),
        node("gy", 3, size=8, backward=True, op="aten.ones_like"),
        node("gx", 0, 1, 2, 4, size=12, time=1e-6, backward=True, keep=True, op="aten.mm"),
        budget=100,
        host_bandwidth=12.5e9,
        name="rich",
        meta={"model": "toy", "device": "cpu"},
    )


def roundtrip(p: Problem) -> Problem:
    return problem_from_json(json.loads(json.dumps(problem_to_json(p))))


def assert_same(a: Problem, b: Problem) -> None:
    assert a == b
    assert a.meta == b.meta  # not part of equality: provenance only


# ---- round trips --------------------------------------------------------------------------


def test_empty_problem_round_trips() -> None:
    assert_same(roundtrip(P()), P())


def test_single_node_round_trips() -> None:
    assert_same(roundtrip(P(node("a"))), P(node("a")))


@pytest.mark.parametrize("problem", [chain_problem([2, 3, 5], [1.0, 2.0, 4.0], budget=12), rich()],
                         ids=["chain", "rich"])
def test_problem_round_trips_through_dict_and_file(problem: Problem, tmp_path: Path) -> None:
    assert_same(roundtrip(problem), problem)
    path = tmp_path / "p.json"
    save_problem(problem, path)
    assert_same(load_problem(path), problem)
    assert_same(load_problem(str(path)), problem)
    assert json.loads(path.read_text()) == problem_to_json(problem)  # same document


def test_written_document_is_tagged_and_explicit() -> None:
    doc = problem_to_json(rich())
    assert (doc["format"], doc["version"]) == ("rematc.problem", 3)
    assert doc["scale"] == {"bytes_per_unit": 4, "seconds_per_unit": 1e-6}
    nodes = doc["nodes"]
    assert isinstance(nodes, list)
    assert nodes[2] == {
        "name": "m", "op": "aten.rand_like", "deps": [1], "backward": False, "size": 4,
        "time": 0.5, "flops": 0.0, "recomputable": False, "offloadable": True, "resident": False,
        "keep": False, "returned": False,
    }


def test_a_version_1_file_means_the_same_problem() -> None:
    """Version 1 named the memory effects ``reuses``, ``reuses_recomputed``, ``inline`` and
    ``fused``; read, they are version 2's ``overwrites``, ``overwrites_copies`` and
    ``unstored``, and the problem writes back as the current version."""
    v1 = {"format": "rematc.problem", "version": 1, "nodes": [
        {"name": "h", "size": 4},
        {"name": "x", "deps": [0], "size": 8},
        {"name": "y", "deps": [1], "size": 8, "reuses": 1, "inline": True, "fused": True},
        {"name": "loss", "deps": [2], "size": 4, "keep": True},
        {"name": "g", "deps": [2], "size": 8, "backward": True, "reuses": 2, "reuses_recomputed": False},
        {"name": "gh", "deps": [4], "size": 4, "backward": True, "keep": True, "inline": True},
    ]}
    p = problem_from_json(v1)
    y, g, gh = p.nodes[2], p.nodes[4], p.nodes[5]
    assert (y.overwrites, y.overwrites_copies, y.unstored) == (1, EVERY_COPY, {Copy.FORWARD, Copy.RECOMPUTED})
    assert (g.overwrites, g.overwrites_copies, g.unstored) == (2, {Copy.FORWARD}, frozenset())
    assert gh.unstored == {Copy.RECOMPUTED} and p.nodes[1] == Node(name="x", deps=(0,), size=8)
    v3 = problem_to_json(p)
    assert v3["version"] == 3 and v3["nodes"][4] == {  # type: ignore[index]
        "name": "g", "op": "", "deps": [2], "backward": True, "size": 8, "time": 0.0, "flops": 0.0,
        "recomputable": True, "offloadable": True, "resident": False, "keep": False, "returned": False,
        "overwrites": 2, "overwrites_copies": ["forward"]}
    assert v3["nodes"][2]["unstored"] == ["forward", "recomputed"]  # type: ignore[index]
    assert_same(problem_from_json(v3), p)


def test_a_version_2_file_has_no_returned_node_and_a_version_3_one_may() -> None:
    """Version 3 added ``returned``: a version-2 file reads as the same problem with none,
    rejects the key, and a returned node round-trips through version 3."""
    nodes = [{"name": "x", "size": 4}, {"name": "logits", "deps": [0], "size": 8},
             {"name": "loss", "deps": [1], "size": 4, "keep": True}]
    p = problem_from_json({"format": "rematc.problem", "version": 2, "nodes": nodes})
    assert not any(n.returned for n in p.nodes)
    with pytest.raises(ProblemError, match=r"^nodes\[1\]: unknown key 'returned'"):
        problem_from_json({"format": "rematc.problem", "version": 2,
                           "nodes": [nodes[0], {**nodes[1], "returned": True}, nodes[2]]})
    returned = problem_from_json({"format": "rematc.problem", "version": 3,
                                  "nodes": [nodes[0], {**nodes[1], "returned": True}, nodes[2]]})
    assert returned.nodes[1].returned
    assert_same(problem_from_json(problem_to_json(returned)), returned)


def test_saved_file_lists_one_node_per_line(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_problem(rich(), path)
    lines = path.read_text().splitlines()
    assert sum(line.lstrip().startswith('{"name"') for line in lines) == len(rich().nodes)


def test_defaults_may_be_omitted() -> None:
    doc = {"format": "rematc.problem", "version": 1,
           "nodes": [{"name": "a", "size": 4}, {"name": "g", "deps": [0], "backward": True}]}
    p = problem_from_json(doc)
    assert p == P(Node(name="a", size=4), Node(name="g", deps=(0,), backward=True))
    assert (p.budget, p.host_bandwidth, p.name, p.meta) == (None, 0.0, "", {})


def test_integer_times_are_read_as_seconds() -> None:
    doc = problem_to_json(P(node("a", time=2.0)))
    doc["nodes"][0]["time"] = 2  # type: ignore[index]
    p = problem_from_json(doc)
    assert p.nodes[0].time == 2.0 and isinstance(p.nodes[0].time, float)


def test_scale_is_informational() -> None:
    doc = problem_to_json(rich())
    doc["scale"] = {"bytes_per_unit": 999}
    assert problem_from_json(doc).scale.bytes_per_unit == 4


# ---- malformed problems -------------------------------------------------------------------


def valid_doc() -> Doc:
    return problem_to_json(chain_problem([2, 3, 5], [1.0, 2.0, 4.0], budget=12))


def edit(change: Callable[[Doc], object]) -> Doc:
    doc = copy.deepcopy(valid_doc())
    change(doc)
    return doc


def nodes_of(doc: Doc) -> list[dict[str, object]]:
    nodes = doc["nodes"]
    assert isinstance(nodes, list)
    return nodes


def as_version_1(i: int, key: str, value: object) -> Callable[[Doc], object]:
    """The document as version 1 (no ``returned``, which version 3 added), node ``i``'s
    ``key`` set to ``value``."""
    def change(d: Doc) -> None:
        d["version"] = 1
        for each in nodes_of(d):
            each.pop("returned", None)
        nodes_of(d)[i][key] = value
    return change


def set_node(i: int, key: str, value: object) -> Callable[[Doc], object]:
    return lambda d: nodes_of(d)[i].__setitem__(key, value)


def drop_node_key(i: int, key: str) -> Callable[[Doc], object]:
    return lambda d: nodes_of(d)[i].pop(key)


def replace_node(i: int, value: object) -> Callable[[Doc], object]:
    def change(doc: Doc) -> None:
        nodes: list[object] = list(nodes_of(doc))
        nodes[i] = value
        doc["nodes"] = nodes

    return change


# Nodes of the valid document: 0 input (resident), 1 f0, 2 f1, 3 f2, 4 g2, 5 g1, 6 g0.
MALFORMED: list[tuple[str, object, str]] = [
    ("not an object", [1, 2], r"^the problem: expected a JSON object, got \[1, 2\]$"),
    ("null", None, r"^the problem: expected a JSON object, got None$"),
    ("no format", edit(lambda d: d.pop("format")), r'^format: missing; expected "format": "rematc.problem"$'),
    ("wrong format", edit(lambda d: d.update(format="rematc.plan")), r"^format: expected 'rematc.problem', got 'rematc.plan'$"),
    ("no version", edit(lambda d: d.pop("version")), r"^version: missing"),
    ("future version", edit(lambda d: d.update(version=4)), r"^version: 4 is not supported; this reader understands versions 1, 2 and 3$"),
    ("version as text", edit(lambda d: d.update(version="1")), r"^version: expected an int, got '1'$"),
    ("version as bool", edit(lambda d: d.update(version=True)), r"^version: expected an int, got True$"),
    ("unknown top-level key", edit(lambda d: d.update(budjet=3)), r"^the top level: unknown key 'budjet'; did you mean 'budget'\?$"),
    ("no nodes", edit(lambda d: d.pop("nodes")), r"^nodes: missing"),
    ("nodes not a list", edit(lambda d: d.update(nodes={"a": 1})), r"^nodes: expected a list of node objects, got \{'a': 1\}$"),
    ("node not an object", edit(replace_node(1, "f0")), r"^nodes\[1\]: expected a JSON object, got 'f0'$"),
    ("node without name", edit(drop_node_key(1, "name")), r"^nodes\[1\]\.name: missing"),
    ("empty name", edit(set_node(1, "name", "")), r"^nodes\[1\]\.name: must not be empty$"),
    ("name not a string", edit(set_node(1, "name", 7)), r"^nodes\[1\]\.name: expected a string, got 7$"),
    ("duplicate name", edit(set_node(2, "name", "f0")), r"^node #2 'f0': the name is used twice"),
    ("size not an int", edit(set_node(3, "size", "abc")), r"^nodes\[3\]\.size: expected a non-negative int of bytes, got 'abc'$"),
    ("negative size", edit(set_node(3, "size", -5)), r"^nodes\[3\]\.size: expected a non-negative int of bytes, got -5$"),
    ("overwrites a non-dep", edit(set_node(3, "overwrites", 0)), r"^nodes\[3\]\.overwrites: expected one of the node's deps \[2\] or null, got 0$"),
    ("overwrites as text", edit(set_node(3, "overwrites", "f1")), r"^nodes\[3\]\.overwrites: expected one of the node's deps \[2\] or null, got 'f1'$"),
    ("unstored not a list", edit(set_node(3, "unstored", 1)),
     r"^nodes\[3\]\.unstored: expected a list of copies among \['forward', 'recomputed', 'reloaded'\], got 1$"),
    ("unknown copy", edit(set_node(3, "overwrites_copies", ["saved"])),
     r"^nodes\[3\]\.overwrites_copies: expected a list of copies among .*, got \['saved'\]$"),
    ("a version-1 key in version 3", edit(set_node(3, "inline", True)), r"^nodes\[3\]: unknown key 'inline'"),
    ("v1 inline not a bool", edit(as_version_1(3, "inline", 1)),
     r"^nodes\[3\]\.inline: expected true or false, got 1$"),
    ("v1 reuses_recomputed not a bool", edit(as_version_1(3, "reuses_recomputed", "no")),
     r"^nodes\[3\]\.reuses_recomputed: expected true or false, got 'no'$"),
    ("fractional size", edit(set_node(3, "size", 4.0)), r"^nodes\[3\]\.size: .* got 4\.0$"),
    ("bool size", edit(set_node(3, "size", True)), r"^nodes\[3\]\.size: .* got True$"),
    ("time not a number", edit(set_node(2, "time", "fast")), r"^nodes\[2\]\.time: expected a number of seconds, got 'fast'$"),
    ("negative time", edit(set_node(2, "time", -1.0)), r"^nodes\[2\]\.time: expected a finite number >= 0 of seconds, got -1\.0$"),
    ("nan time", edit(set_node(2, "time", math.nan)), r"^nodes\[2\]\.time: expected a finite number >= 0 of seconds, got nan$"),
    ("negative flops", edit(set_node(2, "flops", -1)), r"^nodes\[2\]\.flops: .* of FLOPs, got -1$"),
    ("time beyond float range", edit(set_node(2, "time", 10**400)), r"^nodes\[2\]\.time: expected a finite number >= 0 of seconds, got 1000"),
    ("bandwidth beyond float range", edit(lambda d: d.update(host_bandwidth=-(10**400))), r"^host_bandwidth: expected a finite number >= 0"),
    ("op not a string", edit(set_node(2, "op", None)), r"^nodes\[2\]\.op: expected a string, got None$"),
    ("flag not a bool", edit(set_node(4, "backward", "yes")), r"^nodes\[4\]\.backward: expected true or false, got 'yes'$"),
    ("flag as 0/1", edit(set_node(1, "keep", 1)), r"^nodes\[1\]\.keep: expected true or false, got 1$"),
    ("unknown node key", edit(set_node(3, "sise", 5)), r"^nodes\[3\]: unknown key 'sise'; did you mean 'size'\?$"),
    ("unknown node key, no guess", edit(set_node(3, "zzz", 5)), r"^nodes\[3\]: unknown key 'zzz'; known keys: name, op, deps"),
    ("deps not a list", edit(set_node(2, "deps", 1)), r"^nodes\[2\]\.deps: expected a list of node indices, got 1$"),
    ("dep not an int", edit(set_node(2, "deps", ["f0"])), r"^nodes\[2\]\.deps\[0\]: expected a node index \(int\), got 'f0'$"),
    ("dep to a missing node", edit(set_node(2, "deps", [1, 9])), r"^nodes\[2\]\.deps\[1\]: node 9 does not exist \(there are 7 nodes\)$"),
    ("negative dep", edit(set_node(2, "deps", [-1])), r"^nodes\[2\]\.deps\[0\]: node -1 does not exist"),
    ("dep on itself", edit(set_node(2, "deps", [2])), r"^nodes\[2\]\.deps\[0\]: node 2 cannot depend on itself$"),
    ("cycle (dep on a later node)", edit(set_node(1, "deps", [3])), r"^nodes\[1\]\.deps\[0\]: node 3 is not before node 1; deps must point to earlier nodes"),
    ("forward reads backward", edit(set_node(5, "backward", False)), r"^node #5 'g1': a forward value cannot read backward value #4$"),
    ("resident with deps", edit(set_node(1, "resident", True)), r"^node #1 'f0': a resident value must be a forward input with no deps$"),
    ("negative budget", edit(lambda d: d.update(budget=-1)), r"^budget: expected a non-negative int of bytes or null, got -1$"),
    ("budget as text", edit(lambda d: d.update(budget="1 GiB")), r"^budget: .* got '1 GiB'$"),
    ("bandwidth as text", edit(lambda d: d.update(host_bandwidth="fast")), r"^host_bandwidth: expected a number of bytes/s, got 'fast'$"),
    ("negative bandwidth", edit(lambda d: d.update(host_bandwidth=-1.0)), r"^host_bandwidth: expected a finite number >= 0 of bytes/s"),
    ("name not a string", edit(lambda d: d.update(name=["x"])), r"^name: expected a string, got \['x'\]$"),
    ("meta not an object", edit(lambda d: d.update(meta=["x"])), r"^meta: expected a JSON object, got \['x'\]$"),
    ("meta value not a string", edit(lambda d: d.update(meta={"seed": 3})), r"^meta\['seed'\]: expected a string, got 3$"),
    ("scale not an object", edit(lambda d: d.update(scale=4)), r"^scale: expected a JSON object, got 4$"),
    ("huge value is shortened", edit(set_node(3, "size", "x" * 500)), r"^nodes\[3\]\.size: .* got 'x+\.\.\.$"),
    # Beyond what the solvers' 64-bit integers hold (CP-SAT rejected the model, or raised).
    ("size near 2**63", edit(set_node(3, "size", 2**63 - 1)), r"^nodes\[3\]\.size: 9223372036854775807 bytes is over 2\*\*53 bytes \(8 PiB\)"),
    ("size over 2**64", edit(set_node(3, "size", 2**64 + 1)), r"^nodes\[3\]\.size: 18446744073709551617 bytes is over 2\*\*53 bytes"),
    ("sizes add up over 2**53", edit(lambda d: [nodes_of(d)[i].update(size=2**52) for i in (2, 3)]),
     r"^nodes\[3\]\.size: the sizes of nodes\[0\] to nodes\[3\] add up to 9007199254740996 bytes, over 2\*\*53"),
    ("budget over 2**53", edit(lambda d: d.update(budget=2**63)), r"^budget: 9223372036854775808 bytes is over 2\*\*53 bytes"),
    ("bandwidth too slow", edit(lambda d: d.update(host_bandwidth=1e-300)),
     r"^host_bandwidth 1e-300 bytes/s is too slow for this problem: one copy of each value that may be offloaded"),
]


@pytest.mark.parametrize(("data", "message"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_problem_names_the_field(data: object, message: str) -> None:
    with pytest.raises(ProblemError, match=message) as info:
        problem_from_json(data)
    assert "\n" not in str(info.value)


def test_malformed_file_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(edit(set_node(3, "size", "abc"))))
    with pytest.raises(ProblemError, match=r"bad\.json: nodes\[3\]\.size: expected a non-negative int"):
        load_problem(path)


@pytest.mark.parametrize(("raw", "message"), [
    (b"", r"not JSON: Expecting value at line 1 column 1"),
    (b'{"format": "rematc.problem",', r"not JSON: .* at line 1 column \d+"),
    (b"\xff\xfe{}", r"not UTF-8 text \(byte 0\)"),
    (b"[" * 100_000 + b"]" * 100_000, r"not readable JSON|not JSON"),
    (b'{"size": ' + b"9" * 5000 + b"}", r"not readable JSON|not JSON"),
], ids=["empty", "truncated", "not utf-8", "nested too deep", "int too long"])
def test_unreadable_file_raises_problem_error(tmp_path: Path, raw: bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(raw)
    with pytest.raises(ProblemError, match=message) as info:
        load_problem(path)
    assert "\n" not in str(info.value)


def test_byte_order_mark_is_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(problem_to_json(rich())).encode())
    assert_same(load_problem(path), rich())


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_problem(tmp_path / "absent.json")


# ---- fuzzing: nothing but ProblemError comes out -----------------------------------------

huge_ints = st.integers(10**308, 10**400) | st.integers(-(10**400), -(10**308))  # beyond float
json_scalars = st.none() | st.booleans() | st.integers() | huge_ints | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def load_or_problem_error(data: object) -> None:
    try:
        p = problem_from_json(data)
    except ProblemError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert isinstance(p, Problem)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_fuzz_any_json_value(data: object) -> None:
    load_or_problem_error(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_one_field_of_a_valid_document(data: st.DataObject) -> None:
    """Replace or add one field of a valid problem with any JSON value."""
    doc = problem_to_json(rich())
    nodes = doc["nodes"]
    assert isinstance(nodes, list)
    target: dict[str, object] = data.draw(st.sampled_from([doc, *nodes]), label="object")
    key = data.draw(st.sampled_from(sorted(target)) | st.text(max_size=6), label="key")
    target[key] = data.draw(json_scalars | json_values, label="value")  # scalars half the time
    load_or_problem_error(doc)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_node_list_edits(data: st.DataObject) -> None:
    """Delete, duplicate or reorder nodes, and rewire deps to arbitrary ints."""
    doc = problem_to_json(rich())
    nodes = doc["nodes"]
    assert isinstance(nodes, list)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        if not nodes:
            break
        i = data.draw(st.integers(0, len(nodes) - 1), label="node")
        how = data.draw(st.sampled_from(["drop", "dup", "swap", "deps", "drop_key"]), label="edit")
        if how == "drop":
            nodes.pop(i)
        elif how == "dup":
            nodes.insert(i, copy.deepcopy(nodes[i]))
        elif how == "swap":
            j = data.draw(st.integers(0, len(nodes) - 1), label="other")
            nodes[i], nodes[j] = nodes[j], nodes[i]
        elif how == "deps":
            nodes[i]["deps"] = data.draw(st.lists(st.integers(-3, 10), max_size=4), label="deps")
        else:
            nodes[i].pop(data.draw(st.sampled_from(sorted(nodes[i])), label="key"))
    load_or_problem_error(doc)


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "p.json"


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_file_bytes(fuzz_file: Path, raw: bytes) -> None:
    fuzz_file.write_bytes(raw)
    try:
        load_problem(fuzz_file)
    except ProblemError as e:
        assert "\n" not in str(e)


# ---- random problems round trip ----------------------------------------------------------

names = st.text(min_size=1, max_size=6)
amounts = st.floats(min_value=0, allow_nan=False, allow_infinity=False)


@st.composite
def problems(draw: st.DrawFn) -> Problem:
    n_forward = draw(st.integers(0, 5))
    n = n_forward + draw(st.integers(0, 4))
    unique = draw(st.lists(names, min_size=n, max_size=n, unique=True))
    nodes: list[Node] = []
    for i, name in enumerate(unique):
        backward = i >= n_forward
        resident = not backward and draw(st.booleans())
        reads = () if resident or i == 0 else draw(
            st.lists(st.integers(0, i - 1), max_size=3, unique=True).map(lambda d: tuple(sorted(d)))
        )
        if not backward:
            reads = tuple(d for d in reads if d < n_forward)
        nodes.append(Node(
            name=name, op=draw(st.text(max_size=8)), deps=reads, backward=backward,
            size=draw(st.integers(0, 2**40)), time=draw(amounts), flops=draw(amounts),
            recomputable=draw(st.booleans()), resident=resident, keep=draw(st.booleans()),
            overwrites=draw(st.sampled_from([None, *reads])),
            overwrites_copies=draw(st.sampled_from([EVERY_COPY, frozenset({Copy.FORWARD})])),
            unstored=frozenset({Copy.RECOMPUTED}) if draw(st.booleans()) else frozenset(),
        ))
    try:
        return Problem(
            nodes=tuple(nodes),
            budget=draw(st.none() | st.integers(0, 2**50)),
            host_bandwidth=draw(amounts),
            name=draw(st.text(max_size=8)),
            meta=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)),
        )
    except ProblemError as e:  # a host link too slow for the solvers' time scale: not a problem
        assume("host_bandwidth" not in str(e))
        raise


@settings(max_examples=100, deadline=None)
@given(problems())
def test_random_problem_round_trips(p: Problem) -> None:
    assert_same(roundtrip(p), p)
    again = problem_to_json(roundtrip(p))
    assert json.dumps(again) == json.dumps(problem_to_json(p))


# ---- plans -------------------------------------------------------------------------------

PLAN = Plan({1: Decision.SAVE, 2: Decision.RECOMPUTE, 3: Decision.OFFLOAD}, (Step(2, 5), Step(3, 5)),
            (Transfer(3, 4, 4),))


def test_plan_round_trips(tmp_path: Path) -> None:
    doc = plan_to_json(PLAN)
    assert (doc["format"], doc["version"]) == ("rematc.plan", 1)
    assert plan_from_json(json.loads(json.dumps(doc))) == PLAN
    path = tmp_path / "plan.json"
    save_plan(PLAN, path)
    assert load_plan(path) == PLAN


def test_empty_plan_round_trips() -> None:
    assert plan_from_json(plan_to_json(Plan({}))) == Plan({})


def plan_edit(change: Callable[[Doc], object]) -> Doc:
    doc = plan_to_json(PLAN)
    change(doc)
    return doc


BAD_PLAN_DOCS: list[tuple[str, object, str]] = [
    ("not an object", "plan", r"^the plan: expected a JSON object"),
    ("problem format", plan_edit(lambda d: d.update(format="rematc.problem")), r"^format: expected 'rematc.plan'"),
    ("future version", plan_edit(lambda d: d.update(version=9)), r"^version: 9 is not supported"),
    ("unknown key", plan_edit(lambda d: d.update(schedul=[])), r"unknown key 'schedul'; did you mean 'schedule'\?"),
    ("no decisions", plan_edit(lambda d: d.pop("decisions")), r"^decisions: missing"),
    ("decisions not an object", plan_edit(lambda d: d.update(decisions=[])), r"^decisions: expected a JSON object"),
    ("key not an index", plan_edit(lambda d: d.update(decisions={"f0": "save"})), r"^decisions\['f0'\]: keys are node indices"),
    ("unknown decision", plan_edit(lambda d: d.update(decisions={"1": "keep"})), r"malformed plan JSON"),
    ("schedule not a list", plan_edit(lambda d: d.update(schedule={})), r"^schedule: expected a list"),
    ("bad step", plan_edit(lambda d: d.update(schedule=[[2, 5, 1]])), r"^schedule\[0\]: expected a \[node, before\] pair of ints"),
    ("fractional step", plan_edit(lambda d: d.update(schedule=[[2, 5.5]])), r"^schedule\[0\]:"),
    ("transfers not a list", plan_edit(lambda d: d.update(transfers={})), r"^transfers: expected a list"),
    ("transfer pair", plan_edit(lambda d: d.update(transfers=[[3, 4]])),
     r"^transfers\[0\]: expected a \[node, offload_at, reload_at\] triple of ints, got \[3, 4\]"),
]


@pytest.mark.parametrize(("data", "message"), [c[1:] for c in BAD_PLAN_DOCS], ids=[c[0] for c in BAD_PLAN_DOCS])
def test_malformed_plan_raises_plan_error(data: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_from_json(data)


def test_unreadable_plan_file_raises_plan_error(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(b"{nope")
    with pytest.raises(PlanError, match=r"plan\.json: not JSON"):
        load_plan(path)


@settings(max_examples=200, deadline=None)
@given(json_values | st.dictionaries(st.sampled_from(["format", "version", "decisions", "schedule"]), json_values))
def test_fuzz_plan_loader(data: object) -> None:
    if isinstance(data, dict) and data:
        data = {"format": "rematc.plan", "version": 1, **data}
    try:
        plan = plan_from_json(data)
    except PlanError as e:
        assert str(e)
        return
    assert isinstance(plan, Plan)
