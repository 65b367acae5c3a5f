"""The rematc partitioner: a straight line of named stages over AOTAutograd's joint graph.

capture (prepare + annotate + build problem) -> solve -> check plan -> emit -> verify.

Around the solve: the plan cache (:mod:`rematc.plancache`), the time-out fallback and
typed errors (:func:`plan_for`). Around the budget: its share when a model compiles to
several graphs (:class:`BudgetShare`) and its validity across shapes
(:func:`bound_dynamic_sizes`).

It plugs into Inductor as ``config_patches={"custom_partitioner_fn": RematPartitioner(...)}``
(after Inductor's joint-graph passes, so ``replace_random`` and friends have run), or into
``aot_autograd(partition_fn=...)`` for the eager route.
"""

from __future__ import annotations

import logging
import pathlib
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from rematc import plancache
from rematc._torch_compat import (
    CompileContext,
    CustomPartitionerFn,
    OpOverload,
    ShapeEnv,
    force_save_bw_mutation_src,
    force_save_collectives,
    force_save_effectful_ops,
    free_unbacked_symbols,
    fx_graph_cse,
    get_hash_for_files,
    is_primal,
    optimization_hint,
    storage_key,
    tree_leaves,
)
from rematc.annotate import NodeCost, annotate, is_random, transient_scratch
from rematc.calls import Dropped, Signature, signature
from rematc.capture import (
    Captured,
    capture,
    place_addmm_operands,
    returns_loss,
    split_shared_pointwise,
)
from rematc.devices import DeviceProfile, profile_for
from rematc.donation import expected_donations
from rematc.emit import emit, verify
from rematc.errors import NoPlanError, SolverError
from rematc.generated import CodePeak
from rematc.options import Options
from rematc.reuse import Room, room_of
from rematc.status import naming, planning
from solvers import (
    Decision,
    InfeasibleBudgetError,
    Plan,
    Problem,
    Report,
    SolverConfig,
    SolveResult,
    Status,
    check,
    min_feasible_peak,
    planner,
    save_all,
    solve,
)
from solvers.baselines import free_values, greedy, holding_ladder, plan_with, recompute_every
from solvers.free import floor, least_peak_free, only_free
from solvers.mix import Tier, best_mix
from solvers.mix import need as calls_need

log = logging.getLogger(__name__)

_SOURCES = tuple(
    sorted(str(p) for pkg in ("rematc", "solvers")
           for p in (pathlib.Path(__file__).parent.parent / pkg).glob("*.py"))
)


@dataclass(frozen=True)
class PartitionRecord:
    """What one partitioning decided and predicted; ``rematc.records()`` lists them."""

    joint_nodes: int  # FX nodes in the joint graph handed to us
    values: int  # storages in the problem
    candidates: int  # forward values that needed a decision
    budget: int | None  # bytes: what this graph's plan holds to, with ``aside``
    unconstrained_peak: int  # bytes: the checker's peak when everything is saved
    predicted_peak: int  # bytes: the checker's peak of the chosen plan, and ``aside``
    added_time: float  # seconds of recomputation, by the device model
    added_flops: float
    status: str  # the solver's status
    gap: float
    solve_time: float  # seconds in the solver
    partition_time: float  # seconds for the whole partitioning
    saved: tuple[str, ...]  # FX names of saved tensors
    recomputed: tuple[str, ...]  # FX names of forward nodes recomputed in the backward
    problem: Problem
    plan: Plan
    # What produced the plan. The partitioner's own: "save_all", "checkpointing" (no
    # budget: the model's own activation checkpointing, as it is), "greedy" (fallback),
    # "least-peak" (a fraction it cannot reach, or the last resort for several calls),
    # "in-hand" (a plan an error stated). The solvers': "cpsat", "cpsat-anywhere",
    # "local-search", "greedy-anywhere", "chain", "chain-min-peak", "multilevel",
    # "multilevel-min-peak", "checkpoint_every_{k}" (and "+offload"), "recompute-only",
    # "known-min-peak", "free_least_peak", "stated", "sqrt_n", "knapsack".
    solver: str = ""
    # FX names of the backward's further copies of nodes it recomputes more than once
    again: tuple[str, ...] = ()
    cached: bool = False  # the plan came from the on-disk plan cache: no solve ran
    graph: GraphKey | None = None  # its place in the step, Dynamo frame and graph; None outside Dynamo
    held_before: int = 0  # bytes held by earlier graphs of the step, taken off the budget
    holds: int = 0  # bytes this graph's plan holds when its forward ends (saved + outputs)
    size_bounds: tuple[str, ...] = ()  # guards added so the plan serves only these shapes
    # Bytes of saved values the model lets a backward kernel write over that AOTAutograd did
    # not donate (rematc.donation): the measured peak may exceed the prediction by this much.
    # Set when the backward compiles (Inductor only).
    undonated: int = 0
    checkpointed: int = 0  # values the model's own checkpointing recomputes
    overrides: tuple[str, ...] = ()  # of those, the ones this plan keeps instead
    # Bytes: the step's peak in the code Inductor generated for this plan
    # (rematc.generated), set when the backward compiles; None off Inductor.
    generated_peak: int | None = None
    generated_at: str = ""  # the generated statement at that peak
    generated_alive: tuple[tuple[str, int], ...] = ()  # its largest live buffers (name, bytes)
    # Bytes the post-compile check took off the budget before this plan: the generated
    # code of an earlier plan of this graph peaked above the budget by that much.
    squeezed: int = 0
    budget_origin: str = ""  # how an "auto" budget was derived (Options.budget_origin)
    # Bytes kept free beside the plan: for the scratch an op allocates where no value holds
    # it (Captured.scratch) and for memory outside the graphs (Options.reserve); in
    # ``budget``, ``predicted_peak``, ``unconstrained_peak`` and ``generated_peak``.
    aside: int = 0
    # Forwards of this graph the plan leaves room for in one step (Options.calls), and the
    # step's budget in bytes that they and the earlier graphs share (None without one).
    calls: int = 1
    step_budget: int | None = None
    # Bytes: the step's peak this plan counts on, with the earlier graphs' holds
    # (``held_before``), every call of this graph (in a mix, every plan's calls), what the
    # later graphs need beside them and keep to the step's end, and ``aside``.
    step_need: int = 0
    # Bytes: the step's peak while this graph runs, as ``step_need`` but without the room
    # kept for the later graphs, which their own records count with their plans. The
    # largest over a step's records is its predicted peak; ``step_need`` may be above it
    # where a survey's figure for the later graphs (reserve) was above their plans'.
    own_need: int = 0
    # Bytes taken off ``own_need`` once a later graph freed some of this graph's outputs
    # before its backward (:func:`relieve_earlier`); 0 where none did.
    relieved: int = 0
    grads: int = 0  # bytes of the parameters' gradients its backward produces
    # In a mix of plans for a graph's calls (:class:`Mixed`): the calls, by position in the
    # step (a regional block's index), that run this plan; () where every call runs it.
    blocks: tuple[int, ...] = ()
    # A regional block's input (the block before's output), bytes, where a plan may
    # recompute it (:class:`Carrying`; 0 where none may), and the number of blocks, the
    # last, whose inputs this plan recomputes (rematc.regions.Carry).
    carried: int = 0
    inputs_recomputed: int = 0
    # The number of blocks, from the second on, whose inputs this plan copies to host
    # memory as their forwards end and back when their backwards start (rematc.regions.Carry).
    inputs_offloaded: int = 0
    # The forward's outputs the plan counts as freed when the forward returns
    # (Options.outputs="dropped"), as the check at the backward watches them.
    dropped: tuple[Dropped, ...] = ()
    # The earlier graphs' outputs this graph reads and counts as freed when its forward
    # returns (Options.outputs="dropped", :func:`freed_inputs`), as the check at the
    # backward watches them.
    freed: tuple[Dropped, ...] = ()
    freed_bytes: int = 0  # bytes of those in all


@dataclass(frozen=True)
class Mixed:
    """Plans for the calls of a graph that runs several times per step, each run by
    ``counts[i]`` calls (the least-holding plan first: the first calls run it), chosen by
    :func:`solvers.mix.best_mix` within ``room`` bytes (with ``grads`` and ``reserve`` as
    it counted them) at ``time`` seconds added over all calls; ``cached`` where every
    plan offered was found in the plan cache."""

    plans: tuple[Plan, ...]
    tiers: tuple[Tier, ...]
    counts: tuple[int, ...]
    room: int
    grads: int
    reserve: int
    time: float
    cached: bool = False


_RECORDS: deque[PartitionRecord] = deque(maxlen=64)


def drop_record(record: PartitionRecord) -> None:
    """Take ``record`` out of ``records()``: its plan was compiled but is not run."""
    for i, r in enumerate(_RECORDS):
        if r is record:
            del _RECORDS[i]
            return


def records() -> list[PartitionRecord]:
    """Partition records of this process, oldest first (the last 64)."""
    return list(_RECORDS)


def clear_records() -> None:
    """Forget the partition records kept so far."""
    _RECORDS.clear()


class Need(NamedTuple):
    """What one graph of a step needs at its least-peak plan."""

    calls: int  # its forwards in flight per step
    peak: int  # bytes: its least peak, one call
    holds: int  # bytes that plan holds after its forward, one call
    grads: int  # bytes of gradients its backward keeps, one call
    # bytes the inference graphs between the graph before it and it return, alive from
    # then on (BudgetShare.outside)
    before: int = 0
    # bytes of one call's input its plans may recompute (all calls' but the first,
    # PartitionRecord.carried): off what its calls hold while later graphs run
    carried: int = 0
    # bytes of the earlier graphs' outputs it frees when its forward returns
    # (PartitionRecord.freed_bytes), and its forward's peak at that plan: its backward runs
    # without them
    freed: int = 0
    forward: int = 0


class GraphKey(NamedTuple):
    """A graph of the step, as :meth:`BudgetShare.graph` names it. Keys compare in the
    order the share first saw their graphs, which is the step's order: Dynamo compiles a
    graph when the step first reaches it. Its frame number is not that order: Dynamo numbers
    a frame when it first compiles its code, for whichever model (a model compiled earlier
    in the process that runs the same code took the lower numbers)."""

    order: int  # among the graphs of the share, first seen first
    frame: int  # Dynamo's frame
    number: int  # the graph's place within its frame's compile


@dataclass
class BudgetShare:
    """One absolute budget shared by the graphs of one compiled step: graph k is planned
    with the budget less what graphs 1..k-1 hold when their forwards end (``held_before``),
    keyed by :class:`GraphKey`, in the step's order; a recompilation replaces its graph's entry.
    Fraction budgets are not shared. See docs/reliability.md, "Graph breaks"."""

    holds: dict[GraphKey, int] = field(default_factory=dict)  # graph -> bytes
    problems: dict[GraphKey, Problem] = field(default_factory=dict)  # graph -> its problem, no budget
    # graph -> bytes at its backward's predicted peak in the step (what the graphs before
    # it hold included), and bytes it keeps to the end of the step (:func:`lasting`)
    backward_peaks: dict[GraphKey, int] = field(default_factory=dict)
    lasting: dict[GraphKey, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # compile id -> graphs so far
    seen: dict[tuple[int, int], int] = field(default_factory=dict)  # (frame, graph) -> order
    # graph -> bytes an inference graph of the step returns (no partition, no plan: a
    # rotary embedding's cos and sin under no_grad), alive while the later graphs run
    outside: dict[GraphKey, int] = field(default_factory=dict)
    warned: bool = False
    # What each graph of the step needs at its least, in execution order, when a survey of
    # the step has said (rematc.regions.survey); empty otherwise.
    needs: tuple[Need, ...] = ()
    # graph -> the signatures of the outputs it returns and counts alive to the step's end
    # (its forward's kept values), one per output: a later graph that returns the loss may
    # read them and, under outputs="dropped", free them (:func:`freed_inputs`)
    returns: dict[GraphKey, list[Signature]] = field(default_factory=dict)

    def returned_earlier(self, graph: GraphKey | None) -> list[Signature]:
        """The signatures the graphs before ``graph`` return and count alive to the step's end."""
        return [sig for g, sigs in self.returns.items() if graph is not None and g < graph for sig in sigs]

    def graph(self) -> GraphKey | None:
        """The key of the graph being partitioned now (None outside a Dynamo compile); a
        recompilation of a graph keeps its place in the order."""
        cid = CompileContext.current_compile_id()
        if cid is None or cid.frame_id is None:
            return None
        k = self.calls.get(str(cid), 0)
        self.calls[str(cid)] = k + 1
        order = self.seen.setdefault((cid.frame_id, k), len(self.seen))
        return GraphKey(order, cid.frame_id, k)

    def reserve_after(self, graph: GraphKey | None) -> int:
        """Bytes the graphs after ``graph`` need beside what it and the earlier graphs
        hold, from a survey of the step (``needs``, in execution order: see
        :func:`rematc.regions.survey`); 0 without one. Graph k is the k-th in the step's
        order among those recorded. For each later graph j: its least peak, its other
        calls' saved values or gradients (the larger), the gradients of the graphs after j
        (alive while j's backward runs), and what the graphs between hold at their
        least-peak plans, and what the inference graphs before j return; the largest of
        those."""
        if graph is None or not self.needs:
            return 0
        k = sum(1 for g in self.holds if g < graph)
        later = self.needs[k + 1:]
        reserve, between = 0, 0
        for j, need in enumerate(later):
            between += need.before
            grads_after = sum(n.calls * n.grads for n in later[j + 1:])
            # What it frees is held (by the graphs before) until its forward ends, and off
            # its backward. Not off the forwards of the graphs after it: they may run before
            # the model's forward returns, while its frame still holds them.
            peak = max(need.forward, need.peak - need.freed) if need.freed else need.peak
            reserve = max(reserve, between + peak + (need.calls - 1) * max(need.holds, need.grads)
                          + grads_after)
            between += need.calls * need.holds - (need.calls - 1) * need.carried
        return reserve

    def gradients_after(self, graph: GraphKey | None) -> int:
        """Bytes of gradients the graphs after ``graph`` have produced when its backward
        runs, from the survey (``needs``); 0 without one."""
        if graph is None or not self.needs:
            return 0
        k = sum(1 for g in self.holds if g < graph)
        return sum(need.calls * need.grads for need in self.needs[k + 1:])

    def held_before(self, graph: GraphKey | None) -> int:
        """Bytes the graphs before ``graph`` hold when its forward starts: what their plans
        hold after their forwards, and what the inference graphs among them returned."""
        if graph is None:
            return 0
        return sum(b for g, b in self.holds.items() if g < graph) + self.returned_before(graph)

    def returned_before(self, graph: GraphKey | None) -> int:
        """Bytes the inference graphs before ``graph`` returned (:attr:`outside`)."""
        return sum(b for g, b in self.outside.items() if graph is not None and g < graph)

    def smallest_step_budget(self, graph: GraphKey | None, least: int,
                             options: Options) -> int | None:
        """The smallest step budget found at which the graphs before ``graph``, planned
        as they would be at it, leave ``graph`` its ``least`` bytes; None if none found.

        At a larger budget an earlier graph may plan to hold more, so the figure is
        searched for: ask B, re-plan the earlier graphs at B, and raise B to what they
        then hold plus ``least`` until it stands. The plans are kept in hand
        (:func:`keep_in_hand`), so asking for the figure gets the same ones."""
        earlier = sorted(g for g in self.problems if graph is not None and g < graph)
        step = self.held_before(graph) + least
        for _ in range(MAX_STEP_ROUNDS):
            held, needed = self.returned_before(graph), 0
            for g in earlier:
                # What the later graphs keep to the step's end, where a plan of the step
                # found it (lasting_after), is off an earlier graph's budget when planned.
                kept = lasting_after(self.problems[g])
                problem = self.problems[g].with_budget(step - held - kept)
                try:
                    plan = plan_for(problem, options).result.plan
                except InfeasibleBudgetError as e:
                    if e.min_feasible is None or e.plan is None:
                        return None
                    needed = max(needed, held + kept + e.min_feasible)
                    problem, plan = problem.with_budget(e.min_feasible), e.plan
                except NoPlanError:
                    return None
                assert plan is not None
                keep_in_hand(problem, plan, options)
                held += holds_after_forward(problem, check(problem, plan))
            needed = max(needed, held + least)
            if needed <= step:
                return step
            step = needed
        return None

    def over_after(self, graph: GraphKey | None, lasting: int, budget: int) -> int:
        """Bytes by which the backward of a graph before ``graph`` would exceed ``budget``
        beside the ``lasting`` bytes ``graph`` keeps to the end of the step and those the
        graphs between keep (they are alive while it runs: the step's backward runs the
        graphs in reverse); 0 where none would."""
        over = 0
        for g, peak in self.backward_peaks.items():
            if graph is None or g >= graph:
                continue
            between = sum(b for h, b in self.lasting.items() if g < h < graph)
            over = max(over, peak + between + lasting - budget)
        return over

    def remember_lasting(self, graph: GraphKey | None, lasting: int) -> None:
        """Note for each graph before ``graph`` the bytes it and the graphs between keep to
        the end of the step (:func:`lasting_after`), so that it is planned with them off its
        budget from its next compile on."""
        for g, problem in self.problems.items():
            if graph is not None and g < graph:
                between = sum(b for h, b in self.lasting.items() if g < h < graph)
                _remember_lasting(problem, lasting + between)

    def record(self, graph: GraphKey | None, holds: int, problem: Problem | None = None, *,
               backward_peak: int | None = None, lasting: int | None = None) -> None:
        """Note what ``graph`` holds when its forward ends (``holds``), and where given its
        problem, its backward's peak in the step and what it keeps to the step's end (a
        later call that only corrects ``holds`` leaves those as they were)."""
        if graph is None:
            return
        if problem is not None:
            self.problems[graph] = problem.with_budget(None)
        if backward_peak is not None:
            self.backward_peaks[graph] = backward_peak
        if lasting is not None:
            self.lasting[graph] = lasting
        grew = graph in self.holds and holds > self.holds[graph]
        later = [g for g in self.holds if g > graph]
        if grew and later:
            log.info("rematc: graph %s now holds %d B (was %d B) while graphs %s were planned "
                        "against the old figure; recompile them (torch._dynamo.reset()) to re-plan",
                        graph, holds, self.holds[graph], later)
        self.holds[graph] = holds
        if len(self.holds) > 1 and not self.warned:
            self.warned = True
            warnings.warn(
                "rematc: the model compiled to several graphs (a graph break, or parts "
                "compiled on their own); the "
                "activations each graph saves stay alive while the later ones run, so they "
                "share one budget and each later graph gets less (see docs/reliability.md, "
                "'Graph breaks'). Remove the break (TORCH_LOGS=graph_breaks shows it) to "
                "plan the step as one graph.",
                GraphBreakWarning,
                stacklevel=2,
            )


# The solver name of a graph's least-peak plan (PartitionRecord.solver): what a fraction
# budget below it, or several calls no other plan fits, run. A smaller budget plans it again.
LEAST_PEAK = "least-peak"

# Plans of :meth:`RematPartitioner.room_for_calls` before its least-peak plan: each at a
# budget smaller by the last plan's excess (what it holds shrinks with the budget), or
# halfway back up.
CALL_ROUNDS = 6
# A mix of plans for a graph's calls (RematPartitioner.mixed) is taken where it adds at
# least this fraction less time than one plan for every call: each plan of a mix costs a
# compile.
MIX_GAIN = 0.05
# Where between the least peak and the unconstrained one the budgets of the further plans
# a mix is made from lie.
MIX_STEPS = (0.25, 0.5, 0.75)
# Rounds of :meth:`BudgetShare.smallest_step_budget`: each raises the figure; earlier graphs
# hold at most their save-all bytes, so it stands within a few.
MAX_STEP_ROUNDS = 8


def graph_name(graph: GraphKey | None) -> str:
    """How messages name a graph of the step by its :meth:`BudgetShare.graph` key."""
    return "the compiled graph" if graph is None else f"graph {graph.number} of frame {graph.frame}"


class BudgetWarning(UserWarning):
    """A fraction budget a graph cannot reach: it runs at its smallest feasible peak."""


def kept_gradients(joint: fx.GraphModule, num_fwd_outputs: int, kept: Iterable[int]) -> int:
    """Bytes of the gradients a joint graph's backward produces for the inputs at the
    distinct indices ``kept``: those whose gradients stay alive, accumulated in ``.grad``,
    while the step's earlier graphs, or its other calls, run their backwards (the
    parameters, and the leaf tensors that require grad). Another input's gradient is not
    counted: the backward that reads it frees it. The same for every plan."""
    outputs = joint.graph.output_node().args[0]
    grads = list(outputs)[num_fwd_outputs:] if isinstance(outputs, list | tuple) else []
    total = 0
    for i in kept:
        grad = grads[i] if i < len(grads) else None
        val = grad.meta.get("val") if isinstance(grad, fx.Node) else None
        if isinstance(val, torch.Tensor):
            total += int(optimization_hint(val.numel())) * val.element_size()
    return total


def freed_outputs(joint: fx.GraphModule, num_fwd_outputs: int, captured: Captured,
                  plan: Plan) -> tuple[tuple[Dropped, ...], frozenset[str]]:
    """The forward's outputs ``plan`` counts as freed when the forward returns (the
    ``returned`` values of :func:`rematc.capture.dropped_outputs` it neither saves nor
    offloads): by signature, each with how many of the forward's other outputs of that
    signature may stay alive, as the check at the backward watches them (:func:`rematc.calls.outputs_kept`); and by name, as the walk of the
    generated code leaves them out of the backward (:func:`rematc.generated.step_peak`)."""
    outputs = joint.graph.output_node().args[0]
    forward = list(outputs)[:num_fwd_outputs] if isinstance(outputs, list | tuple) else []
    dropped: dict[Signature, int] = {}
    others: dict[Signature, int] = {}
    names: set[str] = set()
    for o in forward:
        val = o.meta.get("val") if isinstance(o, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        sig = signature(val)
        v = captured.value_of.get(o)
        if (v is not None and captured.problem.nodes[v].returned
                and plan.decisions.get(v) not in (Decision.SAVE, Decision.OFFLOAD)):
            dropped[sig] = int(optimization_hint(val.numel())) * val.element_size()
            names.add(o.name)
        else:
            others[sig] = others.get(sig, 0) + 1
    return tuple(Dropped(sig, others.get(sig, 0), nbytes) for sig, nbytes in dropped.items()), frozenset(names)


def saved_storages(joint: fx.GraphModule, saved: Sequence[str]) -> set[Any]:
    """The storages the backward reads: those of the ``saved`` nodes' values, a view
    reading its base's."""
    keys = set()
    for n in joint.graph.nodes:
        val = n.meta.get("val") if n.name in saved else None
        if isinstance(val, torch.Tensor):
            keys.add(storage_key(val.untyped_storage()))
    return keys


def _storage_of(node: Any) -> Any:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return storage_key(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def kept_returns(joint: fx.GraphModule, num_fwd_outputs: int, captured: Captured,
                 read: set[Any]) -> list[Signature]:
    """The signatures of the forward's outputs that its problem counts alive to the step's
    end (kept, not an input's) and its backward does not read (their storage not in
    ``read``: :func:`saved_storages`), one per output."""
    outputs = joint.graph.output_node().args[0]
    forward = list(outputs)[:num_fwd_outputs] if isinstance(outputs, list | tuple) else []
    sigs = []
    for o in forward:
        val = o.meta.get("val") if isinstance(o, fx.Node) else None
        v = captured.value_of.get(o) if isinstance(o, fx.Node) else None
        if (isinstance(val, torch.Tensor) and v is not None and captured.problem.nodes[v].keep
                and not captured.problem.nodes[v].resident and _storage_of(o) not in read):
            sigs.append(signature(val))
    return sigs


def freed_inputs(joint: fx.GraphModule, num_fwd_outputs: int, static: Sequence[int],
                 read: set[Any], earlier: Sequence[Signature]) -> tuple[tuple[Dropped, ...], int]:
    """The inputs of a graph that returns a loss that a caller keeping only the loss has
    freed by the time its backward runs (``Options.outputs="dropped"``): activations
    (tensors that require grad; not parameters or buffers) its backward does not read
    (their storage not in ``read``: :func:`saved_storages`), of a signature the graphs before it
    return and count alive to the step's end (``earlier``, at most as many of each). The
    graphs before count them held through every backward; this graph's backward runs
    without them. By signature, each with how many of the graph's other inputs of it may
    stay alive, as the check at the backward watches them
    (:func:`rematc.calls.outputs_kept`), and their bytes in all. None where the graph
    returns no loss."""
    if not returns_loss(joint, num_fwd_outputs):
        return (), 0
    outputs = joint.graph.output_node().args[0]
    grads = list(outputs)[num_fwd_outputs:] if isinstance(outputs, list | tuple) else []
    left = {sig: earlier.count(sig) for sig in set(earlier)}
    primals = [p for p in joint.graph.find_nodes(op="placeholder") if is_primal(p)]
    freed: dict[Signature, tuple[int, int]] = {}  # signature -> (how many, bytes of one)
    others: dict[Signature, int] = {}
    for i, p in enumerate(primals):
        val = p.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        sig = signature(val)
        needs_grad = i < len(grads) and grads[i] is not None  # the joint's gradient of it
        if (i not in static and needs_grad and val.is_floating_point() and val.dim() > 0
                and _storage_of(p) not in read and left.get(sig, 0) > 0):
            left[sig] -= 1
            count, _ = freed.get(sig, (0, 0))
            freed[sig] = (count + 1, int(optimization_hint(val.numel())) * val.element_size())
        else:
            others[sig] = others.get(sig, 0) + 1
    return (tuple(Dropped(sig, others.get(sig, 0), nbytes) for sig, (_, nbytes) in freed.items()),
            sum(count * nbytes for count, nbytes in freed.values()))


def relieve_earlier(share: BudgetShare, graph: GraphKey, freed: Sequence[Dropped]) -> None:
    """After the graph that returns the loss (``graph``) is planned: the outputs of an
    earlier graph it frees (``freed``, :func:`freed_inputs`) are gone before that graph's
    backward runs, which comes after this one's, so the earlier graph's ``own_need`` (its
    record in ``records()``) counts its backward without them. Its plan was made counting
    them: it stands, and leaves that room unused. Only where one earlier graph, of one
    call and one plan, returns the freed signature once: the bytes are then surely its."""
    relieved: dict[GraphKey, int] = {}
    for dropped in freed:
        returning = [g for g, sigs in share.returns.items() if g < graph and dropped.signature in sigs]
        if len(returning) == 1 and share.returns[returning[0]].count(dropped.signature) == 1:
            relieved[returning[0]] = relieved.get(returning[0], 0) + dropped.nbytes
    for earlier, nbytes in relieved.items():
        i = next((i for i in reversed(range(len(_RECORDS))) if _RECORDS[i].graph == earlier), None)
        if i is None:
            continue
        r = _RECORDS[i]
        if r.calls != 1 or r.solver == "mix" or r.plan is None or r.relieved:
            continue  # relieved already where the loss graph was planned again
        t = tier(r.problem, check(r.problem, r.plan))
        off = r.freed_bytes if r.held_before >= r.freed_bytes else 0

        def alone(freed_bytes: int, t: Tier = t, r: PartitionRecord = r) -> int:
            return calls_need([t], [1], grads=r.grads, freed=freed_bytes)

        lower = alone(off) - alone(off + nbytes)
        if lower > 0:
            _RECORDS[i] = replace(r, own_need=r.own_need - lower, relieved=lower)
            log.info("rematc: %s's backward runs after the loss graph freed %d B of its outputs: "
                     "its step need is %d B lower", graph_name(earlier), nbytes, lower)


def returned_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the storages ``gm`` (a Dynamo graph, before AOTAutograd) returns that none
    of its inputs owns: what its outputs hold beyond its inputs, each storage once."""
    def storage(node: Any) -> Any:
        val = node.meta.get("example_value") if isinstance(node, fx.Node) else None
        return val.untyped_storage() if isinstance(val, torch.Tensor) else None

    inputs = {storage_key(s) for n in gm.graph.find_nodes(op="placeholder") if (s := storage(n)) is not None}
    out: dict[int, int] = {}
    for node in tree_leaves(gm.graph.output_node().args):
        s = storage(node)
        if s is not None and storage_key(s) not in inputs:
            out[storage_key(s)] = int(optimization_hint(s.nbytes()))
    return sum(out.values())


def holds_after_forward(problem: Problem, report: Report) -> int:
    """Bytes a graph's plan holds when its forward ends: the saved values and the
    forward's outputs, which stay alive while later graphs of the step run."""
    return report.saved_bytes + sum(
        n.size for n in problem.nodes[: problem.n_forward] if n.keep and not n.resident)


# Plans an error stated as the smallest feasible, by problem: (the budget stated, the
# plan), so that asking for that budget gets that plan, whatever a new search would find
# in its time limit.
_IN_HAND: dict[str, tuple[int | None, Plan]] = {}
_IN_HAND_MAX = 256


def tier(problem: Problem, report: Report) -> Tier:
    """A plan of one call, as the calls of a step see it (:class:`solvers.mix.Tier`): what
    it holds after its forward, its forward's and its backward's peaks, its added time."""
    return Tier(holds=holds_after_forward(problem, report),
                forward=max(report.timeline[:problem.n_forward], default=0),
                backward=max(report.timeline[problem.n_forward:], default=0), time=report.added_time)


def keep_in_hand(problem: Problem, plan: Plan, options: Options) -> None:
    """Remember ``plan`` as the plan for ``problem`` at its budget (see :func:`plan_for`),
    in this process and in the plan cache, when there is one."""
    if len(_IN_HAND) >= _IN_HAND_MAX:
        _IN_HAND.pop(next(iter(_IN_HAND)))
    _IN_HAND[_unbudgeted_key(problem)] = (problem.budget, plan)
    root = plancache.directory(options.cache_dir)
    result = _fitting(problem, plan, "in-hand") if root is not None else None
    if root is not None and result is not None:
        plancache.store(root, plancache.key(problem, options.solver, options.compiler), result)


def in_hand(problem: Problem, *, any_budget: bool = False) -> SolveResult | None:
    """The plan kept in hand for ``problem``: for its budget, or (``any_budget``) for any
    budget, if the checker accepts it at this one."""
    entry = _IN_HAND.get(_unbudgeted_key(problem)) if _IN_HAND else None
    if entry is None or not (any_budget or entry[0] == problem.budget):
        return None
    return _fitting(problem, entry[1], "in-hand")


def forget_plans_in_hand() -> None:
    """Drop the plans kept by :func:`keep_in_hand`, the solver's stated ones
    (:func:`solvers.planner.forget_stated`) and what later graphs were found to keep
    (:func:`lasting_after`); tests start from none."""
    _IN_HAND.clear()
    _LASTING_AFTER.clear()
    planner.forget_stated()


# Bytes the later graphs of a step keep to its end (their outputs and parameters'
# gradients) while a graph's backward runs, by the graph's unbudgeted problem: found when a
# later graph is planned (BudgetShare.over_after), and off the graph's budget from then on.
_LASTING_AFTER: dict[str, int] = {}


def lasting(problem: Problem, grads: int) -> int:
    """Bytes a graph keeps to the end of the step: its forward's outputs (``keep``:
    returned, they may be held by the caller) and its parameters' gradients (``grads``)."""
    return grads + sum(node.size for node in problem.nodes[:problem.n_forward] if node.keep)


def lasting_after(problem: Problem) -> int:
    """Bytes the graphs after the one of ``problem`` keep to the end of the step, where a
    plan of the step found them (:meth:`BudgetShare.remember_lasting`); 0 otherwise."""
    return _LASTING_AFTER.get(_unbudgeted_key(problem), 0) if _LASTING_AFTER else 0


def _remember_lasting(problem: Problem, nbytes: int) -> None:
    if len(_LASTING_AFTER) >= _IN_HAND_MAX:
        _LASTING_AFTER.pop(next(iter(_LASTING_AFTER)))
    key = _unbudgeted_key(problem)
    _LASTING_AFTER[key] = max(nbytes, _LASTING_AFTER.get(key, 0))


def _unbudgeted_key(problem: Problem) -> str:
    return plancache.key(problem.with_budget(None), SolverConfig())


def _calls_key(problem: Problem, options: Options, calls: int, *, grads: int, reserve: int,
               carrying: Carrying | None = None) -> str:
    """The plan cache's key of a plan for ``calls`` calls of the graph of ``problem``
    within its budget (:meth:`RematPartitioner.room_for_calls`)."""
    moving = "" if carrying is None else f":carried={carrying.carried}x{carrying.most}@{carrying.link}"
    return plancache.derived(plancache.key(problem, options.solver, options.compiler),
                             f"calls={calls}:grads={grads}:reserve={reserve}{moving}")


class Carrying(NamedTuple):
    """A regional block's input, where its calls' plan may move it off the device
    (:class:`rematc.regions.Carry`): the last calls' inputs freed as their forwards end and
    computed again, one forward each, when the backward starts; or, over a host link, the
    first calls' inputs copied to host memory as their forwards end and back when their
    backwards start."""

    carried: int  # bytes of one call's input: its graph's one output, the next call's input
    most: int  # the most calls whose input may be moved: all but the first
    recompute: int  # bytes: one forward without autograd, at its peak
    time: float  # seconds: one forward
    link: float = 0.0  # bytes/s each way to host memory; 0: none, nothing is offloaded

    def moved_time(self, offloaded: int, recomputed: int) -> float:
        """Seconds added by moving that many calls' inputs: each offloaded one copied out
        and back over the link (not counted as overlapping anything), each recomputed
        one a forward run again."""
        copies = 2 * offloaded * self.carried / self.link if offloaded else 0.0
        return copies + recomputed * self.time


def inputs_moved(t: Tier, calls: int, room: int, *, grads: int, reserve: int,
                 carrying: Carrying | None) -> tuple[int, int]:
    """How many calls' inputs to offload and how many to recompute (in that order) so
    that ``calls`` calls of ``t`` fit ``room`` bytes (:func:`solvers.mix.need`), at the
    least time (:meth:`Carrying.moved_time`; then the fewest moved); ``(0,
    carrying.most)`` where none fit, ``(0, 0)`` without ``carrying``. The recomputed ones
    come from a kept input: with any recomputed, at most ``most - 1`` are moved."""
    if carrying is None:
        return 0, 0
    best: tuple[float, int, int, int] | None = None  # (time, moved, offloaded, recomputed)
    for recomputed in range(carrying.most + 1):
        top = 0 if not carrying.link else carrying.most - recomputed - (1 if recomputed else 0)
        for offloaded in range(max(0, top) + 1):  # need falls as more are offloaded
            if calls_need([t], [calls], grads=grads, reserve=reserve, carried=carrying.carried,
                          dropped=recomputed, recompute=carrying.recompute, offloaded=offloaded) <= room:
                key = (carrying.moved_time(offloaded, recomputed), offloaded + recomputed, offloaded, recomputed)
                best = key if best is None else min(best, key)
                break
    return (0, carrying.most) if best is None else (best[2], best[3])


class GraphBreakWarning(UserWarning):
    """The step compiled to several graphs: they share the budget and cost memory."""


class RematPartitioner(CustomPartitionerFn):
    """AOTAutograd's partition function for one compiled step.

    It is a handle: ``copy.deepcopy`` returns the same partitioner (Inductor copies its
    config, this partitioner included, and the backend reads the plan from the one that
    ran), and pickling keeps only its options, which with our sources are all its
    ``uuid()`` covers, so Inductor's FX graph cache can key on it."""

    def __init__(self, options: Options, share: BudgetShare | None = None) -> None:
        self.options = options
        self.share = share if share is not None else BudgetShare()
        # The last plan's live bytes per step and where its FX nodes run, for the buffer
        # pool's rule under a budget (rematc.reuse); None before a plan, without a budget or
        # off Inductor.
        self.room: Room | None = None
        # The saved values the last plan needs donated (rematc.donation), and its record.
        self.donations: dict[str, int] = {}
        self.record: PartitionRecord | None = None
        # Bytes taken off the budget by the post-compile check (Backend), and this graph's
        # key in the share, kept so that a re-plan of it is not taken for a new graph.
        self.squeeze = 0
        self._graph: tuple[GraphKey | None] | None = None
        # Set by the backend for a graph whose calls it can tell apart (a regional block):
        # the partitioning then also offers a mix of plans for them (``mix``, None where
        # one plan for every call is as fast); ``fixed`` makes the next partitioning emit
        # that plan instead of planning (one plan of the mix).
        self.mixes = False
        self.mix: Mixed | None = None
        self.fixed: Plan | None = None
        # Names of the forward's outputs the last plan counts as freed when the forward
        # returns (Options.outputs="dropped"): the walk of the generated code drops them too.
        self.dropped_names: frozenset[str] = frozenset()
        # Set by the backend: the indices of the graph's inputs that are leaf tensors
        # requiring grad, whose gradients (in ``.grad``) stay alive to the step's end like
        # the parameters' (:func:`kept_gradients`). Dynamo's inputs are the caller's own
        # tensors: after a graph break, a leaf such as a model input read again by a later
        # graph keeps its gradient while the earlier graphs' backwards run. Such an input
        # (not a parameter) also gets room for one more gradient of its size beside the
        # graphs: where gradients reach it from outside the compiled graph too (the step
        # returns it, which Dynamo does outside the graph, or reads it elsewhere), autograd
        # sums them into a new tensor, held from the first seed to the end of the backward
        # (512 B over a 3,712 B step, before).
        self.leaves: tuple[int, ...] = ()
        # Set by the backend for a regional block (rematc.regions.block_carry): its plan
        # may then recompute the last blocks' inputs (:class:`Carrying`) where no plan
        # fits otherwise.
        self.carry: object | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> RematPartitioner:
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"])  # type: ignore[misc]

    @property
    def honours_checkpointing(self) -> bool:
        """Whether the last plan is the model's own activation checkpointing, as it is."""
        return self.record is not None and self.record.solver == "checkpointing"

    def _amend(self, **changes: Any) -> PartitionRecord | None:
        """Replace the last plan's record (here and in ``records()``) by one with
        ``changes``; None before a plan."""
        old = self.record
        if old is None:
            return None
        new = replace(old, **changes)
        self.record = new
        for i, r in enumerate(_RECORDS):
            if r is old:
                _RECORDS[i] = new
        return new

    def generated(self, peak: CodePeak) -> None:
        """Note on the last plan's record the peak of the code Inductor generated for it
        (``rematc.generated``)."""
        aside = self.record.aside if self.record is not None else 0
        new = self._amend(generated_peak=peak.peak + aside, generated_at=peak.where,
                          generated_alive=peak.alive)
        if new is not None:
            log.info("rematc: the generated code peaks at %d B (predicted %d B, budget %s B) at %s",
                     peak.peak, new.predicted_peak, new.budget, peak.where)

    def lost_donations(self, gone: dict[str, int]) -> None:
        """Note on the last plan's record the bytes of its donations that did not come
        (``rematc.donation``)."""
        new = self._amend(undonated=sum(gone.values()))
        if new is None:
            return
        log.info("rematc: %d B of saved values the plan lets the backward write over were not "
                 "donated (%s): the peak may exceed the predicted %d B by that much",
                 new.undonated, ", ".join(sorted(gone)), new.predicted_peak)

    def least(self, problem: Problem, e: InfeasibleBudgetError, *, graph: GraphKey | None,
              held: int, asked: int | None, after: int = 0) -> tuple[Planned, Problem]:
        """What an infeasible budget leaves: under a fraction, the graph's least-peak plan
        (a fraction asks to shrink; it cannot shrink further) with one warning; under a
        byte budget, :class:`InfeasibleBudgetError` stating the smallest budget for the
        whole step, whose plans are kept in hand for when it is asked for. ``after``: the
        later graphs' gradients, taken off this graph's budget beside what is ``held``."""
        where = "" if graph is None else f"{graph_name(graph)}: "
        if self.options.calls > 1:
            where += f"{self.options.calls} calls in flight: "
        budget = self.options.budget
        if budget is None:  # no budget: nothing is infeasible
            raise e
        if budget.fraction is not None:
            if e.plan is None or e.min_feasible is None:
                raise InfeasibleBudgetError(e.budget, e.min_feasible, proven=e.proven, at_least=e.at_least,
                                            where=f"{where}{budget}: ") from e
            least = problem.with_budget(e.min_feasible)
            report = check(least, e.plan)
            full = save_all(problem).report
            assert full is not None  # no budget: saving everything always fits
            warnings.warn(
                f"rematc: {where}cannot shrink to {budget} ({e.budget} B): it runs at its "
                f"smallest feasible peak, {report.peak} B ({report.peak / max(1, full.peak):.0%} "
                "of unconstrained).", BudgetWarning, stacklevel=2)
            result = SolveResult(status=Status.FEASIBLE if not e.proven else Status.OPTIMAL,
                                 plan=e.plan, report=report, objective=report.added_time,
                                 bound=0.0, wall_time=0.0, solver=LEAST_PEAK)
            return Planned(result, cached=False), least
        assert asked is not None
        if e.min_feasible is None:
            raise InfeasibleBudgetError(asked, None, proven=e.proven, where=where) from e
        if e.plan is not None:
            keep_in_hand(problem.with_budget(e.min_feasible), e.plan, self.options)
        if not held:
            raise InfeasibleBudgetError(e.budget + after, e.min_feasible + after, proven=e.proven,
                                        at_least=None if e.at_least is None else e.at_least + after,
                                        where=where) from e
        step = self.share.smallest_step_budget(graph, e.min_feasible, self.options)
        raise InfeasibleBudgetError(asked, None if step is None else step + after, proven=False,
                                    where=f"{where}with what the earlier graphs hold: ") from e

    def room_for_calls(self, problem: Problem, calls: int, *, known: Plan | None = None,
                       reserve: int = 0, grads: int = 0,
                       carrying: Carrying | None = None) -> tuple[Planned, Problem]:
        """A plan that leaves room for ``calls`` forwards of this graph in flight and for
        the graphs after it, within ``problem.budget``: its forward's peak plus ``calls - 1``
        times what it holds after its forward; its backward's peak plus ``calls - 1`` times
        the larger of that and its parameters' gradients (``grads``, bytes); and ``calls``
        times what it holds plus ``reserve`` (what the later graphs need beside it,
        :meth:`BudgetShare.reserve_after`). Returned with the problem at the budget it was
        planned for.

        The first round plans at the whole budget, each next one at a budget smaller by
        the excess of the last, or halfway back up where no plan met that. The last
        resorts: the least-peak plan, the block checkpointed whole, and
        :func:`solvers.baselines.holding_ladder`'s plans between (a search under a peak
        finds plans that hold what one call's peak allows, and with many calls what each
        holds is what counts); the fastest that fits where a survey of the step counted
        the graphs after this one, else the one that needs least. Where none fits,
        :class:`InfeasibleBudgetError` states what the one that needs least needs, with
        the plan (kept in hand by :meth:`least`, so that asking for that budget gets it).
        The plan found, and the budget it was planned at, go to the plan cache where there
        is one, and are taken from it at the same room, calls and reserve.

        With ``carrying``, the plans' calls are counted with the calls' inputs moved off
        the device that fit at the least time (:func:`inputs_moved`), and of the last
        resorts that fit, the fastest counts the time moving them adds."""
        room = problem.budget
        assert room is not None

        def counted(report: Report) -> tuple[int, float]:
            # What the calls need: while this call's forward runs, each other one holds its
            # saved values; while its backward runs, each other one holds those (its
            # backward has not run) or its parameters' gradients (it has): the larger,
            # conservatively. And the seconds per call that moving calls' inputs off the
            # device adds (copies to host and back, forwards run again).
            t = tier(problem, report)
            if carrying is None:
                return calls_need([t], [calls], grads=grads, reserve=reserve), 0.0
            offloaded, recomputed = inputs_moved(t, calls, room, grads=grads, reserve=reserve, carrying=carrying)
            nbytes = calls_need([t], [calls], grads=grads, reserve=reserve, carried=carrying.carried,
                                dropped=recomputed, recompute=carrying.recompute, offloaded=offloaded)
            return nbytes, carrying.moved_time(offloaded, recomputed) / calls

        def needed(report: Report) -> int:
            return counted(report)[0]

        root = plancache.directory(self.options.cache_dir)
        digest = _calls_key(problem, self.options, calls, grads=grads, reserve=reserve,
                            carrying=carrying) if root is not None else ""
        if root is not None:
            at = plancache.load_note(root, plancache.derived(digest, "budget"))
            hit = plancache.load(root, digest, problem.with_budget(at)) if isinstance(at, int) else None
            if hit is not None and hit.report is not None and needed(hit.report) <= room:
                return Planned(hit, cached=True), problem.with_budget(at)

        def found(planned: Planned, at: Problem) -> tuple[Planned, Problem]:
            if root is not None and planned.result.plan is not None and at.budget is not None:
                plancache.store(root, digest, planned.result)
                plancache.store_note(root, plancache.derived(digest, "budget"), at.budget)
            return planned, at

        def excess(tried: Problem, plan: Plan) -> int:
            return needed(check(tried, plan)) - room

        # Budgets tried: one taken down by the last plan's excess, or halfway back up
        # from one no plan met to the last that gave an excess.
        tried, over_at, none_at = room, room, -1
        for _ in range(CALL_ROUNDS):
            attempt = problem.with_budget(tried)
            try:
                planned = plan_for(attempt, self.options, known=known)
            except InfeasibleBudgetError:
                none_at = tried
            else:
                assert planned.result.plan is not None
                over = excess(attempt, planned.result.plan)
                log.debug("rematc: room for %d calls: at %d B a plan peaks at %d B and holds %d B "
                          "(%d B over)", calls, tried, check(attempt, planned.result.plan).peak,
                          holds_after_forward(attempt, check(attempt, planned.result.plan)), over)
                if over <= 0:
                    return found(planned, attempt)
                over_at = tried
                tried -= over
            if tried <= none_at:
                tried = (none_at + over_at) // 2
            if tried <= none_at or tried >= over_at:
                break
        # The last resorts: the least-peak plan, the plan that holds least (every
        # recomputable value recomputed: the block checkpointed whole), and the rungs
        # between that and saving everything; the fastest that fits.
        try:  # a budget of 0 asks for the least-peak plan
            plan_for(problem.with_budget(0), self.options)
        except InfeasibleBudgetError as e:
            resorts = [e.plan] if e.plan is not None else []
        else:  # nothing is allocated at all: any plan fits
            return plan_for(problem, self.options), problem
        resorts.append(recompute_every(problem))
        # Between the two, plans that hold little more than the second and recompute less.
        resorts += holding_ladder(problem)
        judged = []  # (need, added time, peak, plan)
        for plan in resorts:
            report = check(problem.with_budget(None), plan)
            nbytes, again = counted(report)
            judged.append((nbytes, report.added_time + again, report.peak, plan))
        if not judged:
            raise InfeasibleBudgetError(room, None, proven=False)
        fitting = [j for j in judged if j[0] <= room]
        if fitting and self.share.needs:
            # The fastest of those that fit, where a survey counted the graphs after this
            # one (reserve); without one, what they keep to the step's end is not known
            # yet, and the plan that needs least leaves them the most.
            least, _, peak, plan = min(fitting, key=lambda j: (j[1], j[0]))
        else:
            least, _, peak, plan = min(judged, key=lambda j: (j[0], j[1]))
        if least <= room:
            fitted = problem.with_budget(peak + room - least)
            fits = _fitting(fitted, plan, LEAST_PEAK if plan is resorts[0] else "holding-ladder")
            assert fits is not None
            return found(Planned(fits, cached=False), fitted)
        raise InfeasibleBudgetError(room, least, proven=False, plan=plan)

    def check_earlier_backwards(self, problem: Problem, graph: GraphKey | None, keeps: int,
                                budget: int, after: int) -> None:
        """After a graph break the step's backward runs the graphs in reverse, so an
        earlier graph's backward runs beside what this graph keeps to the step's end
        (``keeps``: its outputs and parameters' gradients), which that graph's plan could
        not know of. Where that takes it over the byte ``budget``, the bytes are
        remembered for the earlier graphs (planned with them off from their next compile
        on) and :class:`InfeasibleBudgetError` states the smallest step budget found with
        them counted (``after``: what this graph's own budget had taken off)."""
        over = self.share.over_after(graph, keeps, budget)
        if over <= 0:
            return
        self.share.remember_lasting(graph, keeps)
        try:  # a budget of 0 asks for the least-peak plan; one that fits allocates nothing
            plan_for(problem.with_budget(0), self.options)
            least_peak = 0
        except InfeasibleBudgetError as e:
            least_peak = e.min_feasible or 0
        step = self.share.smallest_step_budget(graph, least_peak, self.options)
        where = "" if graph is None else f"{graph_name(graph)}: "
        raise InfeasibleBudgetError(
            budget, None if step is None else max(step + after, budget + over), proven=False,
            where=f"{where}the backward of an earlier graph runs beside the {keeps} B this one keeps "
                  f"to the step's end (its outputs and gradients), {over} B over the budget: ")

    def mixed(self, problem: Problem, calls: int, uniform: Planned, *, reserve: int = 0,
              grads: int = 0) -> Mixed | None:
        """Plans for the ``calls`` calls of this graph that together add at least
        :data:`MIX_GAIN` less time than ``uniform`` (the plan :meth:`room_for_calls` found
        for all of them) within ``problem.budget``, as :func:`solvers.mix.best_mix` mixes
        them; None where there are none. Offered: ``uniform``, saving everything, the
        least-peak plan, the plan that holds least (every recomputable value recomputed),
        and the plans for one call at budgets :data:`MIX_STEPS` of the way from the least
        peak to the unconstrained one."""
        room = problem.budget
        assert room is not None
        free = problem.with_budget(None)
        full = save_all(free)
        assert full.plan is not None and full.report is not None
        assert uniform.result.plan is not None
        plans = [uniform.result.plan, full.plan, recompute_every(problem), *holding_ladder(problem)]
        cached = uniform.cached
        least_peak = full.report.peak
        try:  # a budget of 0 asks for the least-peak plan
            plan_for(problem.with_budget(0), self.options)
        except InfeasibleBudgetError as e:
            if e.plan is not None:
                plans.append(e.plan)
                least_peak = check(free, e.plan).peak
        for step in MIX_STEPS:
            at = int(least_peak + step * (full.report.peak - least_peak))
            try:
                planned = plan_for(problem.with_budget(at), self.options)
            except (InfeasibleBudgetError, NoPlanError):
                continue
            cached = cached and planned.cached
            if planned.result.plan is not None:
                plans.append(planned.result.plan)
        unique: dict[tuple[Any, ...], Plan] = {}
        for plan in plans:
            unique.setdefault(plan.key, plan)
        offered = list(unique.values())
        tiers = [tier(problem, check(free, plan)) for plan in offered]
        best = best_mix(tiers, calls, room, grads=grads, reserve=reserve)
        if best is None or best.time >= calls * tiers[0].time * (1 - MIX_GAIN) or best.tiers == (0,):
            return None
        log.info("rematc: %s of the %d calls, %+.3g s against %+.3g s for one plan",
                 " + ".join(f"{c} x plan {i}" for i, c in zip(best.tiers, best.counts, strict=True)),
                 calls, best.time, calls * tiers[0].time)
        return Mixed(plans=tuple(offered[i] for i in best.tiers), tiers=tuple(tiers[i] for i in best.tiers),
                     counts=best.counts, room=room, grads=grads, reserve=reserve, time=best.time,
                     cached=cached)

    def carrying(self, joint: fx.GraphModule, problem: Problem, calls: int) -> Carrying | None:
        """How this graph's calls may recompute their inputs (:class:`Carrying`): a
        regional block's graph (``carry``) of several calls with one output (what the next
        block reads) and no random op (run again, it would draw anew); None otherwise."""
        if self.carry is None or calls < 2 or any(is_random(n) for n in joint.graph.nodes):
            return None
        outputs = [n for n in problem.nodes[:problem.n_forward] if n.keep and not n.resident]
        if len(outputs) != 1:
            return None
        free = problem.with_budget(None)
        forward = check(free, recompute_every(free)).timeline[:problem.n_forward]
        return Carrying(carried=outputs[0].size, most=calls - 1, recompute=max(forward, default=0),
                        time=sum(n.time for n in problem.nodes[:problem.n_forward]), link=problem.host_bandwidth)

    def uuid(self) -> str:
        # Our sources and every option that changes the plan: a cached graph is reused
        # only for the same budget, solver settings and code.
        return f"{get_hash_for_files(_SOURCES)!r}-{self.options.cache_key()}-{self.leaves}"

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOTAutograd passes ``num_fwd_outputs`` and ``static_lifetime_input_indices``
        (and ``compiler``, which we ignore)."""
        t0 = time.perf_counter()
        num_fwd_outputs: int = kwargs["num_fwd_outputs"]
        static = list(kwargs.get("static_lifetime_input_indices") or [])
        device = device_of(gm, self.options)
        joint, captured = capture_stage(gm, device, fuses=self.options.compiler == "inductor",
                                        num_fwd_outputs=num_fwd_outputs, static=static,
                                        drops_outputs=self.options.outputs == "dropped")
        unconstrained = save_all(captured.problem).report
        assert unconstrained is not None
        if self._graph is None:
            self._graph = (self.share.graph(),)
        graph = self._graph[0]
        budget, held, calls = None, 0, self.options.calls
        self.mix = None
        # The room kept for scratch no value holds (Captured.scratch), for memory outside
        # the graphs (Options.reserve) and for the sums of the leaf inputs' gradients
        # (:attr:`leaves`) is off the budget, like the later graphs' gradients
        # (``after``), and on the prediction.
        summed = kept_gradients(joint, num_fwd_outputs, (i for i in self.leaves if i not in static))
        aside = captured.scratch + self.options.reserve + summed
        grads = kept_gradients(joint, num_fwd_outputs, static) + summed
        # The plan of the model's own activation checkpointing, when it has any.
        own = plan_with(captured.problem, set(captured.checkpointed)) if captured.checkpointed else None
        if self.options.budget is not None:
            # With several calls in flight, a fraction is of the step's unconstrained peak:
            # every call's saved values and the last call's own peak.
            whole = unconstrained.peak + aside + (calls - 1) * holds_after_forward(captured.problem, unconstrained)
            budget = max(0, self.options.budget.resolve(whole) - self.squeeze)
            if self.options.budget.nbytes is not None:
                held = self.share.held_before(graph)
        # Saving everything is right at every shape; a plan under a budget is bounded.
        bounds = bound_dynamic_sizes(joint) if budget is not None else ()
        problem = captured.problem.with_budget(None if budget is None else max(0, budget - held - aside))
        after = reserve = 0
        carrying = self.carrying(joint, captured.problem, calls)
        moving: Carrying | None = None
        room_left: int | None = None
        with naming(graph_name(graph)):  # for the status line of a long plan
            try:
                if budget is None and own is not None:
                    # No budget: the model's own checkpointing is honoured as it is.
                    honoured = _fitting(problem, own, "checkpointing")
                    assert honoured is not None  # no budget: every plan fits
                    planned = Planned(honoured, cached=False)
                else:
                    if budget is not None:
                        # The later graphs' gradients come off this graph's room (they are
                        # alive while its backward runs). The reserve counts them too, at
                        # the later graphs' own backwards, so they come off it as well:
                        # the two are not alive at once beside this graph's saved values.
                        after = self.share.gradients_after(graph)
                        reserve = max(0, self.share.reserve_after(graph) - after)
                    if budget is not None and self.options.budget.nbytes is not None:  # type: ignore[union-attr]
                        after += lasting_after(captured.problem)
                    if after and problem.budget is not None:
                        # The later graphs' gradients are alive while this backward runs.
                        problem = problem.with_budget(max(0, problem.budget - after))
                    if self.fixed is not None and problem.budget is not None:
                        fixed = _fitting(problem, self.fixed, "mix")
                        assert fixed is not None, "a plan of a mix fits one call's room"
                        planned = Planned(fixed, cached=False)
                    elif (calls > 1 or reserve) and problem.budget is not None:
                        room, room_left = problem, problem.budget
                        try:
                            planned, problem = self.room_for_calls(problem, calls, known=own, reserve=reserve,
                                                                   grads=grads)
                        except InfeasibleBudgetError:
                            if carrying is None or budget is None:
                                raise
                            # No plan fits with every block's input held: recompute the
                            # last ones' (rematc.regions.Carry).
                            planned, problem = self.room_for_calls(room, calls, known=own, reserve=reserve,
                                                                   grads=grads, carrying=carrying)
                            moving = carrying
                        if self.mixes and calls > 1 and planned.result.plan is not None and moving is None:
                            self.mix = self.mixed(room, calls, planned, reserve=reserve,
                                                  grads=grads)
                    else:
                        planned = plan_for(problem, self.options, known=own)
            except InfeasibleBudgetError as e:
                planned, problem = self.least(captured.problem, e, graph=graph, held=held, asked=budget,
                                              after=after + aside)
        result = planned.result
        assert result.plan is not None
        report = check(problem, result.plan)
        if not report.fits:
            raise AssertionError(f"plan peaks at {report.peak} B over budget {problem.budget} B")
        holds = holds_after_forward(problem, report)
        mix = self.mix
        offloaded = recomputed = 0
        if moving is not None and room_left is not None:
            offloaded, recomputed = inputs_moved(tier(problem, report), calls, room_left, grads=grads,
                                                 reserve=reserve, carrying=moving)
            log.info("rematc: of %d blocks' inputs (%d B each), %d are offloaded to host memory (the "
                     "2nd on) and the last %d recomputed from an earlier one's", calls, moving.carried,
                     offloaded, recomputed)
        carried = moving.carried if moving is not None else 0
        dropped, self.dropped_names = freed_outputs(joint, num_fwd_outputs, captured, result.plan)
        emitted = emit(joint, captured, result.plan, num_fwd_outputs=num_fwd_outputs,
                       static_lifetime_input_indices=static)
        if self.options.verify:
            verify(joint, captured, result.plan, emitted)
        read = saved_storages(joint, emitted.saved)

        # Under outputs="dropped", the earlier graphs' outputs a loss graph reads and does not
        # save are gone once the model's forward returns: off what the step holds in its
        # backward (the earlier graphs count them held to the step's end). Not off what it
        # holds while later graphs' forwards run: the model's frame may still hold them.
        freed: tuple[Dropped, ...] = ()
        freed_bytes = 0
        if self.options.outputs == "dropped" and calls == 1 and mix is None and moving is None:
            freed, freed_bytes = freed_inputs(joint, num_fwd_outputs, static, read,
                                              self.share.returned_earlier(graph))
        if budget is not None and held < freed_bytes:
            # not among the earlier graphs' holds this graph's budget counted: nothing to
            # take them off
            freed, freed_bytes = (), 0
        off = freed_bytes if held >= freed_bytes else 0  # off each backward of solvers.mix.need

        def calls_with(later: int) -> int:  # what the calls need with ``later`` for the later graphs
            return (calls_need(list(mix.tiers), list(mix.counts), grads=mix.grads, reserve=later)
                    if mix is not None else
                    calls_need([tier(problem, report)], [calls], grads=grads, reserve=later, carried=carried,
                               dropped=recomputed, offloaded=offloaded,
                               recompute=moving.recompute if moving is not None else 0, freed=off))

        need, alone = calls_with(mix.reserve if mix is not None else reserve), calls_with(0)
        if graph is not None:
            self.share.returns[graph] = kept_returns(joint, num_fwd_outputs, captured, read)
        keeps = lasting(captured.problem, grads) * calls
        if budget is not None and self.options.budget.nbytes is not None and not self.share.needs:  # type: ignore[union-attr]
            self.check_earlier_backwards(captured.problem, graph, keeps, budget, after + aside)
        backward = max(report.timeline[problem.n_forward:], default=0)
        self.share.record(graph, holds * calls - (recomputed + offloaded) * carried, captured.problem,  # every call's
                          backward_peak=held - min(held, freed_bytes) + backward + aside
                          + (calls - 1) * max(holds, grads),
                          lasting=keeps)
        if self.options.compiler == "inductor":  # only Inductor's buffer pool reads it
            self.room = room_of(problem, result.plan, report.timeline,
                                [[n.name for n in group] for group in captured.groups])
            self.donations = expected_donations(problem, result.plan)
        checkpointed = own.of(Decision.RECOMPUTE) if own is not None else ()
        overrides = tuple(problem.nodes[v].name for v in checkpointed
                          if result.plan.decisions.get(v) in (Decision.SAVE, Decision.OFFLOAD))
        if overrides:
            log.info("rematc: the plan keeps %d of the %d values the model's checkpointing "
                     "recomputes (%s)", len(overrides), len(checkpointed), ", ".join(overrides[:8]))
        record = PartitionRecord(
            joint_nodes=len(joint.graph.nodes), values=len(problem.nodes),
            candidates=len(problem.candidates),
            budget=None if problem.budget is None else problem.budget + aside,
            budget_origin=self.options.budget_origin,
            unconstrained_peak=unconstrained.peak + aside, predicted_peak=report.peak + aside,
            added_time=report.added_time, added_flops=report.added_flops,
            status=result.status.value, gap=result.gap, solve_time=result.wall_time,
            partition_time=time.perf_counter() - t0, saved=emitted.saved,
            recomputed=emitted.recomputed, again=emitted.again, problem=problem, plan=result.plan,
            solver=result.solver, cached=planned.cached, graph=graph, held_before=held,
            holds=holds, size_bounds=bounds, calls=calls, grads=grads,
            step_budget=None if budget is None else budget + self.squeeze, step_need=held + after + aside + need,
            own_need=held + after + aside + alone,
            checkpointed=len(checkpointed), overrides=overrides, squeezed=self.squeeze, aside=aside,
            dropped=dropped, freed=freed, freed_bytes=freed_bytes, inputs_recomputed=recomputed,
            inputs_offloaded=offloaded,
            carried=0 if carrying is None else carrying.carried,
        )
        _RECORDS.append(record)
        self.record = record
        if freed and graph is not None:
            relieve_earlier(self.share, graph, freed)
        log.info("rematc: %d values, budget %s B, predicted peak %d B (unconstrained %d B), "
                 "+%.3g s, %s by %s%s in %.2f s", record.values, problem.budget, report.peak,
                 unconstrained.peak, report.added_time, record.status, record.solver,
                 " (cached)" if planned.cached else "", record.solve_time)
        return emitted.forward, emitted.backward


def capture_stage(gm: fx.GraphModule, device: DeviceProfile, *, fuses: bool,
                  num_fwd_outputs: int, static: Sequence[int],
                  name: str = "joint", drops_outputs: bool = False) -> tuple[fx.GraphModule, Captured]:
    """prepare -> annotate -> capture: the joint graph as planned, and its problem.

    ``fuses``: the emitted graphs go to Inductor (pointwise ops fuse into their readers,
    matmuls into the adds that read them). ``drops_outputs``: the caller keeps only the
    loss (``Options.outputs``)."""
    joint = prepare(gm)
    if fuses:
        place_addmm_operands(joint)
    return joint, capture_prepared(joint, device, fuses=fuses, num_fwd_outputs=num_fwd_outputs,
                                   static=static, name=name, drops_outputs=drops_outputs)


def capture_prepared(joint: fx.GraphModule, device: DeviceProfile, *, fuses: bool,
                     num_fwd_outputs: int, static: Sequence[int], name: str = "joint",
                     drops_outputs: bool = False) -> Captured:
    """annotate -> capture of a joint graph :func:`capture_stage` has prepared: its costs
    and problem at the sizes its symbols stand at now (see
    :func:`rematc._torch_compat.sizes_at`)."""
    shape_env = shape_env_of(joint)
    # Costs and layout checks are at the size hints: reading a symbolic size must not guard
    # the graph to this one shape (bound_dynamic_sizes says which shapes a plan serves).
    with shape_env.suppress_guards() if shape_env is not None else nullcontext():
        costs = annotate(joint, device, fuses=fuses)
        if fuses:
            split_shared_pointwise(joint, costs, num_fwd_outputs=num_fwd_outputs,
                                   static_lifetime_input_indices=static)
        captured = capture(joint, costs, num_fwd_outputs=num_fwd_outputs,
                           static_lifetime_input_indices=static,
                           host_bandwidth=device.host_bandwidth, name=name, inductor=fuses,
                           drops_outputs=drops_outputs)
        scratch = transient_scratch(list(joint.graph.nodes), scalars=not fuses)
    warn_fallback_costs(costs, joint)
    return replace(captured, scratch=scratch) if scratch else captured


def prepare(gm: fx.GraphModule) -> fx.GraphModule:
    """Dead-code elimination and CSE first (so the plan is made on the graph we emit and
    no later CSE can merge a recomputation away), then PyTorch's own must-save marks."""
    gm.graph.eliminate_dead_code()
    gm.graph = fx_graph_cse(gm.graph)
    gm.recompile()
    force_save_collectives(gm)
    force_save_effectful_ops(gm)
    force_save_bw_mutation_src(gm)
    return gm


class Planned(NamedTuple):
    result: SolveResult  # status FEASIBLE or OPTIMAL, with a plan
    cached: bool  # read from the plan cache


def plan_for(problem: Problem, options: Options, *, known: Plan | None = None) -> Planned:
    """The plan for ``problem``, the first of: a cached or in-hand plan the checker accepts
    (a budget the cache keeps as infeasible raises as its search did, without one);
    under Inductor, the least-peak plan over free recomputations where it fits; saving
    everything where it fits; CP-SAT's; the greedy plan, one in hand or ``known``, with a
    :class:`SolverFallbackWarning`. Raises :class:`NoPlanError` with none,
    :class:`SolverError` for a fault inside a search and :class:`InfeasibleBudgetError` as
    it is. See docs/reliability.md, "Solver faults"."""
    root = plancache.directory(options.cache_dir)
    digest = plancache.key(problem, options.solver, options.compiler) if root is not None else ""
    if root is not None:
        hit = plancache.load(root, digest, problem)
        if hit is not None:
            return Planned(hit, cached=True)
        refused = plancache.load_refusal(root, digest, problem)
        if refused is not None:  # as after the search that found it (below), without the search
            kept = in_hand(problem, any_budget=True) or _fitting(problem, known, "checkpointing")
            if kept is None:
                raise refused
            return Planned(kept, cached=False)
    kept = in_hand(problem)
    if kept is not None:
        return Planned(kept, cached=False)
    if options.compiler == "inductor" and _free_may_fit(problem):
        # Under Inductor a recomputed pointwise op fuses into its reader, so recomputing
        # those is nearly free. A budget that plan meets changes nothing: the least-time
        # plan for a loose budget peaks higher and runs no faster (docs/memory-model.md,
        # "Without a budget").
        free = _searching(least_peak_free, problem, options)
        if problem.budget is None or free.plan is not None:
            if root is not None:
                plancache.store(root, digest, free)
            return Planned(free, cached=False)
    unconstrained = save_all(problem)
    if unconstrained.plan is not None:
        return Planned(unconstrained, cached=False)
    if problem.single_phase and problem.budget is not None and unconstrained.report is not None:
        # No backward to recompute in: emission recomputes forward values in the backward
        # only, so the forward's own peak is the least this graph can do.
        raise InfeasibleBudgetError(problem.budget, unconstrained.report.peak,
                                    plan=save_all(problem.with_budget(None)).plan)
    try:
        result = _searching(solve, problem, options)
    except InfeasibleBudgetError as e:
        # A search in its time limit may state a worse least peak than a plan stated
        # before, in hand: that plan fits, so the budget is not infeasible.
        kept = in_hand(problem, any_budget=True) or _fitting(problem, known, "checkpointing")
        if kept is None:
            if root is not None:
                plancache.store_refusal(root, digest, e)
            raise
        log.info("rematc: %s; using the plan in hand that peaks at %d B", e, kept.report.peak)  # type: ignore[union-attr]
        return Planned(kept, cached=False)
    if result.plan is not None:
        if root is not None:
            plancache.store(root, digest, result)
        return Planned(result, cached=False)
    # The solver is CP-SAT unless replaced (the benchmark's knapsack baseline): name it.
    who = "CP-SAT" if result.solver.startswith("cpsat") else f"the {result.solver or 'solver'}"
    # A search that ran out of time may find a plan with more; a baseline that found none
    # (the benchmark's knapsack: status infeasible) will not.
    timed_out = result.status is Status.UNKNOWN
    limit = f" in its time limit of {options.solver.time_limit:g} s" if timed_out else ""
    fallback = _fitting(problem, greedy(problem, options.solver).plan, "greedy")
    fallback = fallback or in_hand(problem, any_budget=True) or _fitting(problem, known, "checkpointing")
    if fallback is None and timed_out:
        # The minimum-peak search finds a plan where the time objective gives CP-SAT no
        # lead; above the budget, its peak is the smallest budget found (not proven).
        low = _searching(min_feasible_peak, problem.with_budget(None), options)
        if low.plan is not None and low.report is not None:
            fallback = _fitting(problem, low.plan, low.solver)
            if fallback is None:
                raise InfeasibleBudgetError(problem.budget or 0, low.report.peak,
                                            proven=low.status is Status.OPTIMAL, plan=low.plan)
    if fallback is not None:
        warnings.warn(
            f"rematc: {who} found no plan within the budget{limit} (status {result.status.value}); "
            f"using the {fallback.solver} plan, which fits the budget but may recompute more."
            + (" Raise the option 'time_limit' for a better plan." if timed_out else ""),
            SolverFallbackWarning,
            stacklevel=2,
        )
        return Planned(_with_bound(fallback, result.bound), cached=False)
    raise NoPlanError(
        "solve",
        f"{who} found no plan within the budget of {problem.budget} B{limit} (status {result.status.value}), "
        "and neither did the greedy fallback nor the minimum-peak search. "
        + ("Raise the option 'time_limit', or the budget." if timed_out else "Raise the budget."),
    )


def _fitting(problem: Problem, plan: Plan | None, solver: str) -> SolveResult | None:
    """``plan`` (made by ``solver``) as a result, when it is given and fits the budget."""
    if plan is None:
        return None
    report = check(problem, plan)
    if not report.fits:
        return None
    return SolveResult(status=Status.FEASIBLE, plan=plan, report=report,
                       objective=report.added_time, bound=0.0, wall_time=0.0, solver=solver)


def _free_may_fit(problem: Problem) -> bool:
    """Whether a plan recomputing only free values may fit the budget: the bytes live
    whatever such a plan decides stay within it (skips a search that cannot succeed). Not
    without a backward, where emission recomputes nothing."""
    if problem.single_phase:
        return False
    if problem.budget is None:
        return True
    return floor(only_free(problem, free_values(problem))) <= problem.budget


def _searching(search: Callable[[Problem, SolverConfig], SolveResult], problem: Problem,
               options: Options) -> SolveResult:
    """``search(problem, options.solver)``, with a status line while it runs long
    (:mod:`rematc.status`); an exception other than an infeasible budget (an answer) comes
    out as :class:`SolverError`."""
    try:
        with planning(len(problem.candidates), options.solver.time_limit):
            return search(problem, options.solver)
    except InfeasibleBudgetError:
        raise
    except Exception as e:
        raise SolverError(
            "solve",
            f"the solver raised {type(e).__name__}: {e} (problem {problem.name!r}, "
            f"{len(problem.nodes)} values, budget {problem.budget} B). The model was not "
            "compiled. Please report it with the problem file (rematc solve --dump-dir).",
        ) from e


class SolverFallbackWarning(UserWarning):
    """CP-SAT timed out without a plan; the greedy plan is used instead."""


def _with_bound(result: SolveResult, bound: float) -> SolveResult:
    """``result`` with CP-SAT's lower bound, so that its gap is meaningful."""
    return replace(result, bound=min(max(bound, 0.0), result.objective))


def shape_env_of(gm: fx.GraphModule) -> ShapeEnv | None:
    """The ShapeEnv of a graph traced with symbolic sizes, else None."""
    for n in gm.graph.find_nodes(op="placeholder"):
        for s in _symints(n.meta.get("val")):
            return s.node.shape_env
    return None


def bound_dynamic_sizes(gm: fx.GraphModule) -> tuple[str, ...]:
    """Guard every symbolic input size to at most its size hint; return the guards.

    A plan is solved for the hints. Every size in the graph is a product of input
    sizes, so a fixed plan's peak can only grow with them: the plan keeps within its
    budget for every shape up to the hint. A larger shape fails the guard, Dynamo
    recompiles and the plan is solved again for it (and cached under its own key).
    Unbacked sizes (data-dependent) have no hint to bound by; they are left alone and
    logged.
    """
    bounds: dict[str, None] = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        for s in _symints(n.meta.get("val")):
            if free_unbacked_symbols(s):
                log.warning("rematc: input %s has a data-dependent size %s; the plan is "
                            "solved for its hint and not bounded", n.name, s)
                continue
            hint = int(optimization_hint(s))
            text = f"{s.node.expr} <= {hint}"
            if text not in bounds and bool(s <= hint):  # bool(): installs the guard
                bounds[text] = None
    return tuple(bounds)


def _symints(val: Any) -> Iterator[torch.SymInt]:
    if isinstance(val, torch.SymInt):
        if val.node.expr.free_symbols:
            yield val
    elif isinstance(val, torch.Tensor):
        for d in val.shape:
            yield from _symints(d)


def warn_fallback_costs(costs: dict[fx.Node, NodeCost], gm: fx.GraphModule) -> None:
    """Log (once per op and process) ops outside aten/prims: their FLOPs are unknown, so
    they are costed by the bytes they move, which may underrate a compute-heavy op."""
    for node, cost in costs.items():
        target = node.target
        if not isinstance(target, OpOverload) or target.namespace in _KNOWN_NAMESPACES:
            continue
        name = str(target)
        if name not in _FALLBACK_LOGGED and cost.flops_source.startswith("none"):
            _FALLBACK_LOGGED.add(name)
            log.warning("rematc: no cost formula for %s (%s); costed by the %d bytes it moves "
                        "(a compute-heavy op will look cheap to recompute)",
                        name, node.format_node(), cost.bytes_moved)


_KNOWN_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional"})
_FALLBACK_LOGGED: set[str] = set()


def device_of(gm: fx.GraphModule, options: Options) -> DeviceProfile:
    """The configured profile, else a guess from the device of the graph's inputs; the
    option ``host_bandwidth`` overrides the profile's host link."""
    profile = profile_for(options.device)
    for n in gm.graph.find_nodes(op="placeholder"):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            kind = val.device.type
            name = torch.cuda.get_device_name(val.device) if kind == "cuda" else ""
            profile = profile_for(options.device, device_type=kind, device_name=name)
            break
    if options.host_bandwidth is not None:
        profile = replace(profile, host_bandwidth=float(options.host_bandwidth))
    return profile
