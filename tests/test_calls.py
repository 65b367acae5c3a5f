"""A block compiled on its own and called N times before the backward (regional
compilation): every call keeps its saved values, so a plan for one call is wrong by N.
rematc either plans for every call (``calls``) and holds the budget, measured, or stops
the step with :class:`rematc.RepeatedForwardError` before going over it."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rematc
from rematc.memory import profiler_peak
from tests.helpers import tiny_llama

# The step's measured peak may exceed the budget by this many bytes: the loss outside the
# compiled blocks and its implicit gradient (4 B each, float32 scalars).
OUTSIDE = 16
# Under Inductor, the fraction of the budget the measured peak may exceed it by: kernels'
# workspaces the model does not see (as tests/test_measured_peak.py).
PEAK_TOLERANCE = 0.05
BLOCKS, WIDTH = 4, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def blocks(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(Block() for _ in range(BLOCKS))


def inputs() -> torch.Tensor:
    return torch.randn(32, 32, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)


def compile_each(model: nn.ModuleList, **options: object) -> None:
    """Each block compiled on its own, as accelerate's compile_regions does."""
    for block in model:
        block.compile(backend="rematc", options={"cache_dir": None, **options})


def step(model: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    h = x
    for block in model:
        h = block(h)
    loss = h.square().mean()
    loss.backward()
    return loss


def grads(model: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()] + [x.grad]  # type: ignore[list-item]


def zero(model: nn.ModuleList, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None


def measured(model: nn.ModuleList, x: torch.Tensor) -> int:
    zero(model, x)
    step(model, x)  # compile and warm up outside the measurement
    zero(model, x)
    return profiler_peak(lambda: step(model, x))


def one_call_plan_peak() -> tuple[int, int]:
    """(peak, holds) of the block's plan when it saves everything, one call."""
    model, x = blocks(), inputs()
    compile_each(model, budget="1GiB", compiler="eager")
    step(model, x)
    record = rematc.records()[-1]
    return record.predicted_peak, record.holds


def test_a_block_called_again_before_its_backward_stops_the_step_over_the_budget() -> None:
    """Planned for one call at a budget one call fits: the second call's forward would
    take the step over, and the error says so before it runs, naming the fix."""
    peak, holds = one_call_plan_peak()
    torch._dynamo.reset()
    model, x = blocks(), inputs()
    compile_each(model, budget=peak + holds // 2, compiler="eager")
    with pytest.raises(rematc.RepeatedForwardError, match=r"2 calls in flight, planned for 1.*'calls'"):
        step(model, x)


def test_calls_within_the_budget_raise_nothing() -> None:
    """N calls whose plans fit the budget together are not an error."""
    peak, holds = one_call_plan_peak()
    torch._dynamo.reset()
    model, x = blocks(), inputs()
    compile_each(model, budget=peak + (BLOCKS - 1) * holds, compiler="eager")
    step(model, x)


def test_a_forward_whose_graph_is_freed_without_a_backward_leaves_the_flight() -> None:
    """A forward under grad whose result is dropped (an evaluation without no_grad)
    frees its saved values: the training step after it is not refused."""
    peak, holds = one_call_plan_peak()
    torch._dynamo.reset()
    model, x = blocks(), inputs()
    compile_each(model, budget=peak + holds // 2, compiler="eager")
    for _ in range(3):
        model[0](x)  # dropped at once
    with torch.no_grad():
        model[0](x)
    with pytest.raises(rematc.RepeatedForwardError):
        step(model, x)  # the step itself still calls the block 4 times
    flight = _flight()
    assert len(flight.calls) == 0  # the failed step's first call was freed with its graph


def _flight():  # type: ignore[no-untyped-def]
    from rematc.backend import _BACKENDS

    (_, backend), = _BACKENDS.values()
    return backend.flight


def test_a_fraction_budget_warns_instead() -> None:
    model, x = blocks(), inputs()
    compile_each(model, budget=0.5, compiler="eager")
    with pytest.warns(rematc.RepeatedForwardWarning, match="calls in flight"):
        step(model, x)


@pytest.mark.parametrize("share", [0.9, 0.75])
def test_planned_for_every_call_the_step_holds_the_budget_and_gives_eagers_gradients(share: float) -> None:
    """With ``calls`` set to the blocks, each block's plan leaves room for the others'
    saved values: the step's measured peak is within the budget at two binding budgets,
    and loss and gradients are eager's."""
    peak, holds = one_call_plan_peak()
    torch._dynamo.reset()
    budget = int(share * (peak + (BLOCKS - 1) * holds))
    reference, x_ref = blocks(), inputs()
    expected = step(reference, x_ref)
    model, x = blocks(), inputs()
    compile_each(model, budget=budget, compiler="eager", calls=BLOCKS)
    assert step(model, x).item() == pytest.approx(expected.item(), rel=1e-6)
    for got, want in zip(grads(model, x), grads(reference, x_ref), strict=True):
        torch.testing.assert_close(got, want)
    record = rematc.records()[-1]
    assert record.calls == BLOCKS and record.step_budget == budget
    assert record.predicted_peak + (BLOCKS - 1) * record.holds <= budget
    assert record.solver != "save_all"  # the budget binds
    assert measured(model, x) <= budget + OUTSIDE


def test_the_smallest_budget_stated_for_every_call_runs_within_itself() -> None:
    model, x = blocks(), inputs()
    compile_each(model, budget="64KiB", compiler="eager", calls=BLOCKS)
    with pytest.raises(Exception, match=f"{BLOCKS} calls in flight") as info:
        step(model, x)
    stated = int(re.search(r"smallest feasible budget is (\d+) bytes", str(info.value)).group(1))  # type: ignore[union-attr]
    torch._dynamo.reset()
    model, x = blocks(), inputs()
    compile_each(model, budget=stated, compiler="eager", calls=BLOCKS)
    assert measured(model, x) <= stated + OUTSIDE


def test_calls_must_be_a_positive_int() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="option 'calls' must be a positive int"):
            rematc.Options.from_mapping({"calls": bad})


@pytest.mark.inductor
@pytest.mark.slow
def test_planned_for_every_call_under_inductor_the_step_holds_the_budget() -> None:
    peak, holds = one_call_plan_peak()
    torch._dynamo.reset()
    budget = int(0.9 * (peak + (BLOCKS - 1) * holds))
    model, x = blocks(), inputs()
    compile_each(model, budget=budget, compiler="inductor", calls=BLOCKS)
    reference, x_ref = blocks(), inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", rematc.OverBudgetWarning)
        step(model, x)
    step(reference, x_ref)
    for got, want in zip(grads(model, x), grads(reference, x_ref), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert measured(model, x) <= budget * (1 + PEAK_TOLERANCE)


def _llama_regions(**options: object):  # type: ignore[no-untyped-def]
    utils = pytest.importorskip("accelerate.utils")
    pytest.importorskip("transformers")
    model = tiny_llama(BLOCKS)
    compiled = utils.compile_regions(model, backend="rematc",
                                     options={"compiler": "eager", "cache_dir": None, **options})
    return model, compiled


def test_accelerate_compile_regions_with_a_binding_budget_is_never_silently_over() -> None:
    """accelerate's compile_regions on transformers' Llama: at a budget one block's plan
    fits but the blocks together do not, the step stops with one clear error; planned for
    every call, the same budget is held by the blocks."""
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    _, compiled = _llama_regions(budget="1GiB")
    compiled(input_ids=ids, labels=ids).loss.backward()
    block = max(rematc.records(), key=lambda r: r.values)  # the layer's graph, run for each
    budget = block.predicted_peak + block.holds // 2
    torch._dynamo.reset()
    _, compiled = _llama_regions(budget=budget)
    with pytest.raises(rematc.RepeatedForwardError, match="2 calls in flight"):
        compiled(input_ids=ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    rematc.clear_records()
    budget = int(0.9 * (block.predicted_peak + (BLOCKS - 1) * block.holds))
    model, compiled = _llama_regions(budget=budget, calls=BLOCKS)
    compiled(input_ids=ids, labels=ids).loss.backward()
    planned = max(rematc.records(), key=lambda r: r.values)
    assert planned.calls == BLOCKS
    assert planned.held_before + planned.predicted_peak + (BLOCKS - 1) * planned.holds <= budget
    model.zero_grad(set_to_none=True)
    peak = profiler_peak(lambda: compiled(input_ids=ids, labels=ids).loss.backward())
    assert peak <= budget + OUTSIDE, (peak, budget)
