"""solvers.mix: plans mixed over the calls of a graph that runs several times per step.

:func:`need` is checked against a step simulated call by call (every forward in order,
then every backward in reverse), and :func:`best_mix` against every assignment of plans
to calls."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from solvers.mix import TIERS, Tier, best_mix, need


def simulated_peak(order: list[Tier], grads: int) -> int:
    """The step's peak when call i runs ``order[i]``: the forwards in order (earlier calls
    hold their saved values), then the backwards in reverse (earlier calls still hold
    theirs, later ones hold their parameters' gradients)."""
    peak = 0
    for i, tier in enumerate(order):
        peak = max(peak, sum(t.holds for t in order[:i]) + tier.forward)
    for i in reversed(range(len(order))):
        peak = max(peak, sum(t.holds for t in order[:i]) + order[i].backward + grads * (len(order) - 1 - i))
    return peak


def random_tier(rng: random.Random) -> Tier:
    holds = rng.randrange(0, 1000)
    return Tier(holds=holds, forward=holds + rng.randrange(0, 500), backward=holds + rng.randrange(0, 800),
                time=rng.random())


@pytest.mark.parametrize("seed", range(20))
def test_the_need_of_a_mix_bounds_its_step_in_any_order(seed: int) -> None:
    rng = random.Random(seed)
    tiers = [random_tier(rng) for _ in range(3)]
    counts = [rng.randrange(0, 4) for _ in tiers]
    counts[0] += 1
    grads = rng.randrange(0, 600)
    calls = [t for t, c in zip(tiers, counts, strict=True) for _ in range(c)]
    bound = need(tiers, counts, grads=grads)
    for order in set(itertools.permutations(range(len(calls)))):
        assert simulated_peak([calls[i] for i in order], grads) <= bound


def test_one_plan_needs_its_peak_beside_the_other_calls() -> None:
    tier = Tier(holds=100, forward=150, backward=300, time=1.0)
    # The forward of the last call beside three held; the backward beside three (held or
    # gradients, the larger); all four held beside what later graphs reserve.
    assert need([tier], [4], grads=50) == max(150 + 300, 300 + 300, 400)
    assert need([tier], [4], grads=200) == 300 + 3 * 200
    assert need([tier], [4], reserve=500) == 4 * 100 + 500
    # bytes gone before the backwards (a loss graph's dropped inputs) come off each one
    assert need([tier], [1], freed=120) == max(100, 150, 300 - 120)
    assert need([tier], [4], grads=200, freed=120) == 300 - 120 + 3 * 200


def simulated_with_inputs_recomputed(order: list[Tier], grads: int, *, carried: int, dropped: int,
                                     recompute: int, reserve: int, offloaded: int = 0) -> int:
    """As :func:`simulated_peak`, where each call's ``holds`` counts its output (the next
    call's input, ``carried`` bytes), the last ``dropped`` calls' inputs are freed once
    those calls' forwards end, and the inputs of the second to the ``offloaded + 1``-th
    call are copied out as those calls' forwards end: what all calls hold beside
    ``reserve`` (the later graphs), then the recomputed inputs one forward at a time (each
    peaking at ``recompute`` beside them), then the backwards, each with its own input
    copied back and the call before's on its way (rematc.regions.Carry)."""
    n = len(order)
    freed = set(range(n - 1 - dropped, n - 1))  # the calls whose outputs are recomputed
    copied = set(range(offloaded))  # the calls whose outputs are offloaded
    assert not freed & copied and (not freed or n - 2 - dropped not in copied)

    def held(calls: range, *, after: int) -> int:  # after: forwards that have ended
        return sum(order[k].holds - (carried if k in freed | copied and k + 1 < after else 0) for k in calls)

    peak = 0
    for i, tier in enumerate(order):
        peak = max(peak, held(range(i), after=i) + tier.forward)
    peak = max(peak, held(range(n), after=n) + reserve)
    for k in sorted(freed):  # the inputs come back in order, each beside the forward making it
        peak = max(peak, held(range(n), after=n) + carried * sum(1 for j in freed if j < k) + recompute)
    for i in reversed(range(n)):
        away = carried * sum(1 for k in copied if k < i - 2)  # not yet on their way back
        peak = max(peak, sum(t.holds for t in order[:i]) - away + order[i].backward + grads * (n - 1 - i))
    return peak


@pytest.mark.parametrize("seed", range(40))
def test_the_need_with_inputs_recomputed_or_offloaded_bounds_the_step(seed: int) -> None:
    """Even seeds recompute inputs only (up to all but the first's); odd ones offload some
    and may recompute some of the rest (from a kept input)."""
    rng = random.Random(seed)
    carried = rng.randrange(1, 200)
    tiers = [dataclasses.replace(t, holds=t.holds + carried, forward=t.forward + carried,
                                 backward=t.backward + carried) for t in (random_tier(rng) for _ in range(2))]
    counts = [1 + rng.randrange(0, 3), rng.randrange(0, 4)]
    calls = [t for t, c in zip(tiers, counts, strict=True) for _ in range(c)]
    offloaded = rng.randrange(0, len(calls)) if seed % 2 else 0
    left = len(calls) - 1 if not offloaded else len(calls) - 2 - offloaded
    dropped = rng.randrange(0, left + 1) if left > 0 else 0
    recompute = rng.randrange(0, 1500)
    grads, reserve = rng.randrange(0, 600), rng.randrange(0, 3000)
    bound = need(tiers, counts, grads=grads, reserve=reserve, carried=carried, dropped=dropped,
                 recompute=recompute, offloaded=offloaded)
    for order in set(itertools.permutations(range(len(calls)))):
        assert simulated_with_inputs_recomputed([calls[i] for i in order], grads, carried=carried,
                                                dropped=dropped, recompute=recompute, reserve=reserve,
                                                offloaded=offloaded) <= bound


def test_inputs_offloaded_come_off_beside_the_later_graphs_and_the_forwards() -> None:
    tier = Tier(holds=100, forward=150, backward=300, time=1.0)
    assert need([tier], [4], reserve=5000, carried=60, offloaded=3) == 4 * 100 - 3 * 60 + 5000
    # the last forward runs beside three calls' holds, two of their inputs copied out
    assert need([tier], [4], carried=60, offloaded=3) == max(150 + 300 - 2 * 60, 300 + 300, 400 - 3 * 60)
    # beside the recomputation the offloaded inputs stay out
    assert need([tier], [6], carried=60, offloaded=2, dropped=2, recompute=900) == 6 * 100 - 2 * 60 + 900
    with pytest.raises(AssertionError):  # the recomputed ones come from a kept input
        need([tier], [4], carried=60, offloaded=1, dropped=2)


def test_inputs_recomputed_come_off_what_the_calls_hold_beside_the_later_graphs() -> None:
    tier = Tier(holds=100, forward=150, backward=300, time=1.0)
    # the later graphs' reserve binds: three of the four inputs recomputed free 3 x 60 B
    assert need([tier], [4], reserve=5000) == 4 * 100 + 5000
    assert need([tier], [4], reserve=5000, carried=60, dropped=3) == 4 * 100 - 3 * 60 + 5000
    # recomputing them runs a forward beside every call's holds, inputs given back
    assert need([tier], [4], carried=60, dropped=3, recompute=900) == 4 * 100 + 900
    with pytest.raises(AssertionError):  # the first call's input is what they come from
        need([tier], [4], carried=60, dropped=4)


@pytest.mark.parametrize("seed", range(20))
def test_the_best_mix_is_the_fastest_assignment_of_plans_to_calls(seed: int) -> None:
    rng = random.Random(seed)
    offered = [random_tier(rng) for _ in range(4)]
    calls = rng.randrange(2, 6)
    grads = rng.randrange(0, 300)
    room = rng.randrange(500, 4000)
    best = None
    for assignment in itertools.product(range(len(offered)), repeat=calls):
        used = sorted(set(assignment))
        if len(used) > TIERS:
            continue
        counts = [assignment.count(i) for i in used]
        tiers = [offered[i] for i in used]
        if need(tiers, counts, grads=grads) <= room:
            time = sum(offered[i].time for i in assignment)
            best = time if best is None else min(best, time)
    mix = best_mix(offered, calls, room, grads=grads)
    if best is None:
        assert mix is None
        return
    assert mix is not None
    assert mix.time == pytest.approx(best)
    assert sum(mix.counts) == calls and mix.need <= room
    holds = [offered[i].holds for i in mix.tiers]
    assert holds == sorted(holds)  # the least-holding plan first: the first calls run it


def test_a_mix_beats_one_plan_where_memory_would_be_left_unused() -> None:
    """Four calls, room for two that save everything and two that recompute: any one plan
    for all four must recompute everywhere."""
    fast = Tier(holds=300, forward=300, backward=300, time=0.0)
    lean = Tier(holds=100, forward=300, backward=300, time=1.0)
    room = 2 * 300 + 100 + 300  # the last call's backward beside the three others held
    assert need([fast], [4]) > room and need([lean], [4]) <= room
    mix = best_mix([fast, lean], 4, room)
    assert mix is not None
    assert mix.tiers == (1, 0) and mix.counts == (2, 2) and mix.time == 2.0
