"""Under a budget, or without one where the plan is the model's own checkpointing, Inductor
fuses kernels only where the plan's order allows it.

The plan's peak assumes each op runs in the order the plan was made for and frees its
inputs after their last reader. Inductor's scheduler may fuse two kernels that share
inputs but do not depend on each other (a horizontal fusion): one loop writes both
outputs, where the later of the two would have run. The earlier kernel's inputs then live
until that point, and so does everything the earlier kernel's readers wait for.
Inductor's own guard (``Scheduler.are_long_distant_nodes``) refuses such fusions only
when the kernels are more than 64 nodes apart, and its docstring names the problem:
fusions that lengthen live ranges across a region of high memory.

Two such fusions on the benchmark Llama took its step above the plan: the last RMSNorm's
recomputed output fused with the RMSNorm backward's pointwise part (both read the same two
saved tensors), which runs after the LM head's input-gradient matmul, so the
weight-gradient matmul that reads the recomputation ran later too, with that gradient and
the norm backward's output alive; and the weight-gradient sum of a layer's MLP norm fused
with that of its attention norm, so the MLP gradients it reads stayed alive through the
attention backward.

A vertical fusion (a consumer into its producer's kernel) moves the consumer the other
way: the fused kernel runs where the producer did, so the consumer's output is made
early and lives from there. PyTorch's knapsack choice on the benchmark Llama recomputes
the residual sums at the start of the backward, and each layer's recomputed norm, a
reader of one of them that the plan runs at that layer's backward, was fused into that
first kernel.

The rule: a fusion, horizontal or vertical, is refused when an extern kernel (a matmul,
attention, convolution: ops that are not fused and allocate their outputs) runs between
the two kernels in the scheduler's order, the order the graph was lowered in (the plan's;
an elementwise value with one extern reader is emitted where that reader is lowered,
which the plan follows too: :func:`rematc.capture.deferred_to_reader`). Fusions between
neighbouring pointwise and reduction kernels stay. Measurements before and after:
docs/inductor-memory.md, item 7.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import Any

from rematc._torch_compat import inductor_choices, inductor_scheduler_types, warn_fallback


class KeepPlanOrder:
    """Inductor's choices handler as it was, except that a fusion across an extern kernel
    is refused. Every other decision is the wrapped handler's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        # The scheduler asked about last, and the positions of its extern kernels.
        self._externs: tuple[Any, list[int]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def can_fuse_horizontal(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        return (not self.across_extern(scheduler, node1, node2)
                and bool(self.inner.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)))

    def can_fuse_vertical(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        return (not self.across_extern(scheduler, node1, node2)
                and bool(self.inner.can_fuse_vertical(scheduler, node1, node2, shared_data_score)))

    def across_extern(self, scheduler: Any, node1: Any, node2: Any) -> bool:
        """Whether an extern kernel runs between the two; if so, said in the fusion log."""
        if spans(self.extern_positions(scheduler), node1, node2):
            _why_not(node1, node2)
            return True
        return False

    def extern_positions(self, scheduler: Any) -> list[int]:
        """Where the scheduler's extern kernels were in the lowered order, sorted. Extern
        kernels never fuse, so they are the same for the whole fusion pass."""
        if self._externs is None or self._externs[0] is not scheduler:
            extern_node, _ = inductor_scheduler_types()
            positions = sorted(n.min_order for n in scheduler.nodes if isinstance(n, extern_node))
            self._externs = (scheduler, positions)
        return self._externs[1]


def spans(positions: list[int], node1: Any, node2: Any) -> bool:
    """Whether a position in ``positions`` (sorted) lies strictly between the two
    (possibly fused) nodes' ranges of lowered positions."""
    lo = min(node1.max_order, node2.max_order)
    hi = max(node1.min_order, node2.min_order)
    k = bisect.bisect_right(positions, lo)
    return k < len(positions) and positions[k] < hi


def _why_not(node1: Any, node2: Any) -> None:
    """Say so in Inductor's fusion log (``TORCH_LOGS=fusion``), as its own rules do."""
    _, why_no_fuse = inductor_scheduler_types()
    if why_no_fuse is not None:
        why_no_fuse(node1, node2)("rematc: an extern kernel runs between them in the plan's order")


def keep_plan_order(inner_compile: Callable[..., Any], *, when: Callable[[], bool] | None = None
                    ) -> Callable[..., Any]:
    """``inner_compile`` with :class:`KeepPlanOrder` as Inductor's choices handler for
    the duration of each call (where ``when()`` holds at that call, if given; the backward
    compiles later, through this same ``inner_compile``). On a torch without a choices
    handler, ``inner_compile`` itself, with one warning unless ``when`` is given."""
    V = inductor_choices()
    if V is None:
        if when is not None:
            return inner_compile
        warn_fallback("this torch's Inductor has no choices handler, so fusions across an extern "
                      "kernel are not refused: the step may peak above the plan (the check after "
                      "compilation re-plans where its code does)")
        return inner_compile

    @functools.wraps(inner_compile)
    def compile_in_plan_order(*args: Any, **kwargs: Any) -> Any:
        if when is not None and not when():
            return inner_compile(*args, **kwargs)
        with V.set_choices_handler(KeepPlanOrder(V.choices)):
            return inner_compile(*args, **kwargs)

    return compile_in_plan_order
