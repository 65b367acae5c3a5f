"""Offline tracing: a model and example inputs -> the joint training graph -> a problem.

Used by ``rematc export`` and by the other subcommands when their input is a model.
The graph is captured exactly as the backend captures it: Dynamo, AOTAutograd (with
Inductor's decompositions and joint-graph passes for ``target="inductor"``, as
``bench/scale.py`` does, or plain AOTAutograd for ``target="eager"``), then rematc's own
stages ``prepare -> annotate -> capture``. Tracing stops right after capture: no code is
generated and nothing runs on real data.

Two model sources:

* a factory ``"package.module:function"``: a callable with no arguments returning
  ``(model, example_inputs)``;
* a ``.pt2`` file written by ``torch.export.save``. Its ``.module()`` is traced on the
  example inputs stored in the file (or zeros of the recorded shapes when the file has
  none). The loss convention: if the program returns one scalar tensor, that is the loss;
  otherwise the first tensor output is reduced with ``.sum()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from rematc._torch_compat import (
    CustomPartitionerFn,
    DynamoUnsupported,
    aot_autograd,
    guards_broken_at,
    inductor_config,
    inductor_decompositions,
    inductor_fake_mode,
    inductor_partition_fn,
    make_boxed_func,
    sizes_at,
    tree_leaves,
    tree_map,
)
from rematc.capture import Captured
from rematc.devices import profile_for
from rematc.emit import Emitted, emit
from rematc.onmeta import stand_ins
from rematc.partition import capture_prepared, capture_stage, shape_env_of
from solvers import Plan, Problem

SHAPES_KEY = "shapes"  # Problem.meta key: JSON {value name: "float32[4, 64]"}
TARGETS = ("inductor", "eager")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


class TraceError(ValueError):
    """A model source that cannot be loaded or traced; the message says which and why."""


@dataclass(frozen=True)
class Traced:
    """The captured joint graph and its problem; :meth:`emit` gives the graphs of a plan."""

    problem: Problem
    joint: fx.GraphModule
    captured: Captured
    num_fwd_outputs: int
    static_inputs: tuple[int, ...]

    def emit(self, plan: Plan) -> Emitted:
        return emit(self.joint, self.captured, plan, num_fwd_outputs=self.num_fwd_outputs,
                    static_lifetime_input_indices=list(self.static_inputs))

    def input_symbols(self, dim: int) -> tuple[Any, ...]:
        """The symbols of the inputs' dimension ``dim``, where it was traced dynamic
        (``torch._dynamo.mark_dynamic(x, dim)``); parameters are not inputs here."""
        static = set(self.static_inputs)
        out: list[Any] = []
        for i, n in enumerate(self.joint.graph.find_nodes(op="placeholder")):
            val = n.meta.get("val")
            if i in static or not isinstance(val, torch.Tensor) or val.dim() <= dim:
                continue
            d = val.shape[dim]
            if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol and d.node.expr not in out:
                out.append(d.node.expr)
        return tuple(out)

    def batch_symbols(self) -> tuple[Any, ...]:
        """:meth:`input_symbols` of the first dimension."""
        return self.input_symbols(0)

    def at_batch(self, batch: int) -> Problem:
        """The problem of this step at another batch size: the captured graph's sizes
        and costs read again with its batch symbols at ``batch`` (no new trace)."""
        return self.at_sizes({0: batch})

    def at_sizes(self, sizes: Mapping[int, int]) -> Problem:
        """The problem of this step with the inputs' dimension ``d`` at ``sizes[d]`` for
        each ``d``, e.g. ``{0: batch, 1: seq}`` for token inputs: the captured graph's sizes
        and costs read again with those dimensions' symbols at the new sizes (no new
        trace). ``TraceError`` where a dimension was traced fixed, or where a guard the
        trace recorded on its sizes (a branch the model took) does not hold at them."""
        values: dict[Any, int] = {}
        for dim, size in sizes.items():
            symbols = self.input_symbols(dim)
            if not symbols:
                what = "batch size" if dim == 0 else f"size of the inputs' dimension {dim}"
                raise TraceError(f"this step was traced at a fixed {what}: mark its inputs' dimension "
                                 f"{dim} dynamic (torch._dynamo.mark_dynamic(x, {dim})) to resize it")
            values.update(dict.fromkeys(symbols, size))
        shape_env = shape_env_of(self.joint)
        broken = guards_broken_at(shape_env, values)
        if broken:
            raise TraceError(f"the trace took a branch on its sizes that does not hold at {dict(sizes)} "
                             f"({broken}): trace that shape on its own")
        device = profile_for(self.problem.meta.get("device", "cpu"))
        with sizes_at(shape_env, values), collector_paused():
            captured = capture_prepared(self.joint, device, fuses=self.problem.meta.get("target") == "inductor",
                                        num_fwd_outputs=self.num_fwd_outputs, static=self.static_inputs,
                                        name=self.problem.name)
        meta = {**self.problem.meta, **{("batch" if d == 0 else f"dim{d}"): str(v) for d, v in sizes.items()}}
        meta.pop(SHAPES_KEY, None)
        return Problem(nodes=captured.problem.nodes, host_bandwidth=captured.problem.host_bandwidth,
                       name=self.problem.name, meta=meta)


class _Stop(Exception):
    """Raised by the capturing partitioner: everything needed is captured."""


class _Capture(CustomPartitionerFn):
    def __init__(self, device: str, target: str, name: str) -> None:
        self.device, self.target, self.name = device, target, name
        self.traced: Traced | None = None

    def uuid(self) -> str:
        return f"rematc-trace-{self.device}-{self.target}"

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> Any:
        num_fwd_outputs: int = kwargs["num_fwd_outputs"]
        static = tuple(kwargs.get("static_lifetime_input_indices") or ())
        joint, captured = capture_stage(gm, profile_for(self.device),
                                        fuses=self.target == "inductor",
                                        num_fwd_outputs=num_fwd_outputs, static=static,
                                        name=self.name)
        self.traced = Traced(captured.problem, joint, captured, num_fwd_outputs, static)
        raise _Stop


def trace(model: nn.Module, inputs: Sequence[Any], *, device: str = "cpu",
          target: str | None = None, dtype: str | None = None, name: str = "model") -> Traced:
    """Capture one training step of ``model(*inputs)`` (which must return the loss), for
    ``target``'s code generation: by default Inductor's, and eager's for a model on
    ``meta`` tensors, which the Inductor target refuses with a ``TraceError``: there
    Inductor's joint-graph passes folded a Llama's step down to empty outputs (26 values,
    no decisions), and with that folding off most runs corrupted the process's heap
    (glibc's "corrupted double-linked list" at exit, or a segfault in a later solve), with
    torch 2.13."""
    if target is not None and target not in TARGETS:
        raise TraceError(f"target must be one of {TARGETS}, got {target!r}")
    profile_for(device)  # a ValueError naming the known profiles
    on_meta = _on_meta(model, inputs)
    if on_meta and target == "inductor":
        raise TraceError("the Inductor target cannot be traced on meta tensors: trace with target "
                         "'eager' (--target eager), or build the model on a real device")
    target = target or ("eager" if on_meta else "inductor")
    if dtype is not None:
        if dtype not in DTYPES:
            raise TraceError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        model, inputs = _cast(model, inputs, DTYPES[dtype])
    spy = _Capture(device, target, name)
    torch._dynamo.reset()
    try:
        # A shape error is logged with its traceback by the fake-tensor run, then raised
        # as Dynamo's TorchRuntimeError: the TraceError below says it in one line.
        with _backend(spy, target) as backend, _tracebacks_held("torch._subclasses.fake_tensor"), \
                (stand_ins() if on_meta else contextlib.nullcontext()), collector_paused():
            # One graph: a problem is one graph, and a break would leave the rest unplanned.
            torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    except Exception as e:
        if spy.traced is None:
            broken = _graph_break(e)
            if broken is not None:
                raise TraceError(
                    f"tracing {name}: the model breaks into several graphs ({broken}); a problem "
                    "plans one graph: remove the break (TORCH_LOGS=graph_breaks lists them), or "
                    "compile the model with the backend, whose graphs share the budget") from e
            raise TraceError(f"tracing {name} failed: {_describe_error(e)}") from e
    finally:
        torch._dynamo.reset()
    if spy.traced is None:
        raise TraceError(f"tracing {name} captured no training graph: does it return a loss "
                         "that requires grad?")
    t = spy.traced
    if not _has_gradients(t.joint, t.num_fwd_outputs):
        where = (" on meta tensors, where some ops (aten::nll_loss in torch 2.13) have no "
                 "autograd kernel: build the model on a real device, or write the loss out"
                 if on_meta else "")
        raise TraceError(f"tracing {name} captured a step with no backward: no gradient "
                         f"depends on the loss{where}")
    shapes = {t.problem.nodes[i].name: _describe(group[0]) for i, group in enumerate(t.captured.groups)}
    meta = {"source": name, "device": device, "target": target, "dtype": dtype or "as given",
            SHAPES_KEY: json.dumps(shapes, separators=(",", ":"))}
    problem = Problem(nodes=t.problem.nodes, host_bandwidth=t.problem.host_bandwidth, name=name,
                      meta=meta)
    captured = dataclasses.replace(t.captured, problem=problem)
    return Traced(problem, t.joint, captured, t.num_fwd_outputs, t.static_inputs)


def _has_gradients(joint: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """Whether the joint graph computes any input's gradient (its outputs after the
    forward's; ``None`` where an input gets none)."""
    output = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    outs = output.args[0]
    return any(isinstance(o, fx.Node) for o in list(outs)[num_fwd_outputs:])


def _graph_break(e: BaseException) -> str | None:
    """Where and why Dynamo broke the graph, from its error under ``fullgraph=True``;
    None for another error. Where: the innermost frame of its user stack, the line that
    breaks (the outermost is the model's own forward calling the module that breaks)."""
    if not isinstance(e, DynamoUnsupported):
        return None
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    why = lines[0] if lines else type(e).__name__
    where = next((line for line in reversed(lines) if line.startswith("File ")), "")
    return f"{why}{', at ' + where if where else ''}"[:300]


@contextlib.contextmanager
def _backend(spy: _Capture, target: str) -> Iterator[Any]:
    nop = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    if target == "eager":
        yield aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=spy,
                           keep_inference_input_mutations=True)
        return
    inductors = inductor_partition_fn()

    def partition(gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        with inductor_fake_mode(joint_inputs):
            return inductors(gm, joint_inputs, **kwargs)

    with inductor_config.patch(custom_partitioner_fn=spy):
        yield aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition,
                           decompositions=inductor_decompositions())


# ---- model sources ------------------------------------------------------------------


def is_factory(spec: str) -> bool:
    """``package.module:function`` (and not an existing file)."""
    mod, sep, fn = spec.partition(":")
    return bool(sep) and not os.path.exists(spec) and all(
        part.isidentifier() for part in (*mod.split("."), fn)
    )


def import_function(spec: str) -> Any:
    """The function of ``package.module:function`` (found on ``sys.path`` and the working
    directory), not called."""
    mod_name, _, fn_name = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        raise TraceError(f"cannot import {mod_name!r}: {type(e).__name__}: {_first_line(e)}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise TraceError(f"{spec}: {mod_name} has no function {fn_name!r}")
    return fn


def _shape_of(made: object) -> str:
    """What a factory returned, for an error: its type, and a tuple's items."""
    if isinstance(made, (tuple, list)):
        items = ", ".join(type(x).__name__ for x in made[:4]) + (", ..." if len(made) > 4 else "")
        return f"a {type(made).__name__} of {len(made)} ({items})"
    return type(made).__name__


def as_example(spec: str, made: object) -> tuple[nn.Module, tuple[Any, ...]]:
    """What a factory returned, checked to be ``(model, example_inputs)``."""
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise TraceError(f"{spec}() must return (model, example_inputs), got {_shape_of(made)}")
    inputs = made[1]
    return made[0], tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def load_factory(spec: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """Call ``package.module:function`` with no arguments."""
    fn = import_function(spec)
    try:
        made = fn()
    except Exception as e:
        raise TraceError(f"{spec}() failed: {type(e).__name__}: {_first_line(e)}") from e
    return as_example(spec, made)


class _Loss(nn.Module):
    """The exported module, reduced to a scalar loss (see the module docstring)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = [t for t in tree_leaves(self.inner(*args, **kwargs)) if isinstance(t, torch.Tensor)]
        if not out:
            raise TraceError("the exported program returns no tensor to use as a loss")
        return out[0] if out[0].dim() == 0 and len(out) == 1 else out[0].sum()


def load_pt2(path: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """The module of a ``torch.export.save`` file, as a loss, with its example inputs."""
    # torch.export.load logs the archive reader's error with its traceback, then raises
    # its own ("check the warnings above"): the reader's error is the one to report.
    with _tracebacks_held("torch.export") as held:
        try:
            program = torch.export.load(path)
        except OSError:
            raise
        except Exception as e:
            logged = held[0] if held and "warnings above" in str(e) else e
            raise TraceError(f"{path}: not a torch.export program: {_describe_error(logged)}") from e
    stored = getattr(program, "example_inputs", None)
    if stored is not None:
        args, kwargs = stored
        if kwargs:
            raise TraceError(f"{path}: keyword example inputs are not supported")
        inputs = tuple(args)
    else:
        inputs = tuple(_zeros_like_placeholder(n) for n in program.graph.find_nodes(op="placeholder")
                       if n.name in set(program.graph_signature.user_inputs))
    module = program.module()
    for p in module.parameters():
        if p.dtype.is_floating_point:
            p.requires_grad_(True)
    return _Loss(module), inputs


def _zeros_like_placeholder(node: fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise TraceError(f"input {node.name} has no recorded shape; save the program with example inputs")
    return torch.zeros([int(s) for s in val.shape], dtype=val.dtype)


def _on_meta(model: nn.Module, inputs: Sequence[Any]) -> bool:
    tensors = [*model.parameters(), *model.buffers(),
               *(t for t in tree_leaves(tuple(inputs)) if isinstance(t, torch.Tensor))]
    return any(t.device.type == "meta" for t in tensors)


def _cast(model: nn.Module, inputs: Sequence[Any], dtype: torch.dtype) -> tuple[nn.Module, tuple[Any, ...]]:
    model = model.to(dtype)
    cast = tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                    tuple(inputs))
    return model, tuple(cast)


def _describe(node: fx.Node) -> str:
    """``float32[4, 64]`` for a tensor value, ``"-"`` otherwise."""
    val = node.meta.get("val")
    ts = [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]
    if not ts:
        return "-"
    t = ts[0]
    dims = ", ".join(str(s) for s in t.shape)
    return f"{str(t.dtype).removeprefix('torch.')}[{dims}]"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _describe_error(e: BaseException) -> str:
    """``Type: first line``, and the same of the innermost exception in its chain when that
    is another (Dynamo's "RuntimeError when making fake tensor call" hides the shape error)."""
    text = f"{type(e).__name__}: {_first_line(e)}"
    root, seen = e, {id(e)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(root))
    return text if root is e else f"{text} (caused by {type(root).__name__}: {_first_line(root)})"


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while the block runs. Tracing a large model
    makes millions of objects (FX nodes, fake tensors, sympy expressions) that each full
    collection walks: paused, a 16-layer Llama-2-7B-shaped trace with a symbolic batch and
    sequence took 35-36 s instead of 39-44 s (two runs each). What the block leaves in
    cycles is collected by the next collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _tracebacks_held(logger: str) -> Iterator[list[BaseException]]:
    """Hold back the records ``logger`` logs with a traceback while the block runs, and
    yield their exceptions: the caller raises one error that says it in one line."""
    held: list[BaseException] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            held.append(record.exc_info[1])
            return False
        return True

    log = logging.getLogger(logger)
    log.addFilter(hold)
    try:
        yield held
    finally:
        log.removeFilter(hold)
