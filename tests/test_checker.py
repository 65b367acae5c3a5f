"""The plan checker on hand-computed timelines, then every reason a plan cannot run.

Live intervals (closed, in timeline steps) are written next to each expectation; the
timeline is the sum of the sizes of the values live at each step.
"""

from __future__ import annotations

import dataclasses

import pytest

from solvers import (
    Decision,
    Node,
    Plan,
    PlanError,
    Problem,
    Step,
    Transfer,
    check,
    plan_from_decisions,
)
from solvers.checker import transfer_stalls
from solvers.problem import Copy, ProblemError, node
from tests.graphs import (
    P,
    backward_takeover,
    chain,
    deep,
    diamond,
    forward_takeover,
    inline_beside_taker,
    loss_head,
    offload_graph,
    recomputed_takeover,
)

S, R, OFF = Decision.SAVE, Decision.RECOMPUTE, Decision.OFFLOAD










def run(problem: Problem, decisions: dict[int, Decision]):
    return check(problem, plan_from_decisions(problem, decisions))


# ---- trivial cases ----------------------------------------------------------------------


def test_empty_problem_peaks_at_zero() -> None:
    r = check(P(), Plan({}))
    assert (r.peak, r.peak_step, r.timeline, r.added_time) == (0, 0, (), 0.0)
    assert r.fits


def test_single_node_lives_at_its_own_step() -> None:
    r = check(P(node("a", size=3)), Plan({}))
    assert (r.peak, r.timeline) == (3, (3,))


def test_resident_and_zero_size_values_cost_nothing() -> None:
    # #1 h is zero-size, #2 y kept: y [2,4] 3 B, gy [3,4] 2 B, gh [4,4] 1 B.
    p = P(
        node("p", size=8, resident=True),
        node("h", 0, size=0),
        node("y", 1, size=3, keep=True),
        node("gy", 2, size=2, backward=True),
        node("gh", 1, 3, size=1, backward=True, keep=True),
    )
    assert p.candidates == (1,)
    saved = run(p, {1: S})
    assert saved.timeline == (0, 0, 3, 5, 6)
    assert (saved.peak, saved.peak_step, saved.saved_bytes) == (6, 4, 0)
    recomputed = run(p, {1: R})
    assert recomputed.timeline == saved.timeline
    assert recomputed.added_time == 1.0


def test_a_returned_value_lives_to_the_forwards_end_not_the_steps() -> None:
    # logits #1 (4 B) is last read by ls #2 (saved to g #4); loss #3 kept, the forward's
    # last step; gx #5 kept. The logits die after #2 as an ordinary value, after #3 as a
    # returned one (the forward hands them over at its end), after #5 when kept.
    def step(**logits: bool) -> Problem:
        return P(
            node("x", size=8, resident=True),
            node("logits", 0, size=4, **logits),  # type: ignore[arg-type]
            node("ls", 1, size=4),
            node("loss", 2, size=1, keep=True),
            node("g", 2, size=4, backward=True),
            node("gx", 4, size=2, backward=True, keep=True),
        )
    assert run(step(), {2: S}).timeline == (0, 4, 8, 5, 9, 7)
    assert run(step(returned=True), {2: S}).timeline == (0, 4, 8, 9, 9, 7)
    assert run(step(keep=True), {2: S}).timeline == (0, 4, 8, 9, 13, 11)
    assert step(returned=True).candidates == (1, 2) and step(keep=True).candidates == (2,)


def test_a_returned_value_must_be_an_ordinary_forward_value() -> None:
    for wrong in ({"keep": True}, {"resident": True}):
        with pytest.raises(ProblemError, match="returned marks a forward output"):
            P(node("x", size=1, resident=True), node("y", *(() if "resident" in wrong else (0,)),
                                                     size=2, returned=True, **wrong))  # type: ignore[arg-type]
    with pytest.raises(ProblemError, match="returned marks a forward output"):
        P(node("x", size=1, resident=True), node("y", 0, size=2), node("g", 1, size=2, backward=True, returned=True))


# ---- hand-computed timelines -------------------------------------------------------------


def test_in_place_reader_takes_a_dying_input_over() -> None:
    # g1 [3,3], then g2 written over it at step 4 ([4,6]); g3 reuses g2, but g2's last
    # reader is g4, so g2 is not taken over: g3 [5,6]. x saved: [1,4]; loss [2,6].
    p = P(
        node("p", size=8, resident=True),  # 0
        node("x", 0, size=2),  # 1
        node("loss", 1, size=1, keep=True),  # 2
        node("g1", 2, size=4, backward=True),  # 3
        node("g2", 3, 1, size=4, backward=True, overwrites=3),  # 4
        node("g3", 4, size=4, backward=True, overwrites=4),  # 5
        node("g4", 4, 5, size=1, backward=True, keep=True),  # 6
    )
    assert p.taken_over == {3: 4}
    r = run(p, {1: S})
    assert r.timeline == (0, 2, 3, 7, 7, 9, 10)
    # Without the mark g1 and g2 both count at step 4.
    plain = P(*(dataclasses.replace(n, overwrites=None) for n in p.nodes))
    assert run(plain, {1: S}).timeline == (0, 2, 3, 7, 11, 9, 10)


def test_a_value_read_after_its_in_place_reader_is_not_taken_over() -> None:
    # gx reads x after y: the mark on y is ignored.
    p = P(
        node("x", size=2),  # 0
        node("y", 0, size=2, overwrites=0),  # 1
        node("loss", 1, size=1, keep=True),  # 2
        node("gx", 0, 2, size=1, backward=True, keep=True),  # 3
    )
    assert 0 in p.candidates and p.taken_over == {}


def test_a_forward_copy_is_taken_over_unless_kept_for_the_backward() -> None:
    # y is written over x. y saved: x [0,0], y [1,3], loss [2,3], gy [3,3]. y recomputed
    # needs x saved, and a saved copy is a forward output, never overwritten in the
    # forward; y's recomputation, x's last read, writes over it in the backward: x [0,2],
    # y [1,2] and again [3,3].
    p = forward_takeover()
    assert 0 in p.candidates and p.taken_over == {0: 1}
    assert run(p, {1: S}).timeline == (2, 2, 3, 4)
    assert run(p, {0: S, 1: R}).timeline == (2, 4, 5, 4)


def test_a_recomputed_copy_is_taken_over_by_its_readers_recomputation() -> None:
    # x and y both recomputed before step 3: y's recomputation writes over x's, so the
    # chain holds one buffer there (x's copy ends before it starts), not two.
    p = forward_takeover()
    assert run(p, {0: R, 1: R}).timeline == (2, 2, 3, 4)
    plain = P(*(dataclasses.replace(n, overwrites=None) for n in p.nodes))
    assert run(plain, {0: R, 1: R}).timeline == (2, 4, 3, 6)


def test_a_copy_recomputed_early_lives_until_its_takers_recomputation() -> None:
    # x is recomputed before step 4 (for z, which g reads there) and read last by y's
    # recomputation before step 5, which writes over it: x [4,4], not [4,5].
    p = recomputed_takeover()
    assert p.taken_over == {0: 2}
    assert run(p, {0: R, 1: R, 2: R}).timeline == (2, 3, 3, 4, 5, 5)
    plain = P(*(dataclasses.replace(n, overwrites=None) for n in p.nodes))
    assert run(plain, {0: R, 1: R, 2: R}).timeline == (2, 3, 5, 4, 5, 7)


def test_an_inline_read_at_the_takers_step_keeps_the_copy() -> None:
    # Everything recomputed before step 5, in the order x, m, z, y: z computes the inline
    # m and reads x before y does, but inside an op, so x's copy is not taken over:
    # step 5 holds x, z, y, loss and g = 7.
    p = inline_beside_taker()
    assert p.taken_over == {0: 3}
    assert run(p, {0: R, 1: R, 2: R, 3: R}).timeline == (2, 3, 4, 3, 4, 7)


def test_a_backward_copy_is_taken_over_by_its_last_reader() -> None:
    # g2 (step 4) is written over x. x and w saved: x [0,3] -> 2,3,4,6,6,5. x recomputed
    # before step 4: its copy ends before it starts (g2 writes into it), x [0,1] only.
    # w recomputed before step 5 reads x after g2: x [0,5] -> step 4 is 7.
    p = backward_takeover()
    assert p.taken_over == {0: 4}
    assert run(p, {0: S, 1: S}).timeline == (2, 3, 4, 6, 6, 5)
    assert run(p, {0: R, 1: S}).timeline == (2, 3, 2, 4, 6, 5)
    assert run(p, {0: S, 1: R}).timeline == (2, 3, 4, 5, 7, 7)
    plain = P(*(dataclasses.replace(n, overwrites=None) for n in p.nodes))
    assert run(plain, {0: S, 1: S}).timeline == (2, 3, 4, 6, 8, 5)


def test_a_saved_only_taker_leaves_recomputed_and_reloaded_copies() -> None:
    # g2 takes x's saved copy (as above) but not a copy the backward makes: x recomputed
    # before step 4 lives [4,4] beside g2; copied back beside step 3, [3,4].
    p = backward_takeover(saved_only=True)
    assert p.taken_over == {0: 4}
    assert run(p, {0: S, 1: S}).timeline == (2, 3, 4, 6, 6, 5)
    assert run(p, {0: R, 1: S}).timeline == (2, 3, 2, 4, 8, 5)
    offload = backward_takeover(host_bandwidth=1.0, saved_only=True)
    plan = plan_from_decisions(offload, {0: OFF, 1: S}, {0: (2, 3)})
    assert check(offload, plan).timeline == (2, 3, 4, 6, 8, 5)


def test_an_offloaded_copy_back_is_taken_over() -> None:
    # x copied out beside step 2 (its device copy [0,2]) and back beside step 3 ([3,3],
    # not [3,4]: g2 writes over it).
    p = backward_takeover(host_bandwidth=1.0)
    plan = plan_from_decisions(p, {0: OFF, 1: S}, {0: (2, 3)})
    assert check(p, plan).timeline == (2, 3, 4, 6, 6, 5)


def test_inline_recomputation_holds_no_memory_and_reads_at_its_reads() -> None:
    # y reads x; loss, g1 (step 4) and g2 (step 5) read y. x saved, y recomputed before
    # step 4: stored, y's copy lives [4,5] and x is read at step 4 only (x [0,4]);
    # inline, y's copy holds nothing and x is read where y is, at 4 and 5 (x [0,5]).
    p = P(
        node("x", size=4),  # 0
        node("y", 0, size=8),  # 1
        node("loss", 1, size=1, keep=True),  # 2
        node("g0", 2, size=1, backward=True),  # 3
        node("g1", 1, 3, size=2, backward=True),  # 4
        node("g2", 1, 4, size=2, backward=True, keep=True),  # 5
    )
    stored = run(p, {0: S, 1: R})
    assert stored.timeline == (4, 12, 13, 6, 16, 13)
    q = P(*(dataclasses.replace(n, unstored=frozenset({Copy.RECOMPUTED} if n.name == "y" else ())) for n in p.nodes))
    inline = run(q, {0: S, 1: R})
    assert inline.timeline == (4, 12, 13, 6, 8, 9)
    assert inline.added_time == stored.added_time  # the same recomputation, counted once
    # x recomputed too: its copy is made before step 4 and read at y's reads, [4,5].
    both = run(q, {0: R, 1: R})
    assert both.timeline == (4, 12, 9, 2, 8, 9)


def test_a_fused_value_is_stored_only_when_saved() -> None:
    # loss_head: h [0,7], loss [4,7], t [5,6], g [6,7], gh [7,7] in every plan.
    # y saved: stored from step 3, written over x (x [1,2], m [2,3]) and taken over by g
    # (y [3,5]).
    p = loss_head()
    assert p.computed_in(3) == 4
    assert run(p, {0: S, 3: S}).timeline == (1, 3, 4, 4, 4, 5, 5, 5)
    # y recomputed: the loss computes it, so the forward never stores it and reads x and
    # m at step 4; recomputed inside g, it reads them there (x [1,6], m [2,6]).
    assert run(p, {0: S, 1: S, 2: S, 3: R}).timeline == (1, 3, 4, 4, 5, 6, 8, 5)
    # Not fused, y's forward copy counts beside the saved x at steps 3 and 4.
    plain = P(*(dataclasses.replace(n, unstored=frozenset()) for n in p.nodes))
    assert run(plain, {0: S, 1: S, 2: S, 3: R}).timeline == (1, 3, 4, 6, 7, 6, 8, 5)
    # Nothing saved but h: x's forward copy lives to the loss (x [1,4], m [2,4]).
    assert run(p, {0: S, 1: R, 2: R, 3: R}).timeline == (1, 3, 4, 4, 5, 3, 8, 5)


@pytest.mark.parametrize(("nodes", "message"), [
    ((node("x", size=1, unstored=frozenset({Copy.FORWARD})), node("a", 0), node("b", 0), node("g", 0, backward=True)),
     "exactly one forward reader"),
    ((node("x", size=1, unstored=frozenset({Copy.FORWARD})), node("a", 0, unstored=frozenset({Copy.FORWARD})), node("b", 1), node("g", 0, backward=True)),
     "whose own forward copy is stored"),
    ((node("x", size=1), node("g", 0, backward=True, unstored=frozenset({Copy.FORWARD}))), "only an ordinary forward value"),
])
def test_an_unstored_forward_copy_needs_one_forward_reader(nodes: tuple[Node, ...], message: str) -> None:
    with pytest.raises(ProblemError, match=message):
        P(*nodes)


def test_overwrites_must_name_a_dep() -> None:
    with pytest.raises(ProblemError, match="overwrites must be one of its deps"):
        P(node("a", size=1), node("b", size=1), node("c", 0, size=1, overwrites=1))


def test_chain_save_all() -> None:
    # f0 [1,6] 2, f1 [2,5] 3, f2 [3,4] 5, g2 [4,5] 5, g1 [5,6] 3, g0 [6,6] 2.
    r = run(chain(), {1: S, 2: S, 3: S})
    assert r.timeline == (0, 2, 5, 10, 15, 13, 7)
    assert (r.peak, r.peak_step) == (15, 4)
    assert (r.added_time, r.n_recomputed, r.saved_bytes) == (0.0, 0, 10)


def test_chain_recompute_middle() -> None:
    # f1 [2,3] and again [5,5] (before g1); f0 saved up to g0 at 6.
    # step 4: f0 2 + f2 5 + g2 5 = 12; step 5: f0 2 + f1 3 + g2 5 + g1 3 = 13.
    p = chain()
    plan = plan_from_decisions(p, {1: S, 2: R, 3: S})
    assert plan.schedule == (Step(2, 5),)
    r = check(p, plan)
    assert r.timeline == (0, 2, 5, 10, 12, 13, 7)
    assert (r.peak, r.peak_step) == (13, 5)
    assert (r.added_time, r.n_recomputed, r.saved_bytes) == (2.0, 1, 7)


def test_chain_recompute_two_deep() -> None:
    # f1 is recomputed before g1 at 5, so f0 is recomputed at 5 too (not at 6, its own use):
    # f0 [1,2] + [5,6], f1 [2,3] + [5,5], f2 saved [3,4].
    # step 3: f1 3 + f2 5 = 8; step 4: f2 5 + g2 5 = 10; step 5: 2 + 3 + 5 + 3 = 13.
    p = chain()
    plan = plan_from_decisions(p, {1: R, 2: R, 3: S})
    assert plan.schedule == (Step(1, 5), Step(2, 5))
    r = check(p, plan)
    assert r.timeline == (0, 2, 5, 8, 10, 13, 7)
    assert (r.peak, r.peak_step, r.added_time, r.n_recomputed) == (13, 5, 3.0, 2)


def test_chain_recompute_last_does_not_help() -> None:
    # f2 is needed at 4 together with g2, and f1 must be there to recompute it.
    r = run(chain(), {1: S, 2: R, 3: R})
    assert r.timeline == (0, 2, 5, 10, 15, 13, 7)
    assert r.added_time == 6.0


def test_offload_hidden_under_compute_adds_no_time() -> None:
    # a: [1, 3] (copied out beside c, step 3), then [7, 8] (copied back beside gb, step 7).
    # Each copy is 4 B at 2 B/s = 2 s, under the 3 s of c and of gb.
    p = offload_graph()
    plan = plan_from_decisions(p, {1: OFF, 2: S})
    assert plan.transfers == (Transfer(1, offload_at=3, reload_at=7),)
    r = check(p, plan)
    assert r.timeline == (0, 4, 5, 6, 3, 3, 4, 7, 7)
    assert r.added_time == 0.0
    assert (r.offloaded_bytes, r.n_offloaded, r.n_recomputed, r.saved_bytes) == (4, 1, 0, 1)


def test_offload_exposes_what_compute_does_not_hide() -> None:
    # At 0.5 B/s each copy takes 8 s: 5 s beyond c's 3 s, and 5 s beyond gb's 3 s.
    r = run(offload_graph(host_bandwidth=0.5), {1: OFF, 2: S})
    assert r.added_time == pytest.approx(10.0)


def test_offload_over_longer_windows_holds_the_device_copy_longer() -> None:
    # Out until loss (step 4) instead of c: a stays on the device through step 4. Back from
    # gl (step 5): a is on the device again from 5. Each 2 s copy runs over two steps, c and
    # loss (4 s), then gl and gc (2 s): hidden.
    p = offload_graph()
    r = check(p, plan_from_decisions(p, {1: OFF, 2: S}, {1: (4, 5)}))
    assert r.timeline == (0, 4, 5, 6, 7, 7, 8, 7, 7)
    assert r.added_time == 0.0


def test_copies_queue_on_one_engine_each_way() -> None:
    # At 1 B/s a's copies take 4 s, b's 1 s. Out: a is issued as c (step 3, 3 s) starts,
    # b as loss (step 4, 1 s) starts; b waits for a's copy, so the compute stream waits 1 s
    # at the end of step 4 for both (or at the end of c for a alone).
    p = offload_graph(host_bandwidth=1.0)
    for a_out in (3, 4):
        stalls = transfer_stalls(p, plan_from_decisions(p, {1: OFF, 2: OFF}, {1: (a_out, 6), 2: (4, 5)}))
        assert stalls == {a_out: 1.0}
    # Back: b is needed by gc (step 6), so its copy must be done when gl (step 5, 1 s) ends.
    # Issued at 5 with a's, the batch takes 5 s: 4 s waited. Issued at gc, a's copy hides
    # under gc and gb (4 s) and b's under gl.
    late = check(p, plan_from_decisions(p, {1: OFF, 2: OFF}, {1: (4, 6), 2: (4, 5)}))
    early = check(p, plan_from_decisions(p, {1: OFF, 2: OFF}, {1: (4, 5), 2: (4, 5)}))
    assert (late.added_time, early.added_time) == (1.0, 5.0)
    assert late.timeline[5] == early.timeline[5] - 4  # a's reloaded copy is allocated a step later


def test_earlier_recompute_than_canonical_costs_memory() -> None:
    # f1 recomputed before g2 (step 4) instead of g1 (5): f1 [4,5] adds 3 B at step 4.
    p = chain()
    r = check(p, Plan({1: S, 2: R, 3: S}, (Step(2, 4),)))
    assert r.timeline == (0, 2, 5, 10, 15, 13, 7)


def test_diamond_save_all() -> None:
    # x [1,8] 4, a [2,6] 2, b [3,7] 6, loss [4,9] 1, gl [5,7] 1, ga [6,8] 2, gb [7,8] 6,
    # gx [8,9] 4, gw [9,9] 3; w resident. Step 7: 4 + 6 + 1 + 1 + 2 + 6 = 20.
    r = run(diamond(), {1: S, 2: S, 3: S})
    assert r.timeline == (0, 4, 6, 12, 13, 14, 16, 20, 17, 8)
    assert (r.peak, r.peak_step, r.saved_bytes) == (20, 7, 12)


def test_diamond_recompute_input_of_both_branches() -> None:
    # x [1,3] + [8,8]: step 7 loses x (16), step 8: x 4 + loss 1 + ga 2 + gb 6 + gx 4 = 17.
    r = run(diamond(), {1: R, 2: S, 3: S})
    assert r.timeline == (0, 4, 6, 12, 9, 10, 12, 16, 17, 8)
    assert (r.peak, r.peak_step, r.added_time) == (17, 8, 1.0)


def test_diamond_recompute_branch_pulls_its_input_forward() -> None:
    # b recomputed before gb at 7 reads x, so x is recomputed at 7 too: back to 20.
    p = diamond()
    plan = plan_from_decisions(p, {1: R, 2: S, 3: R})
    assert plan.schedule == (Step(1, 7), Step(3, 7))
    assert check(p, plan).peak == 20


def test_deep_chain_of_recomputes() -> None:
    # a [1,7] 1 saved, u [2,3] + [6,6] 4, w [3,4] + [6,6] 4, big [4,5] 8 saved,
    # gbig [5,6] 1, gw [6,7] 1, ga [7,7] 1.
    # step 4: a + w + big = 13; step 5: a + big + gbig = 10; step 6: 1 + 4 + 4 + 1 + 1 = 11.
    r = run(deep(), {1: S, 2: R, 3: R, 4: S})
    assert r.timeline == (0, 1, 5, 9, 13, 10, 11, 3)
    assert (r.peak, r.added_time, r.n_recomputed) == (13, 5.0, 2)


def test_a_recomputed_chains_transients_pass_within_the_step() -> None:
    """t1 and t2 are recomputed before gy only to rebuild y: each lives from its entry to
    the next one's, not through gy's step."""
    p = P(
        node("x", size=1, resident=True),  # 0
        node("a", 0, size=10),  # 1
        node("t1", 1, size=10),  # 2
        node("t2", 2, size=10),  # 3
        node("y", 3, size=10),  # 4
        node("loss", 4, size=1, keep=True),  # 5
        node("gl", 5, size=1, backward=True),  # 6
        node("gy", 4, 6, size=10, backward=True),  # 7
        node("ga", 1, 7, size=10, backward=True, keep=True),  # 8
    )
    plan = plan_from_decisions(p, {1: S, 2: R, 3: R, 4: R})
    assert plan.schedule == (Step(2, 7), Step(3, 7), Step(4, 7))
    # step 7: a, loss, gl, y (from its entry on) and gy: 32; above it, the entries hold at
    # most two copies at once (t1 and t2, then t2 and y), less y, counted: 10 more. Counted
    # through the step, t1 and t2 would make it 52.
    r = check(p, plan)
    assert r.timeline == (0, 10, 20, 30, 30, 21, 12, 42, 31)
    assert (r.peak, r.peak_step, r.n_recomputed) == (42, 7, 3)


def test_flops_and_budget_are_reported() -> None:
    # a [0,0] + [1,1] 2 B, g [1,1] 1 B: timeline (2, 3).
    p = P(node("a", size=2, flops=10.0), node("g", 0, backward=True, keep=True), budget=3)
    r = run(p, {0: R})
    assert (r.added_flops, r.budget, r.timeline) == (10.0, 3, (2, 3))
    assert r.fits
    assert not run(p.with_budget(2), {0: R}).fits


# ---- plans that cannot run ---------------------------------------------------------------

BAD_PLANS: list[tuple[str, Problem, Plan, str]] = [
    ("missing decision", chain(), Plan({1: S, 2: S}),
     r"#3 f2 .* is read by the backward but has no decision"),
    ("missing decision for a recomputed value's input", deep(), Plan({1: S, 3: R, 4: S}, (Step(3, 6),)),
     r"#2 u .* is read by the backward but has no decision"),
    ("decision for an unneeded value", deep(), Plan({1: S, 2: S, 3: S, 4: S}),
     r"#2 u .* has a decision but nothing in the backward reads it"),
    ("decision for a resident value", diamond(), Plan({0: S, 1: S, 2: S, 3: S}),
     r"#0 w .* is resident; it takes no decision"),
    ("decision for a kept value", diamond(), Plan({1: S, 2: S, 3: S, 4: S}),
     r"#4 loss .* is kept to the end of the step; it takes no decision"),
    ("decision for a backward value", chain(), Plan({1: S, 2: S, 3: S, 5: S}),
     r"decision for #5: only forward values \(0\.\.3\) take decisions"),
    ("recompute of a non-recomputable value",
     P(node("m", size=1, recomputable=False), node("g", 0, backward=True)), Plan({0: R}, (Step(0, 1),)),
     r"#0 m .* cannot be recomputed"),
    ("recompute whose input is recomputed later", chain(), Plan({1: S, 2: R, 3: R}, (Step(3, 4), Step(2, 4))),
     r"recomputing #3 f2 .* reads #2 f1 .*, which is not available yet"),
    ("schedule out of order", chain(), Plan({1: S, 2: R, 3: R}, (Step(2, 5), Step(3, 4))),
     r"schedule step 1 goes back to backward step 4; steps must be in order"),
    ("offload without host bandwidth", chain(), Plan({1: S, 2: S, 3: OFF}, (Step(3, 4),)),
     r"#3 f2 .* is offloaded but the problem has no host link"),
    ("recomputed twice, one copy unread", chain(), Plan({1: S, 2: S, 3: R}, (Step(3, 4), Step(3, 4))),
     r"schedule step 0 recomputes #3 f2 .*, but nothing reads that copy before its next recomputation"),
    ("reloaded twice", offload_graph(), Plan({1: OFF, 2: S}, (Step(1, 8), Step(1, 8)), (Transfer(1, 3, 7),)),
     r"schedule reloads #1 a .* twice"),
    ("schedule in the forward", chain(), Plan({1: S, 2: S, 3: R}, (Step(3, 2),)),
     r"schedule step 0: 2 is not a backward step"),
    ("saved value scheduled", chain(), Plan({1: S, 2: S, 3: S}, (Step(3, 4),)),
     r"schedule step 0 rematerializes #3, which is not recomputed or offloaded"),
    ("never scheduled", chain(), Plan({1: S, 2: S, 3: R}),
     r"#3 f2 .* is recomputed but never scheduled"),
    ("offloaded, never scheduled", chain(host_bandwidth=1.0), Plan({1: S, 2: S, 3: OFF}),
     r"#3 f2 .* is offloaded but never scheduled"),
    ("offloaded, no transfer", offload_graph(), Plan({1: OFF, 2: S}, (Step(1, 8),)),
     r"#1 a .* is offloaded but has no transfer"),
    ("transfer of a saved value", offload_graph(), Plan({1: S, 2: S}, (), (Transfer(1, 3, 7),)),
     r"transfer for #1, which is not offloaded"),
    ("copied out before its last forward use", offload_graph(),
     Plan({1: OFF, 2: S}, (Step(1, 8),), (Transfer(1, 2, 7),)),
     r"#1 a .* is copied out beside step 2; it must be a forward step after its last forward read \(3\.\.4\)"),
    ("copied back at its first use", offload_graph(),
     Plan({1: OFF, 2: S}, (Step(1, 8),), (Transfer(1, 3, 8),)),
     r"#1 a .* is copied back beside step 8; it must be a backward step before its first use \(5\.\.7\)"),
    ("offload of a view", P(node("x", size=1, resident=True), node("v", 0, size=2, offloadable=False),
                            node("w", 1), node("o", 2, keep=True), node("g", 1, 3, backward=True),
                            host_bandwidth=1.0),
     Plan({1: OFF, 2: S}, (Step(1, 4),), (Transfer(1, 3, 4),)),
     r"#1 v .* cannot be offloaded"),
    ("read before it is rematerialized", chain(), Plan({1: S, 2: S, 3: R}, (Step(3, 5),)),
     r"#3 f2 .* is read at step 4, before it is rematerialized at 5"),
]


@pytest.mark.parametrize(
    ("problem", "plan", "message"), [c[1:] for c in BAD_PLANS], ids=[c[0] for c in BAD_PLANS]
)
def test_invalid_plan_raises_plan_error_naming_the_value(problem: Problem, plan: Plan, message: str) -> None:
    with pytest.raises(PlanError, match=message) as info:
        check(problem, plan)
    assert "\n" not in str(info.value)


def test_plan_rejects_a_decision_that_is_not_a_decision() -> None:
    with pytest.raises(PlanError, match=r"decision for value #1 is 'save'; use solvers.Decision"):
        Plan({1: "save"})  # type: ignore[dict-item]


def test_plan_is_immutable_data() -> None:
    plan = Plan({2: R, 1: S}, [Step(2, 5)])  # type: ignore[arg-type]
    assert plan.schedule == (Step(2, 5),)
    assert plan.of(S) == (1,) and plan.of(R) == (2,)
    with pytest.raises(TypeError):
        plan.decisions[3] = S  # type: ignore[index]
