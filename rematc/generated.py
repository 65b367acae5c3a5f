"""The peak of the code Inductor generated, found by walking it.

After Inductor compiles a forward and its backward, :func:`step_peak` walks the two
generated ``call`` functions statement by statement on fake tensors: every allocation
(``empty_strided_*``, a fallback kernel's outputs), every reuse and ``del``, with the
saved tensors carried from the forward's return into the backward's arguments. Kernel
launches are not run; they write into buffers already counted. The result is the step's
peak on the graphs' device, above what was alive before it, as the generated code
allocates it: the same measure as rematc's predicted peak and ``rematc.memory``'s
measured one, less the workspaces kernels allocate inside themselves, but for those the
capture measured for a fallback kernel (``rematc.annotate.PROBED``: CPU dropout draws its
mask through an input-sized temporary), counted while its statement runs.

It reads the generated source, not Inductor's internals, so it holds whatever rules
Inductor followed: another torch release, another device, a user's ``config.patch``.
"""

from __future__ import annotations

import ast
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from rematc._torch_compat import (
    FakeTensorMode,
    inductor_extern_kernels,
    optimization_hint,
    storage_key,
)
from rematc.annotate import measured_workspace

__all__ = ["CodePeak", "Generated", "GeneratedCodeWarning", "WalkError", "recording_peaks", "step_peak"]


@dataclass(frozen=True)
class Generated:
    """One compiled graph: the wrapper source Inductor generated and the FX graph it
    compiled (whose placeholders and output name the values crossing between graphs)."""

    source: str
    graph: fx.GraphModule


@dataclass(frozen=True)
class CodePeak:
    """The step's peak in the generated code, in bytes above the pre-step live set."""

    peak: int
    forward: int  # the forward's own peak
    backward: int  # the backward's, saved values and the forward's outputs included
    where: str  # "forward" or "backward" and the generated statement at the peak
    alive: tuple[tuple[str, int], ...]  # (name, bytes) of the largest buffers alive there


def step_peak(forward: Generated, backward: Generated, device: torch.device | str,
              dropped: frozenset[str] = frozenset()) -> CodePeak:
    """Walk ``forward`` then ``backward`` (see the module docstring). ``device`` is the
    graphs' device: offload's host copies and other devices' buffers are not counted.
    The forward's outputs the backward does not read are held by the caller through the
    backward, but those named in ``dropped`` (the caller keeps only the loss:
    ``Options.outputs="dropped"``)."""
    kind = torch.device(device).type
    with FakeTensorMode(allow_non_fake_inputs=True):
        fw = _Walk(kind, "forward")
        outputs = fw.run(forward.source, _named("forward's inputs", _inputs, forward.graph, created=None))
        by_name = _named("saved values", _saved_by_name, forward.graph, outputs, backward.graph)
        bw = _Walk(kind, "backward", created=fw.created, host=fw.host)
        args = _named("backward's inputs", _inputs, backward.graph, created=bw.created, given=by_name)
        consumed = {id(v) for v in args}
        names = _output_names(forward.graph)
        bw.kept = [v for k, v in enumerate(outputs)  # the loss, held by the caller
                   if id(v) not in consumed and (k >= len(names) or names[k] not in dropped)]
        bw.run(backward.source, args)
    if bw.peak >= fw.peak:
        peak, where, alive = bw.peak, f"backward: {bw.at}", bw.alive
    else:
        peak, where, alive = fw.peak, f"forward: {fw.at}", fw.alive
    return CodePeak(peak=peak, forward=fw.peak, backward=bw.peak, where=where, alive=alive)


def _named(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its failure raised as a :class:`WalkError` naming ``what``."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise WalkError(f"{what}: {type(e).__name__}: {e}") from e


def _output_names(gm: fx.GraphModule) -> list[str | None]:
    out = gm.graph.output_node().args[0]
    return [a.name if isinstance(a, fx.Node) else None for a in (out if isinstance(out, list | tuple) else [out])]


def _saved_by_name(forward: fx.GraphModule, outputs: list[Any], backward: fx.GraphModule) -> dict[str, Any]:
    """The backward's inputs that the forward returned, by the backward's names. A saved
    value keeps its name across the graphs, except an offloaded one: the forward returns
    its host copy under the copy's name. Those are the forward's last outputs the backward
    does not name (the user's outputs come first), in the same order."""
    names = _output_names(forward)
    by_name = {n: v for n, v in zip(names, outputs, strict=False) if n is not None}
    wanted = [n.name for n in backward.graph.find_nodes(op="placeholder")
              if not n.name.startswith("tangents") and isinstance(n.meta.get("val"), torch.Tensor)]
    missing = [n for n in wanted if n not in by_name]
    bw_names = set(wanted)
    spare = [v for n, v in zip(names, outputs, strict=False) if n not in bw_names and isinstance(v, torch.Tensor)]
    if missing and len(spare) >= len(missing):
        by_name.update(zip(missing, spare[len(spare) - len(missing):], strict=True))
    return by_name


def _inputs(gm: fx.GraphModule, *, created: dict[int, Any] | None,
            given: dict[str, Any] | None = None) -> list[Any]:
    """Fake stand-ins for ``gm``'s inputs: ``given`` ones by name, the others made fresh
    from their recorded values (counted as created in the step when ``created`` is given:
    the backward's tangents)."""
    args: list[Any] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        if given is not None and node.name in given:
            args.append(given[node.name])
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            t = torch.empty_strided([optimization_hint(s) for s in val.shape],
                                    [optimization_hint(s) for s in val.stride()],
                                    dtype=val.dtype, device=val.device)
            if created is not None:
                created[_key(t)] = t.untyped_storage()
            args.append(t)
        elif isinstance(val, torch.SymInt | int):
            args.append(optimization_hint(val))
        else:
            args.append(val)
    return args


def _key(t: torch.Tensor) -> int:
    return storage_key(t.untyped_storage())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def _reinterpret_tensor(t: torch.Tensor, size: Sequence[int], stride: Sequence[int],
                        offset: int = 0) -> torch.Tensor:
    return torch.as_strided(t, size, stride, t.storage_offset() + offset)


def _empty_on(device: str) -> Any:
    def empty(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    return empty


def _namespace() -> dict[str, Any]:
    """The generated module's names that allocate or alias: kernel launches are absent, so
    a statement that calls one fails to evaluate and is skipped."""
    extern_kernels = inductor_extern_kernels()
    return {
        # __import__: a tensor method's native code imports through the calling frame's
        # builtins (a reduction over Inductor's workspace slice, ``workspace[a:b].sum()``)
        "__builtins__": {"None": None, "True": True, "False": False, "int": int, "float": float,
                         "max": max, "min": min, "len": len, "__import__": __import__},
        "torch": torch, "aten": torch.ops.aten, "inductor_ops": torch.ops.inductor,
        "extern_kernels": extern_kernels, "device": torch.device,
        "reinterpret_tensor": _reinterpret_tensor,
        "empty_strided": torch.empty_strided,
        "empty_strided_cpu": _empty_on("cpu"), "empty_strided_cpu_pinned": _empty_on("cpu"),
        "empty_strided_cuda": _empty_on("cuda"), "empty_strided_xpu": _empty_on("xpu"),
        "empty_strided_mtia": _empty_on("mtia"),
    }


ALIVE_SHOWN = 16  # largest live buffers a CodePeak names
# Calls whose results are host memory whatever the device says: offload's copies (on the
# CPU, where rematc exercises offload plans, host and device memory are one).
HOST_COPIES = ("torch.ops.rematc.offload",)


class _Walk:
    """One generated ``call`` run on fake tensors, counting the bytes alive after each
    statement of storages created in the step on one device type."""

    def __init__(self, kind: str, graph: str, created: dict[int, Any] | None = None,
                 host: set[int] | None = None) -> None:
        self.kind = kind
        self.graph = graph  # "forward" or "backward", for errors
        # Storage address -> the storage, of those created in the step. Holding them keeps
        # their addresses from being reused by later fake allocations.
        self.created: dict[int, Any] = created if created is not None else {}
        self.host: set[int] = host if host is not None else set()  # offload's host copies
        self.env: dict[str, Any] = {}
        self.kept: list[Any] = []
        self.peak = 0
        self.at = ""
        self.scratch = 0  # bytes the statement being noted allocates inside its kernel
        self.alive: tuple[tuple[str, int], ...] = ()

    def run(self, source: str, args: list[Any]) -> list[Any]:
        call = _call_function(source)
        # Split once: ast.get_source_segment splits the whole source at every call, which
        # made this walk quadratic in the graph's size.
        self.lines = source.split("\n")
        self.globals = _namespace()
        self.env["args"] = args
        self._note(None)
        result = self._body(call.body)
        return list(result) if isinstance(result, list | tuple) else [result]

    def _body(self, body: list[ast.stmt]) -> Any:
        for stmt in body:
            if isinstance(stmt, ast.With):
                result = self._body(stmt.body)
                if "<return>" in self.env:
                    return result
                continue
            try:
                returned, value = self._statement(stmt)
            except Exception as e:  # name the statement, so that a failed walk can be followed up
                raise WalkError(f"{self.graph}, line {stmt.lineno}: {self._text(stmt)[:120]}: "
                                f"{type(e).__name__}: {e}") from e
            if returned:
                return value
        return None

    def _text(self, stmt: ast.stmt | None) -> str:
        """The first line of ``stmt``'s source (``start`` before the first statement)."""
        if stmt is None:
            return "start"
        if not 0 < stmt.lineno <= len(self.lines):
            return type(stmt).__name__.lower()
        return self.lines[stmt.lineno - 1][stmt.col_offset:].strip()

    def _statement(self, stmt: ast.stmt) -> tuple[bool, Any]:
        """Run one statement other than a ``with``: (True, its value) where it returns."""
        if isinstance(stmt, ast.Return):
            value = self._eval(stmt.value) if stmt.value is not None else None
            self.env["<return>"] = value
            self._note(stmt)
            return True, value
        if isinstance(stmt, ast.Assign):
            self._assign(stmt)
            self.scratch = self._workspace(stmt.value)
        elif isinstance(stmt, ast.Delete):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    self.env.pop(target.id, None)
        else:
            return False, None
        self._note(stmt)
        self.scratch = 0
        return False, None

    def _workspace(self, value: ast.expr) -> int:
        """The workspace the capture measured for ``value``'s fallback call, where it is a
        call of one of ``rematc.annotate.PROBED`` (0 otherwise)."""
        if not isinstance(value, ast.Call) or not ast.unparse(value.func).startswith("torch.ops.aten."):
            return 0
        try:
            op = self._eval(value.func)
            args = [self._eval(a) for a in value.args]
            kwargs = {k.arg: self._eval(k.value) for k in value.keywords if k.arg is not None}
        except Exception:  # an argument the walk cannot evaluate: nothing known to add
            return 0
        return measured_workspace(op, args, kwargs)

    def _assign(self, stmt: ast.Assign) -> None:
        if len(stmt.targets) != 1:
            return
        target = stmt.targets[0]
        try:
            value = self._eval(stmt.value)
        except Exception:  # a kernel launch or another name the walk lacks: no allocation
            value = None
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple) and isinstance(value, list | tuple):
            for element, v in zip(target.elts, value, strict=False):
                if isinstance(element, ast.Name):
                    self.env[element.id] = v
        host = ast.unparse(stmt.value).startswith(HOST_COPIES)
        for t in _tensors(value):
            key = _key(t)
            if key not in self.created and self.env.get("args") is not value:
                self.created[key] = t.untyped_storage()
                if host:
                    self.host.add(key)

    def _eval(self, node: ast.expr) -> Any:
        code = compile(ast.Expression(node), "<generated>", "eval")
        return eval(code, self.globals, self.env)

    def _note(self, stmt: ast.stmt | None) -> None:
        storages: dict[int, tuple[str, int]] = {}
        for name, value in [*self.env.items(), *(("<output>", v) for v in self.kept)]:
            if name == "args":
                continue
            for t in _tensors(value):
                key = _key(t)
                if (key in self.created and key not in self.host and t.device.type == self.kind
                        and key not in storages):
                    storages[key] = (name, self.created[key].nbytes())
        live = sum(n for _, n in storages.values()) + self.scratch
        if live > self.peak:
            self.peak, self.at = live, self._text(stmt)[:160]
            self.alive = tuple(sorted(storages.values(), key=lambda p: -p[1])[:ALIVE_SHOWN])


def _call_function(source: str) -> ast.FunctionDef:
    """The generated module's ``call`` (a method of its runner class in newer torch)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            return node
    raise ValueError("rematc: the generated module has no call function")


def recording_peaks(inner_compile: Callable[..., Any], sink: Callable[[CodePeak], None], *,
                    dropped: Callable[[], frozenset[str]] = frozenset) -> Callable[..., Any]:
    """``inner_compile`` (Inductor's ``compile_fx_inner``) that, once a backward has
    compiled, walks it with the forward compiled before it and passes the step's
    :class:`CodePeak` to ``sink``; ``dropped()`` names the forward's outputs the caller
    drops (:func:`step_peak`). A graph it cannot walk is warned about once and compiles
    as usual."""
    forward: list[Generated] = []

    @functools.wraps(inner_compile)
    def compile_recording_peaks(gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        compiled = inner_compile(gm, *args, **kwargs)
        source = getattr(compiled, "source_code", None)
        if not isinstance(source, str):
            return compiled
        if not kwargs.get("is_backward", False):
            forward[:] = [Generated(source, gm)]
        elif forward:
            try:
                peak = step_peak(forward[0], Generated(source, gm), _device_of(gm), dropped())
            except Exception as e:  # the walk is a check: it never stops a compile
                _warn_once(f"rematc: could not walk the generated code ({type(e).__name__}: "
                           f"{e}); the budget is not checked after compilation")
            else:
                sink(peak)
        return compiled

    return compile_recording_peaks


def _device_of(gm: fx.GraphModule) -> torch.device:
    """The first accelerator among ``gm``'s inputs, else the CPU."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type not in ("cpu", "meta"):
            return val.device
    return torch.device("cpu")


class WalkError(RuntimeError):
    """What the walk could not follow, named: a statement of the generated code (graph,
    line and text), or the graphs' inputs or saved values it builds first."""


class GeneratedCodeWarning(UserWarning):
    """The post-compile check could not walk or could not fit the generated code."""


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, GeneratedCodeWarning, stacklevel=3)
