"""From AOTAutograd's joint graph to a torch-free :class:`solvers.Problem`.

The joint graph holds the forward and the backward of one training step. Here we

1. split it the way PyTorch's partitioners do: the forward is what the forward outputs
   need (``classify_nodes``); everything else runs in the backward;
2. fold FX nodes into *values*, one per storage: a view, an in-place result or the
   ``getitem`` of a multi-output op belongs to the value that owns its storage
   (:mod:`rematc.annotate`), so saving or freeing it is one decision and its bytes
   count once; nodes without tensor output (symbolic sizes) pass their inputs through;
3. under Inductor (``inductor``), fold a pointwise value into the one op that reads it:
   Inductor inlines it into that op's kernel, so its storage never exists
   (:func:`fused_groups`); and count the channels-last copies of the inputs and weights
   of convolutions that Inductor's layout optimization makes (:func:`layout_copies`);
4. order the backward as the emitted graph will run it: autograd's order, with each
   node's not-yet-computed backward inputs placed just before it (what
   ``reordering_to_mimic_autograd_engine`` does to the emitted backward);
5. under Inductor, set the memory effects of the problem (``Node.unstored``,
   ``Node.overwrites``) where Inductor computes a value inside its readers or writes a
   kernel's output over a dying input.

:func:`capture` runs these as stages over one :class:`CaptureContext`; what each Inductor
rule does, with its measurements, is ``rematc.inductor_rules`` and docs/inductor-memory.md.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from rematc._torch_compat import (
    OpOverload,
    StorageWeakRef,
    classify_nodes,
    extract_fwd_bwd_outputs,
    functorch_config,
    inductor_graph_lowering,
    inductor_thresholds,
    inputs_updated_after,
    is_bwd_seed_offset,
    is_expandable_to,
    is_fwd_seed_offset,
    is_gpu,
    is_pointwise_use,
    is_primal,
    is_tangent,
    make_channels_last_strides_for,
    optimization_hint,
    tree_map_only,
)
from rematc.annotate import (
    DENSE_BIAS_OPS,
    META_KEY,
    NodeCost,
    broadcast_bias,
    channels_last_convolutions,
    storage_bytes,
    tensors,
    val_bytes,
)
from solvers import Copy, Node, Problem
from solvers.problem import EVERY_COPY


@dataclass(frozen=True)
class Captured:
    """A problem and the FX nodes behind each of its values."""

    problem: Problem
    groups: tuple[tuple[fx.Node, ...], ...]  # FX nodes of each value, owner first
    value_of: dict[fx.Node, int]  # FX node -> value index (absent: no tensor output)
    forward: frozenset[fx.Node]  # FX nodes the forward computes
    # Values whose recomputation the backward emits once per reader (:func:`per_reader_values`).
    per_reader: frozenset[int] = frozenset()
    # Values the model's own activation checkpointing recomputes (:func:`checkpointed_values`).
    checkpointed: frozenset[int] = frozenset()
    # Bytes the step keeps free for the scratch an op allocates while it runs, where no
    # value can hold it (:func:`rematc.annotate.transient_scratch`): beside the problem's peak.
    scratch: int = 0


@dataclass
class CaptureContext:
    """What the capture knows of one joint graph: set up by :func:`capture`, filled in by
    its stages in order, and read by the helpers instead of long argument lists."""

    joint: fx.GraphModule
    costs: dict[fx.Node, NodeCost]
    nodes: list[fx.Node]  # the graph's nodes, its output left out
    forward: frozenset[fx.Node]  # what the forward computes
    kept: set[fx.Node]  # the step's outputs
    inductor: bool  # Inductor generates the code (else eager's kernels run the graph)
    # Of the forward's outputs, those the caller drops when the forward returns
    # (:func:`dropped_outputs`): ``returned`` values, not kept to the step's end.
    returned: frozenset[fx.Node] = frozenset()
    owner: dict[fx.Node, fx.Node] = field(default_factory=dict)  # node -> the node owning its storage
    elements: Elements = field(default_factory=lambda: Elements({}, {}, frozenset()))
    layout: dict[fx.Node, int] = field(default_factory=dict)  # channels-last copies: input -> bytes
    deferred: dict[fx.Node, fx.Node] = field(default_factory=dict)  # value -> the extern reader computing it
    extern: frozenset[fx.Node] = frozenset()  # adds Inductor makes extern kernels (addmm)
    groups: list[list[fx.Node]] = field(default_factory=list)  # each value's nodes, owner first
    value_of: dict[fx.Node, int] = field(default_factory=dict)
    folded: frozenset[fx.Node] = frozenset()  # nodes a reader's kernel computes: no value of their own
    deps: list[frozenset[int]] = field(default_factory=list)  # the values each value reads
    # Values whose readers compute them: a forward one where it is recomputed, a backward
    # one always (it has no storage); and those of them emitted once per reader.
    in_readers: set[int] = field(default_factory=set)
    per_reader: dict[int, int] = field(default_factory=dict)  # value -> kernels computing it

    @property
    def unstored_backward(self) -> set[int]:
        """The backward values of :attr:`in_readers`: stored nowhere."""
        return {i for i in self.in_readers if self.groups[i][0] not in self.forward}


def capture(
    joint: fx.GraphModule,
    costs: dict[fx.Node, NodeCost],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Sequence[int] = (),
    host_bandwidth: float = 0.0,
    name: str = "joint",
    inductor: bool = False,
    drops_outputs: bool = False,
) -> Captured:
    """The problem of one joint graph (the steps of the module docstring), for eager's
    kernels or, with ``inductor``, for the code Inductor generates. ``drops_outputs``: the
    caller keeps only the loss, and the forward's other outputs (:func:`dropped_outputs`)
    are ``returned`` values, alive to the forward's end, not kept to the step's."""
    c = _start(joint, costs, num_fwd_outputs, static_lifetime_input_indices, inductor)
    if drops_outputs:
        c.returned = dropped_outputs(joint, num_fwd_outputs)
    _split_storages(c)
    _group_values(c, _step_order(c))
    _read_values(c)
    if inductor:
        _computed_in_readers(c)
    problem = _problem(c, host_bandwidth, name)
    if inductor:
        problem = _inductor_effects(c, problem)
    return Captured(problem, tuple(tuple(g) for g in c.groups), c.value_of, c.forward,
                    frozenset(c.per_reader), checkpointed_values(problem, c.groups))


def _start(joint: fx.GraphModule, costs: dict[fx.Node, NodeCost], num_fwd_outputs: int,
           static_lifetime_input_indices: Sequence[int], inductor: bool) -> CaptureContext:
    """The forward split as PyTorch's partitioners split it, and the step's outputs."""
    info = classify_nodes(joint, list(static_lifetime_input_indices), num_fwd_outputs)
    nodes: list[fx.Node] = [n for n in joint.graph.nodes if n.op != "output"]
    required = set(info.required_fw_nodes)  # a list in some torch versions: not searched per node
    fwd = {n for n in nodes if n in required or is_primal(n) or is_fwd_seed_offset(n)}
    # An element of a forward multi-output op is forward too, even when only the backward
    # reads it: the tuple itself cannot cross into the backward, its elements can.
    fwd |= {n for n in nodes if n.target is operator.getitem and n.args[0] in fwd}
    return CaptureContext(joint, costs, nodes, frozenset(fwd), step_outputs(joint, num_fwd_outputs), inductor)


def _split_storages(c: CaptureContext) -> None:
    """Each node's storage owner, with the elements of multi-output ops that are values of
    their own (:func:`split_elements`)."""
    by_name = {n.name: n for n in c.nodes}
    c.owner = {n: by_name[c.costs[n].owner] for n in c.nodes if _has_storage(c.costs[n])}
    # Storages alive before the step (parameters, inputs, buffers) cost nothing, so
    # nodes aliasing them (a transposed weight, an in-place buffer update) need no
    # grouping: each stays its own zero-byte value with its own inputs and position.
    for n, o in c.owner.items():
        if o.op == "placeholder" and (is_primal(o) or is_fwd_seed_offset(o)):
            c.owner[n] = n
    # A backward op with a workspace hands each of its outputs to a value of its own (its
    # element), so its own value, the outputs and the workspace together, lives only
    # while it runs.
    scratch = {n for n in c.nodes if n not in c.forward and c.costs[n].workspace > 0}
    save_only = {n for n in c.forward if n.op == "call_function" and not _recomputable([n], c.costs)}
    c.elements = split_elements(c, whole=scratch, save_only=save_only)


def _step_order(c: CaptureContext) -> list[fx.Node]:
    """The nodes in the order the emitted graphs run them: the forward with Inductor's
    layout copies just in time, the backward in autograd's order, handed-over elements
    right after their op, and (Inductor) deferred values right before their reader."""
    if c.inductor:
        c.layout = layout_copies(c.joint, c.forward)
    order = _just_in_time(c.layout, [n for n in c.nodes if n in c.forward]) + _backward_order(c.nodes, c.forward)
    order = _right_after(c.elements.handed, order)
    if c.inductor:
        c.deferred = deferred_to_reader(c, order)
        order = _just_in_time(c.deferred, order)  # each right before its one reader
    return order


def _group_values(c: CaptureContext, order: list[fx.Node]) -> None:
    """One value per storage, in step order; under Inductor, the values a reader's kernel
    computes folded into the reader's (:func:`fused_groups`)."""
    owners = [n for n in order if c.owner.get(n) is n]
    c.value_of = {n: i for i, n in enumerate(owners)}
    c.groups = [[o] for o in owners]
    for n in c.nodes:
        if n in c.owner and c.owner[n] is not n:
            c.value_of[n] = c.value_of[c.owner[n]]
            c.groups[c.value_of[n]].append(n)
    if c.inductor:
        addmm = addmm_pairs(c.joint)
        c.extern = frozenset(addmm.values())
        c.groups, c.folded = fused_groups(c, addmm)
        c.value_of = {n: i for i, group in enumerate(c.groups) for n in group}


def _read_values(c: CaptureContext) -> None:
    """The values each value reads, looking through nodes without a storage."""
    memo: dict[fx.Node, frozenset[int]] = {}

    def value_deps(n: fx.Node) -> frozenset[int]:
        if n not in memo:
            out: set[int] = set()
            for a in n.all_input_nodes:
                out |= {c.value_of[a]} if a in c.value_of else value_deps(a)
            memo[n] = frozenset(out)
        return memo[n]

    c.deps = [frozenset().union(*(value_deps(n) for n in g)) - {i} for i, g in enumerate(c.groups)]
    for i, g in enumerate(c.groups):
        # A handed-over element takes its storage from the op at the op's end: it reads no
        # value, and the op's value dies at its own step.
        if g[0] in c.elements.handed:
            c.deps[i] = c.deps[i] - {c.value_of[c.elements.handed[g[0]]]}
        # A deferred value runs after the recomputations its reader needs (it is emitted as
        # that reader is lowered): it reads them, for the plan's order.
        if g[0] in c.deferred:
            c.deps[i] = c.deps[i] | {d for d in value_deps(c.deferred[g[0]]) if c.groups[d][0] in c.forward}


def _computed_in_readers(c: CaptureContext) -> None:
    """The values Inductor computes inside each reader (:func:`inline_values`), and those
    the backward emits once per reader (:func:`per_reader_values`)."""
    c.in_readers = inline_values(c)
    c.per_reader = per_reader_values(c, c.in_readers)
    c.in_readers |= set(c.per_reader)


def _problem(c: CaptureContext, host_bandwidth: float, name: str) -> Problem:
    """One :class:`Node` per value: its bytes, the time it takes, what it reads."""
    unstored = c.unstored_backward
    # Save-only beyond what _recomputable refuses: readers of an input the forward updates,
    # and (Inductor) attention biases its backward would otherwise copy whole (rule 16).
    must_save = reads_mutated_input(c.nodes, c.forward, c.costs)
    if c.inductor:
        must_save |= broadcast_bias_sources(c.nodes, c.forward, c.costs)
    out: list[Node] = []
    for i, group in enumerate(c.groups):
        head = group[0]
        deps = set(c.deps[i])
        # A backward value Inductor computes inside each reader (never recomputed: it runs
        # once, in the backward) is stored nowhere: it holds no bytes, and each reader
        # reads what it reads, so those live until its last reader. That is exact here, as
        # no decision changes a backward value; for forward values the solvers apply the
        # rule to recomputations only (``Node.unstored``).
        deps |= {d for j in deps & unstored for d in out[j].deps}
        own = [n for n in group if n not in c.folded]
        size = c.layout.get(head, c.elements.sizes.get(head, c.costs[head].nbytes))
        keep = any((n in c.kept and n not in c.returned) or _root_gradient(n) for n in group)
        resident = (is_primal(head) or is_fwd_seed_offset(head)) and head not in c.layout
        returned = not (keep or resident) and head in c.forward and any(n in c.returned for n in group)
        out.append(Node(
            name=head.name,
            op=_op_name(head),
            deps=tuple(sorted(deps)),
            backward=head not in c.forward,
            # An op's workspace lives while it runs: counted with its value, which lives on
            # with its outputs unless they are handed over (``split_elements``).
            size=0 if i in unstored else size + sum(c.costs[n].workspace for n in own),
            time=recompute_seconds(group, own, c.costs, stored=c.inductor and i not in c.in_readers)
            * c.per_reader.get(i, 1),
            flops=sum(c.costs[n].flops for n in own),
            recomputable=(_recomputable(group, c.costs) and not must_save.intersection(group)
                          and head not in c.elements.statistics),
            offloadable=_offloadable(group, c.costs),
            resident=resident,
            keep=keep,
            returned=returned,
            unstored=frozenset({Copy.RECOMPUTED}) if i in c.in_readers - unstored else frozenset(),
        ))
    if c.inductor and out and not out[-1].resident and channels_last_convolutions(c.joint):
        # Autograd's copies of gradients into their parameters' layout, made after the
        # backward (accumulate_copy_bytes): at the last step, where every gradient is alive.
        out[-1] = dataclasses.replace(out[-1], size=out[-1].size + accumulate_copy_bytes(c.nodes, c.kept))
    return Problem(nodes=tuple(out), host_bandwidth=host_bandwidth, name=name)


def _inductor_effects(c: CaptureContext, problem: Problem) -> Problem:
    """``problem`` with the effects that depend on the values' readers: kernels that
    compute a value inside their own (:func:`with_one_reader_kernels`) and outputs written
    over a dying input (:func:`with_inplace_reuse`)."""
    problem = with_one_reader_kernels(c, problem)
    # AOTAutograd reads the same flag after partitioning, to mark the backward's saved
    # inputs that Inductor may write over.
    return with_inplace_reuse(c, problem, donated=bool(functorch_config.donated_buffer))


def recompute_seconds(group: Sequence[fx.Node], own: Sequence[fx.Node],
                      costs: dict[fx.Node, NodeCost], *, stored: bool) -> float:
    """Seconds one recomputation of a value adds to the backward (``Node.time``).

    A node inlined into the value's kernel (``group`` minus ``own``) adds no pass over
    memory, only its transcendentals. Under Inductor a pointwise value that is stored
    (not ``inline``: an extern kernel reads it, or several readers and a tanh) is written
    again by its recomputation, so it pays its whole roofline, not the fused price of
    :func:`rematc.annotate.recompute_cost`: on the benchmark GPT that is a LayerNorm
    output rebuilt for a matmul."""
    time = sum(costs[n].time if stored and costs[n].is_pointwise else costs[n].recompute_time
               for n in own)
    return time + sum(costs[n].transcendental_time for n in group if n not in own)


def dropped_outputs(joint: fx.GraphModule, num_fwd_outputs: int) -> frozenset[fx.Node]:
    """The forward's outputs a caller that keeps only the loss drops when the forward
    returns (``Options.outputs="dropped"``): where the forward returns a loss (a 0-dim
    floating-point tensor), every other tensor it returns; none where it returns no loss
    (the caller computes one from what it returns, so holds that)."""
    if not returns_loss(joint, num_fwd_outputs):
        return frozenset()
    fwd_outputs, _, _, _ = extract_fwd_bwd_outputs(joint, num_fwd_outputs=num_fwd_outputs)
    vals = [(o, o.meta.get("val")) for o in fwd_outputs if isinstance(o, fx.Node)]
    return frozenset(o for o, v in vals if isinstance(v, torch.Tensor) and v.dim() > 0)


def returns_loss(joint: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """Whether the forward returns a loss: a 0-dim floating-point tensor."""
    fwd_outputs, _, _, _ = extract_fwd_bwd_outputs(joint, num_fwd_outputs=num_fwd_outputs)
    vals = [o.meta.get("val") for o in fwd_outputs if isinstance(o, fx.Node)]
    return any(isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() for v in vals)


def step_outputs(joint: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    """The nodes the joint graph returns: the forward's outputs and the gradients."""
    fwd_outputs, bwd_outputs, _, _ = extract_fwd_bwd_outputs(joint, num_fwd_outputs=num_fwd_outputs)
    return {o for o in (*fwd_outputs, *bwd_outputs) if isinstance(o, fx.Node)}


def split_shared_pointwise(joint: fx.GraphModule, costs: dict[fx.Node, NodeCost], *,
                           num_fwd_outputs: int, static_lifetime_input_indices: Sequence[int] = ()) -> int:
    """Give each reader of a cheap forward-only elementwise value its own copy of it, as
    Inductor computes it inside each reader and never stores it; return how many copies
    were made. Only values whose inputs hold no more bytes than they do
    (``SPLIT_SLACK``); a value the backward reads keeps its first forward reader and its
    backward ones. Rules 4 and 14 of docs/inductor-memory.md."""
    info = classify_nodes(joint, list(static_lifetime_input_indices), num_fwd_outputs)
    kept = step_outputs(joint, num_fwd_outputs)
    extern = frozenset(addmm_pairs(joint).values())
    by_name = {n.name: n for n in joint.graph.nodes}
    forward = set(info.required_fw_nodes)  # with the copies made here
    copies = copy_constants_to_backward(joint, costs, forward)
    limit = realize_reads()
    # Readers first: the copies of a split reader read the value, which then has more readers.
    for v in reversed(list(joint.graph.nodes)):
        if v not in forward or v not in costs or costs[v].owner != v.name or costs[v].is_view:
            continue
        through = _view_chains(v)
        readers = [u for u in through if u in forward]
        group = [v, *{w for chain in through.values() for w in chain[1:]}]
        if (len(readers) < 2 or len(v.all_input_nodes) > limit
                or not _inlinable(group, costs, kept, extern)
                or _input_bytes(v, costs, by_name) > costs[v].nbytes * (1 + SPLIT_SLACK)):
            continue
        for u in readers[1:]:
            chain = through[u]
            made: dict[fx.Node, fx.Node] = {}
            with joint.graph.inserting_before(u):
                for w in chain:
                    # A copied view reads the copy before it; the value's copy, its inputs.
                    made[w] = joint.graph.node_copy(w, partial(_renamed, made))
            _own_storage(v, made[v])
            for w in chain[1:]:
                _view_value(made[w])
            u.replace_input_with(chain[-1], made[chain[-1]])
            for w in chain:
                costs[made[w]] = dataclasses.replace(costs[w], owner=made[v].name)
                made[w].meta[META_KEY] = costs[made[w]]
            forward |= set(made.values())
            copies += 1
    if copies:
        joint.recompile()
    return copies


SPLIT_SLACK = 1 / 16  # a row statistic or a mask read beside a full-size input


def _renamed(made: dict[fx.Node, fx.Node], a: fx.Node) -> fx.Node:
    return made.get(a, a)


def _view_chains(v: fx.Node) -> dict[fx.Node, list[fx.Node]]:
    """Each reader of ``v`` or of the views Inductor applies to it (:data:`INLINE_VIEWS`),
    in graph order, with the chain ``[v, view, ...]`` to the node it reads (the first
    such, where it reads several)."""
    out: dict[fx.Node, list[fx.Node]] = {}
    stack = [[v]]
    while stack:
        chain = stack.pop()
        for u in chain[-1].users:
            if _inline_view(u) and len(u.all_input_nodes) == 1:
                stack.append([*chain, u])
            else:
                out.setdefault(u, chain)
    order = {n: k for k, n in enumerate(v.graph.nodes)}
    return dict(sorted(out.items(), key=lambda item: order[item[0]]))


def _view_value(view: fx.Node) -> None:
    """Recompute a copied view's fake value from its (copied) input's."""
    args, kwargs = tree_map_only(fx.Node, lambda a: a.meta["val"], (view.args, view.kwargs))
    mode = getattr(args[0], "fake_mode", None)
    if mode is not None and callable(view.target):
        with mode:
            view.meta["val"] = view.target(*args, **kwargs)


def _own_storage(v: fx.Node, copy: fx.Node) -> None:
    """Give ``copy``, made by ``node_copy(v)``, a fake value with a storage of its own."""
    val = v.meta.get("val")
    mode = getattr(val, "fake_mode", None)
    if isinstance(val, torch.Tensor) and mode is not None:
        with mode:
            copy.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def copy_constants_to_backward(joint: fx.GraphModule, costs: dict[fx.Node, NodeCost],
                               forward: Collection[fx.Node]) -> int:
    """Give the backward its own copy of each constant the forward computes and the
    backward reads (a ``full`` with no inputs, which CSE shares between the two), so the
    backward computes it in each kernel and the forward's is no decision; return how many
    copies were made. Rule 13 of docs/inductor-memory.md."""
    copies = 0
    for v in list(joint.graph.nodes):
        readers = [u for u in v.users if u not in forward and u.op != "output"]
        if v not in forward or v not in costs or not readers or not _is_factory(v):
            continue
        first = min(readers, key=list(joint.graph.nodes).index)
        with joint.graph.inserting_before(first):
            copy = joint.graph.node_copy(v)
        _own_storage(v, copy)
        for u in readers:
            u.replace_input_with(v, copy)
        costs[copy] = dataclasses.replace(costs[v], owner=copy.name)
        copy.meta[META_KEY] = costs[copy]
        copies += 1
    return copies


def with_one_reader_kernels(c: CaptureContext, problem: Problem) -> Problem:
    """``problem`` with the forward copy unstored of each value one forward kernel can compute
    (stored only when saved), and the recomputed copy unstored of each value with one
    backward reader that can compute it, where no forward reader of it is recomputed too
    and the kernel stays within :class:`KernelLimits`. Rule 10 of docs/inductor-memory.md."""
    groups, value_of, forward, costs, kept, extern = c.groups, c.value_of, c.forward, c.costs, c.kept, c.extern
    limits = kernel_limits(groups, costs)
    may_recompute = {w for w in problem.candidates if problem.nodes[w].recomputable}
    nodes = list(problem.nodes)
    for v in reversed(range(problem.n_forward)):  # a fused value's reader is not fused: decide it first
        group, node = groups[v], nodes[v]
        if node.resident or node.keep or node.size == 0 or not _elementwise(group, costs, kept, extern):
            continue
        fx_readers = readers_of(group)
        in_forward = {u for u in fx_readers if u in forward}
        readers = problem.forward_users[v]
        if (len(readers) == 1 and nodes[readers[0]].stores(Copy.FORWARD) and problem.backward_uses[v]
                and all(_fusible_reader(u, costs, extern) for u in in_forward)
                and _small([*groups[readers[0]], *group], {v, readers[0]}, value_of, costs, limits)):
            nodes[v] = node = dataclasses.replace(node, unstored=node.unstored | {Copy.FORWARD})
        in_backward = fx_readers - in_forward
        if (node.stores(Copy.RECOMPUTED) and len(in_backward) == 1 and _fusible_reader(next(iter(in_backward)), costs, extern)
                and not may_recompute & set(readers) and len(node.deps) <= limits.reads):
            own = [n for n in group if n not in c.folded]
            nodes[v] = dataclasses.replace(node, unstored=node.unstored | {Copy.RECOMPUTED},
                                           time=recompute_seconds(group, own, costs, stored=False))
    return dataclasses.replace(problem, nodes=tuple(nodes))


def _elementwise(group: Sequence[fx.Node], costs: dict[fx.Node, NodeCost], kept: set[fx.Node],
                 extern: Collection[fx.Node]) -> bool:
    """Elementwise throughout (with views Inductor re-indexes), not random, and stored for
    no other reason: a result Inductor can leave unstored inside its reader's kernel."""
    head = group[0]
    if head.op != "call_function" or not costs[head].is_pointwise or costs[head].is_random or head in extern:
        return False
    return all(not _stays_stored(n, kept) and (costs[n].is_pointwise or _inline_view(n) or _is_factory(n))
               for n in group)


def _input_bytes(v: fx.Node, costs: dict[fx.Node, NodeCost], by_name: dict[str, fx.Node]) -> int:
    """Bytes of the storages ``v`` reads, graph inputs left out (they stay live anyway)."""
    owners = {by_name[costs[a].owner] for a in v.all_input_nodes if a in costs and costs[a].owner in by_name}
    return sum(costs[o].nbytes for o in owners if o.op != "placeholder" and o in costs)


def with_inplace_reuse(c: CaptureContext, problem: Problem, *, donated: bool = True) -> Problem:
    """``problem`` with ``Node.overwrites`` set where Inductor writes an elementwise kernel's
    output over a same-sized input that dies in it (read directly, or through a backward
    value stored nowhere), the first by :func:`_reuse_preference`; ``overwrites_copies``
    the forward copy only where the kernel stores an intermediate ahead of a recomputed
    copy. With ``donated`` false no backward kernel takes a forward value over. Rules 1
    and 5 of docs/inductor-memory.md."""
    groups, value_of, costs, per_reader = c.groups, c.value_of, c.costs, c.per_reader
    through = frozenset(c.unstored_backward)

    def direct(v: int) -> set[int]:
        """The values v's kernel loads: its inputs, and those of the unstored ones."""
        out = {value_of[a] for n in groups[v] if costs[n].is_pointwise for a in n.all_input_nodes
               if a in value_of and groups[value_of[a]][0] is a}
        for d in out & through:
            out |= direct(d)
        return out

    def recomputed_at(u: int) -> int:
        """Where the backward recomputes a forward value: before its first backward reader."""
        return min((r for r in problem.users[u] if problem.nodes[r].backward), default=len(nodes))

    nodes = list(problem.nodes)
    for v, group in enumerate(groups):
        head = group[0]
        if head.op != "call_function" or not costs[head].is_pointwise or any(_mutates(n) for n in group):
            continue
        # Unstored values that the kernel stores after all: read by another op as well
        # (a reduction fused beside v), as large as v's output.
        realized = [d for d in direct(v) & through
                    if len(problem.users[d]) > 1 and costs[groups[d][0]].nbytes == nodes[v].size]
        for u in sorted(direct(v) - {v}, key=lambda u: _reuse_preference(problem.nodes[u], u, u in per_reader)):
            src = problem.nodes[u]
            if (src.size == nodes[v].size > 0 and problem.users[u][-1] == v
                    and not src.resident and not src.keep and groups[u][0].op != "placeholder"
                    and (donated or src.backward or not nodes[v].backward)):
                first = nodes[v].backward and not src.backward and any(d < recomputed_at(u) for d in realized)
                nodes[v] = dataclasses.replace(nodes[v], overwrites=u,
                                               overwrites_copies=frozenset({Copy.FORWARD}) if first else EVERY_COPY)
                break
    return dataclasses.replace(problem, nodes=tuple(nodes))


def _reuse_preference(node: Node, v: int, per_reader: bool = False) -> tuple[bool, bool, int]:
    """Which input a kernel writes over, of several that die in it: one that is stored
    (not computed inside the kernel; a ``per_reader`` value counts as stored), then one of
    the backward's own (a forward value is taken only when donated), then value order.
    Rule 1 of docs/inductor-memory.md."""
    return not node.stores(Copy.RECOMPUTED) and not per_reader, not node.backward, v


def layout_copies(joint: fx.GraphModule, forward: frozenset[fx.Node]) -> dict[fx.Node, int]:
    """Inputs and parameters Inductor copies into channels-last layout, with their bytes.

    When Inductor's layout optimization is on for a graph with convolutions (always on
    CPU with oneDNN: ``GraphLowering.decide_layout_opt``), every convolution reads its
    input and weight in channels-last layout; a graph input in another layout (the
    images, a weight) is copied, and the backward's convolution gradient reads the
    forward's copy, which the forward saves. So the copy lives from the input's first
    convolution to its last reader, where the input itself costs nothing."""
    if not inductor_graph_lowering().decide_layout_opt(joint, is_inference=False):
        return {}
    out: dict[fx.Node, int] = {}
    for n in joint.graph.find_nodes(op="call_function", target=torch.ops.aten.convolution.default):
        if n not in forward:
            continue
        for a in n.args[:2]:
            if not (isinstance(a, fx.Node) and a.op == "placeholder" and is_primal(a)):
                continue
            val = a.meta.get("val")
            if (isinstance(val, torch.Tensor) and val.dim() == 4
                    and not val.is_contiguous(memory_format=torch.channels_last)):
                out[a] = storage_bytes(val)
    return out


def accumulate_copy_bytes(nodes: Sequence[fx.Node], kept: Collection[fx.Node]) -> int:
    """Bytes autograd allocates after the backward to give a gradient its parameter's
    layout: the largest weight gradient a convolution backward returns channels-last
    (a 1x1 kernel's has its parameter's strides already). Rule 12 of
    docs/inductor-memory.md."""
    out = 0
    for n in nodes:
        if not (n in kept and n.target is operator.getitem and n.args[1] == 1):
            continue
        op = n.args[0]
        if not (isinstance(op, fx.Node) and op.target is torch.ops.aten.convolution_backward.default):
            continue
        weight, grad = op.args[2], n.meta.get("val")
        param = weight.meta.get("val") if isinstance(weight, fx.Node) else None
        if not (isinstance(grad, torch.Tensor) and isinstance(param, torch.Tensor) and grad.dim() == 4):
            continue
        channels_last = make_channels_last_strides_for(grad.shape)
        if any(size != 1 and a != b for size, a, b in zip(grad.shape, channels_last, param.stride(), strict=True)):
            out = max(out, storage_bytes(grad))
    return out


def _just_in_time(moved: Collection[fx.Node], order: list[fx.Node]) -> list[fx.Node]:
    """``order`` with each node of ``moved`` right before its first reader (a copy is made
    there, not when the step starts)."""
    if not moved:
        return order
    rest = [n for n in order if n not in moved]
    position = {n: k for k, n in enumerate(rest)}
    before: dict[int, list[fx.Node]] = {}
    for n in moved:
        first = min((position[u] for u in n.users if u in position), default=0)
        before.setdefault(first, []).append(n)
    return [m for k, n in enumerate(rest) for m in (*before.get(k, []), n)]


class Elements(NamedTuple):
    """The elements of multi-output ops made values of their own (:func:`split_elements`)."""

    sizes: dict[fx.Node, int]  # element (its getitem) -> bytes
    handed: dict[fx.Node, fx.Node]  # element of a ``whole`` op -> the op
    statistics: frozenset[fx.Node]  # elements saved for the backward, never recomputed


def split_elements(c: CaptureContext, *, whole: Collection[fx.Node] = (), save_only: Collection[fx.Node] = ()
                   ) -> Elements:
    """Make elements of multi-output ops values of their own: each kept element, every
    element of an op in ``whole`` (handed over right after the op, whose value then lives
    at its own step only: outputs and workspace), and the statistics of forward ops (small
    elements the backward reads, and every element the backward reads of a ``save_only``
    op), which are saved, never recomputed. Rule 11 of docs/inductor-memory.md and
    docs/memory-model.md."""
    nodes, owner, kept, forward = c.nodes, c.owner, c.kept, c.forward
    sizes: dict[fx.Node, int] = {}
    handed: dict[fx.Node, fx.Node] = {}
    statistics: set[fx.Node] = set()
    multi = {o for n, o in owner.items() if n is not o and n.target is operator.getitem}
    by_storage: dict[fx.Node, dict[StorageWeakRef, list[fx.Node]]] = {op: {} for op in multi}
    for n in nodes:  # in graph order: an element's getitem comes before its views
        val = n.meta.get("val")
        if owner.get(n) in multi and n is not owner[n] and isinstance(val, torch.Tensor):
            by_storage[owner[n]].setdefault(StorageWeakRef(val.untyped_storage()), []).append(n)
    for op, storages in by_storage.items():
        stats = _statistics(op, list(storages.values()), forward, save_only=op in save_only) if op in forward else set()
        for members in storages.values():
            heads = [n for n in members if n.target is operator.getitem and n.args[0] is op]
            if not heads or not (op in whole or heads[0] in stats or any(n in kept for n in members)):
                continue
            for n in members:
                owner[n] = heads[0]
            sizes[heads[0]] = storage_bytes(heads[0].meta["val"])
            if op in whole:
                handed[heads[0]] = op
            if heads[0] in stats and not any(n in kept for n in members):
                statistics.add(heads[0])
    return Elements(sizes, handed, frozenset(statistics))


def _statistics(op: fx.Node, elements: Sequence[Sequence[fx.Node]], forward: Collection[fx.Node], *,
                save_only: bool = False) -> set[fx.Node]:
    """The heads of ``op``'s statistics (:func:`split_elements`); ``elements``: the nodes of
    each of its output storages; ``save_only``: ``op`` is never recomputed."""
    total = sum(storage_bytes(members[0].meta["val"]) for members in elements)
    small = [m for m in elements if storage_bytes(m[0].meta["val"]) <= SPLIT_SLACK * total]
    backward_read = [m for m in elements if any(u not in forward for u in readers_of(m) if u.op != "output")]
    if not backward_read or (not save_only and any(m not in small for m in backward_read)):
        return set()
    return {n for m in backward_read for n in m[:1] if n.target is operator.getitem and n.args[0] is op}


def _right_after(handed: dict[fx.Node, fx.Node], order: list[fx.Node]) -> list[fx.Node]:
    """``order`` with each handed-over element right after its op (with the op's other
    elements, in their order): the op's value ends at its own step, the element's begins
    at the next one."""
    if not handed:
        return order
    after: dict[fx.Node, list[fx.Node]] = {}
    for n in order:
        if n in handed:
            after.setdefault(handed[n], []).append(n)
    return [m for n in order if n not in handed for m in (n, *after.get(n, []))]


# Views Inductor applies to an unrealized pointwise result by re-indexing its loader, so
# the result still needs no buffer; any other alias (as_strided, ...) realizes it.
INLINE_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand",
                          "unsqueeze", "squeeze", "alias", "slice", "select"})
# Factories Inductor lowers to a function of the index (no buffer read): it inlines them
# like pointwise ops.
FACTORY_OPS = frozenset({"full", "scalar_tensor", "iota", "arange", "zeros", "ones"})


def realize_reads() -> int:
    """Inductor's ``realize_reads_threshold`` now: a result that several ops read and that
    reads more buffers than this is stored (4 by default)."""
    return inductor_thresholds(cpu=True).reuse_reads


LOADER_OPS = 3  # a fused kernel's loader counts two or three ops per aten pointwise op


@dataclass(frozen=True)
class KernelLimits:
    """Inductor stores an inlined result once its loader reads more than ``reads`` buffers
    or counts more than ``realize_opcount_threshold`` ops, about ``ops`` aten pointwise ops."""

    reads: int  # buffers one fused kernel reads
    ops: int  # pointwise aten ops in one fused kernel


def kernel_limits(groups: Sequence[Sequence[fx.Node]], costs: dict[fx.Node, NodeCost]) -> KernelLimits:
    """The limits of the device the graph runs on (the CPU's where any value is there), read
    from Inductor's config when the graph is captured."""
    limits = inductor_thresholds(cpu=any(costs[g[0]].device == "cpu" for g in groups))
    return KernelLimits(reads=limits.acc_reads, ops=limits.opcount // LOADER_OPS)


def fused_groups(c: CaptureContext, addmm: dict[fx.Node, fx.Node]) -> tuple[list[list[fx.Node]], frozenset[fx.Node]]:
    """The values as Inductor stores them, and the FX nodes folded into a reader's value:
    a matmul merged into its add (``addmm``), and a value whose one reader computes it
    (:func:`inline_reader`), folded from the front while the kernel stays within the
    device's :class:`KernelLimits`. Rules 2 and 10 of docs/inductor-memory.md."""
    groups, value_of, costs = c.groups, c.value_of, c.costs
    limits = kernel_limits(groups, costs)
    kernels = [list(g) for g in groups]
    # Original values each kernel holds, or reads without a buffer (factories).
    factories = {i for i, g in enumerate(groups) if _is_factory(g[0])}
    inside = [{i} | factories for i in range(len(groups))]
    inlined: set[fx.Node] = set()
    folded = [False] * len(groups)
    for i, group in enumerate(groups):
        add = addmm.get(group[0])
        if add is not None and len(group) == 1:
            j = value_of[add]
            kernels[j], inside[j] = kernels[j] + kernels[i], inside[i] | inside[j]
            folded[i] = True
            continue
        reader = inline_reader(c, group)
        if reader is None:
            continue
        j = value_of[reader]
        kernel = kernels[j] + kernels[i]  # the reader's owner stays first
        if not _small(kernel, inside[i] | inside[j], value_of, costs, limits):
            continue
        kernels[j], inside[j] = kernel, inside[i] | inside[j]
        inlined.update(kernels[i])
        folded[i] = True
    return [k for k, gone in zip(kernels, folded, strict=True) if not gone], frozenset(inlined)


def inline_reader(c: CaptureContext, group: Sequence[fx.Node]) -> fx.Node | None:
    """The one FX node that reads this value, when Inductor inlines the value into it.

    Inductor's lowering keeps a pointwise result unrealized and inlines it into the loader
    of its reader, unless the reader needs a buffer (an extern kernel: matmul,
    convolution, attention), the result is an output of the graph, or the function grows
    too large. So: the value is a pointwise op or a constant factory (with views Inductor
    re-indexes), not random, not an output, not forced saved; it has one reader, a
    pointwise op or a reduction that does not mutate and runs in the same graph (forward
    or backward). ``c.extern``: pointwise ops Inductor turns into extern kernels (addmm)."""
    value_of, forward, costs, kept, extern = c.value_of, c.forward, c.costs, c.kept, c.extern
    head = group[0]
    cost = costs[head]
    if head.op != "call_function" or not (cost.is_pointwise or _is_factory(head)) or cost.is_random:
        return None
    if head in extern:
        return None
    phase = head in forward
    for n in group:
        if _stays_stored(n, kept):
            return None
        if (n is not head and not _inline_view(n)) or (n in forward) != phase:
            return None
    readers = readers_of(group)
    if len(readers) != 1:
        return None
    (u,) = readers
    if not _fusible_reader(u, costs, extern) or (u in forward) != phase:
        return None
    return u if u in value_of else None


def readers_of(group: Sequence[fx.Node]) -> set[fx.Node]:
    """The FX nodes outside a value's group that read it (through any of its nodes)."""
    return {u for n in group for u in n.users if u not in group}


def _stays_stored(n: fx.Node, kept: set[fx.Node]) -> bool:
    """Inductor stores this node's result whatever reads it: a graph output, a mutation,
    or a value PyTorch forces to be saved."""
    return n in kept or _mutates(n) or n.meta.get("recompute") is CheckpointPolicy.MUST_SAVE


# Ops Inductor lowers to a pointwise loop that loads its input at computed indices, so an
# unstored elementwise input is computed inside it (the loss's gather of the log-softmax;
# the zeros a slice's or a select's backward scatters into, as in rotary embeddings).
INDEXED_LOADS = frozenset({"gather", "slice_scatter", "select_scatter"})
# Ops Inductor lowers as a copy of their first input into a new buffer, then stores into it
# at computed indices (``index_put``: ``index_put_(clone(x), ...)``): the copy's kernel
# computes an elementwise input itself (the embedding gradient's zeros).
COPYING_SCATTERS = frozenset({"index_put", "_unsafe_index_put", "_unsafe_masked_index_put_accumulate",
                              "scatter", "scatter_add"})


def _fusible_reader(u: fx.Node, costs: dict[fx.Node, NodeCost], extern: Collection[fx.Node]) -> bool:
    """An op whose kernel can compute an elementwise input itself: a pointwise op, a
    reduction or an indexed load, that mutates nothing and that Inductor does not make an
    extern kernel."""
    if u.op != "call_function" or u not in costs or _mutates(u) or u in extern:
        return False
    if costs[u].is_pointwise:
        return True
    return isinstance(u.target, OpOverload) and (
        torch.Tag.reduction in u.target.tags or u.target._opname in INDEXED_LOADS | COPYING_SCATTERS)


# Ops whose results Inductor stores on the CPU when several ops read them
# (``should_realize_on_reuse``: too costly to compute once per reader).
HEAVY_OPS = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


def inline_values(c: CaptureContext) -> set[int]:
    """The values Inductor computes inside each op that reads them instead of storing them,
    wherever they are computed in the backward: elementwise, every reader able to compute
    them, and not worth storing for several readers (on the CPU no exp, log, sigmoid or
    tanh; at most :func:`realize_reads` buffers read, counted as Inductor counts them).
    Rules 3 and 15 of docs/inductor-memory.md."""
    groups, deps, forward, costs, kept, extern = c.groups, c.deps, c.forward, c.costs, c.kept, c.extern
    unstored: dict[int, frozenset[int]] = {}  # backward value read without its own buffer -> buffers read instead
    through: dict[int, frozenset[int]] = {}  # forward inline value, recomputed -> buffers read instead
    out: set[int] = set()
    limit = realize_reads()
    for i, group in enumerate(groups):
        if _is_factory(group[0]):
            # A constant is never worth storing for its readers: Inductor computes it in
            # each (the zeros several slice backwards scatter into).
            unstored[i] = frozenset()
            if (not any(_stays_stored(n, kept) for n in group)
                    and all(_fusible_reader(u, costs, extern) for u in readers_of(group))):
                out.add(i)
            continue
        reads = frozenset().union(*(unstored.get(d, {d}) for d in deps[i]))
        recomputed = frozenset().union(*(unstored.get(d, through.get(d, {d})) for d in deps[i]))
        if max(len(reads), len(recomputed)) <= limit and _inlinable(group, costs, kept, extern):
            out.add(i)
            if group[0] not in forward:
                unstored[i] = reads
            else:
                through[i] = recomputed
    return out


def per_reader_values(c: CaptureContext, inline: Collection[int]) -> dict[int, int]:
    """Forward values whose recomputation the backward emits once per reader, each copy
    computed inside its reader's kernel and never stored: value -> the kernels that
    compute it (:func:`rematc.emit.split_per_reader`). The recomputed values Inductor
    would store for several readers because they hold a tanh, exp, log or sigmoid, under
    :func:`inline_values`'s other conditions. Rule 3 of docs/inductor-memory.md."""
    groups, value_of, deps, forward, costs, kept, extern = (
        c.groups, c.value_of, c.deps, c.forward, c.costs, c.kept, c.extern)
    split: set[int] = set()

    def reads(i: int) -> frozenset[int]:
        return frozenset().union(*(reads(d) if d in inline or d in split else {d} for d in deps[i]))

    readers = [{u for u in readers_of(group) if u in costs} for group in groups]
    limit = realize_reads()
    for i, group in enumerate(groups):
        if group[0] not in forward or len(readers[i]) < 2:
            continue
        heavy = i not in inline or any(d in split for d in deps[i])
        if not heavy or len(reads(i)) > limit or not _elementwise(group, costs, kept, extern):
            continue
        if all(_fusible_reader(u, costs, extern) for u in readers[i]):
            split.add(i)
    final: dict[int, set[fx.Node]] = {}  # the readers that compute it, through split readers
    for i in sorted(split, reverse=True):
        final[i] = set().union(*(final.get(value_of.get(u, -1), {u}) for u in readers[i]))
    # A forward reader recomputed is a kernel of its own (stored: a matmul reads the GELU);
    # the backward's readers of one value fuse into one gradient kernel.
    return {i: sum(u in forward for u in final[i]) + any(u not in forward for u in final[i]) for i in split}


def _inlinable(group: Sequence[fx.Node], costs: dict[fx.Node, NodeCost], kept: set[fx.Node],
               extern: Collection[fx.Node]) -> bool:
    """Elementwise throughout, read by elementwise ops and reductions only, not stored for
    another reason, and on the CPU free of the ops Inductor will not compute twice."""
    if not _elementwise(group, costs, kept, extern):
        return False
    if not all(_fusible_reader(u, costs, extern) for u in readers_of(group)):
        return False
    head = group[0]
    return not (costs[head].device == "cpu" and any(
        isinstance(n.target, OpOverload) and n.target._opname in HEAVY_OPS for n in group))


def addmm_pairs(joint: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """``mm -> add`` for every ``add(mm(a, b), c)`` that Inductor rewrites into
    ``addmm(c, a, b)``: the mm has no other reader, ``c`` is a tensor of the same dtype that
    broadcasts to the product, and on a GPU not every reader of the add is pointwise.
    Rule 2 of docs/inductor-memory.md."""
    out: dict[fx.Node, fx.Node] = {}
    for add in joint.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor):
        if add.kwargs or len(add.args) != 2 or add in out.values():
            continue
        for mm, c in (add.args, add.args[::-1]):
            if isinstance(mm, fx.Node) and _merges_into_addmm(mm, c, add):
                out[mm] = add
                break
    return out


def _merges_into_addmm(mm: fx.Node, c: object, add: fx.Node) -> bool:
    if not (mm.target is torch.ops.aten.mm.default and len(mm.users) == 1):
        return False
    if not isinstance(c, fx.Node) or mm is c:
        return False
    a, b = mm.args[:2]
    vals = [x.meta.get("val") for x in (a, b, c) if isinstance(x, fx.Node)]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if len(tensors) != 3:
        return False
    va, vb, vc = tensors
    if not (va.dtype == vb.dtype == vc.dtype) or not is_expandable_to(vc.shape, (va.shape[0], vb.shape[1])):
        return False
    return not (is_gpu(vc.device.type) and all(is_pointwise_use(u) for u in add.users))


def place_addmm_operands(joint: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Of the pairs of :func:`addmm_pairs`, move each matmul to just before its add, where
    Inductor runs it, so that the problem's order, the emitted graph (a recomputed input of
    the matmul is placed before its first reader) and Inductor's code agree; except where
    the move holds more bytes than it saves (:func:`held_for_addmm`): there the matmul
    stays where autograd placed it and the add is rewritten so that Inductor does not
    merge it (:func:`keep_unmerged`). Returns the pairs moved."""
    pairs = addmm_pairs(joint)
    # Every pair is weighed on the graph as autograd ordered it, before any pair is moved
    # or rewritten (a rewrite adds a node that ``position`` does not know).
    position = {n: i for i, n in enumerate(joint.graph.nodes)}
    unmerged = {mm for mm, add in pairs.items() if held_for_addmm(mm, add, position) > val_bytes(mm)}
    moved: dict[fx.Node, fx.Node] = {}
    for mm, add in pairs.items():
        if mm in unmerged:
            keep_unmerged(mm, add)
        else:
            add.prepend(mm)
            moved[mm] = add
    if pairs:
        joint.recompile()
    return moved


def held_for_addmm(mm: fx.Node, add: fx.Node, position: dict[fx.Node, int]) -> int:
    """Bytes that running ``mm`` at ``add`` keeps alive from the mm's place to the add: the
    storages it reads (not the step's inputs, alive anyway) that nothing else reads that
    late. Over that stretch the merge holds these instead of the mm's result, step for
    step: the tied embedding's gradient ``add(mm(dlogits^T, h), scatter)`` holds the
    logits-sized gradient through the whole backward to save holding a vocab x d one."""
    graph = mm.graph
    inputs = {StorageWeakRef(t.untyped_storage()) for p in graph.find_nodes(op="placeholder")
              for t in tensors(p.meta.get("val"))}
    stores = {key: t for a in mm.all_input_nodes for t in tensors(a.meta.get("val"))
              if (key := StorageWeakRef(t.untyped_storage())) not in inputs}
    last = dict.fromkeys(stores, -1)
    for n in graph.nodes:
        if n is mm:
            continue
        for a in n.all_input_nodes:
            for t in tensors(a.meta.get("val")):
                key = StorageWeakRef(t.untyped_storage())
                if key in last:
                    last[key] = max(last[key], position[n])
    return sum(storage_bytes(t) for key, t in stores.items() if last[key] < position[add])


def keep_unmerged(mm: fx.Node, add: fx.Node) -> None:
    """Replace ``add(mm, c)`` by ``sub(c, mm, alpha=-1)``, which Inductor's post-grad
    ``addmm`` pattern does not match (it ignores keywords it does not name, so an
    ``alpha=1`` on the add would not do). The result is the same to the bit: negating is
    exact and c - (-m) is c + m."""
    c = next(a for a in add.args if a is not mm)
    with add.graph.inserting_before(add):
        sub = add.graph.call_function(torch.ops.aten.sub.Tensor, (c, mm), {"alpha": -1})
    sub.meta = dict(add.meta)
    add.replace_all_uses_with(sub)
    add.graph.erase_node(add)


def _reads(kernel: Sequence[fx.Node], inside: set[int], value_of: dict[fx.Node, int]) -> int:
    return len({value_of[a] for n in kernel for a in n.all_input_nodes if a in value_of} - inside)


def _pointwise_ops(kernel: Sequence[fx.Node], costs: dict[fx.Node, NodeCost]) -> int:
    return sum(1 for n in kernel if costs[n].is_pointwise)


def _small(kernel: Sequence[fx.Node], inside: set[int], value_of: dict[fx.Node, int],
           costs: dict[fx.Node, NodeCost], limits: KernelLimits) -> bool:
    return _pointwise_ops(kernel, costs) <= limits.ops and _reads(kernel, inside, value_of) <= limits.reads


def _is_factory(n: fx.Node) -> bool:
    return (n.op == "call_function" and isinstance(n.target, OpOverload)
            and n.target._opname in FACTORY_OPS and not n.all_input_nodes)


def _inline_view(n: fx.Node) -> bool:
    return isinstance(n.target, OpOverload) and n.target._opname in INLINE_VIEWS


def deferred_to_reader(c: CaptureContext, order: Sequence[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Backward elementwise values that Inductor computes only when their one reader, an
    extern kernel, is lowered (so after the recomputations placed before that kernel):
    value -> that reader. Rule 8 of docs/inductor-memory.md."""
    forward, costs, kept = c.forward, c.costs, c.kept
    out: dict[fx.Node, fx.Node] = {}
    for n in order:
        if n in forward or n.op != "call_function" or n not in costs or _stays_stored(n, kept):
            continue
        cost = costs[n]
        if not cost.is_pointwise or cost.is_random or len(n.users) != 1:
            continue
        (u,) = n.users
        if (u.op == "call_function" and u not in forward and u in costs and not costs[u].is_view
                and not _fusible_reader(u, costs, ())):
            out[n] = u
    return out


def _backward_order(nodes: list[fx.Node], forward: frozenset[fx.Node]) -> list[fx.Node]:
    """Backward nodes in autograd's order: from the first reader of a tangent on, each node
    after the backward inputs it still needs (earlier backward nodes are pulled in lazily)."""
    position = {n: k for k, n in enumerate(nodes)}
    backward = [n for n in nodes if n not in forward]
    # The output node is not placed: a tangent returned unchanged as a gradient has no reader.
    readers = [u for t in backward if is_tangent(t) or is_bwd_seed_offset(t)
               for u in t.users if u in position]
    start = min((position[u] for u in readers), default=len(nodes))
    placed: set[fx.Node] = set()
    out: list[fx.Node] = []

    def place(n: fx.Node) -> None:
        stack, pending = [n], []
        while stack:
            m = stack.pop()
            if m in placed or m in forward:
                continue
            placed.add(m)
            pending.append(m)
            stack.extend(m.all_input_nodes)
        out.extend(sorted(pending, key=position.__getitem__))

    for n in backward:
        if is_tangent(n) or is_bwd_seed_offset(n):
            place(n)
    for n in backward:
        if position[n] >= start:
            place(n)
    for n in backward:  # anything autograd's walk would not reach still runs
        place(n)
    return out


def _root_gradient(n: fx.Node) -> bool:
    """Whether ``n`` is the tangent of a one-element output: the gradient
    ``loss.backward()`` makes (ones) where that output is the loss, which
    ``torch.autograd.backward`` holds until the whole backward returns. The tangents of
    larger outputs come from autograd's other nodes and die after their last reader here."""
    val = n.meta.get("val")
    return is_tangent(n) and isinstance(val, torch.Tensor) and val.numel() == 1


def _has_storage(cost: NodeCost) -> bool:
    return bool(cost.owner) and (cost.nbytes > 0 or cost.is_view or cost.dtype != "")


def _recomputable(group: list[fx.Node], costs: dict[fx.Node, NodeCost]) -> bool:
    """Save-only: placeholders; random ops, since a recompute would draw a new mask
    (pytorch#190717), except Inductor's seeded prims, which replay exactly from their
    saved seed; and values PyTorch forces to be saved (collectives, effectful ops,
    backward mutation sources: ``meta['recompute'] == MUST_SAVE``) or that mutate."""
    for n in group:
        if n.op == "placeholder" or (costs[n].is_random and not costs[n].is_seeded):
            return False
        if n.meta.get("recompute") is CheckpointPolicy.MUST_SAVE:
            return False
        if _mutates(n):
            return False
    return True


def checkpointed_values(problem: Problem, groups: Sequence[Sequence[fx.Node]]) -> frozenset[int]:
    """The candidates the model's own activation checkpointing recomputes.

    ``torch.utils.checkpoint`` (non-reentrant, as ``gradient_checkpointing_enable()`` uses)
    and selective checkpointing tag the forward nodes of each checkpointed region
    ``MUST_RECOMPUTE`` or ``PREFER_RECOMPUTE``, numbering regions by ``ac_graph_id``. As in
    PyTorch's partitioners (``cleanup_recompute_tags``), a region's output that a later
    region reads is kept: it is the later region's input."""
    out = set()
    for v in problem.candidates:
        head = groups[v][0]
        if not (problem.nodes[v].recomputable and _tagged_recompute(head)):
            continue
        region = head.meta.get("ac_graph_id")
        if region is not None and any(
                _tagged_recompute(u) and u.meta.get("ac_graph_id", region) > region
                for n in groups[v] for u in n.users):
            continue
        out.add(v)
    return frozenset(out)


def _tagged_recompute(n: fx.Node) -> bool:
    return n.meta.get("recompute") in (CheckpointPolicy.MUST_RECOMPUTE,
                                       CheckpointPolicy.PREFER_RECOMPUTE)


def broadcast_bias_sources(nodes: Sequence[fx.Node], forward: frozenset[fx.Node],
                           costs: dict[fx.Node, NodeCost]) -> frozenset[fx.Node]:
    """Forward values that an attention backward of :data:`rematc.annotate.DENSE_BIAS_OPS`
    reads through a broadcast view as its bias: save-only under Inductor. Saved, the
    backward reads the bias as a realized input, broadcast in place; recomputed in the
    backward, Inductor writes it out at the broadcast shape for the kernel (a (batch, 1,
    S, S) mask over 32 heads: a copy 32 times its size). Rule 16 of
    docs/inductor-memory.md; :func:`rematc.annotate.dense_bias_bytes` counts the copy
    made all the same, of a bias whose rows are not aligned."""
    sources: set[fx.Node] = set()
    for n in nodes:
        if n in forward or broadcast_bias(n) is None:
            continue
        bias = n.args[DENSE_BIAS_OPS[n.target]]
        while isinstance(bias, fx.Node) and bias in costs and costs[bias].is_view and bias.args:
            bias = bias.args[0]
        if isinstance(bias, fx.Node) and bias in forward and bias.op == "call_function":
            sources.add(bias)
    return frozenset(sources)


def reads_mutated_input(nodes: Sequence[fx.Node], forward: frozenset[fx.Node],
                        costs: dict[fx.Node, NodeCost]) -> frozenset[fx.Node]:
    """Forward nodes that read an input the forward updates in place, directly or through
    a view of it: save-only.

    AOTAutograd keeps a forward input mutation in the joint graph as a ``copy_`` into the
    input, or applies it after the graph (an input that requires grad:
    :func:`inputs_updated_after`), so by the time the backward runs the input holds its
    new value. A recomputation reading it would compute from that new value, not the one
    the forward read: a wrong gradient without an error, or autograd's error that a saved
    tensor was modified in place (the input, saved to recompute from).

    The same for a node that reads a step of the input's new value: a value computed from
    the input on the way to what is copied into it (``slice_scatter(z, ...)`` then ``* 0.5``
    for ``z[:, :32].mul_(2); z.mul_(0.5)``). Inductor writes those steps into the input's
    own buffer, so a saved step is overwritten by the later ones, and a recomputation from
    it computes from the new value (a gradient half the true one, and the input updated
    again, in a case the fuzzer found)."""
    mutating = [n for n in nodes if n in forward and _mutates(n) and n.args
                and isinstance(n.args[0], fx.Node) and n.args[0] in costs]
    updates = [n for n in mutating if len(n.args) > 1 and isinstance(n.args[1], fx.Node)]  # copy_(input, value)
    mutated = {costs[n.args[0]].owner for n in mutating if isinstance(n.args[0], fx.Node)}
    if nodes:
        mutated |= {costs[n].owner for n in inputs_updated_after(nodes[0].graph) if n in costs}
    mutated &= {n.name for n in nodes if n.op == "placeholder"}
    if not mutated:
        return frozenset()
    aliases = {n for n in nodes if costs[n].owner in mutated}  # the inputs and their views
    steps = _steps_to_new_values(updates, aliases, forward)
    return frozenset(n for n in nodes if n in forward and n.op != "placeholder"
                     and (n in aliases or aliases.intersection(n.all_input_nodes)
                          or steps.intersection(n.all_input_nodes)))


def _steps_to_new_values(updates: Sequence[fx.Node], aliases: set[fx.Node],
                         forward: frozenset[fx.Node]) -> set[fx.Node]:
    """The forward nodes computed from a mutated input (one of ``aliases``) on the way to
    a value an update (``copy_(input, value)``, one of ``updates``) writes into an input:
    those that descend from the input and lead to the value, the value included, of the
    input's shape and dtype (:func:`_fits_in`)."""
    if not updates:
        return set()
    descends: set[fx.Node] = set()
    frontier = [u for a in aliases for u in a.users if u in forward]
    while frontier:
        n = frontier.pop()
        if n not in descends:
            descends.add(n)
            frontier.extend(u for u in n.users if u in forward)
    steps: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    # (node, the input its value is on the way to)
    toward: list[tuple[Any, Any]] = [(u.args[1], u.args[0]) for u in updates if u.args[0] in aliases]
    while toward:
        n, target = toward.pop()
        if not isinstance(n, fx.Node) or n in seen or n not in descends or n in updates:
            continue
        seen.add(n)
        if _fits_in(n, target):  # a value Inductor may compute in the input's buffer
            steps.add(n)
        toward.extend((m, target) for m in n.all_input_nodes)
    return steps


def _fits_in(n: fx.Node, target: Any) -> bool:
    """Whether ``n``'s value is one tensor of the shape and dtype of ``target``'s (an
    input's): one that could be computed in that input's storage. A multi-output op (the
    functional BatchNorm, whose new running statistics are copied into the buffers) is
    not, nor are its other outputs."""
    val, into = n.meta.get("val"), target.meta.get("val") if isinstance(target, fx.Node) else None
    return (isinstance(val, torch.Tensor) and isinstance(into, torch.Tensor)
            and val.shape == into.shape and val.dtype == into.dtype)


def _offloadable(group: list[fx.Node], costs: dict[fx.Node, NodeCost]) -> bool:
    """The owner is one dense tensor spanning the whole storage, and the rest of the value
    are views of it: then a host copy of the owner stands in for the value, and the
    backward re-derives the views it reads from the copy (views cost nothing). A
    multi-output op's storage is several tensors: not one copy."""
    owner = group[0]
    val = owner.meta.get("val")
    return (
        owner.op == "call_function"
        and isinstance(val, torch.Tensor)
        and val.layout is torch.strided
        and val.is_contiguous()
        and optimization_hint(val.numel()) * val.element_size() == costs[owner].nbytes
        and not any(_mutates(n) for n in group)
    )


def _mutates(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, OpOverload) and (
        n.target._schema.is_mutable
    )


def _op_name(n: fx.Node) -> str:
    if n.op == "placeholder":
        return "input"
    target = n.target
    if isinstance(target, OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))
