"""Replay a rematc-compiled training step's generated code line by line.

The profiler says how high memory went; this says where, in the code Inductor generated,
and which buffers were alive there. It runs one step with a line tracer on each generated
module's ``call`` and, at every line, sums the bytes of the distinct tensor storages in
that frame, leaving out what was alive before the step (parameters, buffers, inputs).
Buffers allocated inside a kernel (a convolution's workspace) are not in the frame, so
the replay's peak is at most the profiler's; where no kernel has a workspace they agree
to a few bytes. It then prints the plan's own peak step and the values alive there
(:func:`model_peak`, from ``solvers.checker.value_intervals``): set beside the buffers
alive at the replay's peak, they show what the memory model does not follow
(docs/inductor-memory.md). ``--knapsack`` plans with PyTorch's knapsack choice, as the
benchmark's ``rematc_knapsack_<budget>`` rows do.

    python -m bench.replay --model unet --batch 4 --budget 45% [--small] [--top 20] [--knapsack]
    python -m bench.replay --model gpt2_sdpa --device cuda

On CUDA the backward runs on autograd's device thread, which a line tracer set on the main
thread does not see, so there the replay also lists the blocks alive at the step's peak
from the caching allocator's own history (``torch.cuda.memory._record_memory_history``
with Python stacks), each with the generated line that allocated it (:func:`live_at_peak`).
"""

from __future__ import annotations

import argparse
import linecache
import sys
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch

import rematc
from bench import configs, models
from rematc.memory import measure_peak
from solvers.checker import check, value_intervals
from solvers.plan import Plan
from solvers.problem import Problem


@dataclass
class Peak:
    """The most bytes a generated module's ``call`` frame held, at which line."""

    module: str  # the generated file
    line: int
    source: str
    nbytes: int
    alive: list[tuple[str, int]] = field(default_factory=list)  # (local name, bytes), largest first


@contextmanager
def generated_modules() -> Iterator[list[Any]]:
    """The modules Inductor compiles while the block runs, in order."""
    from torch._inductor.graph import GraphLowering

    found: list[Any] = []  # ModuleType, or a FileBackedGraphModule
    original = GraphLowering.compile_to_module

    def recording(self: GraphLowering, *args: Any, **kwargs: Any) -> Any:
        module = original(self, *args, **kwargs)
        found.append(module)
        return module

    GraphLowering.compile_to_module = recording  # type: ignore[method-assign]
    try:
        yield found
    finally:
        GraphLowering.compile_to_module = original  # type: ignore[method-assign]


def storages(frame: FrameType, before: set[int]) -> dict[int, tuple[str, int]]:
    """Storage pointer -> (a local naming it, its bytes), for the frame's tensors not in
    ``before``."""
    out: dict[int, tuple[str, int]] = {}
    for name, value in frame.f_locals.items():
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in before:
                out.setdefault(ptr, (name, storage.nbytes()))
    return out


def replay(step: Callable[[], object], modules: list[Any], before: set[int]) -> list[Peak]:
    """Run ``step`` once with the line tracer on each module's ``call``; each module's peak."""
    calls: dict[CodeType, Any] = {m.call.__code__: m for m in modules}
    best: dict[CodeType, tuple[int, int, dict[int, tuple[str, int]]]] = {}

    def on_line(frame: FrameType, event: str, arg: object) -> Any:
        if event in ("line", "return"):
            alive = storages(frame, before)
            total = sum(b for _, b in alive.values())
            if total > best.get(frame.f_code, (-1, 0, {}))[0]:
                best[frame.f_code] = (total, frame.f_lineno, alive)
        return on_line

    def on_call(frame: FrameType, event: str, arg: object) -> Any:
        return on_line if frame.f_code in calls else None

    sys.settrace(on_call)
    try:
        step()
    finally:
        sys.settrace(None)
    peaks = []
    for code, (total, line, alive) in best.items():
        path = calls[code].__file__ or ""
        with open(path) as f:
            source = f.read().splitlines()[line - 1].strip()
        peaks.append(Peak(path, line, source, total, sorted(alive.values(), key=lambda a: -a[1])))
    return peaks


@dataclass
class Replayed:
    measured: int  # the peak of one step (profiler on the CPU, max_memory_allocated on CUDA), bytes
    files: tuple[str, ...]  # the generated modules seen compiling (forward, backward)
    peaks: list[Peak]  # each module's peak in the replayed step


def replay_step(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], compiled: Callable[..., Any]) -> Replayed:
    """Compile (the first step), measure one step (``rematc.memory.measure_peak`` on the
    inputs' device), then replay one."""
    device = inputs[0].device

    def step() -> None:
        compiled(*inputs).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with generated_modules() as modules:
        step()
    model.zero_grad(set_to_none=True)
    measured = measure_peak(step, device=device)
    model.zero_grad(set_to_none=True)
    before = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), *inputs)}
    files = tuple(str(m.__file__) for m in modules if getattr(m, "__file__", None))
    return Replayed(measured, files, replay(step, modules, before))


@dataclass(frozen=True)
class Block:
    """A block of the CUDA allocator alive at the step's peak."""

    nbytes: int
    where: str  # the generated line that allocated it, else the innermost Python frames


def live_at_peak(events: list[dict[str, Any]], generated: Collection[str] = ()) -> tuple[int, list[Block]]:
    """The most bytes the allocator's trace (``_snapshot()["device_traces"][k]``) holds
    in blocks it allocated, and those blocks, largest first, each named by its line in
    the ``generated`` files. A block counts from its ``alloc`` to its ``free_requested``
    (its ``free_completed`` where no request is recorded); blocks allocated before the
    trace are not in it."""
    live: dict[int, dict[str, Any]] = {}
    held, best, at_best = 0, 0, []
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            held += e["size"]
            if held > best:
                best, at_best = held, list(live.values())
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            held -= live.pop(e["addr"])["size"]
    blocks = [Block(e["size"], allocated_at(e.get("frames", []), generated)) for e in at_best]
    return best, sorted(blocks, key=lambda b: -b.nbytes)


def allocated_at(frames: list[dict[str, Any]], generated: Collection[str]) -> str:
    """The innermost frame in one of the ``generated`` files, with its source line; else
    the innermost three frames."""
    for f in frames:
        path = f.get("filename", "")
        if path in generated:
            line = linecache.getline(path, f["line"]).strip()
            return f"{path.rsplit('/', 1)[-1]}:{f['line']}: {line}"
    return " < ".join(f"{f.get('name')} {f.get('filename', '').rsplit('/', 1)[-1]}:{f.get('line')}"
                      for f in frames[:3])


def cuda_history(step: Callable[[], object], device: torch.device,
                 generated: Collection[str] | None) -> tuple[int, list[Block]]:
    """:func:`live_at_peak` of one step, from the allocator's history on ``device``;
    ``generated`` None: every file of Inductor's cache the history names."""
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python", device=device)
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    events = snapshot["device_traces"][index]
    if generated is None:
        generated = {f["filename"] for e in events for f in e.get("frames", []) if "torchinductor" in f["filename"]}
    return live_at_peak(events, generated)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(models.MODELS))
    p.add_argument("--budget", default="none", help="rematc's budget: none, 45%%, 0.6, 700MiB, bytes")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--small", action="store_true", help="the model at toy sizes")
    p.add_argument("--top", type=int, default=20, help="buffers to list at each peak")
    p.add_argument("--knapsack", action="store_true",
                   help="plan with PyTorch's knapsack choice (bench.configs.use_knapsack), not CP-SAT")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (TF32 matmuls, as bench.run)")
    a = p.parse_args(argv)
    torch._inductor.config.force_disable_caches = True  # compile, so the modules are seen
    if a.knapsack:
        configs.use_knapsack()
    model, inputs = models.make(a.model, batch=a.batch, small=a.small)
    inputs = models.to_device(model, inputs, a.device)
    compiled = rematc.compile(model, budget=configs.rematc_budget(a.budget), compiler="inductor", cache_dir=None)

    result = replay_step(model, inputs, compiled)
    record = rematc.records()[-1]
    print(f"measured {result.measured:,} B; predicted {record.predicted_peak:,} B; "
          f"budget {record.budget if record.budget is not None else 'none'}")
    for peak in result.peaks:
        print(f"\n{peak.module}: {peak.nbytes:,} B at line {peak.line}: {peak.source[:160]}")
        for name, nbytes in peak.alive[:a.top]:
            print(f"    {name:<24} {nbytes:>14,}")
    if inputs[0].device.type == "cuda":
        model.zero_grad(set_to_none=True)
        held, blocks = cuda_history(lambda: compiled(*inputs).backward(), inputs[0].device, result.files)
        print(f"\nthe allocator's history: {held:,} B at the step's peak in {len(blocks)} blocks")
        for block in blocks[:a.top]:
            print(f"    {block.nbytes:>14,}  {block.where[:140]}")
    step, alive = model_peak(record.problem, record.plan)
    print(f"\nthe plan's peak, step {step} ({record.problem.describe(step)}): "
          f"{sum(n for _, n in alive):,} B in {len(alive)} values")
    for name, nbytes in alive[:a.top]:
        print(f"    {name:<24} {nbytes:>14,}")
    return 0


def model_peak(problem: Problem, plan: Plan) -> tuple[int, list[tuple[str, int]]]:
    """The checker's peak step of ``plan`` and the values alive there (FX names and
    bytes, largest first): what to set beside the buffers the replay finds."""
    step = check(problem, plan).peak_step
    alive = [(problem.nodes[v].name, problem.nodes[v].size)
             for v, spans in value_intervals(problem, plan).items()
             if any(lo <= step <= hi for lo, hi in spans)]
    return step, sorted(alive, key=lambda a: (-a[1], a[0]))


if __name__ == "__main__":
    raise SystemExit(main())
