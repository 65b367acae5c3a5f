"""What AOTAutograd hands the partitioner beyond a scalar loss: several and nested
outputs, outputs that are views of activations, in-place updates of inputs, mixed dtypes.
Each runs at the smallest feasible budget (so values are recomputed) against eager."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import rematc
from solvers.budget import Budget
from tests.helpers import infeasible_cause

RTOL, ATOL = 1e-5, 1e-6


class TwoHeads(nn.Module):
    """Returns a tuple: the loss and a second, differentiable output used outside."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.body(x)
        logits = self.head(h)
        return logits.square().mean(), [logits, h.t()]  # h.t(): a view of an activation


class InputMutation(nn.Module):
    """Updates an input in place (functionalized to a copy back into the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        for layer in self.layers:
            x = torch.sigmoid(layer(x))
        return x.sum() * counter.float().mean()


class ScalesItsInput(nn.Module):
    """Scales its input in place before reading it: the backward must not recompute from
    the updated input what the forward computed from the old one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x)) if i % 2 else torch.sigmoid(layer(x))
        return x.sum()


class MixedPrecision(nn.Module):
    """fp32 parameters, bf16 activations (CPU autocast): bytes are counted by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x.float().square().mean()


def loss_of(out: object) -> torch.Tensor:
    if isinstance(out, tuple):
        loss, (logits, ht) = out
        return loss + logits.sum() * 1e-3 + ht.sum() * 1e-3
    assert isinstance(out, torch.Tensor)
    return out


CASES: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "tuple-list-view-outputs": lambda: (TwoHeads(), (torch.randn(256, 32),)),
    "input-mutation": lambda: (InputMutation(), (torch.randn(256, 32), torch.zeros(4, dtype=torch.int64))),
    "bf16-activations": lambda: (MixedPrecision(), (torch.randn(256, 64),)),
    "input-scaled-in-place": lambda: (ScalesItsInput(), (torch.randn(256, 64),)),
}


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return CASES[name]()


@pytest.mark.parametrize("name", sorted(CASES))
def test_smallest_budget_matches_eager(name: str) -> None:
    model, inputs = build(name)
    ref_inputs = tuple(t.clone() for t in inputs)
    loss_of(model(*ref_inputs)).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}

    model, inputs = build(name)
    try:
        loss_of(rematc.compile(model, budget=Budget(nbytes=1), compiler="eager")(*inputs)).backward()
        raise AssertionError("a 1-byte budget was accepted")
    except Exception as e:
        err = infeasible_cause(e)
        assert err is not None and err.min_feasible is not None, repr(e)
        smallest = err.min_feasible
    torch._dynamo.reset()
    rematc.clear_records()

    model, inputs = build(name)
    out = rematc.compile(model, budget=Budget(nbytes=smallest), compiler="eager")(*inputs)
    loss_of(out).backward()
    record = rematc.records()[-1]
    assert record.predicted_peak <= smallest and record.recomputed
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
    # In-place updates of inputs happen exactly once, as in eager.
    for got, want in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(got, want)


def test_bytes_follow_the_dtype() -> None:
    """A bf16 activation costs 2 bytes per element, its fp32 cast 4."""
    model, inputs = build("bf16-activations")
    rematc.compile(model, compiler="eager")(*inputs).backward()
    problem = rematc.records()[-1].problem
    sizes = {n.op: n.size for n in problem.nodes if not n.resident and n.size}
    relu = [n.size for n in problem.nodes if n.op == "aten.relu" and not n.backward]
    assert relu and all(s == 256 * 64 * 2 for s in relu), sizes


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_input_updated_in_place_is_never_read_by_a_recomputation(compiler: str) -> None:
    """Under Inductor the scaled input is free to recompute, so it is recomputed even
    without a budget; on the eager route, once a budget binds. Either way the first
    layer's weight gradient came out 50% off when the recomputation read the updated input."""
    model, inputs = build("input-scaled-in-place")
    ref_inputs = tuple(t.clone() for t in inputs)
    model(*ref_inputs).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    unconstrained = None
    for budget in (None, 0.97):
        model, inputs = build("input-scaled-in-place")
        compiled = rematc.compile(model, budget=budget and int(budget * unconstrained),
                                  compiler=compiler)
        compiled(*inputs).backward()
        record = rematc.records()[-1]
        unconstrained = record.unconstrained_peak
        assert "mul" in record.saved and "mul" not in record.recomputed
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[n], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n, b=budget: f"{n} at budget {b}: {m}")
        torch.testing.assert_close(inputs[0], ref_inputs[0])
        torch._dynamo.reset()


def test_input_that_requires_grad_updated_in_place_is_never_read_by_a_recomputation() -> None:
    """AOTAutograd applies the update of an input that requires grad after the graph, not
    as a ``copy_`` in it. At the smallest budget the backward recomputed autograd's copy of
    the old value (for ``mul_``'s gradient) from the input, so saved the input, which the
    update then changed: autograd raised that a saved tensor was modified in place. Found
    by bench/fuzz.py, the input an output of the graph before a break. The eager route
    only: PyTorch's own aot_eager and Inductor save the input there too and raise."""
    torch.manual_seed(0)
    head = nn.Linear(16, 16)

    def f(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h.mul_(w)
        return head(h)

    def step(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor | None]:
        gen = torch.Generator().manual_seed(0)
        x, w = (torch.randn(8, 16, generator=gen, requires_grad=True) for _ in range(2))
        head.zero_grad(set_to_none=True)
        fn(x * 1.5, w).square().sum().backward()  # x * 1.5: an input that requires grad
        return [x.grad, w.grad, head.weight.grad]

    expected = step(f)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failed:
        step(rematc.compile(f, budget=Budget(nbytes=1), compiler="eager"))
    smallest = infeasible_cause(failed.value)
    assert smallest is not None and smallest.min_feasible is not None
    torch._dynamo.reset()
    got = step(rematc.compile(f, budget=Budget(nbytes=smallest.min_feasible), compiler="eager"))
    assert "clone" in rematc.records()[-1].saved  # the old value, copied before the update
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("budget", [None, Budget(nbytes=1)])
def test_gradient_passed_through_unchanged(compiler: str, budget: Budget | None) -> None:
    """``y + f(x)`` returned as it is: the backward returns the incoming gradient as
    ``y``'s gradient, so a tangent has no reader inside the graph (it raised KeyError)."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y + torch.tanh(layer(x))

    x, y = torch.randn(8, 16), torch.randn(8, 16, requires_grad=True)
    f(x, y).square().sum().backward()
    expected = [y.grad.clone(), layer.weight.grad.clone()]
    y.grad, layer.weight.grad = None, None
    compiled = rematc.compile(f, budget=budget, compiler=compiler)
    try:
        compiled(x, y).square().sum().backward()
    except Exception as e:  # a 1-byte budget states the smallest; that one must work
        err = infeasible_cause(e)
        assert budget is not None and err is not None and err.min_feasible is not None, repr(e)
        torch._dynamo.reset()
        compiled = rematc.compile(f, budget=Budget(nbytes=err.min_feasible), compiler=compiler)
        compiled(x, y).square().sum().backward()
    torch.testing.assert_close([y.grad, layer.weight.grad], expected, rtol=RTOL, atol=ATOL)
