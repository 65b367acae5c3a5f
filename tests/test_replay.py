"""The line-by-line replay of generated code (``bench.replay``) finds the profiler's peak."""

from __future__ import annotations

import pytest
import torch

import rematc
from bench import models
from bench.replay import replay_step


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
