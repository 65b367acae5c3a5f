"""Forwards in flight: a compiled graph's calls whose backward has not run yet.

A plan bounds one call of its graph, with what the step's earlier graphs hold
(:class:`rematc.partition.BudgetShare`) and ``Options.calls`` calls of it in flight. A
block compiled on its own (accelerate's ``compile_regions``, a per-block
``torch.compile``) runs its forward once per block before any backward, and every call
keeps its saved values: N calls hold N times what one plan leaves room for.

:class:`InFlight` watches the calls of one backend's graphs as they run. Before a
forward, what the calls in flight hold plus this call's predicted peak is the step's
predicted peak; above a byte budget, :class:`RepeatedForwardError` stops the step before
that memory is allocated, naming the cause and the fix. A call leaves the flight when
the backward reaches it, or when its autograd graph is freed without one.

A plan made for a caller that keeps only the loss (``Options.outputs="dropped"``) counts
the graph's other outputs as freed when its forward returns. Where a later graph of the
step reads one, or one is still alive when the backward reaches the call,
:class:`OutputsKeptError` stops the step there, before that graph allocates.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rematc._torch_compat import StorageWeakRef, storage_key

__all__ = ["Dropped", "Figures", "InFlight", "OutputsKeptError", "OutputsKeptWarning", "RepeatedForwardError",
           "RepeatedForwardWarning", "signature", "watching"]

# An output's dtype and shape, a symbolic size as -1 (it matches any).
Signature = tuple[str, tuple[int, ...]]
# Per signature counted as dropped: the weak references to the storages of the call's
# outputs of that signature, how many may stay alive, and the bytes of one.
Watched = list[tuple[list[StorageWeakRef], int, int]]


class RepeatedForwardError(RuntimeError):
    """The forwards in flight would take the step above its byte budget: a compiled
    graph ran again before its backward more times than its plan leaves room for."""


class RepeatedForwardWarning(UserWarning):
    """As :class:`RepeatedForwardError`, under a fraction budget (a request to shrink)."""


class OutputsKeptError(RuntimeError):
    """A graph's backward started while the step still held an output its plan counted as
    freed when the forward returned (``Options.outputs="dropped"``)."""


class OutputsKeptWarning(UserWarning):
    """As :class:`OutputsKeptError`, under a fraction budget (a request to shrink)."""


@dataclass(frozen=True)
class Dropped:
    """The outputs of one signature that a graph's plan counts as freed when its forward
    returns."""

    signature: Signature
    others: int  # the graph's other outputs of this signature, which may stay alive
    nbytes: int  # bytes of one


def signature(t: torch.Tensor) -> Signature:
    """``t``'s dtype and shape; a symbolic size (a fake tensor's) as -1."""
    return str(t.dtype), tuple(s if isinstance(s, int) else -1 for s in t.shape)


def _matches(t: torch.Tensor, sig: Signature) -> bool:
    dtype, shape = signature(t)
    return dtype == sig[0] and len(shape) == len(sig[1]) and all(
        want in (-1, got) for got, want in zip(shape, sig[1], strict=True))


@dataclass(frozen=True)
class Figures:
    """A graph's plan, as the watch of its calls reads it."""

    peak: int  # bytes: one call's predicted peak (the generated code's, where higher)
    holds: int  # bytes held from the end of its forward to its backward
    budget: int  # the step's budget in bytes
    calls: int  # calls of it in flight the plan leaves room for
    hard: bool  # a byte budget (an error above it), not a fraction (a warning)
    dropped: tuple[Dropped, ...] = ()  # outputs counted as freed when the forward returns
    freed: tuple[Dropped, ...] = ()  # inputs (earlier graphs' outputs) counted as freed then too


@dataclass(frozen=True)
class Call:
    graph: str  # the graph's name, for messages
    holds: int  # bytes its plan holds from the end of its forward to its backward
    planned: int  # calls of its graph in flight its plan leaves room for


@dataclass
class InFlight:
    """The calls in flight of one backend's graphs (one compiled model)."""

    calls: dict[int, Call] = field(default_factory=dict)  # token -> call
    # token -> its graph and the outputs its plan counts as freed when its forward returned
    dropped: dict[int, tuple[str, Watched]] = field(default_factory=dict)
    tokens: itertools.count[int] = field(default_factory=itertools.count)
    warned: set[str] = field(default_factory=set)  # graphs warned about under a fraction

    def held(self) -> int:
        """Bytes the calls in flight hold."""
        return sum(c.holds for c in self.calls.values())

    def before(self, graph: str, *, peak: int, budget: int | None, planned_calls: int,
               hard: bool = True) -> None:
        """Raise :class:`RepeatedForwardError` where a forward of ``graph`` peaking at
        ``peak`` bytes now would take the step above ``budget`` because a graph has more
        calls in flight than its plan leaves room for (this one or an earlier one); under a
        fraction budget (not ``hard``), warn once per graph instead."""
        if budget is None or self.held() + peak <= budget:
            return
        counts = Counter(c.graph for c in self.calls.values())
        counts[graph] += 1
        planned = {c.graph: c.planned for c in self.calls.values()} | {graph: planned_calls}
        over = [g for g, n in counts.items() if n > planned[g]]
        if not over:
            return  # as the budget share planned: what is over is the prediction's to own
        worst = max(over, key=lambda g: counts[g] - planned[g])
        message = (
            f"rematc: {worst}'s forward runs again before its backward ({counts[worst]} calls in "
            f"flight, planned for {planned[worst]}): the saved values of the calls in flight "
            f"({self.held()} B) and {graph}'s peak ({peak} B) come to {self.held() + peak} B, "
            f"above the budget of {budget} B. A block compiled on its own (accelerate's "
            f"compile_regions, a per-block torch.compile) runs once per block before any "
            f"backward: pass options={{'budget': ..., 'calls': <blocks per step>}} so that its "
            f"plan leaves room for every call, or compile the whole model.")
        if hard:
            raise RepeatedForwardError(message)
        if worst not in self.warned:
            self.warned.add(worst)
            warnings.warn(message, RepeatedForwardWarning, stacklevel=4)

    def reads(self, graph: str, inputs: Any, *, hard: bool = True) -> None:
        """Raise :class:`OutputsKeptError` where ``graph`` is about to read an output of a
        call in flight that its plan counted as freed when its forward returned: a graph
        that returns a loss and outputs a later graph reads (under a fraction budget, warn
        once per graph)."""
        if not self.dropped:
            return
        read = {storage_key(t.untyped_storage()) for t in _flat(inputs) if isinstance(t, torch.Tensor)}
        for earlier, watched in self.dropped.values():
            # a signature the graph also returns kept outputs of cannot tell them apart
            if any(not ref.expired() and ref.cdata in read
                   for refs, others, _ in watched if not others for ref in refs):
                self._outputs_kept(
                    f"rematc: {graph} reads an output of {earlier} that {earlier}'s plan counted as "
                    f"freed when its forward returned (outputs='dropped'): {earlier} returns a loss, "
                    f"and a later graph reads its other outputs. Compile with outputs='kept'.", earlier, hard)
                return

    def _outputs_kept(self, message: str, graph: str, hard: bool) -> None:
        if hard:
            raise OutputsKeptError(message)
        if graph not in self.warned:
            self.warned.add(graph)
            warnings.warn(message, OutputsKeptWarning, stacklevel=4)

    def after(self, graph: str, holds: int, outputs: Any, *, planned_calls: int = 1,
              dropped: tuple[Dropped, ...] = (), inputs: Any = (), freed: tuple[Dropped, ...] = (),
              hard: bool = True) -> None:
        """Count the call that returned ``outputs`` in flight until its backward runs or
        its autograd graph is freed; a call with no output requiring grad is not. Where its
        plan counts ``dropped`` outputs as freed when the forward returned, check when the
        backward reaches the call that no more of them are alive than the graph's other
        outputs of their signatures (:func:`outputs_kept`; ``inputs``: the call's, whose
        storages do not count); and the same of its ``inputs`` of the ``freed``
        signatures, beside the graph's other inputs of them (those its outputs share a
        storage with do not count)."""
        node = _backward_node(outputs)
        if node is None:
            return
        token = next(self.tokens)
        self.calls[token] = Call(graph, holds, planned_calls)
        watched = _watch_dropped(outputs, inputs, dropped)
        if watched:
            self.dropped[token] = (graph, watched)
        checked = watched + _watch_dropped(inputs, outputs, freed)

        def land(*_: Any) -> None:
            self.calls.pop(token, None)
            self.dropped.pop(token, None)

        def check_then_land(*_: Any) -> None:
            land()
            kept = outputs_kept(checked)
            if kept:
                # Held by a reference cycle only, they are garbage: collected here, before
                # the backward allocates anything, they never sat beside it.
                gc.collect()
                kept = outputs_kept(checked)
            if not kept:
                return
            self._outputs_kept(
                f"rematc: {graph}'s backward started while the step still held {kept} B of its outputs, "
                f"or of earlier graphs' outputs it read, that its plan counted as freed when the "
                f"forward returned (outputs='dropped'), so "
                f"the step may peak that much above its plan. Keep only the loss before the backward "
                f"(loss = model(...).loss), or compile with outputs='kept'.", graph, hard)

        node.register_prehook(check_then_land if checked else land)
        # A node Python cannot refer to weakly (TypeError) is landed by its backward alone.
        with contextlib.suppress(TypeError):
            weakref.finalize(node, land)


def _watch_dropped(outputs: Any, inputs: Any, dropped: tuple[Dropped, ...]) -> Watched:
    """Weak references to the storages of the outputs of each ``dropped`` signature (once
    each; not those of the call's ``inputs``, which the step holds anyway)."""
    if not dropped:
        return []
    held = {storage_key(t.untyped_storage()) for t in _flat(inputs) if isinstance(t, torch.Tensor)}
    tensors = [t for t in _flat(outputs) if isinstance(t, torch.Tensor) and t.dim() > 0]
    watched: Watched = []
    for d in dropped:
        refs, seen = [], set()
        for t in tensors:
            key = storage_key(t.untyped_storage())
            if _matches(t, d.signature) and key not in held and key not in seen:
                seen.add(key)
                refs.append(StorageWeakRef(t.untyped_storage()))
        watched.append((refs, d.others, d.nbytes))
    return watched


def outputs_kept(watched: Watched) -> int:
    """Bytes of the outputs counted as dropped that are still alive: per signature, those
    alive beyond the graph's other outputs of it."""
    return sum(max(0, sum(not ref.expired() for ref in refs) - others) * nbytes
               for refs, others, nbytes in watched)


def _backward_node(outputs: Any) -> Any:
    """The autograd node of the compiled function that returned ``outputs`` (the first
    output's grad_fn, or the node under a view of an output), None where no output
    requires grad."""
    tensors = [t for t in _flat(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for t in tensors:
        if "CompiledFunction" in type(t.grad_fn).__name__:
            return t.grad_fn
    for t in tensors:
        assert t.grad_fn is not None
        for nxt, _ in t.grad_fn.next_functions:
            if nxt is not None and "CompiledFunction" in type(nxt).__name__:
                return nxt
    return tensors[0].grad_fn if tensors else None


def _flat(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [x for v in value for x in _flat(v)]
    return [value]


def watching(compiled: Callable[..., Any], flight: InFlight, graph: str,
             plan: Callable[[], Figures | None]) -> Callable[..., Any]:
    """``compiled`` (a graph's compiled function, as the backend returns it to Dynamo)
    counting its calls in ``flight``. ``plan()`` gives the graph's current figures, or
    None with no budget to hold."""
    @functools.wraps(compiled)  # its attributes too: the calling convention Dynamo reads
    def run(*args: Any, **kwargs: Any) -> Any:
        figures = plan()
        if figures is None or not torch.is_grad_enabled():
            return compiled(*args, **kwargs)
        flight.before(graph, peak=figures.peak, budget=figures.budget,
                      planned_calls=figures.calls, hard=figures.hard)
        flight.reads(graph, args, hard=figures.hard)
        outputs = compiled(*args, **kwargs)
        flight.after(graph, figures.holds, outputs, planned_calls=figures.calls, dropped=figures.dropped,
                     inputs=args, freed=figures.freed, hard=figures.hard)
        return outputs

    return run
