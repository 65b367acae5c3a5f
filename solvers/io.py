"""Versioned JSON files for problems and plans.

A problem file is one JSON object (the schema, field by field, is ``docs/problem-format.md``)::

    {"format": "rematc.problem", "version": 3, "name": "mlp", "budget": 1048576,
     "host_bandwidth": 0.0, "scale": {...}, "meta": {...},
     "nodes": [{"name": "x", "resident": true, "size": 4096}, ...]}

Only ``format``, ``version``, ``nodes`` and each node's ``name`` are required; every other
field may be left out and then takes :class:`~solvers.problem.Node`'s default. The
writer writes every field, so that a file says what it means without this code.
``scale`` is written for readers of the file; the loader recomputes it from the nodes and
only checks that it is an object.

Version 1 files (problems written before the memory effects had their generic names:
``reuses``, ``reuses_recomputed``, ``inline``, ``fused``) are read too and mean the same
problem; so are version 2 files, written before a node could be ``returned`` (none is).
The writer writes version 3.

The loader is strict: a wrong format tag, an unsupported version, a missing or unknown
key, a wrongly typed or out-of-range value, or a dependency that does not point to an
earlier node raises :class:`~solvers.problem.ProblemError` with a one-line message that
names the field (``nodes[3].size: expected a non-negative int of bytes, got 'abc'``). No
other exception comes out of it for any input, except ``OSError`` when the file cannot
be read.

A plan file wraps :meth:`Plan.to_json` the same way (``"format": "rematc.plan"``); a
malformed one raises :class:`~solvers.plan.PlanError`.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from typing import TypeGuard, TypeVar

from solvers.plan import Plan, PlanError
from solvers.problem import EVERY_COPY, MAX_BYTES, MAX_BYTES_TEXT, Copy, Node, Problem, ProblemError

PROBLEM_FORMAT = "rematc.problem"
PLAN_FORMAT = "rematc.plan"
VERSION = 3  # of problem files: the version the writer writes
READ_VERSIONS = (1, 2, 3)  # the problem versions the reader reads
PLAN_VERSION = 1  # of plan files: the only one

_PROBLEM_KEYS = ("format", "version", "name", "budget", "host_bandwidth", "scale", "meta", "nodes")
_COMMON_NODE_KEYS = (
    "name", "op", "deps", "backward", "size", "time", "flops", "recomputable", "offloadable",
    "resident", "keep",
)
_NODE_KEYS = {
    1: (*_COMMON_NODE_KEYS, "reuses", "reuses_recomputed", "inline", "fused"),
    2: (*_COMMON_NODE_KEYS, "overwrites", "overwrites_copies", "unstored"),
    3: (*_COMMON_NODE_KEYS, "returned", "overwrites", "overwrites_copies", "unstored"),
}
_PLAN_KEYS = ("format", "version", "decisions", "schedule", "transfers")

_E = TypeVar("_E", bound=ValueError)
_T = TypeVar("_T")


# ---- problems -----------------------------------------------------------------------


def problem_to_json(problem: Problem) -> dict[str, object]:
    """``problem`` as a JSON-ready dict in the current format version."""
    return {**_header(problem), "nodes": [_node_to_json(n) for n in problem.nodes]}


def _header(problem: Problem) -> dict[str, object]:
    scale = problem.scale
    return {
        "format": PROBLEM_FORMAT,
        "version": VERSION,
        "name": problem.name,
        "budget": problem.budget,
        "host_bandwidth": float(problem.host_bandwidth),
        "scale": {
            "bytes_per_unit": scale.bytes_per_unit,
            "seconds_per_unit": scale.seconds_per_unit,
        },
        "meta": dict(sorted(problem.meta.items())),
    }


def _node_to_json(n: Node) -> dict[str, object]:
    return {
        "name": n.name,
        "op": n.op,
        "deps": list(n.deps),
        "backward": n.backward,
        "size": n.size,
        "time": float(n.time),
        "flops": float(n.flops),
        "recomputable": n.recomputable,
        "offloadable": n.offloadable,
        "resident": n.resident,
        "keep": n.keep,
        "returned": n.returned,
        **({"overwrites": n.overwrites} if n.overwrites is not None else {}),
        **({"overwrites_copies": _copies(n.overwrites_copies)} if n.overwrites_copies != EVERY_COPY else {}),
        **({"unstored": _copies(n.unstored)} if n.unstored else {}),
    }


def _copies(copies: frozenset[Copy]) -> list[str]:
    return [c.value for c in Copy if c in copies]  # in the enum's order


def problem_from_json(data: object) -> Problem:
    """The problem in ``data`` (a parsed JSON value); :class:`ProblemError` if malformed."""
    doc = _object(data, "the problem", ProblemError)
    version = _check_envelope(doc, PROBLEM_FORMAT, READ_VERSIONS, _PROBLEM_KEYS, "", ProblemError)
    if "nodes" not in doc:
        raise ProblemError("nodes: missing; a problem lists its values under 'nodes'")
    raw_nodes = doc["nodes"]
    if not isinstance(raw_nodes, list):
        raise ProblemError(f"nodes: expected a list of node objects, got {_show(raw_nodes)}")
    nodes = tuple(_node_from_json(raw, i, len(raw_nodes), version) for i, raw in enumerate(raw_nodes))
    total = 0
    for i, n in enumerate(nodes):
        total += n.size
        if total > MAX_BYTES:
            raise ProblemError(f"nodes[{i}].size: the sizes of nodes[0] to nodes[{i}] add up to {total} "
                               f"bytes, over {MAX_BYTES_TEXT}: no device holds that much")
    budget = doc.get("budget")
    if budget is not None and not (_is_int(budget) and budget >= 0):
        raise ProblemError(f"budget: expected a non-negative int of bytes or null, got {_show(budget)}")
    if budget is not None and budget > MAX_BYTES:
        raise ProblemError(f"budget: {budget} bytes is over {MAX_BYTES_TEXT}: no device holds that much")
    meta: dict[str, str] = {}
    for k, v in _object(doc.get("meta", {}), "meta", ProblemError).items():
        if not isinstance(v, str):
            raise ProblemError(f"meta[{k!r}]: expected a string, got {_show(v)}")
        meta[k] = v
    _object(doc.get("scale", {}), "scale", ProblemError)  # informational: recomputed below
    return Problem(
        nodes=nodes,
        budget=budget,
        host_bandwidth=_amount(doc, "host_bandwidth", "", "bytes/s"),
        name=_typed(doc, "name", "", str, "a string", ""),
        meta=meta,
    )


def _node_from_json(raw: object, i: int, count: int, version: int) -> Node:
    where = f"nodes[{i}]"
    obj = _object(raw, where, ProblemError)
    _reject_unknown(obj, _NODE_KEYS[version], where, ProblemError)
    if "name" not in obj:
        raise ProblemError(f"{where}.name: missing; every node needs a unique name")
    name = _typed(obj, "name", where, str, "a string", "")
    if not name:
        raise ProblemError(f"{where}.name: must not be empty")
    raw_deps = obj.get("deps", [])
    if not isinstance(raw_deps, list):
        raise ProblemError(f"{where}.deps: expected a list of node indices, got {_show(raw_deps)}")
    for k, d in enumerate(raw_deps):
        at = f"{where}.deps[{k}]"
        if not _is_int(d):
            raise ProblemError(f"{at}: expected a node index (int), got {_show(d)}")
        if d < 0 or d >= count:
            raise ProblemError(f"{at}: node {d} does not exist (there are {count} nodes)")
        if d == i:
            raise ProblemError(f"{at}: node {i} cannot depend on itself")
        if d > i:
            raise ProblemError(
                f"{at}: node {d} is not before node {i}; deps must point to earlier nodes "
                "(nodes are listed in topological order, so there are no cycles)"
            )
    size = obj.get("size", 0)
    if not (_is_int(size) and size >= 0):
        raise ProblemError(f"{where}.size: expected a non-negative int of bytes, got {_show(size)}")
    if size > MAX_BYTES:
        raise ProblemError(f"{where}.size: {size} bytes is over {MAX_BYTES_TEXT}: no device holds that much")
    effects = _effects if version >= 2 else _effects_v1
    overwrites, overwrites_copies, unstored = effects(obj, where, raw_deps)
    return Node(
        name=name,
        op=_typed(obj, "op", where, str, "a string", ""),
        deps=tuple(raw_deps),
        backward=_typed(obj, "backward", where, bool, "true or false", False),
        size=size,
        time=_amount(obj, "time", where, "seconds"),
        flops=_amount(obj, "flops", where, "FLOPs"),
        recomputable=_typed(obj, "recomputable", where, bool, "true or false", True),
        offloadable=_typed(obj, "offloadable", where, bool, "true or false", True),
        resident=_typed(obj, "resident", where, bool, "true or false", False),
        keep=_typed(obj, "keep", where, bool, "true or false", False),
        returned=_typed(obj, "returned", where, bool, "true or false", False) if version >= 3 else False,
        overwrites=overwrites,
        overwrites_copies=overwrites_copies,
        unstored=unstored,
    )


Effects = tuple[int | None, frozenset[Copy], frozenset[Copy]]  # overwrites, its copies, unstored


def _effects(obj: Mapping[str, object], where: str, deps: list[object]) -> Effects:
    """The memory effects of a version-2 node."""
    return (_dep(obj, "overwrites", where, deps), _copy_set(obj, "overwrites_copies", where, EVERY_COPY),
            _copy_set(obj, "unstored", where, frozenset()))


def _effects_v1(obj: Mapping[str, object], where: str, deps: list[object]) -> Effects:
    """A version-1 node's effects in version 2's words: ``reuses`` is ``overwrites``,
    ``reuses_recomputed: false`` overwrites the forward copy only, ``fused`` leaves the
    forward copy unstored and ``inline`` the recomputed one."""
    recomputed = _typed(obj, "reuses_recomputed", where, bool, "true or false", True)
    inline = _typed(obj, "inline", where, bool, "true or false", False)
    fused = _typed(obj, "fused", where, bool, "true or false", False)
    unstored = {*([Copy.FORWARD] if fused else []), *([Copy.RECOMPUTED] if inline else [])}
    return (_dep(obj, "reuses", where, deps), EVERY_COPY if recomputed else frozenset({Copy.FORWARD}),
            frozenset(unstored))


def _dep(obj: Mapping[str, object], key: str, where: str, deps: list[object]) -> int | None:
    value = obj.get(key)
    if value is not None and not (_is_int(value) and value in deps):
        raise ProblemError(f"{where}.{key}: expected one of the node's deps {deps} or null, got {_show(value)}")
    return value if _is_int(value) else None


def _copy_set(obj: Mapping[str, object], key: str, where: str, default: frozenset[Copy]) -> frozenset[Copy]:
    value = obj.get(key)
    if value is None:
        return default
    names = [c.value for c in Copy]
    if not (isinstance(value, list) and all(isinstance(c, str) and c in names for c in value)):
        raise ProblemError(f"{where}.{key}: expected a list of copies among {names}, got {_show(value)}")
    return frozenset(Copy(c) for c in value)


def save_problem(problem: Problem, path: str | os.PathLike[str]) -> None:
    """Write ``problem`` to ``path`` as indented JSON, one node per line."""
    head = json.dumps(_header(problem), indent=1, allow_nan=False)
    nodes = [json.dumps(_node_to_json(n), allow_nan=False) for n in problem.nodes]
    listed = "[\n  " + ",\n  ".join(nodes) + "\n ]" if nodes else "[]"
    # head ends with "\n}": reopen the object to append "nodes" as its last key.
    text = f'{head[:-2]},\n "nodes": {listed}\n}}\n'
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def load_problem(path: str | os.PathLike[str]) -> Problem:
    """Read a problem file; :class:`ProblemError` (naming the file) if it is malformed."""
    data = _read_json(path, ProblemError)
    try:
        return problem_from_json(data)
    except ProblemError as e:
        raise ProblemError(f"{os.fspath(path)}: {e}") from None


# ---- plans --------------------------------------------------------------------------


def plan_to_json(plan: Plan) -> dict[str, object]:
    """``plan`` as a JSON-ready dict: :meth:`Plan.to_json` with a format tag and version."""
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **plan.to_json()}


def plan_from_json(data: object) -> Plan:
    """The plan in ``data`` (a parsed JSON value); :class:`PlanError` if malformed."""
    doc = _object(data, "the plan", PlanError)
    _check_envelope(doc, PLAN_FORMAT, (PLAN_VERSION,), _PLAN_KEYS, "", PlanError)
    if "decisions" not in doc:
        raise PlanError("decisions: missing; a plan maps value indices to decisions")
    decisions = _object(doc["decisions"], "decisions", PlanError)
    for k in decisions:
        if not (k.isascii() and k.isdigit()):
            raise PlanError(f"decisions[{k!r}]: keys are node indices written as strings")
    schedule = _int_rows(doc, "schedule", ("node", "before"), "pair")
    transfers = _int_rows(doc, "transfers", ("node", "offload_at", "reload_at"), "triple")
    return Plan.from_json({"decisions": decisions, "schedule": schedule, "transfers": transfers})


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(plan_to_json(plan), f, indent=1)
        f.write("\n")


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan file; :class:`PlanError` (naming the file) if it is malformed."""
    data = _read_json(path, PlanError)
    try:
        return plan_from_json(data)
    except PlanError as e:
        raise PlanError(f"{os.fspath(path)}: {e}") from None


# ---- shared checks ------------------------------------------------------------------


def _int_rows(doc: Mapping[str, object], key: str, fields: tuple[str, ...], row: str) -> list[object]:
    """``doc[key]`` (default []): a list of ``[field, ...]`` lists of ints, else PlanError."""
    rows = doc.get(key, [])
    shape = f"[{', '.join(fields)}]"
    if not isinstance(rows, list):
        raise PlanError(f"{key}: expected a list of {shape} {row}s, got {_show(rows)}")
    for n, r in enumerate(rows):
        if not (isinstance(r, list) and len(r) == len(fields) and all(_is_int(x) for x in r)):
            raise PlanError(f"{key}[{n}]: expected a {shape} {row} of ints, got {_show(r)}")
    return rows


def _read_json(path: str | os.PathLike[str], error: type[_E]) -> object:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw.decode("utf-8-sig"))  # a byte-order mark is tolerated
    except UnicodeDecodeError as e:
        raise error(f"{os.fspath(path)}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise error(f"{os.fspath(path)}: not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # e.g. an int of 5000 digits, nesting too deep
        raise error(f"{os.fspath(path)}: not readable JSON: {_show(str(e))}") from None


def _check_envelope(
    doc: dict[str, object], fmt: str, versions: tuple[int, ...], keys: tuple[str, ...], where: str,
    error: type[_E],
) -> int:
    """The file's version, once its format tag, version and top-level keys are checked."""
    if "format" not in doc:
        raise error(f'format: missing; expected "format": "{fmt}"')
    if doc["format"] != fmt:
        raise error(f"format: expected {fmt!r}, got {_show(doc['format'])}")
    if "version" not in doc:
        raise error(f'version: missing; expected "version": {versions[-1]}')
    version = doc["version"]
    if not _is_int(version):
        raise error(f"version: expected an int, got {_show(version)}")
    if version not in versions:
        understood = (f"version {versions[0]}" if len(versions) == 1 else
                      f"versions {', '.join(str(v) for v in versions[:-1])} and {versions[-1]}")
        raise error(f"version: {version} is not supported; this reader understands {understood}")
    _reject_unknown(doc, keys, where, error)
    return version


def _object(value: object, where: str, error: type[_E]) -> dict[str, object]:
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, got {_show(value)}")
    return value


def _reject_unknown(obj: Mapping[str, object], known: tuple[str, ...], where: str, error: type[_E]) -> None:
    for key in obj:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            raise error(f"{where or 'the top level'}: unknown key {_show(key)}; {hint}")


def _typed(
    obj: Mapping[str, object], key: str, where: str, kind: type[_T], what: str, default: _T
) -> _T:
    value = obj.get(key, default)
    if not isinstance(value, kind):
        raise ProblemError(f"{_at(where, key)}: expected {what}, got {_show(value)}")
    return value


def _amount(obj: Mapping[str, object], key: str, where: str, unit: str) -> float:
    """A finite, non-negative number (JSON ints are accepted and become floats)."""
    value = obj.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProblemError(f"{_at(where, key)}: expected a number of {unit}, got {_show(value)}")
    try:
        number = float(value)  # OverflowError: a JSON int beyond the float range
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and number >= 0):
        raise ProblemError(f"{_at(where, key)}: expected a finite number >= 0 of {unit}, got {_show(value)}")
    return number


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _show(value: object, limit: int = 60) -> str:
    """A one-line, bounded repr for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

