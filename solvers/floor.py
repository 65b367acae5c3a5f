"""The floor every plan holds: the bytes live at each step whatever a plan decides.

What the CP-SAT model (:mod:`solvers.cpsat`) counts as fixed, what the step relaxation
(:mod:`solvers.bound`) and the knapsack baseline (:mod:`solvers.baselines`) subtract from
the budget, and what no budget below its largest step can hold. Reads the problem only:
every solver may import it. :math:`U_F` is the values whose forward copy holds no memory
(``Node.unstored``: the ops that read such a value compute it).
"""

from __future__ import annotations

from solvers.problem import Problem


def baseline(problem: Problem) -> list[int]:
    """Bytes live at each step whatever the plan decides: every value from its step to its
    last read, a candidate only to its last forward read (nothing saved or recomputed), a
    value of U_F not at all, and the reads of the values of U_F that no decision stores."""
    delta = [0] * (len(problem.nodes) + 1)
    candidates = set(problem.candidates)
    for i, node in enumerate(problem.nodes):
        if node.resident or node.size == 0 or problem.computed_in(i) is not None:
            continue  # a forward copy in U_F is there only if it is saved or offloaded
        if node.keep:
            hi = problem.last_step
        elif i in candidates:
            hi = problem.forward_end(i)
        else:
            hi = problem.fixed_end(i)
        delta[i] += node.size
        delta[hi + 1] -= node.size
    for u, lo, hi, vs in unstored_extensions(problem):
        if u not in candidates and any(v not in candidates for v in vs):  # no decision changes it
            delta[lo] += problem.nodes[u].size
            delta[hi + 1] -= problem.nodes[u].size
    out, live = [], 0
    for d in delta[:-1]:
        live += d
        out.append(live)
    return out


def unstored_extensions(p: Problem) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """``(u, first, last, vs)``: steps over which u's forward copy lives on, beyond where it
    ends when every value of U_F that reads it is stored, as long as one of those values
    ``vs`` is not (its reader reads u at ``last`` or later). Disjoint, in step order per u."""
    candidates = set(p.candidates)
    reads: dict[int, list[tuple[int, int]]] = {}  # u -> (step of the reader, value of U_F)
    for v in range(p.n_forward):
        reader = p.computed_in(v)
        if reader is None:
            continue
        for u in set(p.nodes[v].deps):
            node = p.nodes[u]
            if not (node.resident or node.keep or node.size == 0):
                reads.setdefault(u, []).append((reader, v))
    out = []
    for u, at in sorted(reads.items()):
        first = (p.forward_end(u) if u in candidates else p.fixed_end(u)) + 1
        # a read at the step of the op that takes u over is that op's: u ends before it
        later = sorted(r for r in at if r[0] >= first and r[0] != p.taken_over.get(u))
        for j, (last, _) in enumerate(later):
            if last >= first:
                out.append((u, first, last, tuple(v for _, v in later[j:])))
                first = last + 1
    return out
