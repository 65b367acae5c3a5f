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

transformers' check for packed sequences runs eagerly in a regional step
(:func:`packed_check_eager`): the model around the blocks then builds no explicit causal
mask, as it builds none eagerly.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
from torch import nn

from rematc import plancache
from rematc._torch_compat import tree_leaves, tree_map
from rematc.onmeta import flash_attention, losses_written_out, none_packed, packed_check_replaced
from rematc.options import Options
from rematc.partition import BudgetShare, Need, holds_after_forward, tier
from solvers import InfeasibleBudgetError, Plan, Problem, check
from solvers.baselines import holding_ladder, recompute_every
from solvers.mix import need

__all__ = ["block_calls", "block_index", "cached_survey", "mark_regions", "packed_check_eager", "repeated_blocks",
           "survey", "within_packed_check_eager"]

# The index of the block running now and how many blocks there are; None outside a
# marked block.
_BLOCK: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("rematc_block", default=None)
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
    for index, block in enumerate(blocks):
        if _MARK not in vars(block):
            own = block.forward
            setattr(block, _MARK, own)
            block.forward = _marked(own, index, len(blocks))
    return name, len(blocks)


def _marked(forward: Callable[..., Any], index: int, calls: int) -> Callable[..., Any]:
    @functools.wraps(forward)
    def region(*args: Any, **kwargs: Any) -> Any:
        token = _BLOCK.set((index, calls))
        try:
            return forward(*args, **kwargs)
        finally:
            _BLOCK.reset(token)

    # Not traced by the model's compile, but what it calls is: the block's own forward,
    # compiled by the same backend as a graph of its own.
    return torch.compiler.disable(region, recursive=False)


def block_calls() -> int | None:
    """While a marked block runs (and Dynamo compiles its graph): how many blocks it
    stands for; None elsewhere."""
    block = _BLOCK.get()
    return None if block is None else block[1]


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
    quiet = dataclasses.replace(options, budget=None, compiler="eager", cache_dir=None, verify=False,
                                calls=1)
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
        needs.append(Need(calls=record.calls, peak=report.peak,
                          holds=holds_after_forward(record.problem, report),
                          grads=record.grads, before=between))
    return tuple(needs)


def _calls_need(free: Problem, calls: int, grads: int, plan: Plan) -> int:
    """What ``calls`` calls of ``plan`` need (:func:`solvers.mix.need`)."""
    return need([tier(free, check(free, plan))], [calls], grads=grads)


def cached_survey(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], options: Options,
                  compile_twin: CompileTwin) -> tuple[Need, ...]:
    """:func:`survey`, read from the plan cache where an earlier run of the same model,
    inputs' shapes and options stored it (it costs a Dynamo trace of the model), and
    stored there otherwise."""
    root = plancache.directory(options.cache_dir)
    if root is None:
        return survey(model, args, kwargs, options, compile_twin)
    digest = _survey_key(model, args, kwargs, options)
    note = plancache.load_note(root, digest)
    if isinstance(note, list) and all(isinstance(n, list) and len(n) == len(Need._fields) for n in note):
        return tuple(Need(*(int(x) for x in n)) for n in note)
    needs = survey(model, args, kwargs, options, compile_twin)
    plancache.store_note(root, digest, [list(n) for n in needs])
    return needs


def _survey_key(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], options: Options) -> str:
    """SHA-256 of what a survey depends on: the model's class and its parameters' and
    buffers' names, shapes, dtypes and grads, the inputs' shapes and dtypes (other
    inputs by repr), the options, and the versions the plan cache keys on."""
    def describe(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return [list(t.shape), str(t.dtype), t.requires_grad]
        return repr(t)

    material = {
        "format": "rematc.survey/3",
        "model": type(model).__qualname__,
        "state": [[name, *describe(t)] for name, t in (*model.named_parameters(), *model.named_buffers())],
        "inputs": [describe(t) for t in tree_leaves((args, kwargs))],
        "kwargs": sorted(kwargs),
        "options": options.cache_key(),
        "versions": plancache.versions(),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


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
