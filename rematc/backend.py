"""The ``rematc`` torch.compile backend.

Registered under the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="rematc", options={"budget": "2GiB"})`` works without
importing rematc. Dynamo passes ``options`` (and ``mode``) only when they are given.

One :class:`Backend` is one compiled step: the graphs it partitions (graph breaks,
recompilations) share its budget (:class:`rematc.partition.BudgetShare`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.fx as fx

from rematc._torch_compat import (
    TORCH,
    aot_autograd,
    boxed_codegen,
    functorch_config,
    inductor_compile_fx,
)
from rematc.calls import Figures, InFlight, watching
from rematc.devices import DeviceProfile, profile_for
from rematc.donation import checking_donations
from rematc.fusion import keep_plan_order
from rematc.generated import recording_peaks
from rematc.inductor_rules import check_release
from rematc.options import CACHE_AUTO, Options
from rematc.partition import (
    LEAST_PEAK,
    BudgetShare,
    BudgetWarning,
    PartitionRecord,
    RematPartitioner,
    drop_record,
    graph_name,
    keep_in_hand,
    returned_bytes,
)
from rematc.regions import (
    block_calls,
    block_carry,
    block_index,
    cached_survey,
    mark_regions,
    within_packed_check_eager,
)
from rematc.reuse import allocate_line, planned_reuse
from rematc.wholestep import auto_budget
from solvers import InfeasibleBudgetError
from solvers.budget import Budget
from solvers.mix import need

log = logging.getLogger(__name__)


class Backend:
    """A torch.compile backend with fixed options: ``torch.compile(m, backend=Backend(o))``.

    Every graph it compiles shares one budget (see :class:`BudgetShare`): use one
    Backend per model, as ``rematc.compile`` does."""

    def __init__(self, options: Options, *, regions: bool = False) -> None:
        if not isinstance(options, Options):
            raise TypeError(
                f"Backend takes a rematc.Options, got {type(options).__name__}; "
                "use Options.from_mapping({...}) or rematc.compile(model, budget=...)"
            )
        self.options = options
        self.regions = regions  # the model's blocks compile on their own (rematc.regions)
        # Its graphs are many by design: no GraphBreakWarning then.
        self.share = BudgetShare(warned=regions)
        self.flight = InFlight()  # the graphs' calls whose backward has not run
        # The graph being compiled: Inductor's code for each plan compiled (once_per_plan).
        self.compiles: dict[tuple[str, bool, str], Any] = {}
        self.said_outside = False  # the warning of :meth:`_say_outside`, once

    def reset(self) -> None:
        """``torch._dynamo.reset()`` calls this: the compiled graphs are gone, and so is
        what they held."""
        self.share = BudgetShare(warned=self.regions)
        self.flight = InFlight()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self.options.budget is not None and self.options.budget.automatic:
            # Resolved once, at the first graph: the graphs of the step share it.
            self.options = resolve_auto_budget(self.options, example_inputs)
        # A block compiled on its own (rematc.regions) runs once per block before any
        # backward: its plan leaves room for every call.
        calls = block_calls()
        options = self.options if calls is None else dataclasses.replace(self.options, calls=calls)
        if calls is None:
            self._say_outside(options)
        if self.regions and calls is None:
            # Regional compilation sends the blocks to Inductor and runs the rest as it is,
            # planned: the model around the blocks is little compute and much compile time.
            options = dataclasses.replace(options, compiler="eager")
        partitioner = RematPartitioner(options, self.share)
        partitioner.leaves = leaf_inputs(example_inputs)
        self.compiles = {}  # this graph's, by plan: see :func:`once_per_plan`
        # A regional block's calls are told apart by its index: they may run different plans.
        partitioner.mixes = self.regions and calls is not None and calls > 1
        carry = block_carry() if self.regions else None
        partitioner.carry = carry
        if options.compiler == "inductor":
            try:
                compiled: Callable[..., Any] | None = self._inductor(gm, example_inputs, partitioner)
            except _MixOffered:  # the one plan for every block is compiled only if needed
                compiled = None
        else:
            compiled = _eager(gm, example_inputs, partitioner)
        if partitioner.record is None:
            # An inference graph (no output requires grad, so nothing was partitioned or
            # planned): what it returns may stay alive through the step, held by the
            # later graphs' saved values (a rotary embedding's cos and sin under no_grad).
            key = self.share.graph()
            if key is not None:
                self.share.outside[key] = returned_bytes(gm) * (calls or 1)
        if partitioner.mix is not None:
            mixed = self._mixed(gm, example_inputs, partitioner, compiled)
            return mixed if carry is None else carry.moving(mixed, 0)
        assert compiled is not None
        watched = self._watched(compiled, partitioner)
        if carry is not None and partitioner.record is not None:
            # the blocks whose inputs its plan recomputes or offloads (rematc.regions.Carry)
            return carry.moving(watched, partitioner.record.inputs_recomputed,
                                partitioner.record.inputs_offloaded)
        return watched

    def _say_outside(self, options: Options) -> None:
        """Once, where a byte budget is given with ``calls`` (blocks compiled on their own,
        each by ``torch.compile`` or accelerate's ``compile_regions``): the budget is held
        by the graphs this backend compiles, and what the model allocates outside them is
        not seen, so the step may peak above it."""
        if self.said_outside or options.calls < 2 or options.budget is None or options.budget.nbytes is None:
            return
        self.said_outside = True
        warnings.warn(
            f"rematc: the budget is held by the graphs this backend compiles, {options.calls} calls of "
            f"each; what the model allocates outside them (the code left uncompiled around the blocks, "
            f"parameters FSDP2 gathers) is not counted, so the step may peak above it: keep room for it "
            f"with the option 'reserve' (bytes), or compile the model whole with "
            f"rematc.compile(model, regions=True), which plans every graph of the step",
            BudgetWarning, stacklevel=2)

    def _watched(self, compiled: Callable[..., Any], partitioner: RematPartitioner) -> Callable[..., Any]:
        """``compiled``, its calls watched with the figures of ``partitioner``'s plan."""
        record = partitioner.record
        return watching(compiled, self.flight, graph_name(record.graph if record is not None else None),
                        lambda: _figures(partitioner.record, partitioner.options))

    def _mixed(self, gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: RematPartitioner,
               uniform: Callable[..., Any] | None) -> Callable[..., Any]:
        """The regional block's graph compiled once per plan of the mix its partitioning
        offered (``partitioner.mix``), and a function that runs, for each block, the plan
        its index is given: the first ``counts[0]`` blocks the first (least-holding) plan,
        and so on. One plan for every block (``uniform``, which the eager route has
        compiled already, and Inductor compiles here only then) is returned instead where,
        under Inductor, the generated code of the mix's plans peaks so far above their
        predictions that the mix no longer fits (known once the plans compiled so far show
        it: the rest are not compiled; the one plan, where it was one of those, is not
        compiled again, :func:`once_per_plan`). A call outside a marked block runs
        ``uniform`` where it is compiled, else the mix's first plan, each watched with its
        own figures."""
        mix = partitioner.mix
        assert mix is not None
        planned = partitioner.record
        compiled, records = [], []
        start = 0
        needed = 0
        for plan, count in zip(mix.plans, mix.counts, strict=True):
            partitioner.fixed = plan
            try:
                if partitioner.options.compiler == "inductor":
                    fn = self._compile_inductor(gm, example_inputs, partitioner)
                else:
                    fn = _eager(gm, example_inputs, partitioner)
            finally:
                partitioner.fixed = None
            # the step's need is the mix's, which the partitioning that offered it counted
            record = partitioner._amend(blocks=tuple(range(start, start + count)), cached=mix.cached,
                                        **({"step_need": planned.step_need, "own_need": planned.own_need}
                                           if planned is not None else {}))
            assert record is not None
            start += count
            compiled.append(watching(fn, self.flight, graph_name(record.graph),
                                     functools.partial(_figures, record, partitioner.options)))
            records.append(record)
            # The code Inductor generated may peak above a plan's prediction: the mix
            # holds only with those gaps counted. The plans not compiled yet are counted
            # at their predictions, so a mix that cannot fit compiles no further plan.
            gaps = [_gap(r) for r in records] + [0] * (len(mix.tiers) - len(records))
            tiers = [dataclasses.replace(t, forward=t.forward + g, backward=t.backward + g)
                     for t, g in zip(mix.tiers, gaps, strict=True)]
            needed = need(tiers, mix.counts, grads=mix.grads, reserve=mix.reserve)
            if needed > mix.room:
                break
        if needed > mix.room:
            log.info("rematc: the mix of plans needs %d B in the generated code, above its room of %d B: "
                     "one plan for every block instead", needed, mix.room)
            for record in records:
                drop_record(record)
            partitioner.record = planned
            if uniform is None:  # planned again, as one plan for every block, and compiled
                if planned is not None:
                    drop_record(planned)
                partitioner.mixes, partitioner.mix = False, None
                uniform = self._inductor(gm, example_inputs, partitioner)
            elif planned is not None:
                self.share.record(planned.graph, planned.holds * planned.calls)
            return self._watched(uniform, partitioner)
        if planned is not None:
            drop_record(planned)
            self.share.record(planned.graph, sum(c * t.holds for t, c in zip(mix.tiers, mix.counts, strict=True)))
        partitioner.record = planned  # the figures ``uniform``'s watch reads
        outside = compiled[0] if uniform is None else self._watched(uniform, partitioner)
        runs = [k for k, count in enumerate(mix.counts) for _ in range(count)]

        @functools.wraps(compiled[0])  # the calling convention Dynamo reads
        def by_block(*args: Any, **kwargs: Any) -> Any:
            index = block_index()
            run = outside if index is None or index >= len(runs) else compiled[runs[index]]
            return run(*args, **kwargs)

        return by_block


    def _inductor(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                  partitioner: RematPartitioner) -> Callable[..., Any]:
        """Compile with Inductor, then hold the budget against the generated code: where
        its peak (``rematc.generated``) is above the budget, re-plan with the budget less
        the gap between the code's peak and the plan's prediction (so the plan changes),
        at most :data:`REPLANS` times, and not where the plan is the graph's least-peak
        plan (``LEAST_PEAK``), which any smaller budget plans again. Still above a byte budget: an
        :class:`InfeasibleBudgetError` stating the code's peak as the smallest budget that
        holds, its plan kept in hand so that asking for it gets that code; above a fraction
        (a request to shrink): a warning with the numbers."""
        try:
            compiled = self._compile_inductor(gm, example_inputs, partitioner)
        except InfeasibleBudgetError as e:
            raise self._stated_in_code(gm, example_inputs, partitioner, e) from e
        first = partitioner.record
        if first is None or first.budget is None:
            return compiled
        target = first.budget  # this graph's share of the budget, as first planned
        for _ in range(REPLANS):
            record = partitioner.record
            if record is None or record.generated_peak is None or record.budget is None:
                return compiled
            if record.generated_peak <= target:
                return compiled
            if record.solver == LEAST_PEAK:
                # The least peak found: under a fraction a smaller budget plans it again, to
                # the same code. (Where room for several calls chose it as the fastest plan
                # that fits, a smaller room might take a slower rung of the holding ladder
                # that needs less: not tried; the step then warns or states its budget.)
                break
            gap = record.generated_peak - record.predicted_peak
            log.info("rematc: the generated code peaks %d B above the budget (%d B), %d B above the "
                     "plan's prediction; re-planning with that taken off", record.generated_peak - target,
                     target, gap)
            partitioner.squeeze += record.budget - (target - max(gap, record.generated_peak - target))
            try:
                compiled = self._compile_inductor(gm, example_inputs, partitioner)
            except InfeasibleBudgetError:
                partitioner.record = record  # the plan compiled last stands
                break
        record = partitioner.record
        if record is None or record.generated_peak is None or record.generated_peak <= target:
            return compiled
        over = (f"the code Inductor generated peaks at {record.generated_peak} B, "
                f"{record.generated_peak - target} B above the budget of {target} B (the plan "
                f"predicted {record.predicted_peak} B with {record.squeezed} B taken off the "
                f"budget); the peak is at {record.generated_at}")
        if self.options.budget is not None and self.options.budget.fraction is None:
            keep_in_hand(record.problem.with_budget(record.generated_peak), record.plan, partitioner.options)
            outside = (first.step_budget or target) - target  # held by other graphs, and theirs
            raise InfeasibleBudgetError(target + outside, record.generated_peak + outside, proven=False,
                                        plan=record.plan, where=f"{_where(record)}{over}: ")
        warnings.warn(f"rematc: {over}", OverBudgetWarning, stacklevel=2)
        return compiled

    def _stated_in_code(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                        partitioner: RematPartitioner, e: InfeasibleBudgetError) -> InfeasibleBudgetError:
        """``e``, or where the code Inductor generates for the plan at the smallest byte
        budget ``e`` states peaks above the plan's prediction, an error stating the budget
        that code needs, its plan kept in hand: a stated budget holds when used. Costs a
        compile of the stated plan, on this failing path only."""
        budget = self.options.budget
        if budget is None or budget.nbytes is None or e.min_feasible is None:
            return e
        asked = partitioner.options
        partitioner.options = dataclasses.replace(asked, budget=Budget(nbytes=e.min_feasible))
        try:
            self._compile_inductor(gm, example_inputs, partitioner)
        except Exception:  # the probe only sharpens the figure: keep the one stated
            return e
        finally:
            partitioner.options = asked
        record = partitioner.record
        if record is None or record.generated_peak is None or record.budget is None:
            return e
        gap = record.generated_peak - record.budget
        if gap <= 0:
            return e
        keep_in_hand(record.problem.with_budget(record.generated_peak), record.plan, asked)
        return InfeasibleBudgetError(e.budget, e.min_feasible + gap, proven=False, plan=record.plan,
                                     where=f"{_where(record)}in the code Inductor generates: ")

    def _compile_inductor(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                          partitioner: RematPartitioner) -> Callable[..., Any]:
        compile_fx, compile_fx_inner = inductor_compile_fx()
        compile_fx_inner = once_per_plan(compile_fx_inner, partitioner, self.compiles)
        devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)} - {"cpu", "meta"}
        check_release(TORCH, device=min(devices, default="cpu"))
        inner = checking_donations(compile_fx_inner, lambda: partitioner.donations,
                                   partitioner.lost_donations)
        if self.options.budget is not None:
            inner = keep_plan_order(planned_reuse(inner, lambda: partitioner.room))
        else:
            # Without a budget the plan is the model's own checkpointing where it has one:
            # Inductor's fusions are then held to its order too, or a recomputation fused
            # into an earlier kernel lives through the attention backward
            # (docs/memory-model.md, the model's own activation checkpointing).
            inner = keep_plan_order(inner, when=lambda: partitioner.honours_checkpointing)
        inner = recording_peaks(inner, partitioner.generated, dropped=lambda: partitioner.dropped_names)
        inner = stopping_at_a_mix(inner, partitioner)
        # AOTAutograd's cache would skip the partitioner: no record, and a later graph of
        # the step planned without what this one holds. Inductor's FX graph cache (the
        # generated code) and rematc's plan cache still serve. Under a budget the backward
        # compiles now, not at its first run, so that its code is checked while a re-plan
        # is possible (a backward with retain_graph then needs donated_buffer off; torch
        # says so).
        with functorch_config.patch(enable_autograd_cache=False,
                                    force_non_lazy_backward_lowering=self.options.budget is not None):
            compiled = compile_fx(gm, list(example_inputs), inner_compile=inner,
                                  config_patches=inductor_patches(self.options, partitioner))
        return cast(Callable[..., Any], compiled)


def once_per_plan(inner_compile: Callable[..., Any], partitioner: RematPartitioner,
                  compiles: dict[tuple[str, bool, str], Any]) -> Callable[..., Any]:
    """``inner_compile`` (Inductor's ``compile_fx_inner``) that compiles the forward or
    backward of one plan of the graph being compiled once: asked again for the same plan
    (``partitioner.record``'s key), the same graph code and the same inputs' shapes,
    strides, dtypes and devices, it returns what it compiled then from ``compiles``. Same
    plan, same code: the plan fixes the emitted graphs and Inductor's buffer room
    (:func:`rematc.reuse.room_of`). Where a mix of plans falls back to one plan for every
    block, that plan was compiled as one of the mix's."""

    @functools.wraps(inner_compile)
    def compile_once_per_plan(gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any,
                              **kwargs: Any) -> Any:
        record = partitioner.record
        if record is None:
            return inner_compile(gm, example_inputs, *args, **kwargs)
        key = (repr(record.plan.key), bool(kwargs.get("is_backward", False)), _compiled_signature(gm))
        if key not in compiles:
            compiles[key] = inner_compile(gm, example_inputs, *args, **kwargs)
        return compiles[key]

    return compile_once_per_plan


def _compiled_signature(gm: fx.GraphModule) -> str:
    """What Inductor compiles of ``gm``: its code and its placeholders' tensor metadata."""
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        inputs.append(repr((tuple(val.shape), tuple(val.stride()), val.dtype, val.device))
                      if isinstance(val, torch.Tensor) else repr(val))
    return gm.code + "\n" + "\n".join(inputs)


class _MixOffered(Exception):
    """Raised in place of compiling one plan for every block where the partitioning
    offered a mix of plans: each of the mix's plans is compiled instead."""


def stopping_at_a_mix(inner_compile: Callable[..., Any], partitioner: RematPartitioner) -> Callable[..., Any]:
    """``inner_compile``, which raises :class:`_MixOffered` before compiling anything where
    the partitioning just run offered a mix (``partitioner.mix``) and emits no fixed plan."""

    @functools.wraps(inner_compile)
    def compile_unless_mixed(*args: Any, **kwargs: Any) -> Any:
        if partitioner.mix is not None and partitioner.fixed is None:
            raise _MixOffered
        return inner_compile(*args, **kwargs)

    return compile_unless_mixed


def leaf_inputs(example_inputs: Sequence[Any]) -> tuple[int, ...]:
    """The indices of the inputs that are leaf tensors requiring grad: their gradients
    stay in ``.grad`` to the step's end (:attr:`RematPartitioner.leaves`)."""
    return tuple(i for i, t in enumerate(example_inputs)
                 if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf)


def _eager(gm: fx.GraphModule, example_inputs: Sequence[Any],
           partitioner: RematPartitioner) -> Callable[..., Any]:
    """Plain FX, run eagerly: AOTAutograd's functionalization and our partitioner, no
    codegen (what the aot_eager backend does, with our partitioner)."""
    eager = aot_autograd(
        fw_compiler=_boxed_eager,
        bw_compiler=_boxed_eager,
        partition_fn=partitioner,
        keep_inference_input_mutations=True,
    )
    return cast(Callable[..., Any], eager(gm, example_inputs))


def _gap(record: PartitionRecord) -> int:
    """Bytes the code Inductor generated for ``record``'s plan peaks above its
    prediction; 0 off Inductor or below."""
    return max(0, (record.generated_peak or 0) - record.predicted_peak)


def _where(record: PartitionRecord) -> str:
    """The graph an error is about, as the start of its message ("" outside Dynamo)."""
    return "" if record.graph is None else f"{graph_name(record.graph)}: "


def _figures(record: PartitionRecord | None, options: Options) -> Figures | None:
    """What the watch of a graph's calls (:func:`rematc.calls.watching`) reads of its
    plan; None without a budget."""
    if record is None or record.step_budget is None or options.budget is None:
        return None
    peak = max(record.predicted_peak, record.generated_peak or 0)
    hard = options.budget.fraction is None
    return Figures(peak=peak, holds=record.holds, budget=record.step_budget, calls=record.calls,
                   hard=hard, dropped=record.dropped, freed=record.freed)


def resolve_auto_budget(options: Options, example_inputs: Sequence[Any],
                        mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None) -> Options:
    """``options`` with ``budget="auto"`` made bytes from the free memory of the device
    the graph's inputs are on (:func:`rematc.wholestep.auto_budget`); ``ValueError`` off
    an accelerator."""
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    devices = {t.device for t in tensors if t.device.type != "cpu"}
    if not devices:
        raise ValueError("budget='auto' is the free memory of the accelerator the model runs on, and "
                         "this graph's inputs are on the CPU: give the budget in bytes ('2GiB') or as "
                         "a fraction ('40%')")
    device = next(iter(devices))
    if mem_get_info is None:
        if device.type != "cuda":
            raise ValueError(f"budget='auto' reads free memory on CUDA devices, not {device.type}; "
                             "give the budget in bytes or as a fraction")
        mem_get_info = torch.cuda.mem_get_info
    free, total = mem_get_info(device)
    params = {id(t): t.numel() * t.element_size() for t in tensors
              if isinstance(t, torch.nn.Parameter) and t.requires_grad}
    workspace = 0
    if device.type == "cuda":  # the math libraries' workspaces, which a first step allocates
        workspace = profile_for(options.device, device_type="cuda",
                                device_name=torch.cuda.get_device_name(device)).workspace
    auto = auto_budget(free=free, total=total, parameter_bytes=sum(params.values()),
                       optimizer=options.optimizer, workspace=workspace)
    log.info("rematc: budget %s", auto.derivation)
    return dataclasses.replace(options, budget=Budget(nbytes=auto.budget), budget_origin=auto.derivation)


# Re-plans of one graph when its generated code peaks above the budget.
REPLANS = 2


class OverBudgetWarning(UserWarning):
    """The generated code peaks above the budget after every re-plan."""


def inductor_patches(options: Options, partitioner: RematPartitioner) -> dict[str, Any]:
    """Inductor's config for one rematc compile: our partitioner, and under a budget no
    buffer pool where :func:`rematc.reuse.planned_reuse` cannot restrict it."""
    patches: dict[str, Any] = {"custom_partitioner_fn": partitioner}
    if options.budget is not None and allocate_line() is None:
        patches["allow_buffer_reuse"] = False
    return patches


def rematc_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Entry point of ``backend="rematc"``; ``mode`` is accepted and ignored.

    Dynamo calls it once per graph with the same ``options`` object for one
    ``torch.compile`` call, so that object keys the Backend whose budget the graphs share.
    """
    if options is None:  # no budget: nothing to share
        return Backend(Options.from_mapping(None))(gm, example_inputs)
    entry = _BACKENDS.get(id(options))
    if entry is None or entry[0] is not options:
        # The mapping is held, so its id is not reused while the entry lives.
        entry = (options, Backend(Options.from_mapping(options)))
        _BACKENDS[id(options)] = entry
    return entry[1](gm, example_inputs)


# torch.compile(..., backend="rematc", options=o): id(o) -> (o, its Backend). One small
# entry per torch.compile call with options, for the life of the process.
_BACKENDS: dict[int, tuple[Mapping[str, Any], Backend]] = {}
# torch._dynamo.reset() calls the backend's reset(): every compiled graph is dropped.
rematc_backend.reset = _BACKENDS.clear  # type: ignore[attr-defined]


def _boxed_eager(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Run the graph's Python code, which drops each value after its last use, with the
    arguments taken out of AOTAutograd's list (the boxed convention): otherwise the list
    keeps every saved activation alive to the end of the backward, whatever the plan says.
    (An ``fx.Interpreter`` did the same at twice ``aot_eager``'s step time.)"""
    gm.graph.set_codegen(boxed_codegen())
    gm.recompile()

    def run(args: list[Any]) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def compile(
    model: torch.nn.Module | Callable[..., Any],
    *,
    budget: int | float | str | Budget | None = None,
    compiler: str = "inductor",
    device: str | DeviceProfile | None = None,
    host_bandwidth: float | None = None,
    verify: bool = True,
    cache_dir: str | os.PathLike[str] | None = CACHE_AUTO,
    time_limit: float | None = None,
    workers: int | None = None,
    seed: int | None = None,
    gap: float | None = None,
    step_gap: float | None = None,
    stall_time: float | None = None,
    deterministic: bool | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    regions: bool = False,
    **unknown: Any,
) -> Callable[..., Any]:
    """``torch.compile`` with the rematc backend: ``rematc.compile(model, budget="2GiB")``.

    The options are those of ``torch.compile(..., options=...)`` for rematc
    (:meth:`Options.from_mapping`; the solver's left as None take their defaults);
    ``dynamic`` and ``fullgraph`` go to ``torch.compile``. An unknown keyword raises
    ``ValueError`` naming the closest option, and so does ``budget="auto"`` for a module
    whose parameters and buffers are all on the CPU or meta (no accelerator to read).

    ``regions=True`` compiles the model's repeated blocks on their own, once for all of
    them, and the rest around them, the step planned under one budget
    (:mod:`rematc.regions`; it marks the blocks in place). ``ValueError`` where the model
    has no repeated blocks, or with ``fullgraph`` (the model's graph breaks at each block)."""
    solver = {"time_limit": time_limit, "workers": workers, "seed": seed, "gap": gap,
              "step_gap": step_gap, "stall_time": stall_time, "deterministic": deterministic}
    opts = Options.from_mapping({
        "budget": budget, "compiler": compiler, "device": device, "host_bandwidth": host_bandwidth,
        "verify": verify, "cache_dir": cache_dir,
        **{k: v for k, v in solver.items() if v is not None}, **unknown})
    if opts.budget is not None and opts.budget.automatic and isinstance(model, torch.nn.Module):
        # Said now, not as torch's BackendCompilerFailed at the first call (resolve_auto_budget).
        devices = {t.device.type for t in (*model.parameters(), *model.buffers())}
        if devices and devices <= {"cpu", "meta"}:
            where = " and ".join("the CPU" if d == "cpu" else d for d in sorted(devices))
            raise ValueError(f"budget='auto' is the free memory of the accelerator the model runs on, and "
                             f"this model's parameters are on {where}: give the budget in bytes ('2GiB') "
                             f"or as a fraction ('40%')")
    if opts.budget is not None and isinstance(model, torch.nn.Module) and _sharded(model):
        # FSDP2 gathers each module's parameters outside the compiled graphs while they run.
        outside = fsdp_reserve(model)
        opts = dataclasses.replace(opts, reserve=opts.reserve + outside)
        warnings.warn(
            f"rematc: the model is sharded with FSDP2, which gathers parameters outside the compiled "
            f"graphs: {outside} B of the budget are kept for them and the unsharded gradients, an "
            f"estimate that leaves the collectives' own buffers out; measure the step's peak",
            BudgetWarning, stacklevel=2)
    if regions:
        if fullgraph:
            raise ValueError("regions=True compiles each block as a graph of its own, so the model's "
                             "graph breaks at its blocks: pass fullgraph=False")
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"regions=True finds the repeated blocks of a module, got {type(model).__name__}")
        name, count = mark_regions(model)
        log.info("rematc: %d blocks of %s compiled on their own", count, name or "the model")
    backend = Backend(opts, regions=regions)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=fullgraph)
    if isinstance(model, torch.nn.Module):
        # The compiled module's forward takes (*args, **kwargs); trainers that keep only
        # the columns a model's forward names (transformers' Trainer) read it.
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            compiled.forward.__signature__ = inspect.signature(model.forward)  # type: ignore[attr-defined]
    if regions:
        assert isinstance(compiled, torch.nn.Module)
        within_packed_check_eager(compiled)
    if regions and opts.budget is not None and opts.budget.nbytes is not None:
        assert isinstance(model, torch.nn.Module) and isinstance(compiled, torch.nn.Module)
        _survey_first_call(compiled, model, backend)
    return cast(Callable[..., Any], compiled)


def fsdp_reserve(model: torch.nn.Module) -> int:
    """Bytes FSDP2 holds outside the compiled graphs of ``model`` at any point of a step,
    at most: the root's own parameters gathered (FSDP2 keeps them through the backward),
    two other sharded modules' gathered parameters (the one running, and the all-gather
    buffer of the one prefetched beside it), one module's unsharded gradients before its
    reduce-scatter, and the reduce-scatter input of the module before it, which FSDP2
    keeps until the next reduce-scatter starts (``reduce_scatter_max_input_buffers``, 1
    by default). 0 for a model not sharded with ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        return 0
    nested: dict[torch.nn.Module, set[int]] = {
        m: {id(p) for sub in m.modules() if sub is not m and isinstance(sub, FSDPModule) for p in sub.parameters()}
        for m in sharded}

    def gathered(m: torch.nn.Module) -> int:  # its own parameters, unsharded (a DTensor's numel is global)
        return sum(p.numel() * p.element_size() for p in m.parameters() if id(p) not in nested[m])

    root = sharded[0] if sharded[0] is model else None
    others = sorted((gathered(m) for m in sharded if m is not root), reverse=True)
    largest = others[0] if others else 0
    return (gathered(root) if root is not None else 0) + sum(others[:2]) + 2 * largest


def _sharded(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` is sharded with FSDP2 (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _survey_first_call(compiled: torch.nn.Module, model: torch.nn.Module, backend: Backend) -> None:
    """Before ``compiled``'s first call, survey the step on meta tensors
    (:func:`rematc.regions.survey`) so that its graphs are planned leaving room for the
    ones after them. A survey that fails is logged and the step planned without it."""

    def compile_twin(twin: torch.nn.Module, options: Options) -> tuple[Callable[..., Any], BudgetShare]:
        surveying = Backend(options, regions=True)
        return torch.compile(twin, backend=surveying), surveying.share

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        try:
            backend.share.needs = cached_survey(model, args, kwargs, backend.options, compile_twin)
        except Exception as e:  # the survey only improves the plans: never stop the step for it
            log.warning("rematc: could not survey the step on meta tensors (%s: %s); each graph is "
                        "planned without room kept for the graphs after it", type(e).__name__, e)
        else:
            log.info("rematc: the step's graphs need at their least %s", backend.share.needs)

    handle = compiled.register_forward_pre_hook(hook, with_kwargs=True)
