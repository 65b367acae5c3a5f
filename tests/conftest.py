"""Shared test setup: a clean Dynamo state per test and no graph caches.

Inductor's FX graph cache and AOTAutograd's cache would let a test reuse a graph
partitioned by an earlier test with other options (the partitioner's uuid keys them, but
then the partitioner does not run at all and leaves no record to check); Dynamo's
profile-guided dynamic shapes would let an earlier test's shapes make a later one's
dynamic. All three are off. Compiled kernels are kept, in a directory of this run's own:
a kernel is its source's hash, so a test that lowers the same kernel again loads it
instead of running the C++ compiler (most of an Inductor test's time on a small CPU),
and no run reads another's.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
os.environ.setdefault("TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO", "0")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # pytest-xdist's workers inherit it
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="rematc-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
# rematc's plan cache is off unless a test passes its own cache_dir (tmp_path): no test
# writes to ~/.cache or reuses another test's plans.
os.environ.setdefault("REMATC_CACHE_DIR", "off")

import importlib.util
from collections.abc import Iterator

import pytest

# The solver tests need no torch: without it, only they are collected.
TORCH_FREE = frozenset({
    "test_anywhere.py", "test_baselines.py", "test_bound.py", "test_checker.py", "test_cpsat.py",
    "test_determinism.py", "test_free.py", "test_importers.py", "test_io.py", "test_layers.py",
    "test_local.py", "test_problem.py", "test_stall.py", "test_time_bounds.py", "test_window.py",
})
HAS_TORCH = importlib.util.find_spec("torch") is not None


def pytest_ignore_collect(collection_path: object) -> bool | None:
    name = getattr(collection_path, "name", "")
    if not HAS_TORCH and name.startswith("test_") and name.endswith(".py") and name not in TORCH_FREE:
        return True
    return None


@pytest.fixture(autouse=True)
def _work_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deterministic solve in a test counts its work only: the wall clock's backstop
    (solvers.deadline.WALL_BACKSTOP), which stops it where this machine's load says, is out
    of reach, so that the tests that repeat one get the same plan on a busy machine. The
    backstop's own tests (tests/test_time_bounds.py) put it back."""
    import solvers.deadline

    monkeypatch.setattr(solvers.deadline, "WALL_BACKSTOP", float("inf"))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    if not HAS_TORCH:
        from solvers.planner import forget_stated

        forget_stated()  # a plan an earlier test's error stated is not this test's
        yield
        return
    import torch

    import rematc
    from rematc.partition import forget_plans_in_hand
    from rematc.regions import forget_surveys

    # The record list keeps the last 64: tests count new records, so start each empty.
    rematc.clear_records()
    forget_plans_in_hand()  # a plan an earlier test's error stated is not this test's
    forget_surveys()  # nor a step an earlier test surveyed
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def same_random_as_eager() -> Iterator[None]:
    """Make Inductor draw dropout masks with eager's generator, so compiled and eager
    steps see the same masks and gradients can be compared."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fallback_random=True):
        yield
