"""Problems from public rematerialization benchmark graphs (networkx node-link JSON).

The framework graphs Checkmate extracted from Keras models (VGG16/19, MobileNet,
ResNet50, FCN-8, SegNet, U-Net; files ``*_train_nx.json``, as republished with
Moccasin) are networkx node-link documents: ``nodes`` with ``id``, ``name``,
``backward``, ``cost_cpu`` and ``cost_ram``, and ``links`` with ``source`` and
``target`` (an edge u -> v: v reads u's output).

Mapping onto :class:`~solvers.problem.Problem`, chosen so that the problem's memory model
is the one the published numbers use ("when node v runs at step j, memory is the sum of
output sizes of every earlier-computed value that still has a consumer at step j or
later, plus v's own output"):

* order: ``networkx.topological_sort`` of the graph built in file order (what
  ``networkx.node_link_graph`` builds), the order the published baselines execute. Our
  problems list the forward before the backward; if that sort interleaves them, the
  forward nodes are moved ahead of the backward ones keeping each side's relative order
  (still a topological order when no forward node reads a backward one, which is
  checked). The framework graphs are already in that shape.
* ``cost_ram`` -> ``size`` (bytes, an int >= 0); ``cost_cpu`` -> ``time`` and ``flops``.
  ``cost_cpu`` is Checkmate's cost unit (FLOPs-like), not seconds: ``time`` then holds
  cost units, ``meta["time_unit"]`` says so, and cost increases (added time / total
  time) are unit-free as in the papers.
* no node is ``resident``: a graph source (the first convolution) is a real op whose
  output counts, exactly as in the published model; the network's input and weights
  are not in these graphs at all.
* no node is ``keep``: a value with no consumer lives only at its own step, as in the
  published model (the sink is the last gradient, so this changes nothing at the end).
* every node is ``recomputable``: the graphs carry no random ops.

The ``random_layered_*`` graphs of the same collection ("Neural Topological Ordering
for Computation Graphs", Appendix A) have no forward/backward split: nodes carry
``duration`` and ``out_cost`` (the tag names are in the graph attributes
``node_duration_tag`` / ``node_output_cost_tag``), edges use the keys ``"0"`` and ``"1"``,
nodes are identified by ``name`` (or ``id``), and ``graph["order"]`` gives the execution
order the published baselines use (checked to be a topological order of every node;
a topological sort where absent). They become single-phase problems (no backward
values, :attr:`Problem.single_phase`): every value may be recomputed before any later
step. ``param_cost`` is ignored, as in the published memory model.

Every malformed input (unreadable JSON, missing keys, wrong types, negative costs,
links to unknown nodes, duplicate ids, a cycle) raises :class:`ProblemError` with a
one-line message; ``OSError`` when the file cannot be read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

import networkx as nx

from solvers.problem import MAX_BYTES, MAX_BYTES_TEXT, Node, Problem, ProblemError


def is_node_link(data: object) -> bool:
    """Whether a parsed JSON value looks like a networkx node-link document."""
    return isinstance(data, dict) and "nodes" in data and ("links" in data or "edges" in data)


def load_node_link(path: str | os.PathLike[str]) -> Problem:
    """Read a ``*_train_nx.json`` benchmark graph; :class:`ProblemError` names the file."""
    data = read_json(path)
    try:
        return problem_from_node_link(data, name=_stem(path))
    except ProblemError as e:
        raise ProblemError(f"{os.fspath(path)}: {e}") from None


def read_json(path: str | os.PathLike[str]) -> object:
    """A JSON file's value; :class:`ProblemError` (naming the file) when it is not JSON."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ProblemError(f"{os.fspath(path)}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ProblemError(f"{os.fspath(path)}: not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # an int of 5000 digits, nesting too deep
        raise ProblemError(f"{os.fspath(path)}: not readable JSON: {_show(str(e))}") from None


def problem_from_node_link(data: object, *, name: str = "") -> Problem:
    """The problem of a parsed node-link document (see the module docstring)."""
    if not isinstance(data, dict):
        raise ProblemError(f"expected a node-link JSON object, got {_show(data)}")
    nodes = data.get("nodes")
    links = data.get("links", data.get("edges"))
    if not isinstance(nodes, list):
        raise ProblemError(f"nodes: expected a list of node objects, got {_show(nodes)}")
    if not isinstance(links, list):
        raise ProblemError(f"links: expected a list of edge objects, got {_show(links)}")
    graph_attrs = data.get("graph")
    attrs: Mapping[str, object] = graph_attrs if isinstance(graph_attrs, Mapping) else {}
    train = not nodes or not isinstance(nodes[0], dict) or "backward" in nodes[0]
    if train:
        time_key, size_key, ends_keys = "cost_cpu", "cost_ram", ("source", "target")
    else:
        time_key = str(attrs.get("node_duration_tag", "duration"))
        size_key = str(attrs.get("node_output_cost_tag", "out_cost"))
        ends_keys = ("0", "1") if links and isinstance(links[0], dict) and "0" in links[0] else ("source", "target")
    graph = nx.DiGraph()
    key_of: dict[object, int] = {}
    parsed: list[Node] = []
    total = 0
    for i, raw in enumerate(nodes):
        where = f"nodes[{i}]"
        if not isinstance(raw, dict):
            raise ProblemError(f"{where}: expected a JSON object, got {_show(raw)}")
        key = raw.get("id", raw.get("name", i) if not train else i)
        if not isinstance(key, (int, str)) or isinstance(key, bool):
            raise ProblemError(f"{where}.id: expected an int or string, got {_show(key)}")
        if key in key_of:
            raise ProblemError(f"{where}.id: {key!r} is used twice")
        label = raw.get("name", str(key))
        if not isinstance(label, (str, int)) or isinstance(label, bool):
            raise ProblemError(f"{where}.name: expected a string, got {_show(label)}")
        backward = raw.get("backward", False if not train else None)
        if not isinstance(backward, bool):
            raise ProblemError(f"{where}.backward: expected true or false, got {_show(backward)}")
        size = raw.get(size_key)
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
            raise ProblemError(f"{where}.{size_key}: expected a non-negative int of bytes, got {_show(size)}")
        total += size
        if size > MAX_BYTES:
            raise ProblemError(f"{where}.{size_key}: {size} bytes is over {MAX_BYTES_TEXT}: no device "
                               "holds that much")
        if total > MAX_BYTES:
            raise ProblemError(f"{where}.{size_key}: the sizes of nodes[0] to nodes[{i}] add up to {total} "
                               f"bytes, over {MAX_BYTES_TEXT}: no device holds that much")
        cost = _amount(raw, time_key, where)
        key_of[key] = i
        graph.add_node(i)
        parsed.append(Node(name=str(label) or str(key), backward=backward,
                           size=size, time=cost, flops=cost))
    for k, raw in enumerate(links):
        where = f"links[{k}]"
        if not isinstance(raw, dict):
            raise ProblemError(f"{where}: expected a JSON object, got {_show(raw)}")
        ends = []
        for end in ends_keys:
            if end not in raw:
                raise ProblemError(f"{where}.{end}: missing")
            ref = raw[end]
            if isinstance(ref, bool) or not isinstance(ref, (int, str)) or ref not in key_of:
                raise ProblemError(f"{where}.{end}: {_show(ref)} is not the id of a node")
            ends.append(key_of[ref])
        u, v = ends
        if u == v:
            raise ProblemError(f"{where}: node {parsed[u].name!r} reads itself (a cycle)")
        graph.add_edge(u, v)
    try:
        order = list(nx.topological_sort(graph))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(graph)
        path = " -> ".join(parsed[u].name for u, _ in cycle)
        raise ProblemError(f"the graph has a cycle: {path} -> {parsed[cycle[0][0]].name}") from None
    if train:
        order = [i for i in order if not parsed[i].backward] + [i for i in order if parsed[i].backward]
    elif "order" in attrs:
        order = _given_order(attrs["order"], key_of, graph)
    position = {old: new for new, old in enumerate(order)}
    out: list[Node] = []
    names: set[str] = set()
    for old in order:
        n = parsed[old]
        deps = tuple(sorted(position[u] for u in graph.predecessors(old)))
        if not n.backward and any(parsed[u].backward for u in graph.predecessors(old)):
            raise ProblemError(f"forward node {n.name!r} reads a backward node")
        unique = n.name if n.name not in names else f"{n.name}#{old}"
        names.add(unique)
        out.append(Node(name=unique, op=n.op, deps=deps, backward=n.backward, size=n.size,
                        time=n.time, flops=n.flops))
    title = attrs.get("name")
    meta = ({"source": "networkx node-link (Checkmate train graph)",
             "time_unit": "cost_cpu (Checkmate cost units, not seconds)"} if train else
            {"source": "networkx node-link (random layered graph)",
             "time_unit": f"{time_key} (cost units, not seconds)",
             "order": "graph.order" if "order" in attrs else "topological sort"})
    if isinstance(title, str):
        meta["graph"] = title
    return Problem(nodes=tuple(out), name=name or (title if isinstance(title, str) else ""), meta=meta)


def _given_order(raw: object, key_of: Mapping[object, int], graph: nx.DiGraph) -> list[int]:
    """``graph["order"]`` as node indices; :class:`ProblemError` unless it lists every node
    once, in an order where each node comes after the nodes it reads."""
    if not isinstance(raw, list):
        raise ProblemError(f"graph.order: expected a list of node ids, got {_show(raw)}")
    order: list[int] = []
    for k, ref in enumerate(raw):
        if isinstance(ref, bool) or ref not in key_of:
            raise ProblemError(f"graph.order[{k}]: {_show(ref)} is not the id of a node")
        order.append(key_of[ref])
    if len(set(order)) != len(order) or len(order) != len(key_of):
        raise ProblemError(f"graph.order: lists {len(set(order))} distinct nodes of {len(key_of)}; "
                           "it must list every node once")
    position = {v: k for k, v in enumerate(order)}
    for u, v in graph.edges:
        if position[u] > position[v]:
            raise ProblemError(f"graph.order: node at position {position[v]} reads the node at "
                               f"position {position[u]}, which comes later (not a topological order)")
    return order


def _amount(raw: Mapping[str, object], key: str, where: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProblemError(f"{where}.{key}: expected a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and number >= 0):
        raise ProblemError(f"{where}.{key}: expected a finite number >= 0, got {_show(value)}")
    return number


def _stem(path: str | os.PathLike[str]) -> str:
    base = os.path.basename(os.fspath(path))
    return base.removesuffix(".json").removesuffix("_train_nx")


def _show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
