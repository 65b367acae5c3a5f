"""Will it fit? One training step of a model at each micro-batch and sequence length.

For every shape of a sweep, :func:`fit` traces the step on the model's own tensors
(``meta`` for models too big for this machine), plans its activations three ways, and
adds the rest of the step (:mod:`rematc.wholestep`):

* no recomputation: everything the backward reads is saved;
* per-block checkpointing: each segment boundary of the chain of blocks is kept and the
  rest recomputed (``torch.utils.checkpoint`` around every block);
* rematc: the cheapest plan whose whole step fits the device's memory.

Each gets the step's memory by part, whether it fits, the modelled step time (forward
and backward by the device model, the plan's recomputation, the optimizer's passes over
memory; no communication) and tokens per second per rank. :meth:`FitReport.best` is the
fastest configuration that fits. docs/fit.md states the model and its validation.

A model source is a factory ``f(*, batch, seq) -> (model, inputs)`` whose model returns
the loss, or a ``transformers`` config (an object or a JSON file): rematc builds the
causal LM on ``meta`` with no weights, its inputs, and a next-token loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn

from rematc.devices import DeviceProfile, profile_for
from rematc.wholestep import (
    Breakdown,
    ModelStates,
    StepSetup,
    activation_room,
    breakdown,
    model_states,
    optimizer_time,
)
from solvers import InfeasibleBudgetError, Problem, SolverConfig
from solvers.baselines import checkpoint_every, save_all
from solvers.budget import format_bytes
from solvers.chain import sharing_options
from solvers.planner import solve

if TYPE_CHECKING:
    from rematc.trace import Traced

log = logging.getLogger(__name__)

Factory = Callable[..., tuple[nn.Module, Sequence[Any]]]
STRATEGIES = ("no recomputation", "per-block checkpointing", "rematc")
DEFAULT_SETUP = StepSetup()
# Seconds of planning per shape of a sweep. The batches of one sequence length share their
# blocks' options, so most shapes spend it on the chain-level choice: on the Llama-2-7B
# sweep of docs/fit.md, 6 s gave tokens/s within 0.5% of 10 s's at every shape, about as
# much as runs of either differ (the searches stop on the wall clock).
DEFAULT_CONFIG = SolverConfig(time_limit=6.0)


class FitError(ValueError):
    """A model source or setting fit cannot use; the message says which and why."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way of running one shape."""

    strategy: str  # one of STRATEGIES
    breakdown: Breakdown | None  # None where no plan was found
    fits: bool
    added_time: float  # seconds the plan recomputes or exposes
    step_time: float  # seconds of the whole step, modelled
    tokens_per_s: float  # per rank
    status: str  # "fits", "over by 3.1 GiB", "no plan: ...", the solver's status


@dataclass(frozen=True, kw_only=True)
class ShapeFit:
    batch: int
    seq: int
    trace_s: float  # wall seconds to trace (0 where states alone do not fit: not traced)
    plan_s: float
    values: int  # values of the traced graph
    compute_time: float  # seconds of forward and backward, nothing recomputed
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True, kw_only=True)
class FitReport:
    source: str
    device: str
    memory: int  # bytes of device memory per rank
    setup: StepSetup
    parameters: int  # trainable elements
    shapes: tuple[ShapeFit, ...]

    def best(self) -> tuple[ShapeFit, Candidate] | None:
        """The fastest configuration that fits, by tokens per second."""
        fitting = [(s, c) for s in self.shapes for c in s.candidates if c.fits]
        return max(fitting, key=lambda sc: sc[1].tokens_per_s, default=None)

    def to_json(self) -> dict[str, Any]:
        best = self.best()
        return {
            "source": self.source, "device": self.device, "memory": self.memory,
            "setup": dataclasses.asdict(self.setup), "parameters": self.parameters,
            "shapes": [{
                "batch": s.batch, "seq": s.seq, "trace_s": round(s.trace_s, 2),
                "plan_s": round(s.plan_s, 2), "values": s.values, "compute_time": s.compute_time,
                "candidates": [{
                    "strategy": c.strategy, "fits": c.fits, "status": c.status,
                    "peak": c.breakdown.peak if c.breakdown else None,
                    "phase": c.breakdown.phase if c.breakdown else None,
                    "parts": c.breakdown.parts() if c.breakdown else None,
                    "added_time": c.added_time, "step_time": c.step_time,
                    "tokens_per_s": c.tokens_per_s,
                } for c in s.candidates],
            } for s in self.shapes],
            "best": None if best is None else {"batch": best[0].batch, "seq": best[0].seq,
                                               "strategy": best[1].strategy,
                                               "tokens_per_s": best[1].tokens_per_s},
        }


def fit(source: Factory | Any, *, device: str | DeviceProfile, memory: int | None = None,
        setup: StepSetup = DEFAULT_SETUP, batches: Sequence[int] = (1,),
        seqs: Sequence[int] = (2048,), config: SolverConfig = DEFAULT_CONFIG,
        name: str = "model") -> FitReport:
    """Sweep ``batches`` x ``seqs`` of ``source`` (a factory or a transformers config)
    on ``device`` with ``memory`` bytes per rank (the profile's by default).

    A sweep of three shapes or more is traced once, at the longest sequence, with the
    inputs' batch dimension symbolic where batches vary and their sequence dimension where
    sequence lengths do: each shape's problem is the captured graph read again at its sizes
    (:meth:`rematc.trace.Traced.at_sizes`), not a new trace. A shape at which a branch the
    trace took on its sizes does not hold is traced on its own."""
    profile = profile_for(device)
    if memory is not None and memory <= 0:
        raise FitError(f"memory {memory} B per rank is not positive: give the device's memory in bytes, "
                       "e.g. 80 * 2**30")
    memory = memory if memory is not None else profile.memory
    if not memory:
        raise FitError(f"the {profile.name} profile states no device memory; give the memory per rank "
                       "(--memory, e.g. 64GiB)")
    build = _builder(source)
    # Dynamo specializes a dimension of size 1: a symbolic batch is traced at batch >= 2.
    # The trace is at the longest sequence, where tables sliced to the sequence (rotary)
    # hold every one.
    first = batches[0] if len(set(batches)) == 1 else min((b for b in batches if b >= 2), default=2)
    model, inputs = build(batch=first, seq=max(seqs))
    states = model_states(model)
    on_meta = any(t.device.type == "meta" for t in model.parameters())
    # Autocast does not act on meta tensors: there a bf16-mixed step is traced in bf16,
    # and its fp32 gradients are added beside the graph instead of inside it.
    counts = setup.fsdp == 1 and not (on_meta and setup.precision == "bf16-mixed")
    room = activation_room(states, setup, memory, activations_count_gradients=counts)
    shapes: list[ShapeFit] = []
    if room < 0:
        shapes += [_states_over(states, setup, memory, counts, batch=b, seq=q) for q in seqs for b in batches]
    else:
        problems = _problems(build, model, inputs, batches, seqs, first, profile=profile, setup=setup,
                             name=name)
        for seq in seqs:
            # The batches of one sequence length differ in sizes alone: each repeated block
            # is searched at the first batch that needs a plan, its options re-judged at the rest.
            with sharing_options():
                for batch in batches:
                    problem, trace_s = problems[batch, seq]
                    if not counts:
                        problem = gradients_outside(problem)
                    shapes.append(_fit_shape(problem, trace_s, states, profile, memory, room, setup, config,
                                             counts_gradients=counts, batch=batch, seq=seq))
    return FitReport(source=name, device=profile.name, memory=memory, setup=setup,
                     parameters=states.count, shapes=tuple(shapes))


def _problems(build: Factory, model: nn.Module, inputs: Sequence[Any], batches: Sequence[int],
              seqs: Sequence[int], first: int, *, profile: DeviceProfile, setup: StepSetup,
              name: str) -> dict[tuple[int, int], tuple[Problem, float]]:
    """Each (batch, seq)'s problem and the seconds its share of tracing took (``model``
    and ``inputs`` are the step at batch ``first`` and the longest sequence)."""
    from rematc.trace import TraceError

    longest = max(seqs)
    shapes = [(b, q) for q in dict.fromkeys(seqs) for b in dict.fromkeys(batches)]
    dims: dict[int, str] = {}
    if len(shapes) >= 3:
        if len(set(batches)) > 1:
            dims = {d: "batch" for d in _varying(inputs, build(batch=first + 1, seq=longest)[1])}
        if len(set(seqs)) > 1:
            other = min(seqs)
            dims.update({d: "seq" for d in _varying(inputs, build(batch=first, seq=other)[1])})
    out: dict[tuple[int, int], tuple[Problem, float]] = {}
    if dims and sorted(dims.items()) in ([(0, "batch")], [(0, "batch"), (1, "seq")], [(1, "seq")]):
        for x in inputs:
            for d in dims:
                if isinstance(x, Tensor) and x.dim() > d:
                    torch._dynamo.mark_dynamic(x, d)
        t0 = time.perf_counter()
        traced = trace_step(model, inputs, profile=profile, setup=setup, name=name)
        shared = (time.perf_counter() - t0) / len(shapes)
        for b, q in shapes:
            t1 = time.perf_counter()
            sizes = {d: b if what == "batch" else q for d, what in dims.items()}
            try:
                out[b, q] = (traced.at_sizes(sizes), shared + time.perf_counter() - t1)
            except TraceError as e:  # specialized, or a branch on the sizes: its own trace
                log.info("rematc fit: %s at batch %d, seq %d: %s", name, b, q, e)
    elif dims:
        log.info("rematc fit: %s: the inputs' sizes vary in dimensions %s, not batch first and "
                 "sequence second: tracing each shape", name, dims)
    for b, q in shapes:
        if (b, q) in out:
            continue
        step = (model, inputs) if (b, q) == (first, longest) and not dims else build(batch=b, seq=q)
        t0 = time.perf_counter()
        out[b, q] = (trace_step(*step, profile=profile, setup=setup, name=f"{name}-b{b}-s{q}").problem,
                     time.perf_counter() - t0)
    return out


def _varying(inputs: Sequence[Any], other: Sequence[Any]) -> set[int]:
    """The dimensions in which the tensors of two calls' inputs differ in size."""
    return {d for x, y in zip(inputs, other, strict=False)
            if isinstance(x, Tensor) and isinstance(y, Tensor) and x.dim() == y.dim()
            for d in range(x.dim()) if x.shape[d] != y.shape[d]}


def _states_over(states: ModelStates, setup: StepSetup, memory: int, counts: bool, *,
                 batch: int, seq: int) -> ShapeFit:
    probe = breakdown(states, setup, activations=0, activations_count_gradients=counts)
    status = f"model states and workspaces alone need {_size(probe.peak)} of {_size(memory)}"
    out = tuple(Candidate(strategy=s, breakdown=probe, fits=False, added_time=0.0,
                          step_time=float("nan"), tokens_per_s=0.0, status=status) for s in STRATEGIES)
    return ShapeFit(batch=batch, seq=seq, trace_s=0.0, plan_s=0.0, values=0,
                    compute_time=float("nan"), candidates=out)


def _fit_shape(problem: Problem, trace_s: float, states: ModelStates, profile: DeviceProfile,
               memory: int, room: int, setup: StepSetup, config: SolverConfig, *,
               counts_gradients: bool, batch: int, seq: int) -> ShapeFit:
    tokens = batch * seq
    compute = sum(n.time for n in problem.nodes if not n.resident)
    opt_time = optimizer_time(states, setup, profile.mem_bandwidth)

    def candidate(strategy: str, activations: int | None, added: float, status: str) -> Candidate:
        if activations is None:
            return Candidate(strategy=strategy, breakdown=None, fits=False, added_time=added,
                             step_time=float("nan"), tokens_per_s=0.0, status=status)
        b = breakdown(states, setup, activations=activations,
                      activations_count_gradients=counts_gradients)
        fits = b.peak <= memory
        step = compute + added + opt_time
        status = (status or "fits") if fits else f"over by {_size(b.peak - memory)}"
        return Candidate(strategy=strategy, breakdown=b, fits=fits, added_time=added,
                         step_time=step, tokens_per_s=tokens / step, status=status)

    free = problem.with_budget(None)
    everything = save_all(free).report
    blocks = checkpoint_every(free, k=1).report
    assert everything is not None and blocks is not None
    t1 = time.perf_counter()
    planned = _plan(problem, room, everything.peak, config)
    plan_s = time.perf_counter() - t1
    ours = candidate("rematc", planned.peak, planned.added_time, planned.status)
    out = (candidate("no recomputation", everything.peak, 0.0, ""),
           candidate("per-block checkpointing", blocks.peak, blocks.added_time, ""), ours)
    return ShapeFit(batch=batch, seq=seq, trace_s=trace_s, plan_s=plan_s,
                    values=len(problem.nodes), compute_time=compute, candidates=out)


class _Planned(NamedTuple):
    peak: int | None  # the graph's peak under rematc's plan; None where none was found
    added_time: float  # seconds
    status: str


def _plan(problem: Problem, room: int, save_all_peak: int, config: SolverConfig) -> _Planned:
    """rematc's plan of ``problem`` within ``room`` bytes of activations."""
    if save_all_peak <= room:
        return _Planned(save_all_peak, 0.0, "")
    try:
        result = solve(problem.with_budget(room), config)
    except InfeasibleBudgetError as e:
        known = "needs at least" if e.proven else "needs, by the least plan found,"
        least = f"; the graph {known} {_size(e.min_feasible)}" if e.min_feasible else ""
        return _Planned(None, 0.0, f"no plan within {_size(room)} of activations{least}")
    if result.report is None or result.plan is None:
        return _Planned(None, 0.0, f"no plan ({result.status.name.lower()})")
    gap = f", gap {result.gap:.0%}" if result.gap > 0.005 else ""
    return _Planned(result.report.peak, result.report.added_time, f"fits ({result.solver}{gap})")


def gradients_outside(problem: Problem) -> Problem:
    """The problem with its gradients (backward values kept to the end) holding no bytes:
    the whole-step model adds them beside the graph."""
    nodes = [dataclasses.replace(n, size=0) if n.backward and n.keep else n for n in problem.nodes]
    return dataclasses.replace(problem, nodes=tuple(nodes))


def trace_step(model: nn.Module, inputs: Sequence[Any], *, profile: DeviceProfile,
               setup: StepSetup, name: str) -> Traced:
    """One step of ``model`` at ``setup``'s precision: on ``meta`` cast to the compute
    dtype, elsewhere under autocast for bf16-mixed."""
    from rematc.trace import trace

    on_meta = any(t.device.type == "meta" for t in model.parameters())
    dtype: str | None = None
    if setup.precision == "bf16" or (on_meta and setup.precision == "bf16-mixed"):
        dtype = "bfloat16"
    elif setup.precision == "bf16-mixed":
        model = _Autocast(model)
    return trace(model, tuple(inputs), device=profile.name, target="eager", dtype=dtype, name=name)


class _Autocast(nn.Module):
    """``inner`` run under bf16 autocast on its own device type."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Tensor:
        device_type = next(self.inner.parameters()).device.type
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out: Tensor = self.inner(*args)
        return out


# ---- model sources -------------------------------------------------------------------


def _builder(source: Factory | Any) -> Factory:
    if _is_config(source):
        return lambda *, batch, seq: causal_lm(source, batch=batch, seq=seq)
    if callable(source):
        return source
    raise FitError(f"a fit source is a factory f(*, batch, seq) or a transformers config, "
                   f"got {type(source).__name__}")


def load_fit_factory(spec: str) -> Factory:
    """``module:function`` as a fit source: called as ``function(batch=B, seq=S)``."""
    import inspect

    from rematc.trace import as_example, import_function

    fn = import_function(spec)
    try:
        inspect.signature(fn).bind(batch=1, seq=1)
    except (TypeError, ValueError):
        raise FitError(f"{spec} must take the keyword arguments batch and seq") from None

    def build(*, batch: int, seq: int) -> tuple[nn.Module, Sequence[Any]]:
        try:
            made = fn(batch=batch, seq=seq)
        except Exception as e:
            raise FitError(f"{spec}(batch={batch}, seq={seq}) failed: {type(e).__name__}: {e}") from e
        return as_example(spec, made)

    return build


def _is_config(source: object) -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return isinstance(source, transformers.PretrainedConfig)


def load_config(path: str) -> Any:
    """A transformers config from a ``config.json`` (file or folder); one-line errors."""
    try:
        import transformers
    except ImportError as e:
        raise FitError("a config source needs transformers (pip install transformers)") from e
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            data = json.load(f)
    except OSError as e:
        raise FitError(f"cannot read {file}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise FitError(f"{file} is not JSON: {e.msg} at line {e.lineno}") from e
    if not isinstance(data, dict) or "model_type" not in data:
        raise FitError(f"{file}: a transformers config needs the field 'model_type'")
    model_type = data["model_type"]
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise FitError(f"{file}: 'model_type' {model_type!r} is not a model type transformers "
                       f"{transformers.__version__} knows")
    check_shape(data, transformers.CONFIG_MAPPING[model_type], file)
    try:
        return transformers.AutoConfig.for_model(**data)
    # Besides ValueError and TypeError, huggingface_hub's StrictDataclass*ValidationError,
    # which derive from Exception alone (a field of the wrong type, a failed validator).
    except Exception as e:
        raise FitError(f"{file}: {' '.join(str(e).split())}") from e


# The shape fields a fit needs stated: transformers' defaults are one model's (Llama-2-7B's
# hidden size 4096), silently another model. Each is a whole number from 1.
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


def check_shape(data: dict[str, Any], config_class: Any, file: str) -> None:
    """Raise :class:`FitError` naming the field where a shape field of ``data`` (a config's
    JSON) is missing, not a whole number from 1, or does not divide as attention needs.
    A field is looked up under its own name and its model's (``n_embd`` for GPT-2's
    ``hidden_size``, by the config class's ``attribute_map``); ``intermediate_size`` only
    where the class has one (GPT-2's ``n_inner`` defaults to 4 x hidden). A multimodal
    config's shape is its ``text_config``'s."""
    text = data.get("text_config")
    sub = getattr(config_class, "sub_configs", {}).get("text_config")
    if isinstance(text, dict) and sub is not None and not any(f in data for f in SHAPE_FIELDS):
        check_shape(text, sub, f"{file}: text_config")
        return
    aliases = getattr(config_class, "attribute_map", {})
    try:
        default = vars(config_class())
    except Exception:  # a config that needs its parts: no defaults to name
        default = {}
    values: dict[str, int] = {}
    for field in SHAPE_FIELDS:
        names = [n for n in (field, aliases.get(field)) if n is not None]
        if field == "intermediate_size" and not any(n in default for n in names):
            continue
        given = [n for n in names if n in data]
        if not given:
            fallback = next((default[n] for n in names if n in default), None)
            raise FitError(f"{file}: the field '{names[-1]}' is missing: rematc fit needs the model's shape "
                           f"stated, not transformers' default ({fallback!r})")
        value = data[given[0]]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FitError(f"{file}: '{given[0]}' must be a whole number from 1, got {value!r}")
        values[field] = value
    heads, kv = values["num_attention_heads"], data.get("num_key_value_heads")
    if "head_dim" not in data and values["hidden_size"] % heads:
        raise FitError(f"{file}: 'num_attention_heads' {heads} does not divide 'hidden_size' "
                       f"{values['hidden_size']} (or state 'head_dim')")
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv):
        raise FitError(f"{file}: 'num_key_value_heads' must be a whole number from 1 that divides "
                       f"'num_attention_heads' {heads}, got {kv!r}")


class CausalLMLoss(nn.Module):
    """A transformers causal LM and its next-token loss, written out (on meta tensors
    ``aten::nll_loss`` has no autograd kernel)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: Tensor) -> Tensor:
        logits = self.inner(input_ids=tokens, use_cache=False).logits[:, :-1].float()
        picked = logits.log_softmax(-1).gather(-1, tokens[:, 1:].unsqueeze(-1))
        return -picked.mean()


_CAUSAL = "rematc_causal"


def causal_lm(config: Any, *, batch: int, seq: int) -> tuple[nn.Module, tuple[Tensor]]:
    """The config's causal LM on ``meta`` (no weights) and ``batch`` x ``seq`` tokens.
    Attention is torch's SDPA with ``is_causal=True``: the inputs carry no padding, and
    on meta a materialised mask would trace as explicit softmax attention."""
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, **kwargs: Any) -> Any:
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register(_CAUSAL, causal)
    config = config.__class__.from_dict(config.to_dict())
    config._attn_implementation = _CAUSAL
    config.use_cache = False
    with torch.device("meta"), _quiet("transformers"):
        try:
            inner = transformers.AutoModelForCausalLM.from_config(config)
        except (ValueError, TypeError, RuntimeError) as e:
            raise FitError(f"transformers cannot build a causal LM from this config: "
                           f"{str(e).splitlines()[0]}") from e
        tokens = torch.zeros(batch, seq, dtype=torch.long)
    inner.train()
    return CausalLMLoss(inner), (tokens,)


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    lg = logging.getLogger(logger)
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(level)


def _size(n: int | float) -> str:
    return format_bytes(n)


def count(n: int) -> str:
    """A count in thousands, millions or billions: ``'7.00 B'``, ``'1.2 M'``, ``'830'``."""
    for scale, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return str(n)


# ---- reports -------------------------------------------------------------------------


def describe(report: FitReport) -> list[str]:
    """The report as tables: the step's memory by part, then each shape's strategies."""
    s = report.setup
    fsdp = f", FSDP over {s.fsdp} ranks" if s.fsdp > 1 else ""
    lines = [f"{report.source} on {report.device} ({_size(report.memory)} per rank): "
             f"{count(report.parameters)} parameters, {s.optimizer}, {s.precision}{fsdp}, "
             f"reserve {s.reserve:.0%}", ""]
    unit, scale = ("GiB", 2**30) if report.memory >= 2**30 else ("MiB", 2**20)
    head = (f"{'batch':>5} {'seq':>7}  {'strategy':<24} {'peak ' + unit:>9} {'params':>7} {'grads':>7} "
            f"{'optim':>7} {'activ':>7} {'other':>7}  {'added ms':>9} {'step ms':>9} {'tokens/s':>9}  status")
    lines += [head, "-" * len(head)]
    for shape in report.shapes:
        if shape.trace_s == 0 and all(not c.fits for c in shape.candidates):  # not traced
            lines.append(f"{shape.batch:>5} {shape.seq:>7}  {'-':<24} {'':>9} {'':>7} {'':>7} {'':>7} "
                         f"{'':>7} {'':>7}  {'':>9} {'':>9} {'':>9}  {shape.candidates[0].status}")
            continue
        for c in shape.candidates:
            b = c.breakdown
            if b is None:
                cells = f"{'-':>9} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7}"
            else:
                parts = b.parts()
                other = sum(parts[k] for k in ("buffers", "FSDP buffers", "optimizer temporaries", "workspaces",
                                               "reserve"))
                cells = (f"{b.peak / scale:>9.1f} {parts['parameters'] / scale:>7.1f} "
                         f"{parts['gradients'] / scale:>7.1f} {parts['optimizer state'] / scale:>7.1f} "
                         f"{parts['activations'] / scale:>7.1f} {other / scale:>7.1f}")
            timing = (f"{c.added_time * 1e3:>9.1f} {c.step_time * 1e3:>9.1f} {c.tokens_per_s:>9,.0f}"
                      if c.fits else f"{'':>9} {'':>9} {'':>9}")
            lines.append(f"{shape.batch:>5} {shape.seq:>7}  {c.strategy:<24} {cells}  {timing}  {c.status}")
    lines.append("activ: the graph's peak under the plan, with the gradients it produces where grads "
                 "shows 0; other: buffers, FSDP's units in flight, optimizer temporaries, the math "
                 "libraries' workspaces, reserve")
    traced = [x for x in report.shapes if x.trace_s]
    if traced:
        lines.append(f"traced {len(traced)} shapes in {sum(x.trace_s for x in traced):.0f} s, "
                     f"planned in {sum(x.plan_s for x in traced):.0f} s")
    best = report.best()
    lines.append("")
    if best is None:
        lines.append("nothing fits: shard the model (--fsdp), a smaller batch or sequence, or bf16 states")
    else:
        shape, c = best
        assert c.breakdown is not None
        lines.append(f"fastest that fits: batch {shape.batch}, seq {shape.seq}, {c.strategy}: "
                     f"{c.tokens_per_s:,.0f} tokens/s per rank, step {c.step_time * 1e3:.1f} ms, "
                     f"peak {_size(c.breakdown.peak)} of {_size(report.memory)} ({c.breakdown.phase})")
    return lines


def save_plot(report: FitReport, path: str) -> None:
    """A PNG: stacked bars of each configuration's memory against the device's line, and
    tokens per second against the batch for each sequence length."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    bars, speed = fig.subplots(1, 2, width_ratios=(3, 1))
    labels: list[str] = []
    names = ("parameters", "gradients", "optimizer state", "buffers", "activations",
             "FSDP buffers", "optimizer temporaries", "workspaces", "reserve")
    rows: list[dict[str, int]] = []
    short = {"no recomputation": "none", "per-block checkpointing": "ckpt", "rematc": "rematc"}
    for shape in report.shapes:
        for c in shape.candidates:
            if c.breakdown is not None:
                labels.append(f"b{shape.batch} s{shape.seq}\n{short[c.strategy]}")
                rows.append(c.breakdown.parts())
    bottom = [0.0] * len(rows)
    for part in names:
        heights = [r[part] / 2**30 for r in rows]
        if any(heights):
            bars.bar(range(len(rows)), heights, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    bars.axhline(report.memory / 2**30, color="black", linestyle="--", label=f"{report.device} memory")
    bars.set_xticks(range(len(rows)), labels, fontsize=7)
    bars.set_ylabel("GiB per rank")
    bars.set_title(f"{report.source}: the step's memory at its peak")
    bars.legend(fontsize=7)
    for seq in sorted({x.seq for x in report.shapes}):
        for strategy in STRATEGIES:
            points = [(x.batch, c.tokens_per_s) for x in report.shapes if x.seq == seq
                      for c in x.candidates if c.strategy == strategy and c.fits]
            if points:
                speed.plot(*zip(*sorted(points), strict=True), marker="o",
                           label=f"seq {seq}, {short[strategy]}")
    speed.set_xlabel("micro-batch")
    speed.set_ylabel("tokens/s per rank (modelled)")
    speed.set_title("what fits, and how fast")
    speed.legend(fontsize=7)
    FigureCanvasAgg(fig).print_png(path)
