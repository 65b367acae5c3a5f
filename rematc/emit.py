"""From a plan back to FX: the forward graph (returning what is saved) and the backward
graph (recomputing the rest just before first use).

Invariants of :func:`emit`:

* the forward computes exactly what the joint graph's forward computed, and returns the
  real outputs followed by the saved values (AOTAutograd's calling convention);
* every FX node of a RECOMPUTE value that the backward reads is copied into the backward,
  placed right before its first use, in dependency order; nothing else from the forward
  is copied, which :func:`verify` checks;
* no pass runs CSE across the two graphs afterwards, so the backward's copies are never
  merged back into saved values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch._functorch._aot_autograd.graph_compile import is_opaque_node
from torch._functorch.compile_utils import raise_getitems
from torch._functorch.partitioners import (
    _extract_fwd_bwd_modules,
    _is_primal,
    classify_nodes,
    reordering_to_mimic_autograd_engine,
)
from torch.fx.experimental.proxy_tensor import is_sym_node

from rematc.capture import Captured
from solvers import Decision, Plan


class EmitError(RuntimeError):
    """The emitted graphs do not do what the plan says (a bug in rematc: please report)."""


@dataclass(frozen=True)
class Emitted:
    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: tuple[str, ...]  # FX names of the saved tensors, in order
    recomputed: tuple[str, ...]  # FX names of forward nodes copied into the backward


def emit(
    joint: fx.GraphModule,
    captured: Captured,
    plan: Plan,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int],
) -> Emitted:
    recompute = recomputed_nodes(captured, plan)
    backward_region = {n for n in joint.graph.nodes if n.op != "output" and n not in captured.forward}
    backward_region |= recompute
    saved_all = [
        n
        for n in joint.graph.nodes
        if n in captured.forward and n not in recompute and any(u in backward_region for u in n.users)
    ]
    saved_sym = [n for n in saved_all if is_sym_node(n)]
    saved_opaque = [n for n in saved_all if is_opaque_node(n)]
    saved = [n for n in saved_all if not is_sym_node(n) and not is_opaque_node(n)]
    info = classify_nodes(joint, static_lifetime_input_indices, num_fwd_outputs)
    fw, bw = _extract_fwd_bwd_modules(
        joint,
        saved,
        saved_sym_nodes=saved_sym,
        saved_opaque_nodes=saved_opaque,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=info.static_lifetime_input_nodes,
    )
    bw = reordering_to_mimic_autograd_engine(bw)
    fw, bw = raise_getitems(fw), raise_getitems(bw)
    emitted = Emitted(
        forward=fw,
        backward=bw,
        saved=tuple(n.name for n in saved),
        recomputed=tuple(sorted(n.name for n in recompute)),
    )
    return emitted


def recomputed_nodes(captured: Captured, plan: Plan) -> set[fx.Node]:
    """Forward FX nodes the backward recomputes: every node of a RECOMPUTE value."""
    return {
        n
        for i, d in plan.decisions.items()
        if d is Decision.RECOMPUTE
        for n in captured.groups[i]
        if n in captured.forward
    }


def verify(joint: fx.GraphModule, captured: Captured, plan: Plan, emitted: Emitted) -> None:
    """Check the emitted graphs against the plan (cheap; on by default):

    * every node is defined before it is used, in both graphs (FX lint);
    * the backward contains a copy of exactly the planned recomputations that it reads,
      and no other forward node;
    * each copy calls the same op with the same arguments as its original.
    """
    for gm in (emitted.forward, emitted.backward):
        gm.graph.lint()
    fwd_names = {n.name for n in captured.forward}
    planned = set(emitted.recomputed)
    joint_by_name = {n.name: n for n in joint.graph.nodes}
    placeholders = {n.name for n in emitted.backward.graph.find_nodes(op="placeholder")}
    for n in emitted.backward.graph.nodes:
        if n.op != "call_function" or n.name not in fwd_names or n.name in placeholders:
            continue
        if n.name not in planned:
            raise EmitError(f"backward recomputes {n.format_node()}, which the plan saves")
        original = joint_by_name[n.name]
        if n.target is not original.target or _arg_names(n) != _arg_names(original):
            raise EmitError(
                f"recomputed {n.format_node()} differs from its original {original.format_node()}"
            )
    for name in emitted.saved:
        node = joint_by_name[name]
        if not _is_primal(node) and node not in captured.forward:
            raise EmitError(f"saved value {name} is not computed by the forward")


def _arg_names(n: fx.Node) -> str:
    """The node's arguments with nodes replaced by their names (copies keep the names)."""
    return repr(fx.node.map_arg((n.args, n.kwargs), lambda a: a.name))
