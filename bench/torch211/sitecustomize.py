"""Stand-ins for the torch 2.13 internals rematc uses that torch 2.11 lacks, for measuring
on a machine whose image has torch 2.11 and cannot install 2.13 (no network): put this
folder first on ``PYTHONPATH`` and Python imports it at start-up.

    PYTHONPATH=bench/torch211:. python -m bench.run --models gpt2_sdpa --device cuda ...

* ``symbolic_shapes.optimization_hint(a, fallback)``: a SymInt's hint without a guard; 2.11
  has ``size_hint`` with the same meaning.
* ``graph_compile.is_opaque_node``: whether a node's value is a script object.
* ``partitioners._extract_fwd_bwd_modules``: 2.13 added ``saved_opaque_nodes``; without
  opaque saved values (none in the benchmark models) the call is 2.11's.

Figures measured this way are provisional (``bench/results/gpu-h100/``). On torch 2.13
this file changes nothing.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch._functorch._aot_autograd.graph_compile as graph_compile
import torch._functorch.partitioners as partitioners
import torch.fx.experimental.symbolic_shapes as symbolic_shapes

if not hasattr(symbolic_shapes, "optimization_hint"):

    def optimization_hint(a: Any, fallback: int | None = None) -> int:
        if isinstance(a, torch.SymInt):
            size_hint = getattr(symbolic_shapes, "size_hint", None)
            if size_hint is not None:
                return int(size_hint(a, fallback=fallback))
            return int(a.node.shape_env.size_hint(a.node.expr, allow_none=False))
        return int(a)

    symbolic_shapes.optimization_hint = optimization_hint  # type: ignore[attr-defined]

if not hasattr(graph_compile, "is_opaque_node"):

    def is_opaque_node(node: Any) -> bool:
        from torch._library.fake_class_registry import FakeScriptObject

        if not isinstance(node, torch.fx.Node) or "val" not in node.meta:
            return False
        return isinstance(node.meta["val"], torch.ScriptObject | FakeScriptObject)

    graph_compile.is_opaque_node = is_opaque_node  # type: ignore[attr-defined]

if "saved_opaque_nodes" not in inspect.signature(partitioners._extract_fwd_bwd_modules).parameters:
    _extract = partitioners._extract_fwd_bwd_modules

    def _extract_fwd_bwd_modules(joint: Any, saved: Any, saved_sym_nodes: Any,
                                 saved_opaque_nodes: Any = None, **kwargs: Any) -> Any:
        if saved_opaque_nodes:
            raise NotImplementedError("opaque saved values need torch 2.13")
        return _extract(joint, saved, saved_sym_nodes, **kwargs)

    partitioners._extract_fwd_bwd_modules = _extract_fwd_bwd_modules
