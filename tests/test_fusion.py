"""Under a budget Inductor may not fuse two kernels that do not feed each other across an
extern kernel (``rematc.fusion``): the fused kernel runs where its later half would, and
the plan's order, and its peak, no longer hold."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch._inductor.virtualized import V

import rematc
from bench.models import LlamaConfig, make_llama
from rematc._torch_compat import TORCH, InductorFallbackWarning, warn_fallback
from rematc.fusion import KeepPlanOrder, keep_plan_order, spans
from rematc.memory import profiler_peak


def node(*positions: int) -> SimpleNamespace:
    """A (fused) scheduler node made of the nodes lowered at these positions."""
    return SimpleNamespace(min_order=min(positions), max_order=max(positions), get_name=lambda: "op")


def test_spans_an_extern_kernel_strictly_between_the_two() -> None:
    externs = [3, 10]
    assert spans(externs, node(1), node(5))
    assert spans(externs, node(5), node(1))  # either order
    assert not spans(externs, node(4), node(9))  # nothing between
    assert not spans(externs, node(1, 2), node(2, 3))  # touching is not between
    assert spans(externs, node(1, 2), node(11))
    assert not spans(externs, node(1, 5), node(4))  # interleaved ranges: no gap
    assert not spans([], node(1), node(50))


class Inner:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def can_fuse_horizontal(self, *args: Any) -> bool:
        self.calls.append(args)
        return True

    can_fuse_vertical = can_fuse_horizontal


@pytest.mark.parametrize("kind", ["horizontal", "vertical"])
def test_a_fusion_across_an_extern_kernel_is_refused(kind: str) -> None:
    """Horizontal: the fused kernel runs where the later one would, so the earlier one's
    inputs live on. Vertical: a consumer fused into its producer runs where the producer
    does, ahead of the plan, and its output with it. The benchmark Llama's knapsack plan
    at 0.5's peak recomputes the residual sums at the start of the backward; with each
    layer's norm recomputation fused into them the step measured 752.6 MB against 709.9
    MB predicted, 718.3 MB without."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    extern = object.__new__(ExternKernelSchedulerNode)
    extern.min_order = extern.max_order = 4
    scheduler = SimpleNamespace(nodes=[node(1), extern, node(6)])
    inner = Inner()
    can_fuse = getattr(KeepPlanOrder(inner), f"can_fuse_{kind}")
    assert not can_fuse(scheduler, node(1), node(6), 9)
    assert inner.calls == []
    assert can_fuse(scheduler, node(5), node(6), 9)
    assert len(inner.calls) == 1  # the rest is Inductor's decision


def test_the_handler_is_installed_during_the_compile_and_restored_after() -> None:
    before = V.choices
    seen: list[Any] = []

    def inner(*args: Any, **kwargs: Any) -> str:
        seen.append(V.choices)
        return "compiled"

    assert keep_plan_order(inner)() == "compiled"
    assert isinstance(seen[0], KeepPlanOrder) and seen[0].inner is before
    assert V.choices is before

    def failing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("lowering failed")

    with pytest.raises(RuntimeError, match="lowering failed"):
        keep_plan_order(failing)()
    assert V.choices is before


def test_a_torch_without_a_choices_handler_is_warned_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(V, "set_choices_handler", None)
    warn_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inner = object()
        assert keep_plan_order(inner) is inner  # type: ignore[arg-type]
        keep_plan_order(inner)  # type: ignore[arg-type]
    fallbacks = [w for w in caught if issubclass(w.category, InductorFallbackWarning)]
    assert len(fallbacks) == 1 and "choices handler" in str(fallbacks[0].message)
    warn_fallback.cache_clear()


# torch 2.11's Inductor code for the small Llama at 45% peaks 10.6% above the plan; the check
# after compilation re-plans and then warns (docs/inductor-memory.md, "Not followed").
ON_2_11 = pytest.mark.xfail(TORCH == (2, 11), strict=True, reason="not followed on torch 2.11")


@pytest.mark.inductor
@pytest.mark.parametrize("fraction", [0.95, 0.8, pytest.param(0.45, marks=ON_2_11)])
@pytest.mark.canary
def test_a_llama_measures_its_prediction(fraction: float) -> None:
    """The small benchmark Llama: without the rule the step measured 12.5% above the
    predicted peak at 80% (585,864 B against 520,708 B) and 21% at 45% (370,824 B
    against 305,668 B); with it, 0.1% and 0.2%. At 95% the plan recomputes fused pointwise
    values only; recomputing all of them (RMSNorm's with its residual sum) had measured
    3.1% above (553,096 B against 536,708 B) while the model took the recomputed
    ``x * rsqrt`` for unstored."""
    model, inputs = make_llama(LlamaConfig.small(), batch=8, seed=0)
    compiled = rematc.compile(model, budget=fraction, compiler="inductor", workers=1)
    compiled(*inputs).backward()
    model.zero_grad(set_to_none=True)
    peak = profiler_peak(lambda: compiled(*inputs).backward())
    record = rematc.records()[-1]
    assert record.recomputed
    assert abs(peak - record.predicted_peak) <= 0.02 * peak, (
        f"measured {peak} B, predicted {record.predicted_peak} B"
    )
    assert torch.isfinite(compiled(*inputs))
