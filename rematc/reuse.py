"""Under a budget, Inductor's buffer pool holds a dead buffer only where the plan has room.

Inductor's wrapper does not free a dead buffer when a later allocation of the same size
can take it over (``config.allow_buffer_reuse``): the buffer stays allocated from its last
read to that allocation. Inductor allows it when its own peak estimate for the graph says
the held bytes stay under the graph's estimated peak. That estimate is of the one graph,
not of the step the plan was made for, and on a plan tuned to its budget the held
buffers can take the step above the plan. Without the pool every large buffer is a fresh
``mmap`` from glibc whose pages fault in on first write, which slows the step on the CPU;
reuse by the very next kernel only recovers that on the transformers, not on a CNN.

The rule here: a freed buffer may be taken over by a later allocation when the plan's own
timeline (:func:`solvers.checker.check`, the bytes live at each step of the joint graph)
plus the buffers already held over the same steps leaves room for it below the plan's
peak less a margin (``MARGIN``) at every step it would be held over, and Inductor's own
rule agrees; taken over, its bytes are added there. The cap is the plan's peak, not the
budget, so the step peaks where the plan said it would and a plan chosen for its least
peak keeps it. A kernel sits at the plan steps of the FX nodes that made its buffers
(their names are the plan's: the emitted graphs keep the joint graph's names, a
recomputed node's name included). Reuse by the next kernel, and of communication buffers,
is allowed as Inductor allows it. Measurements: docs/inductor-memory.md, item 6.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rematc._torch_compat import inductor_allocate_line as allocate_line
from rematc._torch_compat import inductor_virtualized, warn_fallback
from solvers.plan import Decision, Plan
from solvers.problem import Problem

# A dead buffer is held only below this share of the plan's peak under it: the timeline is
# the model's, exact at the peak but not at every step (docs/inductor-memory.md, item 6).
MARGIN = 0.10


@dataclass
class Room:
    """The plan's live bytes at each step, the cap under them, and where each FX node runs: a
    forward node at its value's step; in the backward, a backward node at its value's step
    and a recomputed forward node at the step its recomputation runs before."""

    timeline: list[int]
    cap: int  # bytes: the plan's peak less the margin
    forward_steps: Mapping[str, int]
    backward_steps: Mapping[str, int]
    held: list[int] = field(init=False)  # bytes of dead buffers kept, per step

    def __post_init__(self) -> None:
        self.held = [0] * len(self.timeline)

    def take(self, lo: int, hi: int, size: int) -> bool:
        """Hold ``size`` more bytes over steps ``lo..hi`` if every one has room for it."""
        if lo > hi:
            return True
        steps = range(max(lo, 0), min(hi, len(self.timeline) - 1) + 1)
        if any(self.timeline[k] + self.held[k] + size > self.cap for k in steps):
            return False
        for k in steps:
            self.held[k] += size
        return True


def room_of(problem: Problem, plan: Plan, timeline: Sequence[int],
            groups: Sequence[Sequence[str]]) -> Room | None:
    """The :class:`Room` of a plan whose checker timeline is ``timeline``; ``groups[v]``
    are the FX names of value v. None without a budget: the pool is then Inductor's."""
    if problem.budget is None:
        return None
    forward: dict[str, int] = {}
    backward: dict[str, int] = {}
    for v, names in enumerate(groups):
        for name in names:
            (forward if v < problem.n_forward else backward)[name] = v
    for s in plan.schedule:
        if plan.decisions.get(s.node) is Decision.RECOMPUTE:
            for name in groups[s.node]:
                backward[name] = min(backward.get(name, s.before), s.before)
    return Room(list(timeline), int(max(timeline, default=0) * (1 - MARGIN)), forward, backward)


def kernel_steps(scheduler: Any, steps: Mapping[str, int]) -> list[tuple[int, int] | None]:
    """For each of the scheduler's nodes, the least and greatest plan step of the FX nodes
    whose lowering made its buffers (``origin_node``), or where none of those is in
    ``steps``, of every FX node it was lowered from; None when none is.

    Why the buffer's own node first: a kernel's origins include what it computes inline,
    and in a forward with BatchNorm the running-statistics updates at the graph's end too
    (the U-Net's encoder kernels spanned steps 114-305 by their origins), which would hold
    a buffer over the whole forward."""
    out: list[tuple[int, int] | None] = []
    for snode in scheduler.nodes:
        parts = [part.node for part in snode.get_nodes()]
        own = [steps[n.name] for n in (_origin_node(part) for part in parts)
               if n is not None and n.name in steps]
        found = own or [steps[o.name] for part in parts for o in getattr(part, "origins", ())
                        if o.name in steps]
        out.append((min(found), max(found)) if found else None)
    return out


def _origin_node(buffer: Any) -> Any:
    get = getattr(buffer, "get_origin_node", None)
    return get() if callable(get) else None


def holds_nothing(alloc: Any, free_line: Any) -> bool:
    """Reuse Inductor allows whatever the plan: by the very next kernel (nothing is
    allocated between the free and the reuse), or of a communication buffer."""
    return bool(alloc.comm_buffer) or free_line.scheduler_node_index + 1 == alloc.scheduler_node_index


def current_scheduler() -> Any:
    """The scheduler of the graph Inductor is generating code for."""
    return inductor_virtualized().graph.scheduler


@dataclass
class Rule:
    """Inductor's ``should_reuse_buffer`` for one compiled graph (module docstring)."""

    room: Room | None
    backward: bool
    scheduler: Callable[[], Any] = current_scheduler
    # Inductor's own rule (its estimate of the graph's peak), which must agree too.
    inductor: Callable[[Any, Any, int], bool] = lambda alloc, free_line, size: True
    _kernels: tuple[Any, list[tuple[int, int] | None]] | None = None

    def allows(self, alloc: Any, free_line: Any, size: int) -> bool:
        if holds_nothing(alloc, free_line):
            return True
        if self.room is None or not self.inductor(alloc, free_line, size):
            return False
        span = self.span(free_line.scheduler_node_index, alloc.scheduler_node_index)
        return span is not None and self.room.take(span[0], span[1], size)

    def span(self, freed: int, taken: int) -> tuple[int, int] | None:
        """The plan steps a buffer dead after kernel ``freed`` is held over until kernel
        ``taken`` allocates: from just after the freeing kernel's first step to just
        before the taking kernel's last, and every step of the kernels in between (a
        fused kernel's FX nodes can lie apart: the span only widens). None where no kernel
        in between maps to a step and an end does not either."""
        kernels = self.kernels()
        inside = [s for s in kernels[freed + 1:taken] if s is not None]
        before, after = kernels[freed], kernels[taken]
        if not inside and (before is None or after is None):
            return None
        los = [lo for lo, _ in inside] + ([before[0] + 1] if before else [])
        his = [hi for _, hi in inside] + ([after[1] - 1] if after else [])
        return min(los), max(his)

    def kernels(self) -> list[tuple[int, int] | None]:
        """:func:`kernel_steps` of the scheduler being code-generated, computed once."""
        scheduler = self.scheduler()
        if self._kernels is None or self._kernels[0] is not scheduler:
            assert self.room is not None
            steps = self.room.backward_steps if self.backward else self.room.forward_steps
            self._kernels = (scheduler, kernel_steps(scheduler, steps))
        return self._kernels[1]


def planned_reuse(inner_compile: Callable[..., Any], room: Callable[[], Room | None]) -> Callable[..., Any]:
    """``inner_compile`` with Inductor's buffer-reuse rule replaced by :class:`Rule` for
    the duration of each call (the backward compiles later, through this same function).
    ``room`` gives the plan's :class:`Room` once the partitioner has made it. Only this
    call's context sees the rule: another thread's compile, or one outside rematc, keeps
    Inductor's. Where this torch's Inductor decides reuse otherwise, ``inner_compile`` is
    returned as it is and :mod:`rematc.backend` turns the pool off, with one warning."""
    line = allocate_line()
    if line is None:
        warn_fallback("this torch's Inductor decides buffer reuse where rematc cannot restrict it, "
                      "so under a budget its buffer pool is off: the plan's peak holds, but every buffer "
                      "is allocated anew and the step may be slower")
        return inner_compile
    inductor_rule = _dispatching(line)

    @functools.wraps(inner_compile)
    def compile_with_planned_reuse(*args: Any, **kwargs: Any) -> Any:
        rule = Rule(room(), backward=bool(kwargs.get("is_backward", False)), inductor=inductor_rule)
        token = _RULE.set(rule)
        try:
            return inner_compile(*args, **kwargs)
        finally:
            _RULE.reset(token)

    return compile_with_planned_reuse


# The rule of the compile running in this context; None: Inductor's own.
_RULE: contextvars.ContextVar[Rule | None] = contextvars.ContextVar("rematc_reuse_rule", default=None)


def _dispatching(line: Any) -> Callable[[Any, Any, int], bool]:
    """Install once on ``line`` (Inductor's ``AllocateLine``) a ``should_reuse_buffer`` that
    asks the context's :class:`Rule`, or Inductor's own where there is none; returns
    Inductor's own."""
    installed = line.should_reuse_buffer
    inductor_rule: Callable[[Any, Any, int], bool] = getattr(installed, "inductor_rule", installed)
    if installed is inductor_rule:
        def should_reuse_buffer(self: Any, free_line: Any, size: int) -> bool:
            rule = _RULE.get()
            return inductor_rule(self, free_line, size) if rule is None else rule.allows(self, free_line, size)

        should_reuse_buffer.inductor_rule = inductor_rule  # type: ignore[attr-defined]
        line.should_reuse_buffer = should_reuse_buffer
    return inductor_rule
