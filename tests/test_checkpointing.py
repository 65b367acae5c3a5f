"""The model's own activation checkpointing (``torch.utils.checkpoint``, non-reentrant):
without a budget rematc honours it as it is; with one, its plan may override it and the
record says where. Measured peaks by the profiler's allocator events (eager route)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import rematc
from rematc.memory import profiler_peak

# rematc's step may peak above eager's checkpointed step by at most this fraction.
PEAK_TOLERANCE = 0.02


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return x + self.down(torch.tanh(h) * torch.sigmoid(h))


class Checkpointed(nn.Module):
    """Four residual blocks, each under non-reentrant checkpointing."""

    def __init__(self, d: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.square().mean()


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Checkpointed(), torch.randn(512, 128)


def _step(fn, model: nn.Module, x: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    peak = profiler_peak(lambda: fn(x).backward())
    return peak, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_without_a_budget_the_models_checkpointing_is_honoured() -> None:
    """rematc read PyTorch's MUST_SAVE tags but not the recompute tags checkpointing
    writes, so it saved everything and peaked far above eager's checkpointed step."""
    model, x = _model()
    eager_peak, expected = _step(model, model, x)
    compiled = rematc.compile(copy.deepcopy(model), compiler="eager")
    clone = compiled._orig_mod
    _step(compiled, clone, x)  # compile
    peak, grads = _step(compiled, clone, x)
    record = rematc.records()[-1]
    assert record.solver == "checkpointing" and record.checkpointed > 0 and not record.overrides
    assert len(record.recomputed) >= record.checkpointed
    assert peak <= eager_peak * (1 + PEAK_TOLERANCE), (peak, eager_peak)
    assert record.predicted_peak < record.unconstrained_peak
    for n, g in expected.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6)


@pytest.mark.inductor
def test_without_a_budget_inductor_honours_it_too(same_random_as_eager: None) -> None:
    model, x = _model()
    eager_peak, expected = _step(model, model, x)
    compiled = rematc.compile(copy.deepcopy(model), compiler="inductor")
    clone = compiled._orig_mod
    _step(compiled, clone, x)
    peak, grads = _step(compiled, clone, x)
    record = rematc.records()[-1]
    assert record.solver == "checkpointing" and record.checkpointed > 0
    assert peak <= eager_peak * (1 + PEAK_TOLERANCE), (peak, eager_peak)
    for n, g in expected.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5)


def test_a_budget_may_override_it_and_the_record_says_where() -> None:
    """A budget the save-all plan meets needs no recomputation: the plan keeps every
    value the checkpointing would recompute, and the record lists them."""
    model, x = _model()
    _, expected = _step(model, model, x)
    compiled = rematc.compile(copy.deepcopy(model), budget="100%", compiler="eager")
    clone = compiled._orig_mod
    _, grads = _step(compiled, clone, x)
    record = rematc.records()[-1]
    assert record.checkpointed > 0 and len(record.overrides) > 0 and not record.recomputed
    for n, g in expected.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6)


@pytest.mark.inductor
def test_without_a_budget_inductor_peaks_no_higher_than_the_default_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' GPT-2 with ``gradient_checkpointing_enable()``, no budget: rematc's plan
    is the model's checkpointing, and Inductor's fusions are held to its order. Left free,
    Inductor fused recomputations into earlier kernels, which then lived through the
    attention backward: 8,766,088 B against the default compile's 8,148,552 B."""
    pytest.importorskip("transformers")
    import tests.realmodels as realmodels

    for name, value in (("BATCH", 4), ("SEQ", 128), ("HIDDEN", 128)):
        monkeypatch.setattr(realmodels, name, value)
    model, inputs = realmodels.hf_gpt2(checkpointing=True)

    def peak(fn) -> int:  # type: ignore[no-untyped-def]
        fn(*inputs).backward()  # compile
        return profiler_peak(lambda: fn(*inputs).backward())

    default = peak(torch.compile(copy.deepcopy(model)))
    torch._dynamo.reset()
    ours = peak(rematc.compile(copy.deepcopy(model)))
    assert rematc.records()[-1].solver == "checkpointing"
    assert ours <= default, (ours, default)
