"""The layers of ``solvers/``, read from the source: no import cycle among its modules (an
import inside a function counts: it ties the modules together all the same), nothing of
torch or rematc, and the flat CP-SAT model and the shared leaves import none of the solvers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "solvers"
# The modules every solver may read, which read no solver: the problem IR, plans, the
# checker, the result types, the CP-SAT plumbing and what several solvers share.
LEAVES = frozenset({
    "solvers.problem", "solvers.plan", "solvers.checker", "solvers.result", "solvers.sat",
    "solvers.floor", "solvers.segments", "solvers.deadline",
})


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str) -> set[str]:
    """Every module that ``name`` imports, at the top, in a function or under
    ``TYPE_CHECKING``: ``from solvers import chain`` names ``solvers.chain``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return out


def graph() -> dict[str, set[str]]:
    """Module -> the modules of ``solvers`` it imports. The package itself (its
    ``__init__`` gathers the public names from the modules) is left out as a target."""
    return {m: {t for t in imported(m) if t in MODULES and t not in (m, "solvers")} for m in MODULES}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` as the modules along it, first repeated at the end; None if
    there is none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return [*path[path.index(w):], w]
            if w not in state and (found := visit(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def test_the_reader_sees_every_kind_of_import() -> None:
    """The helper itself, on the modules it must read: a top-level ``from`` import, a
    package's submodule, and the package ``__init__``."""
    assert len(MODULES) > 10 and "solvers.singlephase.anywhere" in MODULES
    assert "solvers.problem" in imported("solvers.plan")
    assert "solvers.singlephase.anywhere" in imported("solvers.planner")
    assert "solvers.planner" in imported("solvers")


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_solvers() -> None:
    found = cycle(graph())
    assert found is None, "import cycle in solvers/: " + " -> ".join(found or [])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_of_solvers_imports_torch_or_rematc(name: str) -> None:
    outside = {m for m in imported(name) if m.split(".")[0] in ("torch", "rematc")}
    assert not outside, f"{name} imports {sorted(outside)}: solvers/ stays torch-free"


@pytest.mark.parametrize("name", sorted(LEAVES | {"solvers.cpsat"}))
def test_the_flat_model_and_the_leaves_import_no_solver(name: str) -> None:
    """The formulation knows nothing of the other solvers, and what several solvers share
    lives below all of them."""
    assert name in MODULES
    solvers = graph()[name] - LEAVES
    assert not solvers, f"{name} imports {sorted(solvers)}"
