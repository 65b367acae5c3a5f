"""A fuzzer for rematc's correctness: small random models, compiled at random budgets,
checked against eager.

A case is a seeded, picklable description (:class:`Case`): a straight-line forward of
numbered values ``v0, v1, ...`` built from matmuls (``nn.Linear``), pointwise ops,
reductions, views, in-place updates of activations and of inputs, dropout, ``detach``,
BatchNorm, graph breaks, several outputs (an ``int`` among them) and an input that
requires grad passed through as ``y + v``; its forward may run under CPU bfloat16
autocast. :func:`build` turns it into an ``nn.Module`` and its inputs by writing that
forward's source (the report prints it). :func:`run_case` runs one step eagerly, then
compiles fresh copies under rematc, first without a budget and then at the case's budgets
(a fraction; bytes, a share of the unconstrained peak; the smallest feasible budget that
``budget=1``'s InfeasibleBudgetError states), and returns what differs: outputs, every
gradient, mutated inputs, BatchNorm buffers, errors, and the measured peak of a one-graph
step against every budget rematc took (on the eager route not a byte over). A difference
the same route without rematc's partitioner shows as well is reported as "torch" and not
counted (a dropout mask drawn in another order when an unused dropout is dead code). A
case may also trace its step for ``rematc export`` (:func:`export_findings`), for both
targets: the whole step, or a one-line refusal naming a graph break.

Hypothesis drives :func:`describe` in ``tests/test_fuzz.py`` (a failing case shrinks);
here a seeded ``random.Random`` does, and a failing case is shrunk greedily::

    python bench/fuzz.py --cases 200 --seed 0 --inductor-share 0.1 --autocast-share 0.3 \
        --export-share 0.2
    python -m bench.fuzz --replay '<a case's JSON, as a report prints it>'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import linecache
import random
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as ``python bench/fuzz.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import rematc
from rematc.backend import _boxed_eager
from rematc.memory import profiler_peak
from rematc.partition import forget_plans_in_hand
from rematc.trace import SHAPES_KEY, TraceError, trace
from solvers import PlanError, check
from solvers.baselines import save_all
from solvers.budget import Budget
from tests.helpers import infeasible_cause

# Measured peak over a budget rematc took, as tests/test_measured_peak.py: on the eager
# route none (it runs exactly the FX graphs the model describes); under Inductor at most
# this fraction, for what the model does not see (a kernel's workspace).
INDUCTOR_PEAK_TOLERANCE = 0.05
# The eager route runs the ops eager runs, decomposed by AOTAutograd; Inductor fuses and
# reorders floating-point sums. A planning bug is off by far more (the first layer's
# weight gradient 50% off when a recomputation read an updated input).
EAGER_RTOL, EAGER_ATOL = 1e-4, 1e-5
INDUCTOR_RTOL, INDUCTOR_ATOL = 1e-3, 1e-4
# Under bf16 autocast eager and the compiled step both round to bfloat16 (8 bits of
# mantissa: neighbours 2**-8 to 2**-7 apart), where Inductor's fused kernels compute in
# float32 and round once, so a value may land one neighbour off, and a matmul that sums it
# with others of the opposite sign passes that on at the size of the terms, not of their
# sum. So the absolute tolerance is a share of the tensor's largest magnitude; values are
# compared in float32. Measured on 104 autocast cases without a budget: the eager route
# bitwise equal but for one ulp in a graph break's gradient (0.8% of the largest), Inductor
# up to 0.73% of the largest (one ulp of a weight gradient's largest entries); 2**-5 (3.1%)
# is four times that, and a planning bug is off by far more (50% above).
BF16_RTOL, BF16_ATOL = 2**-5, 2**-5  # ATOL: times the expected tensor's largest magnitude
# Seconds CP-SAT may search one graph of a case: their problems have tens of nodes.
SOLVER_TIME_LIMIT = 10.0
# Candidate cases a greedy shrink of one failure may run, each a few compiles.
SHRINK_TRIES = 80


class Op(NamedTuple):
    """One line of the forward: ``kind``'s ``variant`` (both taken modulo what exists)
    reading values ``a`` and ``b`` (indices taken modulo the values so far, so any
    integers describe a model and a shrunk description stays one)."""

    kind: str
    a: int
    b: int
    variant: int


class Ask(NamedTuple):
    """A budget to compile at: ``fraction`` (``value``% of each graph's unconstrained
    peak), ``bytes`` (``value``% of the step's unconstrained peak, in bytes), or ``min``
    (``budget=1``, then the smallest feasible budget its error states)."""

    kind: str
    value: int


@dataclass(frozen=True, kw_only=True)
class Case:
    """One fuzz case: a model, its inputs, the budgets to compile it at and the route.
    Plain data (JSON with :meth:`to_json`), so a failure is reproduced from its report."""

    seed: int  # weights, inputs, gradient seeds and the dropout masks' generator
    batch: int  # rows of every value
    width: int  # columns of every value (even: half-width slices)
    ops: tuple[Op, ...]
    second_input: bool  # an input ``z`` besides ``x`` that never requires grad
    x_grad: bool  # ``x`` requires grad (then it is never updated in place)
    passthrough: int  # -1, or the value ``v`` of an output ``y + v`` (``y`` requires grad)
    outputs: tuple[int, ...]  # values returned after the head's output
    int_output: bool  # an ``int`` among the outputs
    asks: tuple[Ask, ...]  # budgets after the no-budget compile
    compiler: str  # "eager" or "inductor"
    # The forward (eager's and every compiled one's) under CPU bfloat16 autocast; the
    # backward outside it, as a training loop runs it. False in older reports' JSON.
    autocast: bool = False
    # Also trace the step for ``rematc export``, for both targets (:func:`export_findings`).
    export: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Case:
        raw = json.loads(text)
        return Case(**{**raw, "ops": tuple(Op(*o) for o in raw["ops"]),
                       "asks": tuple(Ask(*a) for a in raw["asks"]),
                       "outputs": tuple(raw["outputs"])})


class Variant(NamedTuple):
    """A line template: ``{o}`` the new value, ``{a}``/``{b}`` the values read, ``{h}`` the
    tensor an in-place op updates, ``{i}`` the op's index (its module is ``self.m{i}``),
    ``{B}``/``{W}`` the shape and ``{B2}``/``{W2}`` its halves."""

    line: str
    saves: str  # the operands autograd saves: updating them in place later breaks eager
    fresh: bool  # a new tensor nothing saves and no view: a later op may update it in place
    scalar: bool = True  # reads no second value (the in-place ops an input may take)


VARIANTS: dict[str, tuple[Variant, ...]] = {
    "linear": (Variant("v{o} = self.m{i}(v{a})", "a", True),),
    "pointwise": (
        Variant("v{o} = torch.tanh(v{a})", "", False),  # tanh and sigmoid save their output
        Variant("v{o} = torch.sigmoid(v{a})", "", False),
        Variant("v{o} = torch.relu(v{a})", "", False),
        Variant("v{o} = F.gelu(v{a})", "a", True),
    ),
    "binary": (
        Variant("v{o} = v{a} * v{b}", "ab", True),
        Variant("v{o} = v{a} + v{b}", "", True),
        Variant("v{o} = v{a} - 0.5 * v{b}", "", True),
    ),
    "reduce": (
        Variant("v{o} = v{a} - v{a}.mean(dim=0, keepdim=True)", "", True),
        Variant("v{o} = v{a} * torch.sigmoid(v{a}.sum(dim=1, keepdim=True))", "a", True),
        Variant("v{o} = v{b} + v{a}.sum(dim=1).unsqueeze(1)", "", True),
        Variant("v{o} = v{a}.mean(dim=1, keepdim=True).expand({B}, {W})", "", False),
        Variant("v{o} = v{b} * v{a}.amax(dim=0, keepdim=True)", "ab", True),
    ),
    "view": (
        Variant("v{o} = torch.tanh(v{a}.t()).t()", "", False),
        Variant("v{o} = torch.sigmoid(v{a}.reshape(-1, 4)).reshape({B}, {W})", "", False),
        Variant("v{o} = v{a}.reshape({B}, {W2}, 2).transpose(1, 2).reshape({B}, {W})", "", True),
        Variant("v{o} = torch.cat([v{a}[:, {W2}:], v{a}[:, :{W2}]], dim=1)", "", True),
        Variant("v{o} = v{a}.t().contiguous().t()", "", True),  # a view of a copy nothing saves
    ),
    # In place on ``{h}``: the value itself where nothing saved it, else a copy of it.
    "inplace": (
        Variant("{h}.mul_(0.5)", "", True),
        Variant("{h}.add_(1.0)", "", True),
        Variant("{h}[:, :{W2}].mul_(2.0)", "", True),
        Variant("{h}.add_(v{b})", "", True, scalar=False),
        Variant("{h}.mul_(v{b})", "b", True, scalar=False),
        Variant("{h}.narrow(0, 0, {B2}).add_(v{b}.narrow(0, 0, {B2}))", "", True, scalar=False),
        Variant("{h}.relu_()", "", False),  # relu saves its output
    ),
    "dropout": (
        Variant("v{o} = F.dropout(v{a}, p=0.1, training=True)", "", True),
        Variant("v{o} = F.dropout(v{a}, p=0.5, training=True)", "", True),
    ),
    "detach": (
        Variant("v{o} = v{a}.detach() * v{b}", "ab", True),  # detach shares a's version
        Variant("v{o} = torch.tanh(v{a}.detach()) + v{b}", "", True),
    ),
    "batchnorm": (Variant("v{o} = self.m{i}(v{a})", "a", True),),
    "graph_break": (Variant("torch._dynamo.graph_break()", "", False),),
}
# Drawn by index: the first shrinks best, so it is the plainest; matmuls and pointwise ops
# twice as often as the rest.
KINDS = ("linear", "pointwise", "binary", "linear", "pointwise", "reduce", "view", "inplace",
         "inplace", "dropout", "detach", "batchnorm", "graph_break")
ASK_KINDS = ("bytes", "fraction", "min")
COMPILERS = ("eager", "inductor")
EXPORT_TARGETS = ("inductor", "eager")  # rematc export --target

Draw = Callable[[int, int], int]  # an integer in [lo, hi], both included


def describe(draw: Draw, *, max_ops: int = 8, compiler: str = "eager", autocast: bool = False,
             export: bool = False) -> Case:
    """A case from ``draw``'s integers (Hypothesis's or a seeded ``random.Random``'s):
    smaller integers give a smaller, plainer case. The route, autocast and the export
    check are the caller's (drawn by share)."""
    seed, batch, width = draw(0, 2**16), 8 * draw(1, 4), 16 * draw(1, 4)
    ops = tuple(Op(KINDS[draw(0, len(KINDS) - 1)], draw(0, 63), draw(0, 63), draw(0, 7))
                for _ in range(draw(1, max_ops)))
    second_input, x_grad = bool(draw(0, 1)), bool(draw(0, 1))
    passthrough = draw(0, 63) if draw(0, 1) else -1
    outputs = tuple(draw(0, 63) for _ in range(draw(0, 2)))
    int_output = bool(draw(0, 1))
    asks = tuple(Ask(ASK_KINDS[draw(0, len(ASK_KINDS) - 1)], draw(10, 100))
                 for _ in range(draw(0, 2)))
    return Case(seed=seed, batch=batch, width=width, ops=ops, second_input=second_input,
                x_grad=x_grad, passthrough=passthrough, outputs=outputs,
                int_output=int_output, asks=asks, compiler=compiler, autocast=autocast,
                export=export)


class Source(NamedTuple):
    text: str  # the forward's definition
    modules: dict[str, str]  # attribute -> "linear" or "batchnorm"
    inputs: tuple[str, ...]  # the forward's parameters


def forward_source(case: Case) -> Source:
    """The forward of ``case`` as Python source. Tracks which tensors a later in-place op
    may update without breaking eager's backward: not inputs that require grad, not
    views, not tensors autograd saved (their version is checked in the backward)."""
    inputs = ("x", "z")[: 1 + case.second_input] + (("y",) if case.passthrough >= 0 else ())
    lines = [f"def forward(self, {', '.join(inputs)}):", "    v0 = x"]
    base = [0]  # value -> the value whose tensor it is (an in-place op returns its target)
    mutable = {0: not case.x_grad}  # by base
    if case.second_input:
        lines.append("    v1 = z")
        base.append(1)
        mutable[1] = True
    modules: dict[str, str] = {}
    shape = {"B": case.batch, "W": case.width, "B2": case.batch // 2, "W2": case.width // 2}
    for i, op in enumerate(case.ops):
        variants = VARIANTS[op.kind]
        o, a, b = len(base), op.a % len(base), op.b % len(base)
        in_place_on_input = (op.kind == "inplace" and base[a] < 1 + case.second_input
                             and mutable[base[a]])
        if in_place_on_input:  # by a constant: an input updated from an activation is
            variants = tuple(v for v in variants if v.scalar and v.fresh)  # not this project's
        v = variants[op.variant % len(variants)]
        if op.kind == "inplace" and "b" in v.line and base[b] == base[a] and mutable[base[a]]:
            v = variants[0]  # ``h.mul_(h)`` breaks eager's backward
        if op.kind in ("linear", "batchnorm"):
            modules[f"m{i}"] = op.kind
        if op.kind == "graph_break":
            lines.append(f"    {v.line}")
            continue
        if op.kind == "inplace":
            if mutable[base[a]]:  # an input by its name: the report reads as the model
                target = ("x", "z")[base[a]] if in_place_on_input else f"v{a}"
                pre, post = [], [f"v{o} = {target}"]
                base.append(base[a])
            else:
                target, pre, post = f"v{o}", [f"v{o} = v{a} * 1.5"], []
                base.append(o)
            body = [*pre, v.line.format(h=target, b=b, **shape), *post]
        else:
            body = [v.line.format(o=o, a=a, b=b, i=i, **shape)]
            base.append(o)
        lines += [f"    {line}" for line in body]
        for operand, index in (("a", a), ("b", b)):
            if operand in v.saves:
                mutable[base[index]] = False
        mutable[base[o]] = v.fresh and mutable.get(base[o], True)
    last = len(base) - 1
    outs = [f"self.head(v{last})", *(f"v{k % len(base)}" for k in case.outputs)]
    if case.passthrough >= 0:
        outs.append(f"y + v{case.passthrough % len(base)}")
    if case.int_output:
        outs.append("v0.shape[1] // 2")
    lines.append(f"    return ({', '.join(outs)},)")
    return Source("\n".join(lines) + "\n", modules, inputs)


def source_filename(source: Source) -> str:
    """The file name the forward of ``source`` is compiled under: tracebacks and Dynamo's
    messages name its lines there."""
    return f"<fuzz {hashlib.sha1(source.text.encode()).hexdigest()[:12]}>"


def build(case: Case) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """The model of ``case`` (weights from its seed) and its inputs."""
    source = forward_source(case)
    filename = source_filename(source)
    # Registered so tracebacks and Dynamo's messages show the generated lines.
    linecache.cache[filename] = (len(source.text), None, source.text.splitlines(True), filename)
    namespace: dict[str, Any] = {"torch": torch, "F": F}
    exec(compile(source.text, filename, "exec"), namespace)
    net = type("FuzzNet", (nn.Module,), {"forward": namespace["forward"]})()
    torch.manual_seed(case.seed)
    for name, kind in source.modules.items():
        setattr(net, name, nn.Linear(case.width, case.width) if kind == "linear"
                else nn.BatchNorm1d(case.width))
    net.head = nn.Linear(case.width, case.width)
    gen = torch.Generator().manual_seed(case.seed)
    shape = (case.batch, case.width)
    inputs = [torch.randn(shape, generator=gen).requires_grad_(case.x_grad)]
    if case.second_input:
        inputs.append(torch.randn(shape, generator=gen))
    if case.passthrough >= 0:
        inputs.append(torch.randn(shape, generator=gen).requires_grad_())
    return net, tuple(inputs)


def gradient_seeds(case: Case) -> list[Tensor]:
    """One incoming gradient per output, fixed by the case's seed (every tensor output is
    ``batch × width``)."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    n = 1 + len(case.outputs) + (case.passthrough >= 0)
    return list(torch.randn(n, case.batch, case.width, generator=gen).unbind(0))


class Step(NamedTuple):
    """What one training step leaves, by name: the outputs, the gradients (None where none
    came), the inputs and buffers after it."""

    outputs: dict[str, object]
    grads: dict[str, Tensor | None]
    state: dict[str, Tensor]


def backward_step(fn: Callable[..., Any], inputs: Sequence[Tensor], seeds: Sequence[Tensor], *,
                  autocast: bool) -> Any:
    """The forward (under CPU bf16 autocast if ``autocast``), then the backward from every
    output that requires grad."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = fn(*inputs)
    pairs = [(o, g) for o, g in zip(outs, seeds, strict=False)
             if isinstance(o, Tensor) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return outs


def run_step(case: Case, model: nn.Module, fn: Callable[..., Any],
             inputs: tuple[Tensor, ...]) -> Step:
    """One step of ``fn`` (the model, or a compiled copy) from the case's seed."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(case.seed)
    outs = backward_step(fn, inputs, gradient_seeds(case), autocast=case.autocast)
    outputs: dict[str, object] = {
        f"output {k}": o.detach().clone() if isinstance(o, Tensor) else o for k, o in enumerate(outs)}
    outputs.update({f"output {k} requires grad": o.requires_grad
                    for k, o in enumerate(outs) if isinstance(o, Tensor)})
    named_inputs = dict(zip(forward_source(case).inputs, inputs, strict=True))
    grads = {f"grad {n}": None if p.grad is None else p.grad.clone()
             for n, p in model.named_parameters()}
    grads.update({f"grad {n}": None if t.grad is None else t.grad.clone()
                  for n, t in named_inputs.items() if t.requires_grad})
    state = {f"input {n} after": t.detach().clone() for n, t in named_inputs.items()}
    state.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    return Step(outputs, grads, state)


class Finding(NamedTuple):
    # error | infeasible | mismatch | peak | prediction; torch: the route without rematc
    # differs from eager there as well
    kind: str
    budget: str  # the budget it came at, as asked
    detail: str


class Tolerance(NamedTuple):
    rtol: float
    atol: float
    scaled: bool = False  # atol is a share of the expected tensor's largest magnitude


def differences(expected: Step, got: Step, *, rtol: float, atol: float, scaled: bool = False,
                truth: Step | None = None) -> list[str]:
    """Every entry of ``got`` that is not ``expected``'s, with by how much; with ``scaled``,
    ``atol`` is a share of the largest magnitude of the expected tensor. With ``truth``
    (the step in float32, where ``expected`` ran under bf16 autocast), a tensor no further
    from ``truth`` than twice as far as ``expected`` is counts as rounding, not a
    difference: a gradient that is zero in exact arithmetic (a bias before a BatchNorm) is
    bf16 noise in both, and differs by as much as it is large."""
    out: list[str] = []
    for part in ("outputs", "grads", "state"):
        want: dict[str, Any] = getattr(expected, part)
        have: dict[str, Any] = getattr(got, part)
        if want.keys() != have.keys():
            out.append(f"{part}: {sorted(want)} expected, {sorted(have)} came")
            continue
        for name, e in want.items():
            g = have[name]
            if isinstance(e, Tensor) != isinstance(g, Tensor):
                out.append(f"{name}: {type(g).__name__} instead of {type(e).__name__}")
            elif not isinstance(e, Tensor) or not isinstance(g, Tensor):
                if e != g:
                    out.append(f"{name}: {g!r} instead of {e!r}")
            elif e.shape != g.shape or e.dtype != g.dtype:
                out.append(f"{name}: {g.dtype} {tuple(g.shape)} instead of {e.dtype} {tuple(e.shape)}")
            else:
                g, e = g.float(), e.float()  # bfloat16 values compared in float32
                scale = e.abs().max().item() if scaled and e.numel() else 1.0
                t = getattr(truth, part).get(name) if truth is not None else None
                if isinstance(t, Tensor) and t.shape == e.shape and e.numel():
                    t = t.float()
                    if (g - t).abs().max() <= 2 * (e - t).abs().max() + atol * scale:
                        continue
                if not torch.allclose(g, e, rtol=rtol, atol=atol * scale, equal_nan=True):
                    diff = (g - e).abs()
                    rel = (diff.norm() / e.norm().clamp_min(1e-12)).item()
                    out.append(f"{name}: max abs diff {diff.max().item():.3g}, "
                               f"relative (by norm) {rel:.3g}")
    return out


def _step_budget(records: Sequence[rematc.PartitionRecord]) -> int:
    """The unconstrained peak of a step: its graphs' unconstrained peaks, added (a byte
    budget is shared by the graphs of a step)."""
    return sum(r.unconstrained_peak for r in records)


class Compiled(NamedTuple):
    findings: list[Finding]
    records: list[rematc.PartitionRecord]  # those the compile left; [] when it failed
    min_feasible: int | None = None  # what an InfeasibleBudgetError stated
    error: str = ""  # its message
    measured: int = 0  # 1 when the measured peak was checked


def compile_and_check(case: Case, expected: Step, budget: int | float | None, label: str,
                      truth: Step | None = None) -> Compiled:
    """One step of a fresh copy of ``case`` compiled by rematc at ``budget``, against
    ``expected``, then a second step's peak measured against the budget rematc took
    (:func:`held_budget`). An InfeasibleBudgetError under a byte budget is an answer: its
    figure comes back, for the caller to ask. What the route without rematc gets as wrong
    is marked "torch"."""
    torch._dynamo.reset()
    model, inputs = build(case)
    # A case's byte budgets may be under 1 KiB (budget=1 asks for the stated minimum, and
    # small cases have small peaks): as Budget objects, which parse_budget takes as they are.
    asked = Budget(nbytes=budget) if isinstance(budget, int) else budget
    compiled = rematc.compile(model, budget=asked, compiler=case.compiler, cache_dir=None,
                              time_limit=SOLVER_TIME_LIMIT)
    before, graphs_before = len(rematc.records()), counters["stats"]["unique_graphs"]
    try:
        with same_random_as_eager(case), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run_step(case, model, compiled, inputs)
    except Exception as e:
        err = infeasible_cause(e)
        if err is None:
            lines = "".join(traceback.format_exception_only(type(e), e)).splitlines()
            detail = " | ".join(line for line in lines  # not Dynamo's advice on logging
                                if line.strip() and not line.startswith("Set TORCHDYNAMO"))
            kind = "torch" if isinstance(baseline_step(case), str) else "error"
            return Compiled([Finding(kind, label, detail[-1500:])], [])
        if not isinstance(budget, int) or err.min_feasible is None:
            return Compiled([Finding("infeasible", label, str(err)[:800])], [])
        return Compiled([], [], err.min_feasible, str(err))
    records = rematc.records()[before:]
    # Dynamo's graphs, those without a backward (which rematc does not plan) included: what
    # runs outside the one graph rematc planned is outside the budget (docs/memory-model.md,
    # "What the budget bounds"): after a graph break, the inputs an inference graph computes
    # for it.
    graphs = counters["stats"]["unique_graphs"] - graphs_before
    single = graphs == 1
    if not records:
        return Compiled([Finding("error", label, "the rematc partitioner did not run")], [])
    wrong = differences(expected, got, **_tolerances(case)._asdict(), truth=truth)
    findings: list[Finding] = []
    # A byte budget shared by graphs is the step's: measured where rematc planned every
    # graph of the step (a graph without a backward, which it does not plan, computes
    # outside the budget). A fraction is of one graph's peak: measured for one graph only.
    every_graph = single or (isinstance(budget, int) and len(records) == graphs)
    measurable = every_graph
    held = held_budget(budget, records[-1], [w.category for w in caught]) if measurable else None
    if isinstance(budget, int) and single:
        findings += [Finding("prediction", label,
                             f"predicted peak {r.predicted_peak} B over the budget {r.budget} B")
                     for r in records if r.budget is not None and r.predicted_peak > r.budget]
    if held is not None:
        model.zero_grad(set_to_none=True)  # frees before the measured step, not in it
        for t in inputs:
            t.grad = None
        # In the outputs' dtypes, as a step receives its gradients from autograd's nodes:
        # torch.autograd.backward casts a gradient of another dtype and holds the cast to
        # the end of the backward, beside the model (256 B over a 1,824 B bf16 step).
        seeds = [s.to(o.dtype) if isinstance(o := got.outputs[f"output {k}"], Tensor) else s
                 for k, s in enumerate(gradient_seeds(case))]
        peak = profiler_peak(lambda: backward_step(compiled, inputs, seeds, autocast=case.autocast))
        allowed = held if case.compiler == "eager" else int(held * (1 + INDUCTOR_PEAK_TOLERANCE))
        if peak > allowed:
            findings.append(Finding(
                "peak", label, f"measured {peak} B against the budget {held} B ({allowed} B "
                f"allowed; predicted {records[-1].predicted_peak} B, generated code "
                f"{records[-1].generated_peak} B, kept aside {records[-1].aside} B)"))
    if wrong:  # after the measurement: the baseline resets Dynamo
        torch_also = torch_differences(case, expected, got)
        findings += [Finding("torch" if _name(d) in torch_also else "mismatch", label, d)
                     for d in wrong]
    return Compiled(findings, records, measured=int(held is not None))


def held_budget(budget: int | float | None, record: rematc.PartitionRecord,
                warned: Sequence[type[Warning]]) -> int | None:
    """The bytes rematc took ``budget`` as, where it states the step holds it: a byte
    budget it compiled at; a fraction it neither warned it cannot reach
    (``BudgetWarning``: the least-peak plan runs) nor that the generated code peaks above
    (``OverBudgetWarning``). None without a budget."""
    if isinstance(budget, int):
        return budget
    if budget is None or record.budget is None:
        return None
    if any(issubclass(w, (rematc.BudgetWarning, rematc.OverBudgetWarning)) for w in warned):
        return None
    if record.solver == "least-peak" or record.predicted_peak > record.budget:
        return None
    return record.budget + record.squeezed  # the fraction's bytes, before any re-plan took off


def _name(difference: str) -> str:
    return difference.split(":")[0]


@functools.lru_cache(maxsize=4)
def baseline_step(case: Case) -> Step | str:
    """The step on the route without rematc's partitioner (:func:`baseline_backend`), or
    the error it raised."""
    torch._dynamo.reset()
    model, inputs = build(case)
    compiled = torch.compile(model, backend=baseline_backend(case.compiler))
    try:
        with same_random_as_eager(case):
            return run_step(case, model, compiled, inputs)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        torch._dynamo.reset()


def torch_differences(case: Case, expected: Step, got: Step) -> set[str]:
    """Names where ``got`` differs from eager as the route without rematc does: say a
    parameter only a detached value reads gets zeros, not None, after a graph break
    (AOTAutograd's backward returns every gradient), or a dropout mask is drawn in
    another order when an unused dropout is dead code. Where the baseline raised, none."""
    baseline = baseline_step(case)
    if isinstance(baseline, str):
        return set()
    tol = _tolerances(case)._asdict()
    off = {_name(d) for d in differences(expected, baseline, **tol)}
    return off - {_name(d) for d in differences(baseline, got, **tol)}


class GeneratorError(Exception):
    """Eager could not run a generated model: a bug of the fuzzer, not of rematc."""


class Outcome(NamedTuple):
    findings: list[Finding]  # "torch" ones happen without rematc too: not counted
    measured: dict[str, int]  # by ask kind (and "<kind> stated"): steps measured
    exported: dict[str, int]  # by export check's result: "whole step", "refused"

    @property
    def failures(self) -> list[Finding]:
        """The findings rematc is answerable for."""
        return [f for f in self.findings if f.kind != "torch"]


def run_case(case: Case) -> Outcome:
    """Everything rematc gets wrong on ``case``: compiled without a budget, then at each
    of its asks, against one eager step; then, if the case asks, its export."""
    rematc.clear_records()
    forget_plans_in_hand()
    model, inputs = build(case)
    try:
        expected = run_step(case, model, model, inputs)
        truth = None
        if case.autocast:  # the same step in float32, what bf16 rounding is judged by
            plain = dataclasses.replace(case, autocast=False)
            net, args = build(plain)
            truth = run_step(plain, net, net, args)
    except Exception as e:
        raise GeneratorError(f"eager failed on\n{forward_source(case).text}") from e
    findings: list[Finding] = []
    measured: dict[str, int] = {}
    with warnings.catch_warnings():
        # BudgetWarning (an unreachable fraction runs at the least peak) and
        # GraphBreakWarning are answers, not findings.
        warnings.simplefilter("ignore")
        first = compile_and_check(case, expected, None, "None", truth)
        findings += first.findings
        for ask in case.asks:
            budget: int | float
            if ask.kind == "fraction":
                budget = ask.value / 100
            elif ask.kind == "bytes":
                if not first.records:
                    continue  # no unconstrained peak to take a share of
                budget = max(1, _step_budget(first.records) * ask.value // 100)
            else:
                budget = 1
            result = compile_and_check(case, expected, budget, f"{ask.kind} {budget}", truth)
            findings += result.findings
            measured[ask.kind] = measured.get(ask.kind, 0) + result.measured
            # The stated minimum must work; after a graph break a later graph may state
            # more (the first error knows the graphs compiled so far), so each round may
            # raise again with a larger figure, twice per graph: for its own least, and for
            # the earlier graphs' backwards beside what it keeps to the step's end.
            stated, rounds = result.min_feasible, 0
            while stated is not None:
                rounds += 1
                again = compile_and_check(case, expected, stated,
                                          f"{ask.kind} {budget}: stated minimum {stated}", truth)
                findings += again.findings
                key = f"{ask.kind} stated"  # "min stated": the smallest feasible budget
                measured[key] = measured.get(key, 0) + again.measured
                if again.min_feasible is not None and (
                        again.min_feasible <= stated or rounds > 2 * _graphs(case)):
                    findings.append(Finding(
                        "infeasible", f"stated minimum {stated}",
                        f"asking it raised again (round {rounds}): {again.error}"))
                    break
                stated = again.min_feasible
        exported: dict[str, int] = {}
        if case.export:
            for target in EXPORT_TARGETS:
                found, result_kind = export_findings(case, target)
                findings += found
                exported[result_kind] = exported.get(result_kind, 0) + 1
    torch._dynamo.reset()
    return Outcome(findings, measured, exported)


class StepLoss(nn.Module):
    """The step of a case as the one loss ``rematc export`` traces: each tensor output
    times its gradient seed, summed, so the backward is the step's; the forward under
    autocast where the case's is."""

    def __init__(self, net: nn.Module, seeds: Sequence[Tensor], *, autocast: bool) -> None:
        super().__init__()
        self.net, self.seeds, self.autocast = net, list(seeds), autocast

    def forward(self, *inputs: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            outs = self.net(*inputs)
        terms = [(o * g).sum() for o, g in zip(outs, self.seeds, strict=False) if isinstance(o, Tensor)]
        return torch.stack(terms).sum()


def export_findings(case: Case, target: str) -> tuple[list[Finding], str]:
    """``rematc export``'s trace of the step of ``case`` for ``target``, and what it
    did: a model without a graph break exports its whole step (the loss among its forward
    values, a backward after them, a plan the checker takes); one with a break is refused
    by a one-line ``TraceError`` naming the break, never planned in part."""
    model, inputs = build(case)
    label = f"export --target {target}"
    breaks = _graphs(case) - 1
    source = forward_source(case)
    first_break = next(k for k, line in enumerate(source.text.splitlines(), 1)
                       if "graph_break()" in line) if breaks else 0
    try:
        traced = trace(StepLoss(model, gradient_seeds(case), autocast=case.autocast), inputs,
                       target=target, name="fuzz")
    except TraceError as e:
        message = str(e)
        # Named: the call, and its line in the model (not the line calling the model).
        named = ("breaks into several graphs" in message and "graph_break()" in message
                 and f'"{source_filename(source)}", line {first_break}' in message)
        if breaks and named and "\n" not in message:
            return [], "refused"
        return [Finding("export", label, f"TraceError: {message[:800]}")], "error"
    except Exception as e:  # anything else is a finding, with its type
        return [Finding("export", label, f"not a TraceError: {type(e).__name__}: {str(e)[:800]}")], "error"
    problem = traced.problem
    if breaks:
        return [Finding("export", label, f"a model with {breaks} graph break(s) exported a problem "
                                         f"of {len(problem.nodes)} values, not the refusal")], "partial"
    shapes = json.loads(problem.meta[SHAPES_KEY])
    scalars = [n.name for n in problem.nodes  # StepLoss's loss is float32 under autocast too
               if not n.backward and not n.resident and shapes.get(n.name) == "float32[]"]
    plan = save_all(problem).plan
    missing = [what for what, there in (("the loss (a 0-d forward value)", scalars),
                                        ("a backward", problem.n_forward < len(problem.nodes)),
                                        ("a save-all plan", plan is not None)) if not there]
    if missing:
        return [Finding("export", label, f"the problem ({len(problem.nodes)} values, "
                                         f"{problem.n_forward} forward) lacks {' and '.join(missing)}")], "partial"
    assert plan is not None
    try:
        check(problem, plan)
    except PlanError as e:
        return [Finding("export", label, f"the checker refuses the save-all plan: {e}")], "error"
    return [], "whole step"


def _graphs(case: Case) -> int:
    """Graphs the step compiles to, at most: one more than its graph breaks."""
    return 1 + sum(op.kind == "graph_break" for op in case.ops)


def baseline_backend(compiler: str) -> Any:
    """The route without rematc's partitioner: AOTAutograd running the FX graphs as
    rematc's eager route does (``rematc.backend``), or Inductor as it comes."""
    if compiler == "inductor":
        return "inductor"
    return aot_autograd(fw_compiler=_boxed_eager, bw_compiler=_boxed_eager,
                        keep_inference_input_mutations=True)


def same_random_as_eager(case: Case) -> contextlib.AbstractContextManager[object]:
    """Inductor drawing dropout masks with eager's generator (the eager route does), in
    eager's order; not on the eager route, where the option changes the graph
    (``native_dropout`` is kept). Inductor's peak-memory reordering moves independent
    ``native_dropout`` fallbacks, which draw from that generator, out of program order
    (pytorch/pytorch#192635): a plan's forward, saving other values, had two dropouts'
    masks swapped."""
    if case.compiler == "inductor":
        return torch._inductor.config.patch(fallback_random=True, reorder_for_peak_memory=False)
    return contextlib.nullcontext()


def _tolerances(case: Case) -> Tolerance:
    if case.autocast:
        return Tolerance(BF16_RTOL, BF16_ATOL, scaled=True)
    if case.compiler == "eager":
        return Tolerance(EAGER_RTOL, EAGER_ATOL)
    return Tolerance(INDUCTOR_RTOL, INDUCTOR_ATOL)


def report(case: Case, findings: Sequence[Finding]) -> str:
    """A failure as a reproduction: the findings, the forward, the case's JSON."""
    route = case.compiler + (", bf16 autocast" if case.autocast else "")
    lines = [f"{f.kind} {'in' if f.kind == 'export' else 'at budget'} {f.budget} ({route}): {f.detail}"
             for f in findings]
    asks = ", ".join(f"{a.kind} {a.value}" for a in case.asks) or "none"
    lines += [f"model (seed {case.seed}, batch {case.batch}, width {case.width}, "
              f"x requires grad: {case.x_grad}, autocast: {case.autocast}; budgets after None: "
              f"{asks}; export checked: {case.export}):",
              forward_source(case).text.rstrip(), f"case: {case.to_json()}"]
    return "\n".join(lines)


def smaller(case: Case) -> Iterator[Case]:
    """Cases one step simpler than ``case``, most simplifying first."""
    rep = dataclasses.replace
    for k in range(len(case.ops)):
        if len(case.ops) > 1:
            yield rep(case, ops=case.ops[:k] + case.ops[k + 1:])
    for k in range(len(case.asks)):
        yield rep(case, asks=case.asks[:k] + case.asks[k + 1:])
    for k in range(len(case.outputs)):
        yield rep(case, outputs=case.outputs[:k] + case.outputs[k + 1:])
    for field, plain in (("export", False), ("autocast", False), ("passthrough", -1),
                         ("int_output", False), ("second_input", False), ("x_grad", False),
                         ("batch", 8), ("width", 16)):
        if getattr(case, field) != plain:
            yield rep(case, **{field: plain})
    text = forward_source(case).text
    for k, op in enumerate(case.ops):
        for simpler in (op._replace(variant=0), op._replace(a=0), op._replace(b=0)):
            candidate = rep(case, ops=(*case.ops[:k], simpler, *case.ops[k + 1:]))
            if forward_source(candidate).text != text:  # not the same model again
                yield candidate


def shrink(case: Case, kinds: set[str], *, tries: int = SHRINK_TRIES) -> tuple[Case, list[Finding]]:
    """Greedily the smallest case found within ``tries`` runs that still fails with one of
    ``kinds``, and its failures."""
    best, failures = case, run_case(case).failures
    improved = True
    while improved and tries > 0:
        improved = False
        for candidate in smaller(best):
            if tries <= 0:
                break
            tries -= 1
            try:
                found = run_case(candidate).failures
            except GeneratorError:
                continue
            if any(f.kind in kinds for f in found):
                best, failures, improved = candidate, found, True
                break
    return best, failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inductor-share", type=float, default=0.0,
                        help="share of cases compiled with Inductor (slow on a CPU)")
    parser.add_argument("--autocast-share", type=float, default=0.0,
                        help="share of cases whose forward runs under CPU bf16 autocast")
    parser.add_argument("--export-share", type=float, default=0.0,
                        help="share of cases also traced for rematc export, for both targets")
    parser.add_argument("--max-ops", type=int, default=10)
    parser.add_argument("--no-shrink", action="store_true", help="report failures as found")
    parser.add_argument("--stop-after", type=int, default=0,
                        help="stop after this many failing cases (0: run them all)")
    parser.add_argument("--replay", metavar="JSON", help="run one case from its JSON")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    if args.replay:
        case = Case.from_json(args.replay)
        outcome = run_case(case)
        print(report(case, outcome.findings) if outcome.findings else "no findings")
        return 1 if outcome.failures else 0
    tally: Counter[str] = Counter()  # what the cases run held, for the summary
    invalid, torch_only = 0, 0
    failures: list[tuple[int, Case, list[Finding]]] = []
    for k in range(args.cases):
        rng = random.Random(args.seed * 1_000_003 + k)
        compiler = "inductor" if rng.random() < args.inductor_share else "eager"
        case = describe(rng.randint, max_ops=args.max_ops, compiler=compiler)
        # Drawn after the description, so a seed describes the models it did before.
        case = dataclasses.replace(case, autocast=rng.random() < args.autocast_share,
                                   export=rng.random() < args.export_share)
        try:
            outcome = run_case(case)
        except GeneratorError as e:
            invalid += 1
            print(f"case {k}: {e} {e.__cause__!r}", flush=True)
            continue
        tally.update({compiler: 1, f"{compiler} autocast": case.autocast,
                      "x requires grad": case.x_grad, "passthrough": case.passthrough >= 0,
                      "graph break": _graphs(case) > 1,
                      "measured steps of several graphs": sum(outcome.measured.values()) * (_graphs(case) > 1),
                      **{f"ask {a.kind}": 1 for a in case.asks},
                      **{f"measured {compiler} {kind}": n for kind, n in outcome.measured.items()},
                      **{f"export {result}": n for result, n in outcome.exported.items()}})
        if outcome.findings and not outcome.failures:
            torch_only += 1
            print(f"case {k}, also without rematc:\n{report(case, outcome.findings)}", flush=True)
        if outcome.failures:
            print(f"case {k} fails:\n{report(case, outcome.findings)}", flush=True)
            failures.append((k, case, outcome.failures))
            if args.stop_after and len(failures) >= args.stop_after:
                break
        if k % 10 == 9:
            print(f"{k + 1} cases, {len(failures)} failing, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\ncases run: {tally['eager'] + tally['inductor']} ({tally['eager']} eager, "
          f"{tally['inductor']} inductor), failing: {len(failures)}, differing without rematc "
          f"too: {torch_only}, invalid (eager failed): {invalid}, "
          f"time: {time.perf_counter() - t0:.0f} s, torch {torch.__version__}")
    print("held: " + ", ".join(f"{name} {n}" for name, n in sorted(tally.items())
                               if name not in COMPILERS))
    for k, case, found in failures:
        kinds = {f.kind for f in found}
        shrunk, findings = (case, found) if args.no_shrink else shrink(case, kinds)
        print(f"\nfailure in case {k} ({', '.join(sorted(kinds))}), "
              f"{'as found' if args.no_shrink else 'shrunk'}:\n{report(shrunk, findings)}")
    print(f"total time: {time.perf_counter() - t0:.0f} s")
    return 1 if failures or invalid else 0


if __name__ == "__main__":
    sys.exit(main())
