"""The status line of a long plan (rematc.status): on a terminal, one line rewritten and
erased at the end; elsewhere, log records; nothing for a short plan."""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import pytest
import torch

import rematc
import rematc.partition
from rematc import status
from solvers import sat
from tests.helpers import tiny_llama


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "STATUS_AFTER", 0.05)
    monkeypatch.setattr(status, "TICK", 0.02)
    monkeypatch.setattr(status, "LOG_EVERY", 0.0)


def test_a_long_plan_rewrites_one_line_on_a_terminal_and_erases_it(quick: None) -> None:
    out = Terminal()
    with status.naming("graph 0 of frame 0"), status.planning(42, 60.0, stream=out):
        time.sleep(0.3)
    text = out.getvalue()
    assert text.startswith("\r\x1b[2Krematc: planning graph 0 of frame 0: 42 decisions, ")
    assert "s left of the time limit)" in text and text.count("\r\x1b[2Krematc:") >= 2
    assert text.endswith("\r\x1b[2K") and "\n" not in text


def test_a_short_plan_shows_nothing() -> None:
    out = Terminal()
    with status.planning(42, 60.0, stream=out):
        pass
    assert out.getvalue() == ""


def test_off_a_terminal_the_line_goes_to_the_log(quick: None, caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="rematc.status"), status.planning(7, 60.0, stream=out):
        time.sleep(0.2)
    assert out.getvalue() == ""
    assert any(r.getMessage().startswith("rematc: planning a graph: 7 decisions") for r in caplog.records)


def test_the_line_shows_the_searchs_best_plan_and_bound(quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sat, "_LATEST", [sat.Incumbent(added=0.25, bound=0.2, gap=0.2, at=time.perf_counter())])
    assert status.line("g", 3, 1.0, 10.0).endswith("; best plan +0.25 s, bound +0.2 s (gap 20.0%)")


def test_a_compile_that_plans_long_says_so(quick: None, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """Through the backend: the graph's name and decisions, from the solve CP-SAT runs."""
    real = rematc.partition.solve

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(rematc.partition, "solve", slow)
    model = tiny_llama(2)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    compiled = rematc.compile(model, budget=600_000, compiler="eager", cache_dir=None)
    with caplog.at_level(logging.INFO, logger="rematc.status"):
        compiled(input_ids=ids, labels=ids).loss.backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "rematc.status"]
    assert lines and lines[0].startswith("rematc: planning graph 0 of frame 0: ")
    assert rematc.records()[-1].solver not in ("save_all", "free_least_peak")
