"""Dropout under recomputation: the backward must use the forward's mask.

Under Inductor, ``replace_random`` turns dropout into ``inductor_seeds`` (drawn once, from
the global generator) and ``inductor_random(shape, seed)``, which Inductor lowers to a
counter-based generator: recomputed from the saved seed it gives the same mask. rematc
recomputes it when memory asks, and never recomputes ``inductor_seeds``. On the eager
route dropout stays ``native_dropout`` and is saved.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rematc
from rematc.annotate import is_random
from solvers.budget import Budget
from tests.helpers import infeasible_cause


class DropoutNet(nn.Module):
    """Dropout on the input, then layers whose backward reaches the mask last."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dropped = nn.functional.dropout(h, 0.5, training=True)
        x = dropped
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean(), dropped


def masks(compiled: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's mask, and the mask the backward used: the gradient of the dropout's
    input is zero exactly where the mask dropped."""
    h = torch.randn(512, 64, requires_grad=True)
    loss, dropped = compiled(h)  # type: ignore[operator]
    loss.backward()
    assert h.grad is not None
    return dropped != 0, h.grad != 0


@pytest.mark.inductor
def test_recomputed_dropout_replays_the_forward_mask() -> None:
    model = DropoutNet()
    try:
        h = torch.randn(512, 64, requires_grad=True)
        rematc.compile(model, budget=Budget(nbytes=1), compiler="inductor")(h)[0].backward()
    except Exception as e:
        err = infeasible_cause(e)
        assert err is not None and err.min_feasible is not None
        smallest = err.min_feasible
    torch._dynamo.reset()
    rematc.clear_records()
    compiled = rematc.compile(model, budget=smallest, compiler="inductor")
    forward_mask, backward_mask = masks(compiled)
    record = rematc.records()[-1]
    random = [n for n in record.recomputed if "inductor_random" in n]
    assert random, f"the smallest budget should recompute the mask; recomputed {record.recomputed}"
    assert not [n for n in record.recomputed if "inductor_seeds" in n]
    assert torch.equal(forward_mask, backward_mask)
    assert 0.3 < forward_mask.float().mean().item() < 0.7


@pytest.mark.parametrize(("dropout_p", "random"), [(0.0, False), (0.1, True)])
def test_attention_is_random_only_with_dropout(dropout_p: float, random: bool) -> None:
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    by_position = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                                  (q, k, v, dropout_p, True))
    by_name = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                              (q, k, v), {"dropout_p": dropout_p})
    default = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v))
    assert is_random(by_position) is random and is_random(by_name) is random
    assert not is_random(default)  # dropout_p defaults to 0
    assert is_random(g.call_function(torch.ops.aten.bernoulli.p, (q, 0.5)))
