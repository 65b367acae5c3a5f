"""Small built-in example models for tests, demos and benchmarks.

Every model's ``forward`` returns a scalar loss, so one training step is
``model(*inputs).backward()``. Each model has a frozen, keyword-only config and a
factory ``make_<name>(config, *, batch, seed, device) -> (model, inputs)`` that builds
the module and a matching tuple of example inputs (data first, target last).

Factories seed a forked RNG, so the same ``seed`` gives the same weights and inputs
without touching the caller's global RNG state. Randomness *during* a step (dropout)
still comes from the global generator, as in any PyTorch training loop.

The models are deliberately plain ``nn.Module`` code so they exercise what real
training code does under ``torch.compile``:

* ``GPT`` — matmul/softmax/layer-norm chains, tied weights, dropout RNG and, with
  ``attention="math"``, the B·H·T² score tensors that dominate activation memory.
* ``CNN`` — ``BatchNorm2d`` in train mode, i.e. buffer mutation inside the graph.
* ``InPlaceNet`` — in-place ops on intermediates (and through a view), so AOTAutograd
  functionalization has work to do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from itertools import pairwise
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "CNN",
    "EXAMPLES",
    "GPT",
    "GPT2_BENCH_BATCH",
    "MLP",
    "CNNConfig",
    "GPTConfig",
    "InPlaceNet",
    "InPlaceNetConfig",
    "MLPConfig",
    "make_cnn",
    "make_gpt",
    "make_inplace",
    "make_mlp",
]

Device = str | torch.device
Example = tuple[nn.Module, tuple[Tensor, ...]]


def _generator(seed: int, device: Device) -> torch.Generator:
    """A generator for example inputs, on the device the inputs are created on."""
    return torch.Generator(device=device).manual_seed(seed)


def _build(factory: Callable[[], nn.Module], *, seed: int, device: Device) -> nn.Module:
    """Run ``factory`` under a forked, seeded CPU RNG and move the result to ``device``.

    Parameters are initialised on the CPU so the same seed gives the same weights on
    every device.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory()
    return model.to(device)


# ---------------------------------------------------------------------------- MLP


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    # Width of the input features.
    d_in: int = 32
    # Width of every hidden layer.
    d_hidden: int = 64
    # Number of Linear+GELU hidden layers (the classifier layer is extra).
    n_layer: int = 3
    # Number of classes of the cross-entropy target.
    n_class: int = 10


class MLP(nn.Module):
    """``n_layer`` × (Linear, GELU), then a linear classifier; cross-entropy loss."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        widths = [config.d_in] + [config.d_hidden] * config.n_layer
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(widths))
        self.head = nn.Linear(widths[-1], config.n_class)

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        for layer in self.hidden:
            x = F.gelu(layer(x))
        return F.cross_entropy(self.head(x), target)


def make_mlp(config: MLPConfig, *, batch: int, seed: int, device: Device = "cpu") -> Example:
    """An ``MLP`` and ``(x [batch, d_in], target [batch] class ids)``."""
    model = _build(partial(MLP, config), seed=seed, device=device)
    g = _generator(seed, device)
    x = torch.randn(batch, config.d_in, generator=g, device=device)
    target = torch.randint(config.n_class, (batch,), generator=g, device=device)
    return model, (x, target)


# ---------------------------------------------------------------------------- GPT


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    # Number of transformer blocks.
    n_layer: int = 6
    # Residual-stream width; must be divisible by n_head.
    d_model: int = 512
    # Attention heads per block; head size is d_model // n_head.
    n_head: int = 8
    # Sequence length T (also the size of the position table). Math attention keeps
    # B·n_head·T² score tensors alive, so activation memory grows with T².
    seq_len: int = 512
    # Vocabulary size; the tied LM head makes logits [B, T, vocab].
    vocab: int = 8192
    # Dropout probability on the embeddings, the attention output projection and the
    # MLP output, as in nanoGPT. Not applied inside attention, so "sdpa" and "math"
    # compute the same function. 0 by default: budget-driven recompute of RNG ops is
    # unsound in torch 2.13 (pytorch#190717, #190758).
    dropout: float = 0.0
    # "sdpa": F.scaled_dot_product_attention(is_causal=True), a fused kernel that
    # keeps no T² tensor; "math": explicit masked softmax(QKᵀ/√d)V.
    attention: Literal["sdpa", "math"] = "sdpa"

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by "
                f"n_head={self.n_head}; pick a d_model that is a multiple of n_head"
            )
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"GPTConfig: attention={self.attention!r}; expected 'sdpa' or 'math'")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1)")

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """A model small enough for unit tests (about 30 K parameters)."""
        return replace(cls(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64), **overrides)

    @classmethod
    def gpt2_bench(cls, **overrides: Any) -> GPTConfig:
        """The benchmark model (23.4 M parameters); use with ``batch=GPT2_BENCH_BATCH``."""
        return replace(cls(n_layer=6, d_model=512, n_head=8, seq_len=512, vocab=8192), **overrides)


# Batch size the GPT-2 benchmark is run at (batch belongs to the inputs, not the config).
GPT2_BENCH_BATCH = 8


class CausalSelfAttention(nn.Module):
    causal_mask: Tensor  # [seq_len, seq_len] bool, True on and below the diagonal

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.attention = config.attention
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        mask = torch.ones(config.seq_len, config.seq_len, dtype=torch.bool).tril()
        # Not persistent: derived from the config, nothing to save in a checkpoint.
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, n_head, T, head_size]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            # dropout_p stays 0: dropout is applied to the projected output below.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            scores = scores.masked_fill(~self.causal_mask[:T, :T], float("-inf"))
            y = F.softmax(scores, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.drop(self.proj(y))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = FeedForward(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style decoder returning the next-token cross-entropy loss.

    The LM head reuses the token-embedding matrix (weight tying, as in GPT-2), so
    there is no separate head parameter.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 initialisation: N(0, 0.02) everywhere, output projections of each
        # residual branch scaled by 1/√(2·n_layer) (GPT-2 paper, §2.3).
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=residual_std)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        n_tokens = idx.size(1)
        if n_tokens > self.config.seq_len:
            raise ValueError(
                f"GPT: input has {n_tokens} tokens but seq_len={self.config.seq_len}; "
                "truncate the input or build the model with a larger seq_len"
            )
        pos = torch.arange(n_tokens, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_gpt(config: GPTConfig, *, batch: int, seed: int, device: Device = "cpu") -> Example:
    """A ``GPT`` and ``(idx [batch, seq_len], targets [batch, seq_len])`` token ids."""
    model = _build(partial(GPT, config), seed=seed, device=device)
    g = _generator(seed, device)
    shape = (batch, config.seq_len)
    idx = torch.randint(config.vocab, shape, generator=g, device=device)
    targets = torch.randint(config.vocab, shape, generator=g, device=device)
    return model, (idx, targets)


# ---------------------------------------------------------------------------- CNN


@dataclass(frozen=True, kw_only=True)
class CNNConfig:
    # Channels of the input images (3 for RGB).
    in_channels: int = 3
    # Height and width of the square input images, in pixels; must be even (one 2×2
    # max-pool).
    image_size: int = 16
    # Output channels of each Conv3×3+BatchNorm+ReLU stage.
    channels: tuple[int, ...] = (8, 16)
    # Number of classes of the cross-entropy target.
    n_class: int = 10


class CNN(nn.Module):
    """Conv-BN-ReLU stages, a 2×2 max-pool after the first, global average pool, linear
    head; cross-entropy loss.

    In train mode every ``BatchNorm2d`` updates ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` in place, so a compiled step has buffer mutations.
    """

    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = config.in_channels
        for i, c_out in enumerate(config.channels):
            # Bias is redundant before BatchNorm.
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out)]
            layers.append(nn.ReLU())
            if i == 0:
                layers.append(nn.MaxPool2d(2))
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, config.n_class)

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        x = self.features(images).mean(dim=(2, 3))
        return F.cross_entropy(self.head(x), labels)


def make_cnn(config: CNNConfig, *, batch: int, seed: int, device: Device = "cpu") -> Example:
    """A ``CNN`` in train mode and ``(images [batch, C, H, W], labels [batch])``."""
    model = _build(partial(CNN, config), seed=seed, device=device)
    g = _generator(seed, device)
    s = config.image_size
    images = torch.randn(batch, config.in_channels, s, s, generator=g, device=device)
    labels = torch.randint(config.n_class, (batch,), generator=g, device=device)
    return model, (images, labels)


# --------------------------------------------------------------------- InPlaceNet


@dataclass(frozen=True, kw_only=True)
class InPlaceNetConfig:
    # Width of the input, the hidden layers and the regression target.
    d: int = 32
    # Number of in-place residual blocks.
    n_layer: int = 2


class InPlaceNet(nn.Module):
    """An MLP whose forward mutates intermediates in place; mean-squared-error loss.

    Each block does ``relu_``, ``add_`` (a residual), ``mul_`` by a scalar and a
    ``mul_`` through a slice view. Every mutated tensor is one autograd does not save
    for backward at the time it is mutated, so eager autograd accepts the code and
    AOTAutograd must functionalize it. Parameters are never mutated.
    """

    def __init__(self, config: InPlaceNetConfig) -> None:
        super().__init__()
        d = config.d
        self.inner = nn.ModuleList(nn.Linear(d, d) for _ in range(config.n_layer))
        self.outer = nn.ModuleList(nn.Linear(d, d) for _ in range(config.n_layer))
        self.head = nn.Linear(d, d)

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        for inner, outer in zip(self.inner, self.outer, strict=True):
            h = inner(x)
            h.relu_()  # linear's output is not saved by its backward
            y = outer(h)
            y.add_(h)  # in-place residual
            y.mul_(0.5)
            y[:, : y.size(1) // 2].mul_(2.0)  # in-place through a view
            x = y.relu_()
        return F.mse_loss(self.head(x), target)


def make_inplace(
    config: InPlaceNetConfig, *, batch: int, seed: int, device: Device = "cpu"
) -> Example:
    """An ``InPlaceNet`` and ``(x [batch, d], target [batch, d])``."""
    model = _build(partial(InPlaceNet, config), seed=seed, device=device)
    g = _generator(seed, device)
    x = torch.randn(batch, config.d, generator=g, device=device)
    target = torch.randn(batch, config.d, generator=g, device=device)
    return model, (x, target)


# ---------------------------------------------------------------------- registry

# Tiny instance of every model, for tests and demos. Call as
# ``EXAMPLES[name](batch=..., seed=..., device=...)``; every keyword has a default.
EXAMPLES: dict[str, Callable[..., Example]] = {
    "mlp": partial(make_mlp, MLPConfig(), batch=4, seed=0),
    "gpt": partial(make_gpt, GPTConfig.tiny(), batch=2, seed=0),
    "cnn": partial(make_cnn, CNNConfig(), batch=4, seed=0),
    "inplace": partial(make_inplace, InPlaceNetConfig(), batch=4, seed=0),
}
