"""The line-by-line replay of generated code (``bench.replay``) finds the profiler's peak."""

from __future__ import annotations

import pytest
import torch

import rematc
from bench import models
from bench.replay import model_peak, replay_step
from solvers import save_all
from solvers.checker import check
from tests.graphs import chain


@pytest.mark.inductor
def test_replay_finds_the_profilers_peak_in_the_generated_code() -> None:
    """The small Llama has no kernel with a workspace: the replay's peak is the profiler's
    to a few bytes (8 B when measured), and the buffers listed there add up to it."""
    model, inputs = models.make("llama", small=True)
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = rematc.compile(model, budget=0.45, compiler="inductor", cache_dir=None, workers=1)
        result = replay_step(model, inputs, compiled)
    assert result.modules == 2  # the forward and the backward
    peaks, measured = result.peaks, result.measured
    assert len(peaks) == 2
    top = max(p.nbytes for p in peaks)
    assert top <= measured and measured - top <= 64, (top, measured)
    for p in peaks:
        assert sum(b for _, b in p.alive) == p.nbytes and p.source


def test_model_peak_lists_what_the_checker_counts_at_its_peak() -> None:
    """The values listed at the plan's peak step add up to the checker's peak there, the
    largest first."""
    p = chain()
    plan = save_all(p).plan
    assert plan is not None
    step, alive = model_peak(p, plan)
    report = check(p, plan)
    assert step == report.peak_step
    assert sum(b for _, b in alive) == report.peak
    assert [b for _, b in alive] == sorted((b for _, b in alive), reverse=True)
    assert {name for name, _ in alive} >= {"f0", "f1", "f2"}
