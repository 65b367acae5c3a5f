"""Shared test setup: a clean Dynamo state per test and no compile caches.

Caches would let Inductor reuse a graph partitioned by an earlier test with other
options (the partitioner's uuid keys them, but then the partitioner does not run at all
and leaves no record to check).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
# rematc's plan cache is off unless a test passes its own cache_dir (tmp_path): no test
# writes to ~/.cache or reuses another test's plans.
os.environ.setdefault("REMATC_CACHE_DIR", "off")

from collections.abc import Iterator

import pytest
import torch

import rematc
from rematc.partition import forget_plans_in_hand


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    # The record list keeps the last 64: tests count new records, so start each empty.
    rematc.clear_records()
    forget_plans_in_hand()  # a plan an earlier test's error stated is not this test's
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
