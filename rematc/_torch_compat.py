"""Every private torch API rematc uses, in one place (torch 2.11 to 2.14).

The other modules import these names from here, never from torch's private modules, so
that a torch release that moves or changes one breaks here, at import, with the version
gate beside it. Names every supported torch spells the same are plain re-exports; the
functions below them are the version gates. Inductor internals read only while a compile
runs (its scheduler, wrapper codegen, graph lowering and ``compile_fx``) cost seconds to
import, so functions here import them at first use.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import BackendCompilerFailed
from torch._dynamo.exc import Unsupported as DynamoUnsupported
from torch._functorch import partitioners as _partitioners
from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.compile_utils import fx_graph_cse, raise_getitems
from torch._functorch.partitioners import (
    _extract_fwd_bwd_outputs as extract_fwd_bwd_outputs,
)
from torch._functorch.partitioners import _is_bwd_seed_offset as is_bwd_seed_offset
from torch._functorch.partitioners import _is_fwd_seed_offset as is_fwd_seed_offset
from torch._functorch.partitioners import _is_primal as is_primal
from torch._functorch.partitioners import _is_tangent as is_tangent
from torch._functorch.partitioners import (
    classify_nodes,
    force_save_bw_mutation_src,
    force_save_collectives,
    force_save_effectful_ops,
    reordering_to_mimic_autograd_engine,
)
from torch._guards import CompileContext, TracingContext, detect_fake_mode
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch._inductor.utils import is_gpu, is_pointwise_use
from torch._ops import OpOverload
from torch._prims_common import is_expandable_to, make_channels_last_strides_for
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import symbolic_shapes as _symbolic_shapes
from torch.fx.experimental.proxy_tensor import is_sym_node
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

# Saved-tensor hooks pushed and popped by C functions: a frame Dynamo leaves untraced while
# it compiles the frames it calls (rematc.regions) can set them around such a call
# without a Python frame of its own (torch.autograd.graph.saved_tensors_hooks is one).
push_saved_tensors_hooks = torch._C._autograd._push_saved_tensors_default_hooks
pop_saved_tensors_hooks = torch._C._autograd._pop_saved_tensors_default_hooks

__all__ = [
    "TORCH",
    "BackendCompilerFailed",
    "CompileContext",
    "CustomPartitionerFn",
    "DynamoUnsupported",
    "FakeTensorMode",
    "InductorFallbackWarning",
    "OpOverload",
    "ShapeEnv",
    "StorageWeakRef",
    "TracingContext",
    "aot_autograd",
    "boxed_codegen",
    "classify_nodes",
    "detect_fake_mode",
    "extract_fwd_bwd_modules",
    "extract_fwd_bwd_outputs",
    "force_save_bw_mutation_src",
    "force_save_collectives",
    "force_save_effectful_ops",
    "free_unbacked_symbols",
    "functorch_config",
    "fx_graph_cse",
    "get_hash_for_files",
    "guards_broken_at",
    "has_ao_offload",
    "inductor_allocate_line",
    "inductor_choices",
    "inductor_compile_fx",
    "inductor_config",
    "inductor_decompositions",
    "inductor_extern_kernels",
    "inductor_graph_lowering",
    "inductor_partition_fn",
    "inductor_scheduler_types",
    "inductor_thresholds",
    "inductor_virtualized",
    "inputs_updated_after",
    "is_bwd_seed_offset",
    "is_expandable_to",
    "is_fwd_seed_offset",
    "is_gpu",
    "is_opaque_node",
    "is_pointwise_use",
    "is_primal",
    "is_sym_node",
    "is_tangent",
    "make_boxed_func",
    "make_channels_last_strides_for",
    "optimization_hint",
    "pop_saved_tensors_hooks",
    "push_saved_tensors_hooks",
    "raise_getitems",
    "reordering_to_mimic_autograd_engine",
    "sizes_at",
    "skip_frame_only",
    "storage_key",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
    "warn_fallback",
]

TORCH: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]


def _optimization_hint_211(a: Any, fallback: int | None = None) -> int:
    """A SymInt's value without adding a guard (torch 2.11 and 2.12 call it size_hint)."""
    if isinstance(a, torch.SymInt):
        return int(_symbolic_shapes.size_hint(a, fallback=fallback))  # type: ignore[attr-defined]
    return int(a)


_optimization_hint = getattr(_symbolic_shapes, "optimization_hint", _optimization_hint_211)
# Shape environments read at other sizes (:func:`sizes_at`): id -> each expression's value
# there, as a graph repeats the same few size expressions in every layer.
_RESIZED: dict[int, dict[tuple[Any, int | None], int]] = {}


def skip_frame_only(code: Any) -> None:
    """Have Dynamo run every frame of ``code`` as it is, without asking its callback, and
    still compile the frames it calls: what ``torch.compiler.disable(fn, recursive=False)``
    means, which asks the callback again on each call of ``fn`` (docs/benchmarks.md has
    its cost). Where this torch cannot say so per code object, nothing changes: the
    callback goes on skipping the frame, call by call."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover - a torch without code exec strategies
        return
    skip_code(code)


def storage_key(storage: Any) -> int:
    """What identifies ``storage`` (an untyped storage, real or fake) while it lives: the
    address of its implementation, which every tensor viewing it shares and which
    ``StorageWeakRef.cdata`` holds."""
    return int(storage._cdata)


def optimization_hint(a: Any, fallback: int | None = None) -> int:
    """A SymInt's value without adding a guard: its hint, or under :func:`sizes_at` its
    expression at the values given there."""
    if _RESIZED and isinstance(a, torch.SymInt) and id(a.node.shape_env) in _RESIZED:
        values = _RESIZED[id(a.node.shape_env)]
        key = (a.node.expr, fallback)
        if key not in values:
            values[key] = int(a.node.shape_env.optimization_hint(a.node.expr, fallback=fallback))
        return values[key]
    return int(_optimization_hint(a, fallback=fallback))


@contextlib.contextmanager
def sizes_at(shape_env: Any, values: dict[Any, int]) -> Iterator[None]:
    """Read every size of ``shape_env``'s graph with its symbols at ``values`` (sympy
    symbol -> int) instead of the values it was traced at, e.g. another batch size."""
    import sympy

    hints = _size_hints(shape_env)
    saved = dict(hints)
    hints.update({s: sympy.Integer(v) for s, v in values.items()})
    _RESIZED[id(shape_env)] = {}
    try:
        yield
    finally:
        _RESIZED.pop(id(shape_env), None)
        hints.clear()
        hints.update(saved)


def _size_hints(shape_env: Any) -> dict[Any, Any]:
    """The values ``shape_env``'s symbols were traced at (symbol -> sympy integer)."""
    return shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val


def guards_broken_at(shape_env: Any, values: dict[Any, int]) -> str:
    """The first guard ``shape_env`` recorded on its sizes (a branch the traced code took
    on them) that does not hold with its symbols at ``values`` and the rest at their traced
    values, as text; "" where every one holds."""
    import sympy

    hints = _size_hints(shape_env)
    at = {**hints, **{s: sympy.Integer(v) for s, v in values.items()}}
    for guard in shape_env.guards:
        expr = shape_env.replace(guard.expr)  # symbols found equal to others, as the others
        if expr.xreplace(at) != sympy.true:  # false, or not decided: not known to hold
            return str(guard.expr)
    return ""


def _is_opaque_node_211(node: Any) -> bool:
    """Whether an FX node's value is a script object (torch 2.13 moved this into
    AOTAutograd; 2.11 saves none for the backward)."""
    from torch._library.fake_class_registry import FakeScriptObject

    if not isinstance(node, fx.Node) or "val" not in node.meta:
        return False
    return isinstance(node.meta["val"], torch.ScriptObject | FakeScriptObject)


try:
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node
except ImportError:  # torch < 2.13
    is_opaque_node = _is_opaque_node_211

_TAKES_OPAQUE = "saved_opaque_nodes" in inspect.signature(
    _partitioners._extract_fwd_bwd_modules).parameters


def extract_fwd_bwd_modules(joint: fx.GraphModule, saved: Sequence[fx.Node], *,
                            saved_sym_nodes: Sequence[fx.Node], saved_opaque_nodes: Sequence[fx.Node],
                            **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The partitioner's forward and backward modules for a choice of saved values.
    Torch before 2.13 cannot save script objects for the backward."""
    if _TAKES_OPAQUE:
        return _partitioners._extract_fwd_bwd_modules(
            joint, list(saved), saved_sym_nodes=list(saved_sym_nodes),
            saved_opaque_nodes=list(saved_opaque_nodes), **kwargs)
    if saved_opaque_nodes:
        raise NotImplementedError(
            f"rematc: saving script objects for the backward needs torch 2.13 (this is {torch.__version__})")
    return _partitioners._extract_fwd_bwd_modules(
        joint, list(saved), saved_sym_nodes=list(saved_sym_nodes), **kwargs)


@functools.cache
def has_ao_offload() -> bool:
    """Whether torch has the ``ao::offload``/``reload``/``wait_tensor`` copy ops (2.13 on);
    importing them registers them."""
    try:
        from torch._functorch._activation_offloading import offload_ops  # noqa: F401
    except ImportError:
        return False
    return True


class InductorThresholds(NamedTuple):
    """When Inductor stores a result it could compute inside its readers' kernels."""

    acc_reads: int  # buffers a fused loader may read (``realize_acc_reads_threshold``)
    opcount: int  # ops a fused loader may count (``realize_opcount_threshold``)
    reuse_reads: int  # a result read more often is stored (``realize_reads_threshold``)


def inductor_thresholds(*, cpu: bool) -> InductorThresholds:
    """Inductor's thresholds as its config stands now (a user's ``config.patch`` included),
    for kernels on the CPU (``cpu``) or elsewhere. Torch 2.11 has one value of the first
    two for every device; later releases leave them None by default and read a
    per-device default (12 reads and 50 ops on the CPU, 8 and 30 elsewhere)."""

    def per_device(name: str) -> int:
        value = getattr(inductor_config, f"realize_{name}_threshold")
        if value is None:
            value = getattr(inductor_config, f"realize_cpu_{name}_threshold" if cpu
                            else f"_realize_{name}_threshold_default")
        return int(value)

    return InductorThresholds(per_device("acc_reads"), per_device("opcount"),
                              int(inductor_config.realize_reads_threshold))


class InductorFallbackWarning(UserWarning):
    """This torch's Inductor lacks a hook rematc uses under a budget; rematc does without it
    and says what that costs."""


@functools.cache
def warn_fallback(what: str) -> None:
    """Warn once per process that rematc falls back where ``what`` says."""
    warnings.warn(f"rematc: {what}", InductorFallbackWarning, stacklevel=3)


# ---- Inductor internals read while a compile runs (imported at first use) ----------------


def boxed_codegen() -> Any:
    """FX's code generator for the boxed calling convention: the generated ``forward``
    takes the argument list and clears it once unpacked (``torch.fx.graph._BoxedCodeGen``,
    as AOTAutograd's boxed graphs use)."""
    from torch.fx.graph import _BoxedCodeGen

    return _BoxedCodeGen()


def inductor_compile_fx() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Inductor's ``compile_fx`` and ``compile_fx_inner``."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def inductor_partition_fn() -> Callable[..., Any]:
    """The partition function ``compile_fx`` hands AOTAutograd."""
    from torch._inductor.compile_fx import partition_fn

    return partition_fn


def inputs_updated_after(graph: fx.Graph) -> list[fx.Node]:
    """The inputs of an AOTAutograd joint graph whose in-place update its runtime applies
    after the graph (an input that requires grad): the graph returns the new value, named
    by an ``InputMutationAOTOutput`` among its output's descriptors. [] where the graph
    carries none (not AOTAutograd's)."""
    descs = graph.output_node().meta.get("desc") or ()
    mutated = [d.mutated_input for d in descs if isinstance(d, InputMutationAOTOutput)]
    return [n for n in graph.find_nodes(op="placeholder") if n.meta.get("desc") in mutated]


@contextlib.contextmanager
def inductor_fake_mode(example_inputs: Sequence[Any]) -> Iterator[None]:
    """Inductor's virtualized fake mode (``V.fake_mode``) set to that of
    ``example_inputs``, as ``compile_fx`` sets it around its partition: a joint-graph pass
    enters it (``fuse_seed_creation_pass``, on every graph with dropout)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V

    mode = detect_fake_mode(example_inputs)
    if mode is None:
        yield
        return
    with V.set_fake_mode(mode):
        yield


def inductor_decompositions() -> dict[Any, Any]:
    """The decompositions Inductor traces the joint graph with."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_graph_lowering() -> Any:
    """Inductor's ``GraphLowering`` class (its ``decide_layout_opt``)."""
    from torch._inductor.graph import GraphLowering

    return GraphLowering


def inductor_extern_kernels() -> Any:
    """The namespace generated code calls extern kernels through."""
    from torch._inductor.select_algorithm import extern_kernels

    return extern_kernels


def inductor_virtualized() -> Any:
    """Inductor's virtualized globals ``V`` (``V.graph``, ``V.choices``)."""
    from torch._inductor.virtualized import V

    return V


def inductor_choices() -> Any | None:
    """``V`` where this torch lets a compile swap Inductor's choices handler
    (``V.set_choices_handler``), else None."""
    try:
        v = inductor_virtualized()
    except ImportError:
        return None
    return v if callable(getattr(v, "set_choices_handler", None)) else None


def inductor_scheduler_types() -> tuple[Any, Any | None]:
    """The scheduler's ``ExternKernelSchedulerNode`` and ``WhyNoFuse`` (None where this
    torch has no fusion log)."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    try:
        from torch._inductor.scheduler import WhyNoFuse
    except ImportError:
        return ExternKernelSchedulerNode, None
    return ExternKernelSchedulerNode, WhyNoFuse


def inductor_allocate_line() -> Any | None:
    """Inductor's ``AllocateLine`` where it decides buffer reuse in ``should_reuse_buffer``
    with the fields :mod:`rematc.reuse` reads, else None."""
    try:
        from torch._inductor.codegen.wrapper import AllocateLine
    except ImportError:
        return None
    rule = getattr(AllocateLine, "should_reuse_buffer", None)
    fields = getattr(AllocateLine, "__dataclass_fields__", {})
    return AllocateLine if callable(rule) and "comm_buffer" in fields else None
