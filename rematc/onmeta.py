"""Stand-ins for ops that trace wrongly on ``meta`` tensors, where rematc plans models
too big for the machine: :func:`stand_ins` holds them all while a model on meta is traced
(:func:`rematc.trace.trace`).

On meta tensors ``F.scaled_dot_product_attention`` picks no fused kernel and traces as
softmax attention that keeps its scores, with a mask or without (:func:`flash_attention`).

On meta tensors ``aten::nll_loss`` has no autograd kernel (torch 2.13): a model whose
loss is ``F.cross_entropy`` or ``F.nll_loss``, as every transformers model's is, traces
with no backward at all (transformers' GPT-2 at 24 layers gave 1,099 values and no
decision; written out, 2,325 values and 808 decisions, and 1,681 and 476 with the flash
attention below), and the regional survey found a Llama's loss head needing 9.4 MB where
it needs 21.0 MB on the CPU (vocabulary 1024, 4 x 256 tokens).

transformers, given no attention mask, checks the position ids for packed sequences; on
meta (or while tracing) it cannot read them, so it builds an explicit causal mask, and
``F.scaled_dot_product_attention`` with a mask traces as softmax attention that keeps its
scores: a TinyLlama-shaped step (22 layers, 32 heads, 4 x 2,048 tokens) peaked at 53.2 GB
under checkpointing, most of it scores no GPU kernel holds.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F


def picked_losses(logp: torch.Tensor, target: torch.Tensor, ignore_index: int,
                  reduction: str) -> torch.Tensor:
    """``nll_loss(logp, target)`` without weights, as gather and sums: each position's
    negative log-probability of its class (classes on dim 1, or 0 unbatched), positions
    whose target is ``ignore_index`` counting zero (and, for ``"mean"``, not counted)."""
    dim = 1 if logp.dim() > 1 else 0
    valid = target != ignore_index
    index = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(dim)
    losses = (-logp.gather(dim, index).squeeze(dim)).masked_fill(~valid, 0.0)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum().to(losses.dtype)


@contextlib.contextmanager
def losses_written_out() -> Iterator[None]:
    """``F.cross_entropy`` and ``F.nll_loss`` of class indices written out as
    ``log_softmax``, ``gather`` and sums while the block runs (process-wide: they are
    module attributes, which transformers' losses read at each call). Calls with class
    weights, label smoothing, probability targets or the deprecated
    ``size_average``/``reduce`` keep the library's op. The written-out loss allocates the
    same full-size tensors as the library's: the log-probabilities and, in the backward,
    their gradient."""
    plain_ce, plain_nll = F.cross_entropy, F.nll_loss

    def plain_only(weight: Any, target: torch.Tensor, size_average: Any, reduce: Any) -> bool:
        return weight is not None or target.is_floating_point() or size_average is not None or reduce is not None

    def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: Any = None,
                      size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                      reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
        if label_smoothing or plain_only(weight, target, size_average, reduce):
            return plain_ce(input, target, weight, size_average, ignore_index, reduce, reduction,
                            label_smoothing)
        return picked_losses(input.log_softmax(1 if input.dim() > 1 else 0), target, ignore_index, reduction)

    def nll_loss(input: torch.Tensor, target: torch.Tensor, weight: Any = None, size_average: Any = None,
                 ignore_index: int = -100, reduce: Any = None, reduction: str = "mean") -> torch.Tensor:
        if plain_only(weight, target, size_average, reduce):
            return plain_nll(input, target, weight, size_average, ignore_index, reduce, reduction)
        return picked_losses(input, target, ignore_index, reduction)

    F.cross_entropy, F.nll_loss = cross_entropy, nll_loss
    try:
        yield
    finally:
        F.cross_entropy, F.nll_loss = plain_ce, plain_nll


def none_packed(position_ids: torch.Tensor) -> None:
    """transformers' packed-sequence check answering "none packed"."""
    return None


@contextlib.contextmanager
def packed_check_replaced(replace: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """transformers' packed-sequence check (``find_packed_sequence_indices``) is
    ``replace(check)`` while the block runs, ``check`` being the one in place; restored
    after. Nothing happens where transformers' masking module is not loaded."""
    masking = sys.modules.get("transformers.masking_utils")
    check = getattr(masking, "find_packed_sequence_indices", None)
    if check is None:
        yield
        return
    masking.find_packed_sequence_indices = replace(check)  # type: ignore[union-attr]
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = check  # type: ignore[union-attr]


def unpacked_sequences() -> contextlib.AbstractContextManager[None]:
    """transformers' packed-sequence check answers "none packed" while the block runs, so
    that a model given no attention mask leaves causality to SDPA's ``is_causal``, as it
    does eagerly on unpacked inputs. Traced inline (no graph break: a trace on meta is one
    graph)."""
    return packed_check_replaced(lambda check: none_packed)


@contextlib.contextmanager
def flash_attention() -> Iterator[None]:
    """On ``meta`` tensors, ``F.scaled_dot_product_attention`` picks no fused kernel (it
    has no device to pick for) and traces as explicit softmax attention, whose score
    matrices a device with flash attention never holds. While tracing on meta, it calls
    the CPU flash-attention op instead: the same inputs, output and saved log-sum-exp as
    a GPU's flash kernel. Grouped-query key and value heads are read in place, as the
    fused kernels read them (the op takes fewer key and value heads than query heads). A
    mask goes to the op as well (a boolean one made additive first, as SDPA does), as a
    GPU's memory-efficient kernel takes one: torch before 2.14 builds transformers' causal
    mask under Dynamo (``torch.compiler.is_exporting()`` reads as true there), and masked
    softmax attention held two 512 MiB score matrices per block of a 32-head Llama at 4 x
    1,024 tokens, whose regional survey then refused HF checkpointing's measured peak as
    infeasible."""
    plain = F.scaled_dot_product_attention

    def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
        if dropout_p or q.dim() != 4:
            return plain(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # as SDPA turns a boolean mask into an additive one before its fused kernels
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(attn_mask.logical_not(),
                                                                               float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]

    F.scaled_dot_product_attention = flash  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """Every stand-in of this module, while the block runs: flash attention, the losses
    written out, and no packed sequences."""
    with flash_attention(), losses_written_out(), unpacked_sequences():
        yield
