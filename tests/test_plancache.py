"""The on-disk plan cache: keys, round trips, corrupt and stale entries, concurrent
writers, and a second compile of the same model that does not solve."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import stat

import pytest
import torch

import rematc
import rematc.partition
from rematc import plancache
from rematc.options import Options
from solvers import Decision, SolverConfig, Status, check, solve
from solvers.problem import chain_problem
from tests.helpers import MODELS

CONFIG = SolverConfig(time_limit=10.0, workers=1)


def _problem(budget: int = 90):  # type: ignore[no-untyped-def]
    return chain_problem([10, 20, 30, 20, 10], [1.0, 2.0, 1.0, 3.0, 1.0], budget=budget)


def test_directory_option() -> None:
    assert plancache.directory(None) is None
    assert plancache.directory("off") is None
    assert plancache.directory("/x/y") == pathlib.Path("/x/y")


def test_directory_auto_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv(plancache.ENV, str(tmp_path))
    assert plancache.directory("auto") == tmp_path
    monkeypatch.setenv(plancache.ENV, "off")
    assert plancache.directory("auto") is None
    monkeypatch.delenv(plancache.ENV)
    assert plancache.directory("auto") == pathlib.Path("~/.cache/rematc").expanduser()


def test_key_covers_problem_budget_and_solver_config() -> None:
    base = plancache.key(_problem(), CONFIG)
    assert base == plancache.key(_problem(), CONFIG)
    assert base != plancache.key(_problem(budget=100), CONFIG)
    assert base != plancache.key(chain_problem([10, 20, 30, 20, 11], [1.0, 2.0, 1.0, 3.0, 1.0], budget=90), CONFIG)
    assert base != plancache.key(_problem(), SolverConfig(time_limit=10.0, workers=1, seed=1))
    assert base != plancache.key(_problem(), SolverConfig(time_limit=5.0, workers=1))


def test_round_trip(tmp_path: pathlib.Path) -> None:
    problem = _problem()
    result = solve(problem, CONFIG)
    assert result.plan is not None and result.plan.of(Decision.RECOMPUTE)  # the budget bites
    digest = plancache.key(problem, CONFIG)
    assert plancache.load(tmp_path, digest, problem) is None
    plancache.store(tmp_path, digest, result)
    hit = plancache.load(tmp_path, digest, problem)
    assert hit is not None
    assert hit.plan == result.plan and hit.status is result.status
    assert hit.objective == pytest.approx(result.objective)


@pytest.mark.parametrize(
    "corrupt",
    [
        "{not json",
        "",
        json.dumps([1, 2, 3]),
        json.dumps({"format": "rematc.plancache/0"}),
        json.dumps({"format": plancache.FORMAT, "key": "0" * 64}),
        b"\xff\xfe{}",  # not UTF-8
        "[" * 100_000 + "]" * 100_000,  # deeper than the JSON parser recurses
    ],
    ids=["truncated", "empty", "list", "old-format", "other-key", "not-utf8", "deep"],
)
def test_corrupt_entry_is_ignored(tmp_path: pathlib.Path, corrupt: str | bytes) -> None:
    problem = _problem()
    digest = plancache.key(problem, CONFIG)
    path = plancache._path(tmp_path, digest)
    path.parent.mkdir(parents=True)
    path.write_bytes(corrupt if isinstance(corrupt, bytes) else corrupt.encode())
    assert plancache.load(tmp_path, digest, problem) is None


def test_stale_plan_over_budget_is_ignored(tmp_path: pathlib.Path) -> None:
    """An entry whose plan the checker rejects for this problem is not used."""
    problem = _problem()
    digest = plancache.key(problem, CONFIG)
    loose = solve(_problem(budget=1000), CONFIG)  # saves everything: over 90 B
    plancache.store(tmp_path, digest, loose)
    assert plancache.load(tmp_path, digest, problem) is None


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_entries_get_the_mode_the_umask_gives(tmp_path: pathlib.Path, umask: int) -> None:
    """As ``open`` would create them, so a shared cache directory is readable by the
    others the umask lets read it (mkstemp's 0600 let none)."""
    problem = _problem()
    digest = plancache.key(problem, CONFIG)
    result = solve(problem, CONFIG)
    old = os.umask(umask)
    try:
        plancache.store(tmp_path, digest, result)
    finally:
        os.umask(old)
    path = plancache._path(tmp_path, digest)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [path]  # no temporary file left
    assert plancache.load(tmp_path, digest, problem) is not None


def _writer(root: str, rounds: int) -> None:
    problem = _problem()
    result = solve(problem, CONFIG)
    digest = plancache.key(problem, CONFIG)
    for _ in range(rounds):
        plancache.store(pathlib.Path(root), digest, result)
        plancache.load(pathlib.Path(root), digest, problem)


def test_concurrent_writers_leave_one_valid_entry(tmp_path: pathlib.Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), 50)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    problem = _problem()
    hit = plancache.load(tmp_path, plancache.key(problem, CONFIG), problem)
    assert hit is not None and check(problem, hit.plan).fits
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 1, files  # no temporary file left behind


def _compile_and_step(cache_dir: pathlib.Path, budget: int) -> rematc.PartitionRecord:
    model, inputs = MODELS["mlp"]()
    compiled = rematc.compile(model, budget=budget, compiler="eager", cache_dir=str(cache_dir),
                              workers=1)
    before = len(rematc.records())
    compiled(*inputs).backward()
    (record,) = rematc.records()[before:]
    return record


def _budget() -> int:
    model, inputs = MODELS["mlp"]()
    compiled = rematc.compile(model, compiler="eager")
    compiled(*inputs).backward()
    torch._dynamo.reset()
    return int(rematc.records()[-1].unconstrained_peak * 0.8)


def test_second_run_does_not_solve_and_corrupt_entry_is_rebuilt(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = _budget()
    first = _compile_and_step(tmp_path, budget)
    assert not first.cached and first.solver == "cpsat" and first.recomputed
    (entry,) = tmp_path.rglob("*.json")

    def no_solve(*args: object, **kwargs: object) -> None:
        raise AssertionError("the solver ran although the plan is cached")

    monkeypatch.setattr(rematc.partition, "solve", no_solve)
    torch._dynamo.reset()
    second = _compile_and_step(tmp_path, budget)
    assert second.cached and second.plan == first.plan and second.recomputed == first.recomputed
    monkeypatch.undo()

    entry.write_text(entry.read_text()[:40])  # a torn or corrupt file
    torch._dynamo.reset()
    third = _compile_and_step(tmp_path, budget)
    # Solved again: an optimal plan of the same cost (CP-SAT with several workers may
    # pick another plan among equals).
    assert not third.cached and third.added_time == pytest.approx(first.added_time)
    assert json.loads(entry.read_text())["status"] in (Status.OPTIMAL.value, Status.FEASIBLE.value)
    torch._dynamo.reset()
    assert _compile_and_step(tmp_path, budget).cached


def test_cache_off_writes_nothing(tmp_path: pathlib.Path) -> None:
    budget = _budget()
    record = _compile_and_step(tmp_path / "unused", budget)  # on: writes
    assert not record.cached and (tmp_path / "unused").exists()
    model, inputs = MODELS["mlp"]()
    opts = Options.from_mapping({"budget": budget, "compiler": "eager", "cache_dir": None})
    torch.compile(model, backend=rematc.Backend(opts))(*inputs).backward()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unused"]
