"""From AOTAutograd's joint graph to a torch-free :class:`solvers.Problem`.

The joint graph holds the forward and the backward of one training step. Here we

1. split it the way PyTorch's partitioners do: the forward is what the forward outputs
   need (``classify_nodes``); everything else runs in the backward;
2. fold FX nodes into *values*, one per storage: a view, an in-place result or the
   ``getitem`` of a multi-output op belongs to the value that owns its storage
   (:mod:`rematc.annotate`), so saving or freeing it is one decision and its bytes
   count once; nodes without tensor output (symbolic sizes) pass their inputs through;
3. order the backward as the emitted graph will run it: autograd's order, with each
   node's not-yet-computed backward inputs placed just before it (what
   ``reordering_to_mimic_autograd_engine`` does to the emitted backward).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._functorch.partitioners import (
    _extract_fwd_bwd_outputs,
    _is_bwd_seed_offset,
    _is_fwd_seed_offset,
    _is_primal,
    _is_tangent,
    classify_nodes,
)
from torch.utils.checkpoint import CheckpointPolicy

from rematc.annotate import NodeCost
from solvers import Node, Problem


@dataclass(frozen=True)
class Captured:
    """A problem and the FX nodes behind each of its values."""

    problem: Problem
    groups: tuple[tuple[fx.Node, ...], ...]  # FX nodes of each value, owner first
    value_of: dict[fx.Node, int]  # FX node -> value index (absent: no tensor output)
    forward: frozenset[fx.Node]  # FX nodes the forward computes


def capture(
    joint: fx.GraphModule,
    costs: dict[fx.Node, NodeCost],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Sequence[int] = (),
    host_bandwidth: float = 0.0,
    name: str = "joint",
) -> Captured:
    info = classify_nodes(joint, list(static_lifetime_input_indices), num_fwd_outputs)
    nodes: list[fx.Node] = [n for n in joint.graph.nodes if n.op != "output"]
    fwd = {n for n in nodes if n in info.required_fw_nodes or _is_primal(n) or _is_fwd_seed_offset(n)}
    # An element of a forward multi-output op is forward too, even when only the backward
    # reads it: the tuple itself cannot cross into the backward, its elements can.
    fwd |= {n for n in nodes if n.target is operator.getitem and n.args[0] in fwd}
    forward = frozenset(fwd)
    fwd_outputs, bwd_outputs, _, _ = _extract_fwd_bwd_outputs(joint, num_fwd_outputs=num_fwd_outputs)
    kept = {o for o in (*fwd_outputs, *bwd_outputs) if isinstance(o, fx.Node)}

    by_name = {n.name: n for n in nodes}
    owner = {n: by_name[costs[n].owner] for n in nodes if _has_storage(costs[n])}
    # Storages alive before the step (parameters, inputs, buffers) cost nothing, so
    # nodes aliasing them (a transposed weight, an in-place buffer update) need no
    # grouping: each stays its own zero-byte value with its own inputs and position.
    for n, o in owner.items():
        if o.op == "placeholder" and (_is_primal(o) or _is_fwd_seed_offset(o)):
            owner[n] = n
    order = [n for n in nodes if n in forward] + _backward_order(nodes, forward)
    owners: list[fx.Node] = [n for n in order if owner.get(n) is n]
    value_of: dict[fx.Node, int] = {n: i for i, n in enumerate(owners)}
    groups: list[list[fx.Node]] = [[o] for o in owners]
    for n in nodes:
        if n in owner and owner[n] is not n:
            value_of[n] = value_of[owner[n]]
            groups[value_of[n]].append(n)

    deps_memo: dict[fx.Node, frozenset[int]] = {}

    def value_deps(n: fx.Node) -> frozenset[int]:
        """Values ``n`` reads, looking through nodes without a storage."""
        if n not in deps_memo:
            out: set[int] = set()
            for a in n.all_input_nodes:
                out |= {value_of[a]} if a in value_of else value_deps(a)
            deps_memo[n] = frozenset(out)
        return deps_memo[n]

    problem_nodes: list[Node] = []
    for i, group in enumerate(groups):
        head = group[0]
        deps = set().union(*(value_deps(n) for n in group)) - {i}
        problem_nodes.append(
            Node(
                name=head.name,
                op=_op_name(head),
                deps=tuple(sorted(deps)),
                backward=head not in forward,
                size=costs[head].nbytes,
                time=sum(costs[n].recompute_time for n in group),
                flops=sum(costs[n].flops for n in group),
                recomputable=_recomputable(group, costs),
                offloadable=_offloadable(group, costs),
                resident=_is_primal(head) or _is_fwd_seed_offset(head),
                keep=any(n in kept for n in group),
            )
        )
    problem = Problem(nodes=tuple(problem_nodes), host_bandwidth=host_bandwidth, name=name)
    return Captured(problem, tuple(tuple(g) for g in groups), value_of, forward)


def _backward_order(nodes: list[fx.Node], forward: frozenset[fx.Node]) -> list[fx.Node]:
    """Backward nodes in autograd's order: from the first reader of a tangent on, each node
    after the backward inputs it still needs (earlier backward nodes are pulled in lazily)."""
    position = {n: k for k, n in enumerate(nodes)}
    backward = [n for n in nodes if n not in forward]
    readers = [u for t in backward if _is_tangent(t) or _is_bwd_seed_offset(t) for u in t.users]
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
        if _is_tangent(n) or _is_bwd_seed_offset(n):
            place(n)
    for n in backward:
        if position[n] >= start:
            place(n)
    for n in backward:  # anything autograd's walk would not reach still runs
        place(n)
    return out


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
        and val.numel() * val.element_size() == costs[owner].nbytes
        and not any(_mutates(n) for n in group)
    )


def _mutates(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and (
        n.target._schema.is_mutable
    )


def _op_name(n: fx.Node) -> str:
    if n.op == "placeholder":
        return "input"
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))
