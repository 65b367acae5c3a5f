"""The backward's donated buffers against those the memory model counts on
(``rematc.donation``): a lost donation is said when the backward compiles, and its bytes
bound how far the measured peak can exceed the prediction."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._functorch._aot_autograd import graph_compile

import rematc
from rematc import DonationWarning
from rematc.donation import expected_donations
from rematc.models import make_gpt
from solvers.plan import Decision, plan_from_decisions
from tests.graphs import backward_takeover
from tests.test_measured_peak import BATCH, CONFIG, measured_step_peak


def test_a_saved_value_a_backward_kernel_writes_over_must_be_donated() -> None:
    problem = backward_takeover()  # g2 (backward) writes over x, its last reader
    saved = plan_from_decisions(problem, {0: Decision.SAVE, 1: Decision.SAVE})
    assert expected_donations(problem, saved) == {"x": 2}
    # A recomputed x is the backward's own buffer: nothing to donate.
    recomputed = plan_from_decisions(problem, {0: Decision.RECOMPUTE, 1: Decision.SAVE})
    assert expected_donations(problem, recomputed) == {}


@pytest.mark.inductor
def test_the_donations_counted_on_arrive() -> None:
    """The test GPT's loss gradient is written over the saved log-softmax, donated."""
    model, inputs = make_gpt(CONFIG, batch=BATCH, seed=0)
    compiled = rematc.compile(model, compiler="inductor", cache_dir=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DonationWarning)
        measured_step_peak(compiled, model, inputs)
    record = rematc.records()[-1]
    assert expected_donations(record.problem, record.plan)
    assert record.undonated == 0


@pytest.mark.inductor
def test_a_lost_donation_is_said_and_bounds_the_excess(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if AOTAutograd donated nothing (the flag on): the backward allocates the loss
    gradient beside the saved log-softmax, the step peaks above the prediction, and by
    no more than the bytes the warning names."""
    monkeypatch.setattr(graph_compile, "collect_bw_donated_buffer_idxs", lambda *a, **k: [])
    model, inputs = make_gpt(CONFIG, batch=BATCH, seed=0)
    compiled = rematc.compile(model, compiler="inductor", cache_dir=None)
    with pytest.warns(DonationWarning, match="did not donate"):
        peak = measured_step_peak(compiled, model, inputs)
    record = rematc.records()[-1]
    assert record.undonated == sum(expected_donations(record.problem, record.plan).values()) > 0
    assert record.predicted_peak < peak <= record.predicted_peak + record.undonated, (
        f"measured {peak} B, predicted {record.predicted_peak} B + {record.undonated} B")
    assert torch.isfinite(compiled(*inputs))


@pytest.mark.inductor
def test_a_first_backward_with_retain_graph_loses_the_donations() -> None:
    """AOTAutograd compiles the backward at its first call and donates nothing when that
    call keeps the graph (``retain_graph=True``): rematc says so, with the bytes."""
    model, inputs = make_gpt(CONFIG, batch=BATCH, seed=0)
    compiled = rematc.compile(model, compiler="inductor", cache_dir=None)
    with pytest.warns(DonationWarning, match="did not donate"):
        compiled(*inputs).backward(retain_graph=True)
    record = rematc.records()[-1]
    assert record.undonated == sum(expected_donations(record.problem, record.plan).values()) > 0
