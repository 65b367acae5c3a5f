"""Private torch APIs rematc uses whose spelling differs between the torch releases it
supports (2.11 to 2.14). Each name here is one version gate; import it from here, never
from torch directly. Names that every supported torch spells the same stay where they are
used until they need a gate.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import partitioners as _partitioners
from torch.fx.experimental import symbolic_shapes as _symbolic_shapes

__all__ = [
    "TORCH", "extract_fwd_bwd_modules", "has_ao_offload", "is_opaque_node", "optimization_hint",
]

TORCH: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]


def _optimization_hint_211(a: Any, fallback: int | None = None) -> int:
    """A SymInt's value without adding a guard (torch 2.11 and 2.12 call it size_hint)."""
    if isinstance(a, torch.SymInt):
        return int(_symbolic_shapes.size_hint(a, fallback=fallback))  # type: ignore[attr-defined]
    return int(a)


optimization_hint = getattr(_symbolic_shapes, "optimization_hint", _optimization_hint_211)


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
        return _partitioners._extract_fwd_bwd_modules(  # type: ignore[no-any-return]
            joint, saved, saved_sym_nodes=saved_sym_nodes, saved_opaque_nodes=saved_opaque_nodes,
            **kwargs)
    if saved_opaque_nodes:
        raise NotImplementedError(
            f"rematc: saving script objects for the backward needs torch 2.13 (this is {torch.__version__})")
    return _partitioners._extract_fwd_bwd_modules(  # type: ignore[no-any-return]
        joint, saved, saved_sym_nodes=saved_sym_nodes, **kwargs)


@functools.cache
def has_ao_offload() -> bool:
    """Whether torch has the ``ao::offload``/``reload``/``wait_tensor`` copy ops (2.13 on);
    importing them registers them."""
    try:
        from torch._functorch._activation_offloading import offload_ops  # noqa: F401
    except ImportError:
        return False
    return True
