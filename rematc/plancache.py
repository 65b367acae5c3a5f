"""An on-disk cache of solved plans, so that a second run of the same job does not solve.

One JSON file per key under the cache directory. The key is the SHA-256 of

* the problem, canonically serialized (``solvers.problem_to_json``, sorted keys): every
  value's name, op, dependencies, size and time, and the budget in bytes; so a new
  shape, another budget or another device profile is another key;
* the solver configuration (time limit, workers, seed, gaps) and the compiler the plan
  is for (under Inductor a budget the no-budget plan fits takes that plan);
* the versions of rematc, OR-Tools and torch, a hash of the solver sources, and
  :data:`FORMAT` (bumped when the entry layout changes).

An entry holds the plan (``solvers.plan_to_json``) and the solver's status, objective,
bound and wall time. A budget the search found infeasible keeps, under a key of its own
(:func:`store_refusal`), the least peak found and its plan, so that asking again raises
the same :class:`solvers.InfeasibleBudgetError` without a search. Loading trusts nothing:
an entry that does not parse, belongs to another key or format, or whose plan the
checker rejects for this problem (invalid, or over budget) is logged, ignored and overwritten by the next solve. Writes go to a
temporary file in the same directory and are renamed into place (``os.replace`` is
atomic on POSIX and Windows), so concurrent writers of one key leave one whole entry,
never a mix. Entries get the mode the umask gives a new file (``0666 & ~umask``), as
``open`` would: a cache directory shared by a group is readable by it (``mkstemp``'s
0600 made every entry its writer's alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import secrets
from importlib import metadata
from typing import Any

from rematc.options import CACHE_AUTO, CACHE_OFF
from solvers import (
    InfeasibleBudgetError,
    PlanError,
    Problem,
    SolverConfig,
    SolveResult,
    Status,
    check,
    plan_from_json,
    plan_to_json,
    problem_to_json,
)

log = logging.getLogger(__name__)

FORMAT = "rematc.plancache/1"
ENV = "REMATC_CACHE_DIR"  # overrides the default directory; "off" turns the cache off


def directory(option: str | os.PathLike[str] | None) -> pathlib.Path | None:
    """The cache directory for the ``cache_dir`` option, or None when the cache is off."""
    if option is None:
        return None
    value = os.fspath(option)
    if value == CACHE_AUTO:
        value = os.environ.get(ENV) or str(pathlib.Path("~/.cache/rematc"))
    if value.strip().lower() == CACHE_OFF:
        return None
    return pathlib.Path(value).expanduser()


def key(problem: Problem, config: SolverConfig, compiler: str = "") -> str:
    """SHA-256 hex digest of everything that determines the plan (see the module doc)."""
    material = {
        "format": FORMAT,
        "compiler": compiler,
        "problem": problem_to_json(problem),
        # Every setting that can change the plan; the search log cannot.
        "solver": {k: v for k, v in dataclasses.asdict(config).items() if k != "log"},
        "versions": versions(),
    }
    blob = json.dumps(material, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def load(root: pathlib.Path, digest: str, problem: Problem) -> SolveResult | None:
    """The cached result for ``digest`` if present and valid for ``problem``, else None."""
    path = _path(root, digest)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("rematc plan cache: cannot read %s (%s); solving instead", path, e)
        return None
    try:
        entry = json.loads(data.decode("utf-8"))  # UnicodeDecodeError is a ValueError
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != digest:
            raise ValueError("not an entry of this format and key")
        plan = plan_from_json(entry["plan"])
        report = check(problem, plan)
        if not report.fits:
            raise ValueError(f"its plan peaks at {report.peak} B, over the budget {problem.budget} B")
        status = Status(entry["status"])
        if status not in (Status.OPTIMAL, Status.FEASIBLE):
            raise ValueError(f"status {status.value!r} has no plan")
        return SolveResult(
            status=status, plan=plan, report=report, objective=report.added_time,
            bound=min(float(entry["bound"]), report.added_time),
            wall_time=float(entry["wall_time"]), solver=str(entry["solver"]),
            stats={"cache": str(path)},
        )
    # RecursionError: JSON nested deeper than Python's parser recurses.
    except (ValueError, KeyError, TypeError, RecursionError, PlanError) as e:
        log.warning("rematc plan cache: ignoring invalid entry %s (%s); solving again", path, e)
        return None


def store(root: pathlib.Path, digest: str, result: SolveResult) -> None:
    """Write ``result`` under ``digest`` atomically; a failure to write is logged, not raised
    (the plan is already in hand)."""
    assert result.plan is not None
    entry: dict[str, Any] = {
        "format": FORMAT, "key": digest, "status": result.status.value,
        "plan": plan_to_json(result.plan), "objective": result.objective,
        "bound": result.bound, "wall_time": result.wall_time, "solver": result.solver,
    }
    _write(_path(root, digest), digest, entry, what="the plan is used uncached")


def load_note(root: pathlib.Path, digest: str) -> Any:
    """A JSON note stored by :func:`store_note` under ``digest`` (what a step's survey
    found, ``rematc.regions``), or None where there is none or it does not parse."""
    path = _path(root, digest)
    try:
        entry = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != digest:
            raise ValueError("not an entry of this format and key")
        return entry["note"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, RecursionError) as e:
        log.warning("rematc plan cache: ignoring %s (%s)", path, e)
        return None


def store_refusal(root: pathlib.Path, digest: str, error: InfeasibleBudgetError) -> None:
    """Keep what a search found where the budget of ``digest`` is infeasible (the least
    peak it found and that plan; nothing where it found no plan)."""
    if error.plan is None or error.min_feasible is None:
        return
    store_note(root, derived(digest, "infeasible"), {"budget": error.budget, "min_feasible": error.min_feasible,
                                         "proven": error.proven, "at_least": error.at_least,
                                         "plan": plan_to_json(error.plan)})


def load_refusal(root: pathlib.Path, digest: str, problem: Problem) -> InfeasibleBudgetError | None:
    """The error :func:`store_refusal` kept for ``digest``, where its plan fits
    ``problem`` at the least peak it states; None otherwise."""
    note = load_note(root, derived(digest, "infeasible"))
    if note is None:
        return None
    try:
        plan = plan_from_json(note["plan"])
        least = int(note["min_feasible"])
        if not check(problem.with_budget(least), plan).fits:
            raise ValueError(f"its plan peaks over the least peak it states, {least} B")
        at_least = note["at_least"]
        return InfeasibleBudgetError(int(note["budget"]), least, proven=bool(note["proven"]), plan=plan,
                                     at_least=None if at_least is None else int(at_least))
    except (ValueError, KeyError, TypeError, RecursionError, PlanError) as e:
        log.warning("rematc plan cache: ignoring the infeasible budget kept for %s (%s)", digest[:12], e)
        return None


def derived(digest: str, what: str) -> str:
    """The key of an entry about ``what`` beside the one under ``digest`` (its budget, a
    refusal, a plan for several calls)."""
    return hashlib.sha256(f"{digest}:{what}".encode()).hexdigest()


def store_note(root: pathlib.Path, digest: str, note: Any) -> None:
    """Write a JSON ``note`` under ``digest`` atomically; a failure is logged."""
    _write(_path(root, digest), digest, {"format": FORMAT, "key": digest, "note": note},
           what="it is found again next time")


def _write(path: pathlib.Path, digest: str, entry: dict[str, Any], *, what: str) -> None:
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = str(path.parent / f".{digest[:16]}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.warning("rematc plan cache: cannot write %s (%s); %s", path, e, what)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _path(root: pathlib.Path, digest: str) -> pathlib.Path:
    return root / digest[:2] / f"{digest}.json"


@functools.cache
def versions() -> dict[str, str]:
    """Package versions, plus a hash of the solver sources: an edited solver in a
    development install must not reuse plans of the old one."""
    out = {}
    for dist in ("rematc", "ortools", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "unknown"
    sources = sorted((pathlib.Path(__file__).parent.parent / "solvers").glob("*.py"))
    h = hashlib.sha256()
    for p in sources:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    out["solvers"] = h.hexdigest()
    return out

