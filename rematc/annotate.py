"""Cost analysis: one typed record per FX node, under ``node.meta["rematc"]``.

* FLOPs from torch's flop counter registry (``torch.utils.flop_counter.flop_registry``)
  evaluated on the fake tensors of ``node.meta["val"]``. The CPU flash-attention kernel
  is not in the registry; it gets the standard attention count (4·B·H·Tq·Tk·D, halved
  when causal; 2.5x that for its backward, as FlashAttention's paper counts). Any other
  op without a formula counts 0 FLOPs and is costed by the bytes it moves (pointwise,
  reductions, copies): a documented fallback, never an error.
* Bytes: the storage bytes a node *allocates*. Tensors that share a storage (views,
  in-place results, the elements of a multi-output op seen through ``getitem``) are
  counted once, on the first node that holds the storage, its ``owner``.
* Time: the roofline of :mod:`rematc.devices` over FLOPs, elementwise transcendentals
  (tanh, exp, ...: :func:`transcendentals`) and bytes read plus written.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from rematc._torch_compat import (
    OpOverload,
    StorageWeakRef,
    inductor_graph_lowering,
    make_channels_last_strides_for,
    optimization_hint,
    tree_leaves,
    tree_map,
)
from rematc.devices import TRANSCENDENTAL_WEIGHT, DeviceProfile

log = logging.getLogger(__name__)

META_KEY = "rematc"

_aten = torch.ops.aten
_SDPA_CPU = _aten._scaled_dot_product_flash_attention_for_cpu.default
_SDPA_CPU_BWD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclass(frozen=True, kw_only=True)
class NodeCost:
    flops: float  # floating-point operations
    flops_source: str  # "registry", "attention formula" or "none (memory-bound)"
    nbytes: int  # bytes of storage this node allocates (0 when it aliases another node)
    owner: str  # name of the node whose storage this node's output lives in
    bytes_moved: int  # storage bytes read plus written
    dtype: str  # dtype of the (first) tensor output, "" when there is none
    device: str
    is_random: bool  # draws random numbers: never recomputed with fresh randomness
    is_seeded: bool  # random, but replayed exactly from its seed input (Inductor's RNG prims)
    is_view: bool  # output aliases an input's storage
    is_cheap: bool  # no FLOPs to speak of: pointwise, view, reduction, copy
    is_pointwise: bool  # tagged pointwise: Inductor fuses it into its consumer
    time: float  # seconds, roofline estimate
    recompute_time: float  # seconds to recompute it in the backward (see recompute_cost)
    transcendental_time: float = 0.0  # seconds of its tanh/exp/...: what it costs inside another kernel
    workspace: int = 0  # bytes the op allocates beside its outputs while it runs (workspaces)


def annotate(gm: fx.GraphModule, device: DeviceProfile, *, fuses: bool = False) -> dict[fx.Node, NodeCost]:
    """Write a :class:`NodeCost` into every node's meta and return them.

    ``fuses``: the emitted graphs go to Inductor, which fuses a recomputed pointwise op
    into the kernel that consumes it (see :func:`recompute_cost`), and lays the tensors of
    convolutions out channels-last (:func:`channels_last_convolutions`), which changes
    their scratch memory (:func:`workspaces`)."""
    owners: dict[StorageWeakRef, fx.Node] = {}
    costs: dict[fx.Node, NodeCost] = {}
    scratch = workspaces(list(gm.graph.nodes), channels_last=fuses and channels_last_convolutions(gm),
                         inductor=fuses)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        cost = _cost(node, owners, costs, device, fuses=fuses, workspace=scratch.get(node, 0))
        node.meta[META_KEY] = cost
        costs[node] = cost
    return costs


def channels_last_convolutions(gm: fx.GraphModule) -> bool:
    """Inductor's layout optimization is on for this graph: its convolutions read and
    write channels-last tensors (``GraphLowering.decide_layout_opt``; always on for CPU
    convolutions with oneDNN)."""
    convolutions = (_aten.convolution.default, _aten.convolution_backward.default)
    if not any(gm.graph.find_nodes(op="call_function", target=t) for t in convolutions):
        return False
    return bool(inductor_graph_lowering().decide_layout_opt(gm, is_inference=False))


def is_random(node: fx.Node) -> bool:
    """Random ops: tagged ``nondeterministic_seeded``, plus Inductor's seeded random prims,
    which ``replace_random`` introduces and which carry no tag."""
    target = node.target
    if isinstance(target, OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return not _no_dropout(node, target)
        return is_seeded(node) or target.name().startswith("prims::inductor_seed")
    return False


def _no_dropout(node: fx.Node, target: OpOverload) -> bool:
    """An op tagged random only for its ``dropout_p`` argument (the attention kernels),
    called with ``dropout_p`` 0: it draws nothing, so recomputing it gives the same
    result. (Without this every attention output of a model without attention dropout
    would have to be saved: per-block checkpointing recomputes them.)"""
    for k, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            if k < len(node.args):
                value = node.args[k]
            else:
                value = node.kwargs.get("dropout_p", arg.default_value)
            return isinstance(value, (int, float)) and value == 0
    return False


def is_seeded(node: fx.Node) -> bool:
    """Inductor's ``inductor_random`` / ``inductor_randint``: random numbers that are a pure
    function of their seed input and of each element's position (Inductor lowers them to
    a counter-based generator, ``ops.rand(seed, index)``). Recomputed from the same seed
    they draw the same numbers, so unlike ``inductor_seeds`` (which draws the seeds from
    the global generator) they may be recomputed: the seed is saved, not the mask."""
    target = node.target
    return isinstance(target, OpOverload) and target.name() in (
        "prims::inductor_random", "prims::inductor_randint"
    )


def tensors(val: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]


def _cost(
    node: fx.Node,
    owners: dict[StorageWeakRef, fx.Node],
    costs: dict[fx.Node, NodeCost],
    device: DeviceProfile,
    *,
    fuses: bool,
    workspace: int = 0,
) -> NodeCost:
    outs = tensors(node.meta.get("val"))
    nbytes = 0
    owner: fx.Node | None = None
    for t in outs:
        key = StorageWeakRef(t.untyped_storage())
        first = owners.setdefault(key, node)
        if first is node:
            nbytes += storage_bytes(t)
        owner = owner or first
    owner = owner or node
    is_view = owner is not node
    if node.op != "call_function":
        flops, source = 0.0, "none (memory-bound)"
    else:
        flops, source = node_flops(node)
    read = sum(costs[a].nbytes if costs[a].owner == a.name else val_bytes(a)
               for a in node.all_input_nodes if a in costs)
    moved = 0 if is_view or node.target is operator.getitem else read + nbytes
    itemsize = outs[0].element_size() if outs else 4
    time = 0.0
    exps = transcendentals(node)
    if node.op == "call_function" and not is_view and node.target is not operator.getitem:
        time = device.op_time(flops=flops, bytes_moved=moved, itemsize=itemsize, transcendentals=exps,
                              attention=is_attention(node))
    pointwise = isinstance(node.target, OpOverload) and (
        torch.Tag.pointwise in node.target.tags
    )
    return NodeCost(
        flops=flops,
        flops_source=source,
        nbytes=nbytes,
        owner=owner.name,
        bytes_moved=moved,
        dtype=str(outs[0].dtype).removeprefix("torch.") if outs else "",
        device=str(outs[0].device) if outs else "",
        is_random=is_random(node),
        is_seeded=is_seeded(node),
        is_view=is_view,
        is_cheap=flops == 0,
        is_pointwise=pointwise,
        time=time,
        recompute_time=recompute_cost(time, pointwise=pointwise, fuses=fuses, device=device,
                                      transcendentals=exps),
        transcendental_time=exps * device.transcendental_time,
        workspace=workspace,
    )


# The eager route's dropout, or Inductor's with fallback_random: on the CPU it draws its
# mask, and its backward scales the gradient, through an input-sized temporary (and two
# 0-d scalars), 64 KiB beside a 64 KiB output.
CPU_DROPOUT = frozenset({_aten.native_dropout.default, _aten.native_dropout_backward.default})
# Kernels whose scratch memory is measured (:func:`workspaces`). The backward ones return
# several gradients, so the capture can hand its outputs to values of their own and count
# the scratch while it runs only (``rematc.capture.split_elements``); dropout's forward
# elements are values of their own too, and its backward's scratch is counted while its
# one output lives. On the CPU they allocate it through PyTorch's allocator, in amounts
# that depend on the shapes, the layout, the thread count and the instruction set, so
# they are run once to see it.
PROBED = frozenset({
    _aten.convolution_backward.default,  # oneDNN: the weight's gradient blocked, a scratchpad
    _aten.native_batch_norm_backward.default,  # an input-sized buffer (eager route)
    _SDPA_CPU_BWD,  # per-thread accumulators
    *CPU_DROPOUT,
})
# Measured workspaces by call (:func:`_call`, as JSON): each distinct call runs once a process.
_WORKSPACES: dict[str, int] = {}
PROBE_TIMEOUT = 600.0  # seconds for the fresh process that measures while a profiler records here


def workspaces(nodes: Sequence[fx.Node], *, channels_last: bool = False,
               inductor: bool = False) -> dict[fx.Node, int]:
    """Bytes each op of ``nodes`` allocates for itself while it runs, beyond its outputs'
    storage: measured once per distinct call for the CPU kernels of :data:`PROBED` (in
    Inductor's channels-last layout with ``channels_last``), 0 for every other op. A
    convolution backward that cannot be measured counts two weight-sized buffers, with a
    warning. Rule 11 of docs/inductor-memory.md. With ``inductor``, also the dense copy of
    a broadcast attention bias (:func:`dense_bias_bytes`, rule 16)."""
    calls: dict[fx.Node, str] = {}
    for node in nodes:
        outs = tensors(node.meta.get("val"))
        if node.target in PROBED and outs and outs[0].device.type == "cpu":
            convolution = node.target is _aten.convolution_backward.default
            try:
                calls[node] = _call(node, channels_last=channels_last and convolution)
            except TypeError as e:  # an argument it cannot stand in for
                log.warning("rematc: the scratch memory of %s is not measured: %s", node.format_node(), e)
    _measure_missing(calls.values())
    out: dict[fx.Node, int] = {}
    for node in nodes:
        if node in calls and calls[node] in _WORKSPACES:
            out[node] = _WORKSPACES[calls[node]]
        elif node.target is _aten.convolution_backward.default:
            outs = tensors(node.meta.get("val"))
            out[node] = 2 * storage_bytes(outs[1]) if len(outs) > 1 and outs[0].device.type == "cpu" else 0
        elif inductor and (dense := dense_bias_bytes(node)):
            out[node] = dense
    return out


# Ops to which Inductor hands their attention bias (the argument at this index) with dense,
# aligned strides (``torch._inductor.lowering.sdpa_constraint``): the memory-efficient
# attention's backward on CUDA. A bias the backward reads as an input (saved, or a graph
# input), broadcast over heads or batch (stride 0), is passed as it is where its rows are
# aligned (SDPA_BIAS_ALIGNMENT elements); one the backward computes, or with unaligned rows,
# is written out at its full broadcast shape just before the call and freed after it:
# transformers' causal mask of (batch, 1, S, S) recomputed in a block's backward became a
# 512 MiB buffer at 32 heads and 4 x 1,024 tokens.
DENSE_BIAS_OPS: dict[Any, int] = {_aten._scaled_dot_product_efficient_attention_backward.default: 4}
SDPA_BIAS_ALIGNMENT = 8


def broadcast_bias(node: fx.Node) -> torch.Tensor | None:
    """The bias of ``node``, an op of :data:`DENSE_BIAS_OPS` on a CUDA device, where it is
    broadcast along a dimension; None otherwise. Rule 16 of docs/inductor-memory.md."""
    index = DENSE_BIAS_OPS.get(node.target)
    arg = node.args[index] if index is not None and index < len(node.args) else None
    if not isinstance(arg, fx.Node):
        return None
    bias = arg.meta.get("val")
    if not isinstance(bias, torch.Tensor) or bias.device.type != "cuda":
        return None
    if not any(stride == 0 and size > 1 for size, stride in zip(bias.shape, bias.stride(), strict=True)):
        return None
    return bias


def dense_bias_bytes(node: fx.Node) -> int:
    """Bytes of the dense copy Inductor makes of ``node``'s broadcast bias whatever the
    plan: where its rows are not aligned (a bias the backward computes is copied too, but
    rematc saves those: ``rematc.capture.broadcast_bias_sources``). 0 otherwise."""
    bias = broadcast_bias(node)
    if bias is None or bias.shape[-1] % SDPA_BIAS_ALIGNMENT == 0:
        return 0
    return int(bias.numel()) * bias.element_size()


# Matmuls whose CPU kernels allocate scratch: oneDNN in low precision (50-260 kB for
# bfloat16 products of a few hundred rows on this project's CPU, none in float32), and in
# any precision a contiguous copy of an operand broadcast along a dimension (stride 0: a
# mean expanded to the input's shape, then a linear layer), which BLAS cannot read. Each
# returns one tensor, so no value of its own can hold the scratch for its step only: the
# step keeps room for the largest (:func:`transient_scratch`).
LOW_PRECISION_MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                                   _aten.baddbmm.default})
LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})


# An ATen op given a Python number for a Tensor or Scalar parameter wraps it in a 0-d
# tensor (a double or an int64: 8 bytes) and, on the CPU, casts that to the op's dtype
# while it runs (up to 8 more): ``x * 1.5`` allocates 12 bytes beside a float32 output,
# 10 beside a bfloat16 one. Only ATen's kernels do (the eager route's); Inductor's own take
# the number as a constant.
WRAPPED_SCALAR_BYTES = 16


def wrapped_scalars(node: fx.Node) -> int:
    """The Python numbers ``node`` passes for Tensor or Scalar parameters of its op."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return 0
    params = node.target._schema.arguments
    given = [*zip(params, node.args, strict=False),
             *((p, node.kwargs[p.name]) for p in params if p.name in node.kwargs)]
    return sum(isinstance(value, (bool, int, float)) and isinstance(p.type, (torch.TensorType, torch.NumberType))
               for p, value in given)


def transient_scratch(nodes: Sequence[fx.Node], *, scalars: bool = False) -> int:
    """The most scratch memory one op of ``nodes`` allocates beside its outputs while it
    runs: the CPU matmuls of :data:`LOW_PRECISION_MATMULS` in bfloat16 or float16, or
    with a broadcast operand, measured once per distinct call, as :func:`workspaces`
    measures its kernels, and with ``scalars`` (ATen's kernels run the ops) the CPU ops'
    :func:`wrapped_scalars`, at :data:`WRAPPED_SCALAR_BYTES` each. Only one op runs at a
    time, so a step that keeps this much room holds whichever runs at its peak. 0 where
    there are none; a call that cannot be measured counts nothing, with a warning."""
    calls: dict[fx.Node, str] = {}
    wrapped: dict[fx.Node, int] = {}
    for node in nodes:
        outs = tensors(node.meta.get("val"))
        if not outs or outs[0].device.type != "cpu":
            continue
        if scalars and wrapped_scalars(node):
            wrapped[node] = WRAPPED_SCALAR_BYTES * wrapped_scalars(node)
        if node.target in LOW_PRECISION_MATMULS and (outs[0].dtype in LOW_PRECISION or _broadcast_operand(node)):
            try:
                calls[node] = _call(node, channels_last=False)
            except TypeError as e:
                log.warning("rematc: the scratch memory of %s is not measured: %s", node.format_node(), e)
    _measure_missing(calls.values())
    return max((_WORKSPACES.get(calls.get(n, ""), 0) + wrapped.get(n, 0) for n in {*calls, *wrapped}),
               default=0)


def _broadcast_operand(node: fx.Node) -> bool:
    """Whether a tensor operand of ``node`` is broadcast: stride 0 along a dimension of
    more than one element."""
    for arg in node.args:
        t = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if isinstance(t, torch.Tensor) and any(
                optimization_hint(size) > 1 and optimization_hint(stride) == 0
                for size, stride in zip(t.shape, t.stride(), strict=True)):
            return True
    return False


def _measure_missing(calls: Iterable[str]) -> None:
    """Measure the calls :data:`_WORKSPACES` does not hold yet, here or, while a profiler
    records in this process, in a fresh one."""
    missing = sorted({c for c in calls if c not in _WORKSPACES})
    if not missing:
        return
    if torch._C._autograd._profiler_enabled():
        measured = _measure_elsewhere(missing)
    else:
        measured = [_measure_or_none(c) for c in missing]
    _WORKSPACES.update((c, m) for c, m in zip(missing, measured, strict=True) if m is not None)


def _call(node: fx.Node, *, channels_last: bool) -> str:
    """``node``'s op and arguments as JSON (a tensor as its size hints, strides and dtype),
    with the thread count: what :func:`_measure` needs to run it again."""
    return _encoded(node.target, node.args, node.kwargs, channels_last=channels_last)


def measured_workspace(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The workspace of a call of ``op`` (one of :data:`PROBED`) on tensors of exactly
    these shapes and strides (real or fake), as :func:`workspaces` measures it: once per
    distinct call in a process, here or, while a profiler records, in a fresh one. 0 for
    other ops, and where the call cannot be measured. For the walk of generated code
    (:mod:`rematc.generated`), whose fallback kernels allocate it where no statement
    shows: the strides are the generated code's own, which the capture cannot foresee (a
    gradient read through a view of a padded buffer is copied dense by oneDNN first)."""
    if op not in PROBED:
        return 0
    try:
        call = _encoded(op, args, kwargs, channels_last=False)
    except TypeError:
        return 0
    _measure_missing([call])
    return _WORKSPACES.get(call, 0)


def _encoded(op: Any, args: Any, kwargs: dict[str, Any], *, channels_last: bool) -> str:
    def encode(a: Any) -> Any:
        if isinstance(a, fx.Node):
            t = a.meta.get("val")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"argument {a.name} is no tensor")
            a = t
        if isinstance(a, torch.Tensor):
            return {"tensor": [_hints(a.shape), _strides(a, channels_last), str(a.dtype).removeprefix("torch.")]}
        if isinstance(a, torch.SymInt):
            return int(optimization_hint(a))
        if isinstance(a, (list, tuple)):
            return [encode(x) for x in a]
        if isinstance(a, torch.dtype):
            return {"dtype": str(a).removeprefix("torch.")}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise TypeError(f"argument {a!r} of type {type(a).__name__}")

    return json.dumps({"op": str(op), "args": encode(args),
                       "kwargs": {k: encode(v) for k, v in kwargs.items()},
                       "threads": torch.get_num_threads()}, sort_keys=True)


def _measure(call: str) -> int:
    """Run a call of :func:`_call` and return its workspace (:func:`workspaces`)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from rematc.memory import profiler_peak

    spec = json.loads(call)

    def decode(a: Any) -> Any:
        if isinstance(a, dict) and "tensor" in a:
            size, stride, dtype = a["tensor"]
            return torch.empty_strided(size, stride, dtype=getattr(torch, dtype)).zero_()
        if isinstance(a, dict):
            return getattr(torch, a["dtype"])
        return [decode(x) for x in a] if isinstance(a, list) else a

    namespace, name, overload = spec["op"].split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    threads = torch.get_num_threads()
    torch.set_num_threads(spec["threads"])
    try:
        with _disable_current_modes(), torch.no_grad():
            args, kwargs = decode(spec["args"]), {k: decode(v) for k, v in spec["kwargs"].items()}
            op(*args, **kwargs)  # oneDNN builds and caches its primitive on the first call
            out: list[Any] = []
            peak = profiler_peak(lambda: out.append(op(*args, **kwargs)))
            storages = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors(out)}
    finally:
        torch.set_num_threads(threads)
    return max(0, peak - sum(storages.values()))


def _measure_or_none(call: str) -> int | None:
    try:
        return _measure(call)
    except Exception as e:  # not measurable: the fallback of workspaces() counts it
        log.warning("rematc: the scratch memory of %s is not measured: %s", call, e)
        return None


def _measure_elsewhere(calls: list[str]) -> list[int | None]:
    """:func:`_measure_or_none` of each call, in a fresh Python process with this one's
    import path (a profiler records in this one)."""
    code = ("import json, sys\nfrom rematc.annotate import _measure_or_none\n"
            "print(json.dumps([_measure_or_none(c) for c in json.load(sys.stdin)]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run([sys.executable, "-c", code], input=json.dumps(calls), env=env,
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT, check=True)
        line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith("["))
        measured: list[int | None] = json.loads(line)
        return measured
    except (OSError, ValueError, StopIteration, subprocess.SubprocessError) as e:
        log.warning("rematc: the scratch memory of %d kernels is not measured (a profiler records "
                    "here, and a fresh process failed: %s)", len(calls), e)
        return [None] * len(calls)


def _hints(sizes: Any) -> list[int]:
    return [int(optimization_hint(s, fallback=4096)) for s in sizes]


def _strides(t: torch.Tensor, channels_last: bool) -> list[int]:
    if channels_last and t.dim() == 4:
        return [int(s) for s in make_channels_last_strides_for(_hints(t.shape))]
    return _hints(t.stride())


def recompute_cost(time: float, *, pointwise: bool, fuses: bool, device: DeviceProfile,
                   transcendentals: float = 0.0) -> float:
    """Seconds a recomputation adds to the backward: for a pointwise op that fuses into its
    reader (Inductor), at most one launch plus its transcendentals; for anything else, and
    on the eager route, its roofline ``time`` again. See docs/architecture.md, "2. annotate"."""
    if fuses and pointwise:
        return min(time, device.launch_overhead + transcendentals * device.transcendental_time)
    return time


def is_attention(node: fx.Node) -> bool:
    """A fused attention kernel (any ``scaled_dot_product`` variant, forward or backward)."""
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and "scaled_dot_product" in packet.__name__


def transcendentals(node: fx.Node) -> float:
    """Exp-equivalents an op evaluates (:data:`rematc.devices.TRANSCENDENTAL_WEIGHT` per
    element of its output): tanh, exp, sigmoid, ... and the undecomposed ops built on one
    (GELU, SiLU, softmax)."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is None:
        return 0.0
    name = packet.__name__
    if name == "gelu":
        name = "tanh" if node.kwargs.get("approximate", "none") == "tanh" else "erf"
    weight = TRANSCENDENTAL_WEIGHT.get(_BUILT_ON.get(name, name), 0.0)
    if not weight:
        return 0.0
    return weight * sum(int(optimization_hint(t.numel(), fallback=4096)) for t in tensors(node.meta.get("val")))


# Undecomposed ops (the eager route keeps them) and the transcendental each one evaluates.
_BUILT_ON = {"silu": "sigmoid", "_softmax": "exp", "_log_softmax": "exp", "special_erf": "erf"}


def node_flops(node: fx.Node) -> tuple[float, str]:
    """FLOPs of one call_function node and where the number comes from."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    try:
        args, kwargs = tree_map(_val, (node.args, node.kwargs))
        if formula is not None:
            return _number(formula(*args, **kwargs, out_val=node.meta.get("val"))), "registry"
        if target in (_SDPA_CPU, _SDPA_CPU_BWD):
            return _attention_flops(target, args, kwargs), "attention formula"
    except Exception as e:  # a formula that cannot read these shapes: cost by bytes instead
        log.debug("no FLOP count for %s: %s", node.format_node(), e)
    return 0.0, "none (memory-bound)"


def _attention_flops(target: Any, args: Any, kwargs: dict[str, Any]) -> float:
    """4·B·H·Tq·Tk·D (two matmuls of 2·M·N·K), halved when causal; backward 2.5x."""
    backward = target is _SDPA_CPU_BWD
    q, k = (args[1], args[2]) if backward else (args[0], args[1])
    causal_pos = 7 if backward else 4
    causal = kwargs.get("is_causal", args[causal_pos] if len(args) > causal_pos else False)
    b, h, tq, d = (optimization_hint(s) for s in q.shape)
    f = 4.0 * b * h * tq * optimization_hint(k.shape[-2]) * d * (0.5 if causal else 1.0)
    return 2.5 * f if backward else f


def _number(x: Any) -> float:
    """A formula's result; a symbolic one at the sizes' hints, adding no guard."""
    return float(optimization_hint(x)) if isinstance(x, torch.SymInt) else float(x)


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def val_bytes(node: fx.Node) -> int:
    return sum(storage_bytes(t) for t in tensors(node.meta.get("val")))


def storage_bytes(t: torch.Tensor) -> int:
    # Symbolic sizes (dynamic shapes) are planned at their size hint, as the partitioner does.
    return int(optimization_hint(t.untyped_storage().nbytes(), fallback=4096))
