"""From a plan back to FX: the forward graph (returning what is saved) and the backward
graph (recomputing the rest just before first use).

Invariants of :func:`emit`:

* the forward computes exactly what the joint graph's forward computed, and returns the
  real outputs followed by the saved values (AOTAutograd's calling convention);
* every FX node of a RECOMPUTE value that the backward reads is copied into the backward,
  placed right before its first use, in dependency order; nothing else from the forward
  is copied, which :func:`verify` checks;
* every OFFLOAD value is saved as a host copy: the forward starts the copy after its last
  forward use and waits for it (freeing the device tensor) after the plan's ``offload_at``
  step; the backward starts the copy back before the plan's ``reload_at`` step and waits
  for it just before the first use (:mod:`rematc.offload`);
* no pass runs CSE across the two graphs afterwards, so the backward's copies are never
  merged back into saved values.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from rematc._torch_compat import (
    classify_nodes,
    detect_fake_mode,
    extract_fwd_bwd_modules,
    is_opaque_node,
    is_primal,
    is_sym_node,
    raise_getitems,
    reordering_to_mimic_autograd_engine,
)
from rematc.capture import Captured
from rematc.offload import OFFLOAD, RELOAD, WAIT
from solvers import Decision, Plan, Transfer


class EmitError(RuntimeError):
    """The emitted graphs do not do what the plan says (a bug in rematc: please report)."""


@dataclass(frozen=True)
class Emitted:
    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: tuple[str, ...]  # FX names of the saved tensors, in order
    recomputed: tuple[str, ...]  # FX names of forward nodes copied into the backward
    offloaded: tuple[str, ...] = ()  # FX names of the saved tensors kept in host memory


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
    # An offloaded value crosses as one tensor, its owner; the backward re-derives the
    # views of it that it reads (free: views move no data).
    for t in plan.transfers:
        group = captured.groups[t.node]
        at = min(k for k, n in enumerate(saved) if n in group)
        saved = [*saved[:at], group[0], *(n for n in saved[at:] if n not in group)]
    info = classify_nodes(joint, static_lifetime_input_indices, num_fwd_outputs)
    fw, bw = extract_fwd_bwd_modules(
        joint,
        saved,
        saved_sym_nodes=saved_sym,
        saved_opaque_nodes=saved_opaque,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=info.static_lifetime_input_nodes,
    )
    bw = reordering_to_mimic_autograd_engine(bw)
    fw, bw = raise_getitems(fw), raise_getitems(bw)
    if split_per_reader(bw, captured, plan):
        bw.recompile()
    offloaded = [captured.groups[t.node][0].name for t in plan.transfers]
    for t, name in zip(plan.transfers, offloaded, strict=True):
        emit_offload(fw, bw, captured, t, name)
    if offloaded:  # the graphs changed after extraction generated their code
        for gm in (fw, bw):
            gm.recompile()
    return Emitted(
        forward=fw,
        backward=bw,
        saved=tuple(n.name for n in saved),
        recomputed=tuple(sorted(n.name for n in recompute)),
        offloaded=tuple(offloaded),
    )


def emit_offload(fw: fx.GraphModule, bw: fx.GraphModule, captured: Captured, t: Transfer,
                 name: str) -> None:
    """Rewrite the saved tensor ``name`` into a host copy and its reload (module docstring).

    Positions follow the plan where the graphs allow: after the last forward node of step
    ``offload_at`` and before the first backward node of step ``reload_at``; a position
    that would break the data flow falls back to the nearest one that does not."""
    fwd = {n.name: n for n in fw.graph.nodes}
    x = fwd[name]
    order = {n: k for k, n in enumerate(fw.graph.nodes)}
    # The copy starts after the last forward read of any view of x.
    members = [fwd[n.name] for n in captured.groups[t.node] if n.name in fwd]
    uses = [u for m in members for u in m.users if u.op != "output"]
    issue_after = max([x, *members, *uses], key=order.__getitem__)
    step_nodes = [fwd[n.name] for n in captured.groups[t.offload_at] if n.name in fwd]
    wait_after = max([issue_after, *step_nodes], key=order.__getitem__)
    val = x.meta.get("val")
    device = val.device if isinstance(val, torch.Tensor) else torch.device("cpu")
    with fw.graph.inserting_after(issue_after):
        host = fw.graph.call_function(OFFLOAD, (x,))
    with fw.graph.inserting_after(wait_after if wait_after is not issue_after else host):
        saved = fw.graph.call_function(WAIT, (host, x))
    host.meta["val"] = saved.meta["val"] = _fake(OFFLOAD, val)
    output = fw.graph.find_nodes(op="output")[0]
    output.args = fx.node.map_arg(output.args, lambda a: saved if a is x else a)

    bwd = {n.name: n for n in bw.graph.nodes}
    placeholder = bwd[name]
    order = {n: k for k, n in enumerate(bw.graph.nodes)}
    first_use = min(placeholder.users, key=order.__getitem__)
    step_nodes = [bwd[n.name] for n in captured.groups[t.reload_at] if n.name in bwd]
    start_before = min([first_use, *step_nodes], key=order.__getitem__)
    with bw.graph.inserting_before(start_before):
        copy = bw.graph.call_function(RELOAD, (placeholder, device))
    with bw.graph.inserting_before(first_use):
        ready = bw.graph.call_function(WAIT, (copy, placeholder))
    placeholder.replace_all_uses_with(ready, delete_user_cb=lambda u: u not in (copy, ready))
    placeholder.meta["val"] = host.meta["val"]
    copy.meta["val"] = ready.meta["val"] = val


def _fake(op: Any, val: Any) -> Any:
    """``op``'s fake result for a fake input (metadata for the compilers downstream)."""
    if not isinstance(val, torch.Tensor):
        return None
    mode = detect_fake_mode([val])
    with mode if mode is not None else nullcontext():
        return op(val)


PER_READER = "_per_reader"  # a per-reader copy's name: the original's and this


def split_per_reader(bw: fx.GraphModule, captured: Captured, plan: Plan) -> int:
    """Give each backward reader of a recomputed ``per_reader`` value its own copy of the
    value's nodes, placed right before it, so that Inductor computes it inside that
    reader's kernel instead of storing it (:func:`rematc.capture.per_reader_values`).
    Copies are named ``<original>_per_reader`` (FX numbers further ones). Returns how
    many copies were made."""
    by_name = {n.name: n for n in bw.graph.nodes}
    copies = 0
    for i in sorted(captured.per_reader, reverse=True):  # readers first: their copies read it
        if plan.decisions.get(i) is not Decision.RECOMPUTE:
            continue
        chain = [by_name[n.name] for n in captured.groups[i] if n.name in by_name]
        members = set(chain)
        position = {n: k for k, n in enumerate(bw.graph.nodes)}
        chain.sort(key=position.__getitem__)
        readers = sorted({u for n in chain for u in n.users if u not in members}, key=position.__getitem__)
        for reader in readers[1:]:
            for original, copy in _copy_before(bw, chain, reader).items():
                reader.replace_input_with(original, copy)
            copies += 1
    return copies


def _copy_before(bw: fx.GraphModule, chain: list[fx.Node], reader: fx.Node) -> dict[fx.Node, fx.Node]:
    """Copies of ``chain`` (in order, each reading the copies before it) placed before ``reader``."""
    made: dict[fx.Node, fx.Node] = {}
    with bw.graph.inserting_before(reader):
        for n in chain:
            made[n] = bw.graph.node_copy(n, lambda a: made.get(a, a))
            # A name no joint-graph node has, which :func:`verify` maps back to the original.
            made[n]._rename(f"{n.name}{PER_READER}")
    return made


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
    * each copy calls the same op with the same arguments as its original (a per-reader
      copy: the same op as its original);
    * every offloaded tensor is copied out once and waited for once in the forward, which
      saves the host copy instead of it, and copied back once in the backward, waited
      for before every other use (:func:`verify_offload`).
    """
    for gm in (emitted.forward, emitted.backward):
        gm.graph.lint()
    fwd_names = {n.name for n in captured.forward}
    planned = set(emitted.recomputed) | {
        n.name for t in plan.transfers for n in captured.groups[t.node][1:]
    }
    joint_by_name = {n.name: n for n in joint.graph.nodes}
    placeholders = {n.name for n in emitted.backward.graph.find_nodes(op="placeholder")}
    # A recomputation that reads an offloaded tensor reads the wait for its copy back.
    reloaded = {w.name: w.args[1].name for w in emitted.backward.graph.nodes
                if w.target is WAIT and isinstance(w.args[1], fx.Node)}
    copies: dict[str, str] = {}  # a per-reader copy's name -> its original's
    for n in emitted.backward.graph.nodes:
        if n.op == "call_function" and PER_READER in n.name and n.name not in fwd_names:
            original_name = n.name.rsplit(PER_READER, 1)[0]
            if original_name not in planned or n.target is not joint_by_name[original_name].target:
                raise EmitError(f"backward copy {n.format_node()} is no planned recomputation")
            copies[n.name] = original_name
    for n in emitted.backward.graph.nodes:
        if n.op != "call_function" or n.name not in fwd_names or n.name in placeholders:
            continue
        if n.target in (OFFLOAD, RELOAD, WAIT):
            continue
        if n.name not in planned:
            raise EmitError(f"backward recomputes {n.format_node()}, which the plan saves")
        original = joint_by_name[n.name]
        if n.target is not original.target or _arg_names(n, {**copies, **reloaded}) != _arg_names(original):
            raise EmitError(
                f"recomputed {n.format_node()} differs from its original {original.format_node()}"
            )
    verify_offload(emitted)
    for name in emitted.saved:
        node = joint_by_name[name]
        if not is_primal(node) and node not in captured.forward:
            raise EmitError(f"saved value {name} is not computed by the forward")


def verify_offload(emitted: Emitted) -> None:
    """The offload pattern of :mod:`rematc.offload`, exactly once per offloaded tensor."""
    fw, bw = emitted.forward.graph, emitted.backward.graph
    fwd = {n.name: n for n in fw.nodes}
    outputs = set(fw.find_nodes(op="output")[0].all_input_nodes)
    for name in emitted.offloaded:
        x = fwd[name]
        copies = [u for u in x.users if u.target is OFFLOAD]
        waits = [u for u in x.users if u.target is WAIT]
        if len(copies) != 1 or len(waits) != 1 or waits[0].args[0] is not copies[0]:
            raise EmitError(f"forward: {name} needs one copy out and one wait for it, has "
                            f"{len(copies)} and {len(waits)}")
        if x in outputs or waits[0] not in outputs:
            raise EmitError(f"forward: {name} must be saved as its host copy, not itself")
    placeholders = {n.name: n for n in bw.find_nodes(op="placeholder")}
    for name in emitted.offloaded:
        host = placeholders[name]
        copies = [u for u in host.users if u.target is RELOAD]
        waits = [u for u in host.users if u.target is WAIT]
        others = [u for u in host.users if u not in copies and u not in waits]
        if len(copies) != 1 or len(waits) != 1 or waits[0].args[0] is not copies[0] or others:
            raise EmitError(f"backward: {name} needs exactly one copy back and one wait, read "
                            f"by nothing else; has {len(copies)}, {len(waits)} and {len(others)}")


def _arg_names(n: fx.Node, renamed: dict[str, str] | None = None) -> str:
    """The node's arguments with nodes replaced by their names (copies keep the names;
    ``renamed`` maps a stand-in's name to the original's)."""
    renamed = renamed or {}
    return repr(fx.node.map_arg((n.args, n.kwargs), lambda a: renamed.get(a.name, a.name)))
