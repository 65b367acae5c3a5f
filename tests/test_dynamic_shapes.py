"""Dynamic shapes: a plan is solved for the size hint and guarded to shapes up to it; a
larger shape recompiles and solves again; no plan is used for a shape it was not made for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rematc

BUDGET = 400_000  # bytes: above the unconstrained peak up to batch 64, below it at 256


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _steps(dynamic: bool | None, batches: list[int]) -> list[list[rematc.PartitionRecord]]:
    torch.manual_seed(0)
    model = Net()
    compiled = rematc.compile(model, budget=BUDGET, compiler="eager", dynamic=dynamic)
    out = []
    for b in batches:
        x = torch.randn(b, 64)
        model.zero_grad(set_to_none=True)
        model(x).backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        before = len(rematc.records())
        compiled(x).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6)
        out.append(rematc.records()[before:])
    return out


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "recompile"])
def test_plan_per_shape_bound(dynamic: bool | None) -> None:
    small, large, smaller, larger = _steps(dynamic, [8, 64, 4, 256])
    (first,) = small
    assert first.budget == BUDGET and first.predicted_peak <= BUDGET
    # A larger batch fails the guards: the graph is re-planned for it, not reused.
    (second,) = large
    assert second.unconstrained_peak > first.unconstrained_peak
    assert second.predicted_peak <= BUDGET
    assert second.size_bounds and all(b.endswith("<= 64") for b in second.size_bounds)
    # A smaller batch is served by the plan for 64: its peak only shrinks with the batch.
    assert smaller == []
    (fourth,) = larger
    assert all(b.endswith("<= 256") for b in fourth.size_bounds)
    assert fourth.unconstrained_peak > second.unconstrained_peak
    assert fourth.predicted_peak <= BUDGET < fourth.unconstrained_peak and fourth.recomputed
    if dynamic:
        assert first.size_bounds and all(b.endswith("<= 8") for b in first.size_bounds)
    else:
        assert first.size_bounds == ()  # static shapes: Dynamo's own guards pin them


def test_no_budget_adds_no_guards() -> None:
    torch.manual_seed(0)
    model = Net()
    compiled = rematc.compile(model, compiler="eager", dynamic=True)
    before = len(rematc.records())
    for b in (8, 16, 32):
        compiled(torch.randn(b, 64)).backward()
    (record,) = rematc.records()[before:]  # one graph for every batch
    assert record.size_bounds == ()
