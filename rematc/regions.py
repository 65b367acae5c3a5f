"""Regional compilation: a model's repeated blocks compiled once, the step planned whole.

``rematc.compile(model, regions=True)`` finds the model's repeated blocks (the largest
``nn.ModuleList`` of two or more modules of one class, as accelerate's
``compile_regions`` and torchtitan do) and marks each block's ``forward`` so that Dynamo
compiles the model around the blocks and each block on its own: one graph, compiled
once and run for every block, instead of N copies of it inside one graph.

Every graph goes to one :class:`rematc.backend.Backend`, so they share one budget in
execution order (:class:`rematc.partition.BudgetShare`). A block's graph is compiled
while a marked block runs, and :func:`block_calls` then says how many blocks there are:
its plan leaves room for that many calls in flight (``Options.calls``), since every
block keeps its saved values until its backward. The other graphs run once. Each block
knows its index while it runs (:func:`block_index`), so the blocks may run different plans
of their graph (:meth:`rematc.partition.RematPartitioner.mixed`).

Block inputs recomputed. Each block's input is the block before's output, held from its
forward to its backward: N inputs beside whatever the model does after the blocks (a
loss head). Where no plan of the block fits that, the plan may recompute the last blocks'
inputs (:class:`Carry`): their forwards free them as they end (the block's graph saves a
stand-in), and when the backward first needs one, the blocks from the last kept input on
run forward again, eagerly and without autograd, and give them back, all at once. Every
input is then held through the backward as before; between the forwards and the backward
(the loss head) the last blocks' inputs are not. Blocks that draw random numbers are
never planned so.

Block inputs offloaded. Over a host link the plan may instead copy the inputs of blocks 1
to ``offloaded`` to host memory as their forwards end (the copy waited for as the block's
forward ends, so the input may go) and back when their backwards read them, the copy
back of the block before's input started as a block's comes back. The recomputed inputs
(the last blocks') come from a kept one, which no offloaded block follows.

transformers' check for packed sequences runs eagerly in a regional step
(:func:`packed_check_eager`): the model around the blocks then builds no explicit causal
mask, as it builds none eagerly.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import gc
import hashlib
import json
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
from torch import nn

from rematc import plancache
from rematc._torch_compat import (
    StorageWeakRef,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    skip_frame_only,
    storage_key,
    tree_leaves,
    tree_map,
)
from rematc.offload import OFFLOAD, RELOAD, WAIT
from rematc.onmeta import flash_attention, losses_written_out, none_packed, packed_check_replaced
from rematc.options import Options
from rematc.partition import BudgetShare, Need, tier
from solvers import InfeasibleBudgetError, Plan, Problem, check
from solvers.baselines import holding_ladder, recompute_every
from solvers.mix import need

__all__ = [
    "CarriedInputError",
    "Carry",
    "block_calls",
    "block_carry",
    "block_index",
    "cached_survey",
    "forget_surveys",
    "mark_regions",
    "packed_check_eager",
    "repeated_blocks",
    "survey",
    "within_packed_check_eager",
]

# The index of the block running now, how many blocks there are and what they carry;
# None outside a marked block.
_BLOCK: contextvars.ContextVar[tuple[int, int, Carry] | None] = contextvars.ContextVar("rematc_block", default=None)
# The attribute a marked block keeps its own forward under.
_MARK = "_rematc_region_forward"
# Compiles a model's meta twin regionally with rematc's backend: the compiled twin and
# that backend's budget share.
CompileTwin = Callable[[nn.Module, Options], tuple[Callable[..., Any], BudgetShare]]


def repeated_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The qualified name and the list of ``model``'s repeated blocks: of the
    ``nn.ModuleList``s whose two or more children are all of one class, the one holding
    the most parameters (a transformer's layers rather than a list of heads); None where
    there is none."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    return None if best is None else (best[1], best[2])


def mark_regions(model: nn.Module) -> tuple[str, int]:
    """Mark ``model``'s repeated blocks (:func:`repeated_blocks`) for regional
    compilation, in place: each block's ``forward`` becomes a wrapper that Dynamo does not
    trace (the model's graph breaks there) and that runs the block's own ``forward``,
    which Dynamo then compiles once for all blocks. Marking twice changes nothing.
    Returns the blocks' name and count; ``ValueError`` where the model has none."""
    found = repeated_blocks(model)
    if found is None:
        raise ValueError(
            f"regions=True: {type(model).__name__} has no nn.ModuleList of two or more blocks of one "
            "class to compile on their own; compile it whole (regions=False)")
    name, blocks = found
    carry = Carry(len(blocks))
    for index, block in enumerate(blocks):
        if _MARK not in vars(block):
            own = block.forward
            setattr(block, _MARK, own)
            block.forward = _marked(own, index, carry)
    return name, len(blocks)


def _marked(forward: Callable[..., Any], index: int, carry: Carry) -> Callable[..., Any]:
    carry.forwards[index] = forward
    # Every Python frame ``region`` calls is compiled unless disabled: the bookkeeping is.
    after = torch.compiler.disable(functools.partial(carry.after, index), recursive=True)

    @functools.wraps(forward)
    def region(*args: Any, **kwargs: Any) -> Any:
        token = _BLOCK.set((index, carry.blocks, carry))
        try:
            out = forward(*args, **kwargs)
            after(args, kwargs, out)
            return out
        finally:
            _BLOCK.reset(token)

    # Not traced by the model's compile, but what it calls is: the block's own forward,
    # compiled by the same backend as a graph of its own. Dynamo is told once, for the
    # code of every block's ``region``, to run it untraced, rather than asked per call.
    skip_frame_only(region.__code__)  # type: ignore[attr-defined]  # functools.wraps hides it from mypy
    return torch.compiler.disable(region, recursive=False)


class CarriedInputError(RuntimeError):
    """A regional step whose plan recomputes the last blocks' inputs
    (:class:`Carry`) cannot: a block's input is not the block before's output, or an
    input is still held elsewhere when the backward starts (its bytes are not freed)."""


class _Box:
    """One recomputed block input, shared by the stand-ins of its block's saved values."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


class _Host(_Box):
    """One offloaded block input: its device tensor until the copy to host is waited for
    (the end of its block's forward), the host copy until it comes back, and the copy
    back on its way (started by the backward of the block after) until it is waited for."""

    __slots__ = ("back", "device", "host", "index", "source")

    def __init__(self, index: int, source: torch.Tensor) -> None:
        super().__init__()
        self.index = index
        self.source: torch.Tensor | None = source
        self.device = source.device
        self.host: torch.Tensor | None = None
        self.back: torch.Tensor | None = None

    def start_back(self) -> None:
        """Start copying the input back to its device (once)."""
        if self.value is None and self.back is None and self.host is not None:
            self.back = RELOAD(self.host, self.device)

    def returned(self) -> torch.Tensor:
        """The input back on its device, waited for; the host copy let go."""
        if self.value is None:
            self.start_back()
            assert self.back is not None and self.host is not None, "offloaded, then read back once"
            self.value = WAIT(self.back, self.host)
            self.back = self.host = None
        return self.value


class _StandIn:
    """What a block's graph saves in place of its input, or of a view of it: the box the
    input comes back in, and the view's size, stride and offset (None: the input itself)."""

    __slots__ = ("box", "view")

    def __init__(self, box: _Box, view: tuple[Any, ...] | None) -> None:
        self.box, self.view = box, view


@dataclasses.dataclass(eq=False)
class Carry:
    """What the blocks of one list carry from one to the next: each block's input (its
    first tensor argument) is the output of the block before. A plan may recompute the
    inputs of the last ``recomputed`` blocks (``PartitionRecord.inputs_recomputed``; each
    compiled graph of the block sets it as it runs, :meth:`moving`): each such
    block's graph then saves a stand-in for its input (saved-tensor hooks around the
    graph's call), so the input is freed when the forward ends, and the
    first time the backward reads a stand-in, the blocks from the last kept input on run
    forward again (their own ``forward``, eagerly, without autograd, in the autocast
    state of their first run) and every stand-in gets its input back. A plan may also
    offload the inputs of blocks 1 to ``offloaded``: their stand-ins hold host copies, and
    each comes back when its block's backward first reads it (module docstring)."""

    blocks: int
    forwards: dict[int, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    eager: dict[int, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    recomputed: int = 0
    offloaded: int = 0
    # This step's: each block's output's storage (to check the chain), the last kept
    # block input, the calls to run again (arguments without the input), the boxes of the
    # recomputed inputs, and weak references to the inputs freed.
    outputs: dict[int, int] = dataclasses.field(default_factory=dict)
    anchor: torch.Tensor | None = None
    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any], Any, tuple[Any, ...]]] = dataclasses.field(
        default_factory=dict)
    boxes: dict[int, _Box] = dataclasses.field(default_factory=dict)
    freed: dict[int, tuple[StorageWeakRef, int]] = dataclasses.field(default_factory=dict)
    # This step's offloaded inputs, by block.
    hosts: dict[int, _Host] = dataclasses.field(default_factory=dict)

    @property
    def first(self) -> int:
        """The first block whose input is recomputed (``blocks`` where none is)."""
        return self.blocks - self.recomputed

    def moving(self, compiled: Callable[..., Any], recomputed: int, offloaded: int = 0) -> Callable[..., Any]:
        """``compiled`` (a block's graph, whose plan recomputes the inputs of the last
        ``recomputed`` blocks and offloads those of blocks 1 to ``offloaded``) as each
        block calls it: it sets how many are moved (each graph its own: a block
        recompiled for new shapes may have another plan), and where this block's input is
        one of them, saves a stand-in for it."""
        assert not (recomputed and offloaded) or offloaded < self.blocks - recomputed - 1, \
            "the recomputed come from a kept input"

        @functools.wraps(compiled)  # the calling convention Dynamo reads
        def call(*args: Any) -> Any:
            index = block_index()
            self.recomputed, self.offloaded = recomputed, offloaded
            hooks = None if index is None else self._hooks(index, args)
            if hooks is None:
                return compiled(*args)
            push_saved_tensors_hooks(*hooks)
            try:
                return compiled(*args)
            finally:
                pop_saved_tensors_hooks()

        return call

    def _offloads(self, index: int) -> bool:
        return 1 <= index <= self.offloaded

    def _hooks(self, index: int, args: tuple[Any, ...]) -> tuple[Any, Any] | None:
        """Where block ``index``'s input is recomputed or offloaded, the saved-tensor hooks
        (pack, unpack) that save a stand-in for it (found among ``args``, the graph's
        inputs, as the block before's output); None otherwise."""
        if not self._offloads(index) and (not self.recomputed or index < self.first):
            return None
        before = self.outputs.get(index - 1)
        x = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor)
                  and storage_key(t.untyped_storage()) == before), None)
        if x is None:
            raise CarriedInputError(
                f"rematc: the plan recomputes block {index}'s input from the block before's output, "
                f"but the block does not read that output (the model changes it between the "
                f"blocks); compile with a larger budget, or the model whole (regions=False)")
        if x.untyped_storage().nbytes() != x.nbytes or not x.is_contiguous():
            raise CarriedInputError(
                f"rematc: block {index}'s input is a view of a larger storage, which the plan cannot "
                f"free and recompute; compile with a larger budget, or the model whole (regions=False)")
        box: _Box
        if self._offloads(index):
            box = self.hosts.setdefault(index, _Host(index, x))
        else:
            box = self.boxes.setdefault(index, _Box())
        self.freed[index] = (StorageWeakRef(x.untyped_storage()), x.nbytes)
        # The hooks outlive the forward (autograd keeps the pack hook with what it saved):
        # they know the input by its storage, not by a reference that would keep it alive.
        within = (x.device, storage_key(x.untyped_storage()), tuple(x.shape), tuple(x.stride()))
        return functools.partial(self._pack, within, box), self._unpack

    def after(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """After block ``index``'s forward: note its output, and where the blocks from it
        on run again to recompute inputs, its call (read now: the plan is made while block
        0's forward compiles)."""
        if index == 0:  # a new step: the last one's inputs are given back or gone
            self.outputs.clear()
            self.calls.clear()
            self.boxes.clear()
            self.freed.clear()
            self.hosts.clear()
            self.anchor = None
        host = self.hosts.get(index)
        if host is not None and host.source is not None:
            # The copy out is waited for as the block's forward ends: then its input may go.
            if host.host is not None:
                host.host = WAIT(host.host, host.source)
            host.source = None
        spot, x = _carried(args, kwargs)
        if self.recomputed and index >= self.first and (
                x is None or storage_key(x.untyped_storage()) != self.outputs.get(index - 1)):
            raise CarriedInputError(
                f"rematc: the plan recomputes block {index}'s input by running the blocks before "
                f"it again, but its first tensor argument is not the block before's output; compile "
                f"with a larger budget, or the model whole (regions=False)")
        y = _first_tensor(out)
        if y is not None:
            self.outputs[index] = storage_key(y.untyped_storage())
        if self.recomputed and x is not None and self.first - 1 <= index < self.blocks - 1:
            if index == self.first - 1:
                self.anchor = x
            self.calls[index] = (*_without(args, kwargs, spot), spot, _autocast_state())

    def _pack(self, within: tuple[Any, ...], box: _Box, t: torch.Tensor) -> Any:
        device, key, shape, stride = within
        if t.device != device or storage_key(t.untyped_storage()) != key:
            return t
        view = None if (tuple(t.shape) == shape and tuple(t.stride()) == stride and t.storage_offset() == 0) else (
            tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if isinstance(box, _Host) and box.host is None and box.source is not None:
            box.host = OFFLOAD(box.source)  # the whole input: a view's stride reads into it
        return _StandIn(box, view)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _StandIn):
            return saved
        box = saved.box
        if isinstance(box, _Host):
            first = box.value is None
            if first:
                self._none_held(box.index, "offloads to host memory")
            value = box.returned()
            if first:
                self.hosts.pop(box.index, None)  # held on by its stand-ins alone
                before = self.hosts.get(box.index - 1)
                if before is not None:  # its backward runs next: its input on its way back
                    before.start_back()
        else:
            if box.value is None:
                self._recompute()
            back = box.value
            assert back is not None, "every recomputed input is given back at once"
            value = back
        return value if saved.view is None else value.as_strided(*saved.view)

    def _none_held(self, index: int, how: str) -> None:
        """Raise :class:`CarriedInputError` where an input the plan counts as freed, of
        block ``index`` and every later one, is still held."""
        def held() -> list[tuple[int, int]]:
            return [(i, nbytes) for i, (ref, nbytes) in sorted(self.freed.items())
                    if i >= index and not ref.expired()]
        if held():
            gc.collect()
        still = held()
        if still:
            raise CarriedInputError(
                f"rematc: the plan {how} the inputs of blocks {sorted(self.freed)[0]}-{max(self.freed)} to fit "
                f"the budget, but {len(still)} of them ({sum(n for _, n in still)} B, block {still[0][0]} the "
                f"first) are still held when the backward starts: something else keeps them (a forward hook, "
                f"a list of the hidden states); compile with a larger budget")

    def _recompute(self) -> None:
        """Run the blocks from the last kept input on again and fill every box."""
        self._none_held(0, "recomputes" if not self.hosts else "recomputes or offloads")
        if self.anchor is None:
            raise CarriedInputError("rematc: a block input to recompute from was not kept: the step ran "
                                    "its blocks out of order")
        x = self.anchor.detach()
        with torch.no_grad():
            for index in range(self.first - 1, self.blocks - 1):
                args, kwargs, spot, autocast = self.calls[index]
                with _autocast(autocast):
                    args, kwargs = _with(args, kwargs, spot, x)
                    out = self._eager(index)(*args, **kwargs)
                y = _first_tensor(out)
                assert y is not None
                x = y.detach()
                box = self.boxes.get(index + 1)
                if box is not None:
                    box.value = x
        self.anchor = None
        self.calls.clear()
        self.boxes.clear()

    def _eager(self, index: int) -> Callable[..., Any]:
        """Block ``index``'s own forward, run eagerly (outside Dynamo)."""
        if index not in self.eager:
            self.eager[index] = torch.compiler.disable(self.forwards[index], recursive=True)
        return self.eager[index]


def _carried(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[str, Any] | None, torch.Tensor | None]:
    """Where a block's input is among its arguments (its first tensor argument,
    positional first), and the input; (None, None) where it has none."""
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return ("arg", k), a
    for name, a in kwargs.items():
        if isinstance(a, torch.Tensor):
            return ("kw", name), a
    return None, None


def _without(args: tuple[Any, ...], kwargs: dict[str, Any],
             spot: tuple[str, Any] | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments less the block's input (None in its place)."""
    return _with(args, kwargs, spot, None)


def _with(args: tuple[Any, ...], kwargs: dict[str, Any], spot: tuple[str, Any] | None,
          x: torch.Tensor | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = list(args), dict(kwargs)  # type: ignore[assignment]
    if spot is not None and spot[0] == "arg":
        args[spot[1]] = x  # type: ignore[index]
    elif spot is not None:
        kwargs[spot[1]] = x
    return tuple(args), kwargs


def _first_tensor(out: Any) -> torch.Tensor | None:
    return next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)


def _autocast_state() -> tuple[Any, ...]:
    """The autocast state of the devices a block may run on."""
    return tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                 for device in ("cpu", "cuda"))


@contextlib.contextmanager
def _autocast(state: tuple[Any, ...]) -> Any:
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in state:
            if enabled or torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield


def block_calls() -> int | None:
    """While a marked block runs (and Dynamo compiles its graph): how many blocks it
    stands for; None elsewhere."""
    block = _BLOCK.get()
    return None if block is None else block[1]


def block_carry() -> Carry | None:
    """While a marked block runs: what its list's blocks carry (:class:`Carry`); None
    elsewhere."""
    block = _BLOCK.get()
    return None if block is None else block[2]


def block_index() -> int | None:
    """While a marked block runs: its index among the blocks (the step runs them in
    that order); None elsewhere."""
    block = _BLOCK.get()
    return None if block is None else block[0]


# The check each eager wrapper runs, by wrapper. One wrapper per function: Dynamo guards on
# the identity of the global it reads, so a new wrapper each step would recompile the
# model around the blocks each step.
_RUNS: dict[Callable[..., Any], Callable[..., Any]] = {}


def _run_eagerly(check: Callable[..., Any]) -> Callable[..., Any]:
    for wrapper, runs in _RUNS.items():
        if runs is check:
            return wrapper
    wrapper = torch.compiler.disable(check, recursive=True)
    _RUNS[wrapper] = check
    return wrapper


def packed_check_eager(*, on_meta: bool = False) -> contextlib.AbstractContextManager[None]:
    """transformers' check for packed sequences (``find_packed_sequence_indices``) runs
    eagerly, outside Dynamo's graphs, within the ``with`` statement; restored after, and
    nothing happens where transformers' masking module is not loaded.

    Given no attention mask, transformers reads the position ids for packed sequences.
    Under Dynamo it cannot read them, keeps a packed-sequence mask, and builds an explicit
    causal mask from it, which every block's graph turns into a float mask and runs its
    masked attention with; run eagerly, the check finds none and leaves causality to SDPA's
    ``is_causal``, as an eager step does. Under a whole-model compile the mask is built
    once per step inside the one graph, and the graph break this costs is not worth it;
    the model around a regional step's blocks breaks at every block anyway
    (docs/benchmarks.md, "Regional against whole-model compilation").

    ``on_meta``: the check answers "none packed" (on ``meta`` tensors it cannot read the
    ids either), still outside Dynamo's graphs, so that the survey's graphs are the real
    step's for unpacked inputs."""
    # the library's own check, where a step runs in another's scope
    return packed_check_replaced(
        lambda check: _run_eagerly(none_packed if on_meta else _RUNS.get(check, check)))


def within_packed_check_eager(compiled: nn.Module) -> None:
    """Every call of ``compiled`` runs within :func:`packed_check_eager` (forward hooks:
    the scope closes when the call returns or raises)."""
    scopes: list[contextlib.ExitStack] = []

    def enter(module: nn.Module, args: Any) -> None:
        scope = contextlib.ExitStack()
        scope.enter_context(packed_check_eager())
        scopes.append(scope)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if scopes:
            scopes.pop().close()

    compiled.register_forward_pre_hook(enter)
    compiled.register_forward_hook(leave, always_call=True)


def survey(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], options: Options,
           compile_twin: CompileTwin) -> tuple[Need, ...]:
    """What each graph of one regional step of ``model(*args, **kwargs)`` needs at its
    least, in execution order: a twin of ``model`` on ``meta`` tensors (no memory, no
    data) is compiled regionally on the eager route and run through its backward, and
    each graph's least-peak plan is found. The real compile then plans each graph with
    room left for the graphs after it (:meth:`BudgetShare.reserve_after`): a block
    compiled before the loss head would otherwise take all of the budget.
    ``compile_twin(twin, options)`` compiles the twin regionally with rematc's backend and
    returns it with that backend's budget share, which says what the step's inference
    graphs return (``Need.before``)."""
    from rematc.partition import _RECORDS, plan_for

    twin = _meta_twin(model)
    mark_regions(twin)
    meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
    quiet = _quiet(options)
    before = len(_RECORDS)
    with losses_written_out(), flash_attention(), packed_check_eager(on_meta=True):
        compiled, share = compile_twin(twin, quiet)
        loss = _loss_of(compiled(*meta[0], **meta[1]))
        loss.backward()
    records = list(_RECORDS)[before:]
    for _ in records:  # the survey's records are not the user's
        _RECORDS.pop()
    needs = []
    last = -1  # the order of the graph before
    for record in sorted(records, key=lambda r: -1 if r.graph is None else r.graph.order):
        order = -1 if record.graph is None else record.graph.order
        between = sum(b for g, b in share.outside.items() if last < g.order < order)
        last = order
        free = record.problem.with_budget(None)
        if record.calls > 1:
            # A graph of several calls is counted at the plan, of those the real graph's
            # planning has as last resorts and finds alike on the twin (the block
            # checkpointed whole and the rungs above it), that needs least for all its
            # calls. Not the least-peak plan: it holds what its least time needs, which
            # differs between the twin's graph and the real one.
            least: Plan | None = min(
                [recompute_every(free), *holding_ladder(free)],
                key=functools.partial(_calls_need, free, record.calls, record.grads))
        else:
            try:
                plan_for(record.problem.with_budget(0), quiet)
            except InfeasibleBudgetError as e:
                least = e.plan
            else:
                least = None
        report = check(free, least or record.plan)
        one = tier(record.problem, report)
        needs.append(Need(calls=record.calls, peak=report.peak, holds=one.holds,
                          grads=record.grads, before=between, carried=record.carried,
                          freed=record.freed_bytes, forward=one.forward))
    return tuple(needs)


def _calls_need(free: Problem, calls: int, grads: int, plan: Plan) -> int:
    """What ``calls`` calls of ``plan`` need (:func:`solvers.mix.need`)."""
    return need([tier(free, check(free, plan))], [calls], grads=grads)


def _quiet(options: Options) -> Options:
    """The options the survey compiles its twin with: no budget, eager, nothing stored
    or verified, one call. Only these change what it finds."""
    return dataclasses.replace(options, budget=None, compiler="eager", cache_dir=None, verify=False, calls=1)


# Surveys found in this process, by :func:`_survey_key`: a model compiled again in the
# process (at another budget, or at the smallest one an error stated) is not surveyed again.
_SURVEYS: dict[str, tuple[Need, ...]] = {}
SURVEYS_KEPT = 64  # the most kept; the oldest goes first


def cached_survey(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], options: Options,
                  compile_twin: CompileTwin) -> tuple[Need, ...]:
    """:func:`survey`, found once per process for the same model, inputs' shapes, options
    (the budget aside) and autocast state, and read from the plan cache where an earlier
    run stored it (it costs a Dynamo trace of the model), and stored there otherwise."""
    digest = _survey_key(model, args, kwargs, options)
    root = plancache.directory(options.cache_dir)
    stored = None if root is None else _needs_of(plancache.load_note(root, digest))
    needs = _SURVEYS.get(digest, stored)
    if needs is None:
        needs = survey(model, args, kwargs, options, compile_twin)
    if root is not None and stored is None:  # written once per plan cache, not per compile
        plancache.store_note(root, digest, [list(n) for n in needs])
    _SURVEYS.pop(digest, None)
    _SURVEYS[digest] = needs
    while len(_SURVEYS) > SURVEYS_KEPT:
        del _SURVEYS[next(iter(_SURVEYS))]
    return needs


def _needs_of(note: Any) -> tuple[Need, ...] | None:
    """The survey a plan-cache note holds, None where it holds none."""
    if isinstance(note, list) and all(isinstance(n, list) and len(n) == len(Need._fields) for n in note):
        return tuple(Need(*(int(x) for x in n)) for n in note)
    return None


def forget_surveys() -> None:
    """Drop the surveys :func:`cached_survey` keeps in this process (tests start from none)."""
    _SURVEYS.clear()


def _survey_key(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], options: Options) -> str:
    """SHA-256 of what a survey depends on: the model's class, its modules' classes,
    training flags and plain attributes (transformers' ``gradient_checkpointing``), its
    config where it has one, its parameters' and buffers' names, shapes, dtypes and grads,
    the inputs' shapes and dtypes (other inputs by repr), the options the survey compiles
    with (:func:`_quiet`: not the budget), the autocast state, and the versions the plan
    cache keys on."""
    def describe(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return [list(t.shape), str(t.dtype), t.requires_grad]
        return repr(t)

    def plain(module: nn.Module) -> list[Any]:
        return [type(module).__qualname__, module.training,
                sorted((k, v) for k, v in vars(module).items()
                       if isinstance(v, (bool, int, float, str)) or v is None)]

    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    material = {
        "format": "rematc.survey/6",
        "model": type(model).__qualname__,
        "modules": [[name, *plain(m)] for name, m in model.named_modules()],
        "config": to_dict() if callable(to_dict) else None,
        "state": [[name, *describe(t)] for name, t in (*model.named_parameters(), *model.named_buffers())],
        "inputs": [describe(t) for t in tree_leaves((args, kwargs))],
        "kwargs": sorted(kwargs),
        "options": _quiet(options).cache_key(),
        "autocast": repr(_autocast_state()),
        "grad": torch.is_grad_enabled(),
        "versions": plancache.versions(),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=repr).encode()).hexdigest()


def _meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are ``meta`` tensors (nothing of
    the original's data is copied), its blocks unmarked."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        twin = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin
    copy = deepcopy(model, memo)
    for module in copy.modules():
        if _MARK in vars(module):  # the class's own forward again, bound to the twin
            del vars(module)[_MARK]
            vars(module).pop("forward", None)
    return copy


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a step returns: the output itself, its ``loss`` (transformers), or its
    first tensor."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ValueError("the model's output holds no tensor that requires grad")
    return tensors[0].sum()
