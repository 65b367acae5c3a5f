"""Several plans for one graph that runs several times per step.

A block compiled on its own runs its forward once per block before any backward, and each
call keeps what its plan saves until its backward. One plan for every call must leave
room for ``calls`` times what it holds; different plans per call can do better: the first
calls' plans hold little (they are held longest), the last calls' plans recompute little.
:func:`best_mix` chooses how many calls run each of the plans offered, at the least added
time within a budget. It is exact over mixes of at most :data:`TIERS` plans.

A plan is described by a :class:`Tier`: what one call holds from the end of its forward
to its backward, its forward's and its backward's peaks (each counted alone), and its
added time. While one call runs, every other call in flight holds its saved values, or,
once its backward ran, its parameters' gradients (``grads``): the larger is counted, so
the bound holds in whatever order the calls' plans run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Mix", "Tier", "best_mix", "need"]

# The most distinct plans in a mix: each is compiled once, so more cost compile time.
TIERS = 2


@dataclass(frozen=True)
class Tier:
    """One plan of a graph, as the calls of a step see it (bytes, seconds)."""

    holds: int  # held from the end of its forward to its backward
    forward: int  # its forward's peak, alone
    backward: int  # its backward's peak, alone
    time: float  # its added time per call


@dataclass(frozen=True)
class Mix:
    """How many calls run each offered plan: ``counts[i]`` calls of plan ``tiers[i]``
    (indices into the offered list), least-holding plan first; and the step's ``need``
    (bytes) and ``time`` (seconds added over all calls)."""

    tiers: tuple[int, ...]
    counts: tuple[int, ...]
    need: int
    time: float


def need(tiers: Sequence[Tier], counts: Sequence[int], *, grads: int = 0, reserve: int = 0,
         carried: int = 0, dropped: int = 0, recompute: int = 0, freed: int = 0,
         offloaded: int = 0) -> int:
    """Bytes the step needs for ``counts[i]`` calls of ``tiers[i]``: the largest of each
    call's forward peak beside what every other call holds, each call's backward peak
    beside the larger of every other call's saved values and its parameters' gradients
    (``grads``), and what all calls hold beside ``reserve`` (what later graphs need).

    ``dropped`` calls' inputs (``carried`` bytes each, counted in what the call before
    holds) are freed once their forwards end and recomputed from an earlier call's input
    when the backward starts (:mod:`rematc.regions`, "Block inputs recomputed"): they are
    off what all calls hold beside ``reserve``, counted while any forward runs and
    through every backward, and their recomputation, one forward at a time peaking at
    ``recompute`` bytes, runs beside what every call holds.

    ``offloaded`` calls' inputs (``carried`` bytes each; the second to the
    ``offloaded + 1``-th call's, none of them the input the recomputed ones come from) are
    copied to host memory as those calls' forwards end and copied back when their
    backwards start (:mod:`rematc.regions`, "Block inputs offloaded"): off what all calls
    hold beside ``reserve`` and beside the recomputation, and, but for the one being
    copied, beside each forward where every call holds at least its input; counted
    through every backward (one comes back while another's backward runs).

    ``freed``: bytes counted in each call's peaks that are gone by the time the backwards
    run (the earlier graphs' outputs a loss graph's caller dropped, ``outputs="dropped"``):
    off each backward's peak."""
    calls = sum(counts)
    assert dropped >= 0 and offloaded >= 0
    assert dropped + offloaded < max(1, calls), "at least the first call's input stays"
    assert not (dropped and offloaded) or dropped + offloaded < calls - 1, \
        "the input the recomputed ones come from stays"
    full = sum(c * t.holds for t, c in zip(tiers, counts, strict=True))
    held = full - (dropped + offloaded) * carried
    after = sum(c * max(t.holds, grads) for t, c in zip(tiers, counts, strict=True))
    worst = held + reserve
    if dropped:
        worst = max(worst, full - offloaded * carried + recompute)
    # Beside a forward, the inputs offloaded before it are gone: at most all but the one
    # being copied, and as many as the calls after it hold where each holds an input.
    each_holds_one = all(t.holds >= carried for t, c in zip(tiers, counts, strict=True) if c > 0)
    copied = max(0, offloaded - 1) * carried if each_holds_one else 0
    for t, c in zip(tiers, counts, strict=True):
        if c > 0:
            worst = max(worst, t.forward + full - t.holds - copied,
                        t.backward - freed + after - max(t.holds, grads))
    return worst


def best_mix(offered: Sequence[Tier], calls: int, room: int, *, grads: int = 0,
             reserve: int = 0) -> Mix | None:
    """The mix of at most :data:`TIERS` of the ``offered`` plans over ``calls`` calls
    whose :func:`need` is within ``room`` bytes at the least added time (ties: the fewer
    plans, then the smaller need); None where no mix fits. A mix of one plan is every
    call running it."""
    best: Mix | None = None
    for size in range(1, min(TIERS, len(offered)) + 1):
        for chosen in itertools.combinations(range(len(offered)), size):
            for counts in _compositions(calls, size):
                tiers = [offered[i] for i in chosen]
                needed = need(tiers, counts, grads=grads, reserve=reserve)
                if needed > room:
                    continue
                time = sum(c * t.time for t, c in zip(tiers, counts, strict=True))
                if best is None or (time, size, needed) < (best.time, len(best.tiers), best.need):
                    order = sorted(range(size), key=lambda k: (tiers[k].holds, tiers[k].time))
                    best = Mix(tuple(chosen[k] for k in order), tuple(counts[k] for k in order),
                               needed, time)
    return best


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """The ways to write ``total`` as ``parts`` positive counts, in order."""
    if parts == 1:
        return [(total,)] if total > 0 else []
    return [(first, *rest) for first in range(1, total) for rest in _compositions(total - first, parts - 1)]
