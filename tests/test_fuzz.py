"""The fuzzer's fast slice (``bench/fuzz.py`` runs the long one): random small models on
the eager route, compiled at random budgets, against eager. Hypothesis draws the cases,
so a failing one shrinks to a small model; the two explicit examples are the regressions
of abf260e (an input updated in place, a gradient passed through unchanged). Fixed cases
check the fuzzer's other paths (bf16 autocast at a stated budget, the export check) and
that they find the defects fixed in 93f6e9c and e50e6dc with those fixes taken away."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import rematc.annotate
import rematc.partition
import rematc.trace
from bench.fuzz import (
    EXPORT_TARGETS,
    KINDS,
    Ask,
    Case,
    Op,
    build,
    describe,
    differences,
    export_findings,
    forward_source,
    report,
    run_case,
    run_step,
)
from solvers.baselines import recompute_every

# Cases of the CI slice: each compiles two to five times (a few seconds on a small CPU).
FAST_EXAMPLES = 8
# Models that eager must run: no compile, milliseconds each.
EAGER_EXAMPLES = 60


@st.composite
def cases(draw: Any, *, max_ops: int = 6) -> Case:
    return describe(lambda lo, hi: draw(st.integers(lo, hi)), max_ops=max_ops,
                    autocast=draw(st.booleans()))


def case(*ops: Op, asks: tuple[Ask, ...] = (), passthrough: int = -1, x_grad: bool = False,
         autocast: bool = False, export: bool = False) -> Case:
    return Case(seed=0, batch=32, width=64, ops=ops, second_input=False, x_grad=x_grad,
                passthrough=passthrough, outputs=(), int_output=False, asks=asks,
                compiler="eager", autocast=autocast, export=export)


# x.mul_(0.5), then linear and sigmoid layers: a recomputation must not read the updated x.
INPUT_SCALED = case(Op("inplace", 0, 0, 0), Op("linear", 1, 0, 0), Op("pointwise", 2, 0, 1),
                    Op("linear", 3, 0, 0), Op("pointwise", 4, 0, 0),
                    asks=(Ask("bytes", 90), Ask("min", 10)))
# y + tanh(linear(x)) returned: y's gradient is the incoming one, unchanged.
PASSED_THROUGH = case(Op("linear", 0, 0, 0), Op("pointwise", 1, 0, 0), passthrough=2,
                      asks=(Ask("min", 10),))

# Two linear layers under CPU bf16 autocast at the smallest budget stated: oneDNN's bf16
# matmul scratch, which no value holds, took the step 42% over it before 93f6e9c.
BF16_STATED = case(Op("linear", 0, 0, 0), Op("pointwise", 1, 0, 2), Op("linear", 2, 0, 0),
                   asks=(Ask("min", 10),), autocast=True)
# A dropout after a layer, then the head, at the smallest budget stated: CPU dropout's
# backward scales through an input-sized temporary, uncounted before it was measured
# (rematc.annotate.PROBED).
DROPOUT_STATED = case(Op("linear", 0, 0, 0), Op("dropout", 1, 0, 0), asks=(Ask("min", 10),))
# A dropout between two layers: the Inductor target's export failed on it before e50e6dc.
DROPPED = case(Op("linear", 0, 0, 0), Op("dropout", 1, 0, 0), Op("linear", 2, 0, 0), export=True)
# A graph break between two layers: export planned the first graph alone before e50e6dc.
BROKEN = case(Op("linear", 0, 0, 0), Op("graph_break", 0, 0, 0), Op("linear", 1, 0, 0), export=True)


@settings(max_examples=FAST_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(fuzzed=cases())
@example(fuzzed=INPUT_SCALED)
@example(fuzzed=PASSED_THROUGH)
def test_compiled_step_matches_eager(fuzzed: Case) -> None:
    """Outputs, every gradient, updated inputs and buffers as eager's, at every budget;
    the measured peak within a byte budget."""
    outcome = run_case(fuzzed)
    assert not outcome.failures, report(fuzzed, outcome.findings)


@settings(max_examples=EAGER_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(fuzzed=cases(max_ops=12))
def test_every_description_is_a_model_eager_runs(fuzzed: Case) -> None:
    """In-place updates only where eager's backward allows them; every output either a
    ``batch × width`` tensor or an int."""
    model, inputs = build(fuzzed)
    step = run_step(fuzzed, model, model, inputs)
    assert step.outputs["output 0 requires grad"] is True  # the head's: a backward runs
    for name, value in step.outputs.items():
        assert isinstance(value, (torch.Tensor, int)), name
        if isinstance(value, torch.Tensor):
            assert value.shape == (fuzzed.batch, fuzzed.width), name
    assert Case.from_json(fuzzed.to_json()) == fuzzed


def test_the_generator_reaches_every_feature() -> None:
    """Within 300 seeded cases: every kind of op, an input updated in place, a view of one
    updated, an activation updated in place where it stands (not a copy), a pass-through
    gradient, an int output, and every kind of budget; inputs that require grad (``x``
    and a passed-through ``y``) each in at least a third of the cases."""
    sources, seen_kinds, seen_asks, x_grad, passthrough = [], set(), set(), 0, 0
    for k in range(300):
        c = describe(random.Random(k).randint, max_ops=10)
        sources.append(forward_source(c).text)
        seen_kinds |= {op.kind for op in c.ops}
        seen_asks |= {a.kind for a in c.asks}
        x_grad += c.x_grad
        passthrough += c.passthrough >= 0
    text = "\n".join(sources)
    assert seen_kinds == set(KINDS)
    assert seen_asks == {"bytes", "fraction", "min"}
    assert x_grad >= 100 and passthrough >= 100, (x_grad, passthrough)
    for feature in ("    x.mul_(0.5)", "    x[:, :", "    z.add_(1.0)", "    z[:, :", "y + v", "// 2,)",
                    "torch._dynamo.graph_break()", "F.dropout", ".detach()", ".t()"):
        assert feature in text, feature
    in_place = [line for line in text.splitlines() if line.startswith("    v") and "_(" in line]
    assert any(line.split(".")[0].strip() not in ("x", "z") for line in in_place), in_place


# z[:, :32].mul_(2.0), then z.mul_(0.5), then the head reads z, under Inductor: z's new
# value is computed in z's own buffer, step by step, so a plan that recomputed the last
# step from the one before read the new value (half the head's gradient, z updated twice).
# Found by a long run (seed 22, case 90) where a tight budget's search chose that plan.
INPUT_STEPS = Case(seed=45585, batch=8, width=64, ops=(Op("pointwise", 35, 15, 2), Op("dropout", 27, 46, 6),
                                                       Op("inplace", 53, 51, 2), Op("linear", 58, 55, 2),
                                                       Op("inplace", 28, 39, 0)),
                   second_input=True, x_grad=True, passthrough=-1, outputs=(), int_output=False, asks=(),
                   compiler="inductor", autocast=False, export=False)


@pytest.mark.inductor
def test_no_plan_recomputes_a_step_of_an_inputs_new_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every recomputable value recomputed (the plan a tight budget may get), under
    Inductor: the step is still eager's."""
    assert "z[:, :32].mul_(2.0)" in forward_source(INPUT_STEPS).text
    assert "z.mul_(0.5)" in forward_source(INPUT_STEPS).text

    def recompute_all(problem: Any, options: Any, *, known: Any = None) -> Any:
        plan = recompute_every(problem)
        return rematc.partition.Planned(rematc.partition._fitting(problem.with_budget(None), plan, "all"),
                                        cached=False)

    monkeypatch.setattr(rematc.partition, "plan_for", recompute_all)
    outcome = run_case(INPUT_STEPS)
    assert not outcome.failures, report(INPUT_STEPS, outcome.findings)


# Two dropouts under Inductor with eager's generator (fallback kernels), the first's output
# unused: Inductor keeps it to the graph's end while the second draws its mask through an
# input-sized temporary no statement shows. The stated 7,168 B measured 9,216 B before the
# code walk counted that temporary (seed 22, case 14).
FALLBACK_DROPOUTS = Case(seed=7783, batch=32, width=16,
                         ops=(Op("dropout", 24, 63, 0), Op("reduce", 45, 26, 0), Op("pointwise", 0, 38, 0),
                              Op("pointwise", 12, 53, 0), Op("pointwise", 44, 15, 6), Op("inplace", 46, 37, 0),
                              Op("dropout", 44, 7, 4)),
                         second_input=True, x_grad=False, passthrough=-1, outputs=(), int_output=False,
                         asks=(Ask("bytes", 89),), compiler="inductor", autocast=False, export=False)


@pytest.mark.inductor
def test_the_stated_budget_holds_with_inductors_fallback_dropout() -> None:
    outcome = run_case(FALLBACK_DROPOUTS)
    assert outcome.measured.get("bytes stated"), "no stated budget was measured"
    assert not outcome.failures, report(FALLBACK_DROPOUTS, outcome.findings)


def test_a_wrong_gradient_is_a_difference() -> None:
    """The comparison can fail: a gradient 1% off, a missing one and a flag differing."""
    model, inputs = build(INPUT_SCALED)
    expected = run_step(INPUT_SCALED, model, model, inputs)
    model, inputs = build(INPUT_SCALED)
    got = run_step(INPUT_SCALED, model, model, inputs)
    assert differences(expected, got, rtol=1e-4, atol=1e-5) == []
    grads = dict(got.grads)
    weight = grads["grad m1.weight"]
    assert weight is not None
    grads["grad m1.weight"] = weight * 1.01
    grads["grad head.bias"] = None
    outputs = {**got.outputs, "output 0 requires grad": False}
    found = differences(expected, got._replace(grads=grads, outputs=outputs), rtol=1e-4, atol=1e-5)
    assert [d.split(":")[0] for d in found] == ["output 0 requires grad", "grad m1.weight",
                                              "grad head.bias"]


def test_under_bf16_rounding_is_judged_by_the_float32_step() -> None:
    """Under bf16 autocast a gradient that is zero in exact arithmetic (a linear's bias
    before a training BatchNorm) is rounding noise, as large as itself, on every route:
    another route's noise is no difference, but a wrong gradient still is (fuzz seed 31,
    case 99: Inductor's noise differed from eager's by 107% of it)."""
    fuzzed = case(Op("linear", 0, 0, 0), Op("batchnorm", 1, 0, 0), autocast=True)
    model, inputs = build(fuzzed)
    expected = run_step(fuzzed, model, model, inputs)
    plain = dataclasses.replace(fuzzed, autocast=False)
    model, inputs = build(plain)
    truth = run_step(plain, model, model, inputs)
    bias = expected.grads["grad m0.bias"]
    assert bias is not None and truth.grads["grad m0.bias"] is not None
    tol = {"rtol": 2**-5, "atol": 2**-5, "scaled": True}
    noise = (bias - truth.grads["grad m0.bias"]).abs().max()
    other = {**expected.grads, "grad m0.bias": truth.grads["grad m0.bias"] - (bias - truth.grads["grad m0.bias"])}
    assert differences(expected, expected._replace(grads=other), **tol)  # the noise flipped: too far alone
    assert differences(expected, expected._replace(grads=other), **tol, truth=truth) == []
    weight = expected.grads["grad m0.weight"]
    assert weight is not None and noise > 0
    wrong = {**expected.grads, "grad m0.weight": weight * 1.2}
    found = differences(expected, expected._replace(grads=wrong), **tol, truth=truth)
    assert [d.split(":")[0] for d in found] == ["grad m0.weight"]


def test_the_smallest_budget_stated_holds_under_bf16_autocast() -> None:
    """Measured on the eager route, not a byte over; outputs and gradients as eager's
    under autocast."""
    outcome = run_case(BF16_STATED)
    assert not outcome.failures, report(BF16_STATED, outcome.findings)
    assert outcome.measured == {"min": 0, "min stated": 1}  # budget=1 raises; its figure ran


def _bf16_matmul_scratch() -> int:
    """Bytes a bfloat16 CPU matmul of the case's shape allocates beside its output: oneDNN's
    scratch on CPUs with native bfloat16 products; none where ATen computes them another
    way (an AVX2-only CPU)."""
    from rematc.memory import profiler_peak

    a, b = torch.ones(32, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.bfloat16)
    return profiler_peak(lambda: torch.mm(a, b)) - 32 * 64 * 2


def test_the_fuzzer_finds_a_stated_budget_without_room_for_bf16_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 93f6e9c's room for the scratch taken away, the measured peak is over, on a CPU
    whose bfloat16 matmuls allocate scratch (on one that allocates none there is nothing
    the room holds, and nothing to find)."""
    if _bf16_matmul_scratch() <= 0:
        pytest.skip("this CPU's bfloat16 matmuls allocate no scratch")
    monkeypatch.setattr(rematc.partition, "transient_scratch", lambda nodes, **_: 0)
    outcome = run_case(BF16_STATED)
    assert [f.kind for f in outcome.failures] == ["peak"], report(BF16_STATED, outcome.findings)


def test_the_smallest_budget_stated_holds_with_cpu_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a byte over on the eager route; over once dropout's scratch is not measured."""
    outcome = run_case(DROPOUT_STATED)
    assert not outcome.failures, report(DROPOUT_STATED, outcome.findings)
    assert outcome.measured == {"min": 0, "min stated": 1}
    monkeypatch.setattr(rematc.annotate, "PROBED", rematc.annotate.PROBED - rematc.annotate.CPU_DROPOUT)
    outcome = run_case(DROPOUT_STATED)
    assert [f.kind for f in outcome.failures] == ["peak"], report(DROPOUT_STATED, outcome.findings)


@pytest.mark.parametrize(("fuzzed", "result"), [(DROPPED, "whole step"), (BROKEN, "refused")],
                         ids=["dropout", "graph break"])
def test_export_traces_the_whole_step_or_refuses_a_graph_break(fuzzed: Case, result: str) -> None:
    for target in EXPORT_TARGETS:
        assert export_findings(fuzzed, target) == ([], result), target


def test_the_fuzzer_finds_the_export_defects(monkeypatch: pytest.MonkeyPatch) -> None:
    """With e50e6dc's fixes taken away: no fake mode around Inductor's partition fails the
    dropout model's trace; without ``fullgraph=True`` a graph break exports a problem of
    the first graph."""
    with monkeypatch.context() as m:
        m.setattr(rematc.trace, "inductor_fake_mode", lambda inputs: contextlib.nullcontext())
        assert export_findings(DROPPED, "inductor")[1] == "error"
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, **{**kw, "fullgraph": False}))
    assert export_findings(BROKEN, "eager")[1] == "partial"
