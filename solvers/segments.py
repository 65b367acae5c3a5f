"""A step's forward as a chain of segments, cut at its boundaries: what checkpointing, the
chain model (:mod:`solvers.chain`) and multi-level recomputation (:mod:`solvers.multilevel`)
share. Reads the problem only: every solver may import it.

The *boundaries* (:func:`segment_boundaries`) are the values that alone carry the
computation on, such as a residual stream between blocks. Segment ``s`` is the forward
steps after boundary ``s - 1`` up to and including boundary ``s`` (the last one runs to the
end of the forward). Its *interior* is the candidates among those steps that only it reads
in the forward: every boundary, and any value a later segment reads too, is saved. Its
*window* is the backward steps from its interior's first backward read to its last. Its
*region* is its forward steps and its window.
"""

from __future__ import annotations

from dataclasses import dataclass

from solvers.problem import Problem

# A value live across a boundary besides it does not keep it from being one when it is at
# most PASSED_OVER of its size (a rotary table: 1 MiB on Llama-2-7B beside the residual's
# 32 MiB), or read over at least LONG_LIVED of the forward's steps (a table or a mask every
# block reads, whatever its size: a toy model's rotary table is a quarter of its residual).
PASSED_OVER = 1 / 8
LONG_LIVED = 1 / 4


def segment_boundaries(problem: Problem) -> list[int]:
    """Forward values that alone carry the computation from their step to the next: every
    other value live across that step was computed before it and is a constant, at most
    ``PASSED_OVER`` of its size, or read over ``LONG_LIVED`` of the forward.

    Constants (values computed from no input, as a ``full`` fill value or an ``iota``
    mask, and what only they feed) are not counted: every block may read one, as a
    checkpointed block reads it from its closure. Nor are small or long-lived values, such
    as a rotary table cast once and read by every block, which would otherwise hide every
    boundary after them; a plan saves them whole (they are a segment's inputs).
    """
    f = problem.n_forward
    constant = [False] * f
    ends: dict[int, list[int]] = {}
    for v in range(f):
        node = problem.nodes[v]
        if node.resident:
            continue
        constant[v] = all(constant[d] for d in node.deps)  # deps precede v
        if not constant[v] and problem.last_forward_use[v] - v < f * LONG_LIVED:
            ends.setdefault(problem.last_forward_use[v], []).append(v)
    out: list[int] = []
    live: dict[int, int] = {}  # values computed before the step and read after it -> size
    for k in range(f):
        for v in ends.get(k, ()):  # read last by step k: not live after it
            live.pop(v, None)
        node = problem.nodes[k]
        carried = not node.resident and not constant[k]
        if (carried and problem.forward_users[k] and k in problem.candidates
                and all(size <= node.size * PASSED_OVER for size in live.values())):
            out.append(k)
        if carried and 0 < problem.last_forward_use[k] - k < f * LONG_LIVED:
            live[k] = node.size
    return out


@dataclass(frozen=True)
class Segment:
    """One link of the chain, in the step's own indices."""

    forward: tuple[int, int]  # first and last forward step (the last is its boundary)
    window: tuple[int, int] | None  # first and last backward step reading its interior
    interior: tuple[int, ...]  # the candidates it decides

    @property
    def region(self) -> tuple[int, ...]:
        steps = list(range(self.forward[0], self.forward[1] + 1))
        if self.window is not None:
            steps += range(self.window[0], self.window[1] + 1)
        return tuple(steps)


def find_segments(problem: Problem) -> list[Segment]:
    """The chain of ``problem``'s forward, cut at its boundaries; a problem without a
    backward, or without two segments, has no chain (an empty list)."""
    if problem.single_phase or not problem.candidates:
        return []
    f = problem.n_forward
    cuts = [b for b in segment_boundaries(problem) if b < f - 1]
    if not cuts:
        return []
    firsts = [0, *(b + 1 for b in cuts)]
    lasts = [*cuts, f - 1]
    owner = [0] * f
    for s, (lo, hi) in enumerate(zip(firsts, lasts, strict=True)):
        owner[lo:hi + 1] = [s] * (hi - lo + 1)
    out = []
    candidates = set(problem.candidates)
    for s, (lo, hi) in enumerate(zip(firsts, lasts, strict=True)):
        interior = tuple(v for v in range(lo, hi + (s == len(cuts)))
                         if v in candidates and v not in cuts
                         and all(owner[u] == s for u in problem.forward_users[v]))
        reads = [u for v in interior for u in problem.backward_uses[v]]
        window = (min(reads), max(reads)) if reads else None
        out.append(Segment((lo, hi), window, interior))
    return out
