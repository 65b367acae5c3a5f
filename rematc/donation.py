"""Whether the backward got the donated buffers the memory model counted on.

Under Inductor the model lets a backward kernel write its output over a saved forward
value that dies in it (``Node.overwrites``; the loss gradient over the saved log-softmax).
Inductor does that only to a saved value AOTAutograd donates: one listed in
``fw_metadata.bw_donated_idxs``, which AOTAutograd fills after partitioning when
``torch._functorch.config.donated_buffer`` is on, and leaves empty in other cases (a
metadata mutation in either graph, a backward that may run twice). The capture reads the
flag; this checks the list itself when the backward compiles, where Inductor reads it, so
a lost donation is said, not found later in a measured peak. See docs/reliability.md,
"Donated buffers", and docs/inductor-memory.md, item 1.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx

from rematc._torch_compat import TracingContext
from solvers.plan import Decision, Plan
from solvers.problem import Problem


class DonationWarning(UserWarning):
    """The backward got fewer donated buffers than the memory model counted on: the step
    may peak above the predicted peak, by at most the bytes named."""


def expected_donations(problem: Problem, plan: Plan) -> dict[str, int]:
    """FX name -> bytes of each saved forward value that the model lets a backward kernel
    write over (:attr:`Problem.taken_over`): those need to arrive donated. A recomputed or
    reloaded copy is the backward's own buffer and needs nothing."""
    out: dict[str, int] = {}
    for u, v in problem.taken_over.items():
        src = problem.nodes[u]
        if (problem.nodes[v].backward and not src.backward
                and plan.decisions.get(u, Decision.SAVE) is Decision.SAVE):
            out[src.name] = src.size
    return out


def donated_names(gm: fx.GraphModule) -> set[str] | None:
    """The names of ``gm``'s inputs that AOTAutograd donated, as Inductor will read them
    while compiling it as a backward; None outside an AOTAutograd compile."""
    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    if meta is None:
        return None
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return {placeholders[i] for i in (meta.bw_donated_idxs or ()) if 0 <= i < len(placeholders)}


def missing(expected: Mapping[str, int], donated: set[str]) -> dict[str, int]:
    """The expected donations that did not come, with their bytes."""
    return {name: nbytes for name, nbytes in expected.items() if name not in donated}


def checking_donations(inner_compile: Callable[..., Any], expected: Callable[[], Mapping[str, int]],
                       lost: Callable[[dict[str, int]], None]) -> Callable[..., Any]:
    """``inner_compile`` that, compiling a backward, compares the donated inputs with
    ``expected()`` (the last plan's :func:`expected_donations`) and, where some are
    missing, warns and calls ``lost`` with them."""

    @functools.wraps(inner_compile)
    def compile_checking_donations(gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        want = expected() if kwargs.get("is_backward", False) else {}
        donated = donated_names(gm) if want else None
        gone = missing(want, donated) if donated is not None else {}
        if gone:
            lost(gone)
            warnings.warn(explain(gone, len(want)), DonationWarning, stacklevel=2)
        return inner_compile(gm, *args, **kwargs)

    return compile_checking_donations


def explain(gone: Mapping[str, int], expected: int) -> str:
    names = sorted(gone, key=lambda n: -gone[n])
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    total = sum(gone.values())
    return (
        f"rematc: AOTAutograd did not donate {len(gone)} of the {expected} saved activations "
        f"the memory model lets backward kernels write over ({shown}; {total} B), so Inductor "
        f"allocates fresh buffers there: the step may peak up to {total} B above the "
        "predicted peak. Donation needs torch._functorch.config.donated_buffer on and a "
        "backward that runs once (no retain_graph)."
    )
