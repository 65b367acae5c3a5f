"""From a plan back to FX: the forward graph (returning what is saved) and the backward
graph (recomputing the rest just before first use).

Invariants of :func:`emit`:

* the forward computes exactly what the joint graph's forward computed, and returns the
  real outputs followed by the saved values (AOTAutograd's calling convention);
* every FX node of a RECOMPUTE value that the backward reads is copied into the backward,
  placed right before its first use, in dependency order; nothing else from the forward
  is copied, which :func:`verify` checks;
* a value the schedule recomputes more than once (a multi-level plan) gets one copy of
  its nodes per recomputation after the first (:func:`recompute_again`), each serving the
  reads the plan's checker says it serves, placed right before the first of them;
* every OFFLOAD value is saved as a host copy: the forward starts the copy after its last
  forward use and waits for it (freeing the device tensor) after the plan's ``offload_at``
  step; the backward starts the copy back before the plan's ``reload_at`` step and waits
  for it just before the first use (:mod:`rematc.offload`);
* no pass runs CSE across the two graphs afterwards, so the backward's copies are never
  merged back into saved values.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
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
    # FX names of the copies that run a value's recomputations after its first (multi-level plans)
    again: tuple[str, ...] = ()


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
    again, later = recompute_again(bw, captured, plan)
    if split_per_reader(bw, captured, plan, later) or again:
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
        again=tuple(again),
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
AGAIN = "_again"  # a later recomputation's copy's name: the original's and this
COPY_SUFFIXES = (PER_READER, AGAIN)


def recompute_again(bw: fx.GraphModule, captured: Captured, plan: Plan
                    ) -> tuple[list[str], dict[int, list[list[fx.Node]]]]:
    """Emit every recomputation after the first of a value the schedule recomputes more
    than once: a copy of the value's nodes (named ``<original>_again``) that reads the copies
    of its inputs serving its schedule entry and serves, as in the checker, the reads
    between its entry and the value's next one. Each copy lands right before its first
    reader. Returns the copies' names, and for each value recomputed inside each reader
    (``captured.per_reader``) its later copies' nodes, entry by entry, for
    :func:`split_per_reader`."""
    entries: dict[int, list[int]] = {}
    for k, s in enumerate(plan.schedule):
        if plan.decisions.get(s.node) is Decision.RECOMPUTE:
            entries.setdefault(s.node, []).append(k)
    repeated = {v: ks for v, ks in entries.items() if len(ks) > 1}
    if not repeated:
        return [], {}
    by_name = {n.name: n for n in bw.graph.nodes}
    value_of = {n.name: v for n, v in captured.value_of.items()}
    members = {v: [by_name[n.name] for n in captured.groups[v] if n in captured.forward and n.name in by_name]
               for v in repeated}
    member_of = {n: v for v, ns in members.items() for n in ns}
    position = {n: k for k, n in enumerate(bw.graph.nodes)}
    for ns in members.values():
        ns.sort(key=position.__getitem__)

    def serving(v: int, key: tuple[int, int]) -> int:
        """Which of v's recomputations serves a read at ``key`` (step, order within it)."""
        ks = repeated[v]
        return max((j for j, k in enumerate(ks) if (plan.schedule[k].before, k) < key), default=0)

    copies: dict[tuple[int, int], dict[fx.Node, fx.Node]] = {}  # (value, entry) -> original -> copy

    def copy_input(a: fx.Node, *, made: dict[fx.Node, fx.Node], value: int, key: tuple[int, int]) -> fx.Node:
        """What a copy of ``value``'s nodes for the entry at ``key`` reads for ``a``: its
        own copy of a node of the value, else the copy of ``a``'s value serving it there."""
        d = member_of.get(a)
        if a in made or d is None or d == value or (e := serving(d, key)) == 0:
            return made.get(a, a)
        return copies[(d, e)][a]

    output = bw.graph.find_nodes(op="output")[0]
    for k, s in enumerate(plan.schedule):  # entries in order: what a copy reads exists
        if s.node not in repeated or k == repeated[s.node][0]:
            continue
        made: dict[fx.Node, fx.Node] = {}
        copies[(s.node, repeated[s.node].index(k))] = made
        read = functools.partial(copy_input, made=made, value=s.node, key=(s.before, k))
        with bw.graph.inserting_before(output):
            for n in members[s.node]:
                made[n] = bw.graph.node_copy(n, read)
                made[n]._rename(f"{n.name}{AGAIN}")
    # Move each read to the copy that serves it: a backward op at step t reads after every
    # entry before t; a first recomputation reads at its own first entry.
    first_entry = {v: (plan.schedule[ks[0]].before, ks[0]) for v, ks in entries.items()}
    forward = {n.name for n in captured.forward}
    made_nodes = {c for m in copies.values() for c in m.values()}
    n_forward = captured.problem.n_forward

    def read_at(n: fx.Node) -> int | None:
        """The step of the first backward op that reads ``n``, through views of a forward
        value taken in the backward (a weight gradient's transpose of a saved input)."""
        steps = []
        for u in n.users:
            w = value_of.get(u.name)
            if w is None or u.name in forward:
                continue
            steps.append(w if w >= n_forward else read_at(u))
        return min((t for t in steps if t is not None), default=None)

    step = n_forward  # of the latest backward op seen (nodes without a value: no step)
    for n in list(bw.graph.nodes):
        if n in made_nodes:
            continue
        v = value_of.get(n.name)
        own = v if n.name in forward else None  # a first recomputation of value v
        at = step
        if v is not None and own is None:
            if v >= n_forward:
                step = at = v
            else:  # a view of a forward value taken in the backward reads where its readers do
                at = read_at(n) or step
        key = first_entry[own] if own in first_entry else (at, len(plan.schedule))
        for a in n.all_input_nodes:
            d = member_of.get(a)
            if d is None or d == own:
                continue
            e = serving(d, key)
            if e:
                n.replace_input_with(a, copies[(d, e)][a])
    kept = []
    for made in reversed(list(copies.values())):  # a copied view nothing reads goes
        for c in reversed(list(made.values())):
            if c.users:
                kept.append(c.name)
            else:
                bw.graph.erase_node(c)
    _order_by_first_use(bw.graph)
    alive = set(bw.graph.nodes)
    later = {v: [[c for c in made.values() if c in alive] for (u, _), made in copies.items() if u == v]
             for v in repeated if v in captured.per_reader}
    return kept[::-1], later


def split_per_reader(bw: fx.GraphModule, captured: Captured, plan: Plan,
                     later: Mapping[int, list[list[fx.Node]]] | None = None) -> int:
    """Give each backward reader of a recomputed ``per_reader`` value its own copy of the
    value's nodes, placed right before it, so that Inductor computes it inside that
    reader's kernel instead of storing it (:func:`rematc.capture.per_reader_values`).
    A value recomputed more than once is split entry by entry: ``later`` holds the nodes
    of its copies after the first (:func:`recompute_again`), each read by the readers its
    entry serves. Copies are named ``<original>_per_reader`` (FX numbers further ones).
    Returns how many copies were made."""
    by_name = {n.name: n for n in bw.graph.nodes}
    later = later or {}
    copies = 0
    for i in sorted(captured.per_reader, reverse=True):  # readers first: their copies read it
        if plan.decisions.get(i) is not Decision.RECOMPUTE:
            continue
        first = [by_name[n.name] for n in captured.groups[i] if n.name in by_name]
        for chain in [first, *later.get(i, [])]:
            members = set(chain)
            position = {n: k for k, n in enumerate(bw.graph.nodes)}
            chain = sorted(chain, key=position.__getitem__)
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


def _order_by_first_use(graph: fx.Graph) -> None:
    """Reorder ``graph`` so that each node comes after its inputs, keeping the present
    order wherever it already does: a node out of place moves to just before its first
    reader (the copies of :func:`recompute_again`, made at the end, land where used)."""
    placed: set[fx.Node] = set()
    order: list[fx.Node] = []

    def visit(n: fx.Node) -> None:
        stack = [(n, iter(n.all_input_nodes))]
        while stack:
            node, inputs = stack[-1]
            dep = next((a for a in inputs if a not in placed), None)
            if dep is not None:
                stack.append((dep, iter(dep.all_input_nodes)))
                continue
            stack.pop()
            if node not in placed:
                placed.add(node)
                order.append(node)

    for n in list(graph.nodes):
        if n not in placed:
            visit(n)
    for before, n in itertools.pairwise(order):  # the first node has no inputs: it stays first
        if before.next is not n:
            before.append(n)


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
    copies: dict[str, str] = {}  # a per-reader or later recomputation's copy's name -> its original's
    for n in emitted.backward.graph.nodes:
        cut = min((n.name.find(x) for x in COPY_SUFFIXES if x in n.name), default=-1)
        if n.op == "call_function" and cut > 0 and n.name not in fwd_names:
            original_name = n.name[:cut]  # a per-reader copy of a later copy: both suffixes
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
