"""The benchmark's models: every one returns the training loss and keeps its repeated
blocks in a ``blocks`` ``nn.ModuleList`` (what the checkpointing configurations wrap).

* ``gpt2_sdpa`` / ``gpt2_math``: the GPT-2-style decoder of :mod:`rematc.models` (6 layers,
  d_model 512, 8 heads, T 512, batch 8, vocab 8192, tied embeddings, GELU-tanh MLP),
  with ``F.scaled_dot_product_attention`` or explicit softmax(QKᵀ)V attention.
* ``llama``: a Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP,
  causal SDPA, untied LM head; same width, depth and sequence as the GPT.
* ``resnet``: a ResNet-18-style CNN (BasicBlocks with BatchNorm) on 224×224 images.
* ``unet``: a U-Net-style CNN (four down and four up levels, long skip connections
  concatenated into the decoder) with a per-pixel cross-entropy loss.
* ``hf_gpt2`` / ``hf_llama``: Hugging Face ``transformers`` models built from configs
  (random weights, nothing downloaded) when ``transformers`` is installed.
* ``gpt_tiny``: the tiny GPT of the unit tests, for the smoke test.

``MODELS[name](batch=None, seed=0)`` builds ``(model, inputs)``; ``batch=None`` is the
model's benchmark batch. Every factory also has a ``small`` variant used by tests
(``SMALL[name]``): the same code at toy sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rematc.models import GPT2_BENCH_BATCH, GPTConfig, make_gpt

Example = tuple[nn.Module, tuple[Tensor, ...]]


def _seeded(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Build under a forked, seeded RNG: the same seed gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -------------------------------------------------------------------------- Llama


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    # Decoder layers.
    n_layer: int = 6
    # Residual width; a multiple of n_head.
    d_model: int = 512
    # Attention heads (no grouped-query attention: as many key/value heads).
    n_head: int = 8
    # Hidden width of the SwiGLU MLP: about 8/3·d_model rounded up to 64, as in Llama.
    d_ff: int = 1408
    # Sequence length (and size of the rotary tables).
    seq_len: int = 512
    vocab: int = 8192
    # RMSNorm epsilon and rotary base, Llama's values.
    norm_eps: float = 1e-5
    rope_base: float = 10000.0

    @classmethod
    def small(cls) -> LlamaConfig:
        return cls(n_layer=2, d_model=32, n_head=2, d_ff=64, seq_len=16, vocab=64)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x`` [B, H, T, D] (the "rotate half" layout of Llama's HF port)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.eps = c.norm_eps
        self.attn_norm = nn.Parameter(torch.ones(c.d_model))
        self.wq = nn.Linear(c.d_model, c.d_model, bias=False)
        self.wk = nn.Linear(c.d_model, c.d_model, bias=False)
        self.wv = nn.Linear(c.d_model, c.d_model, bias=False)
        self.wo = nn.Linear(c.d_model, c.d_model, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(c.d_model))
        self.w_gate = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w_up = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w_down = nn.Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, C = x.shape
        h = F.rms_norm(x, (C,), self.attn_norm, self.eps)
        q, k, v = (w(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        h = F.rms_norm(x, (C,), self.mlp_norm, self.eps)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    cos: Tensor  # [seq_len, head_dim] rotary tables
    sin: Tensor

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.n_layer))
        self.norm = nn.Parameter(torch.ones(c.d_model))
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        head_dim = c.d_model // c.n_head
        inv_freq = c.rope_base ** (-torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(c.seq_len).float(), inv_freq).repeat(1, 2)
        # Derived from the config: not persistent.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        # GPT-2's initialisation: N(0, 0.02), residual output projections scaled by
        # 1/√(2·n_layer).
        residual_std = 0.02 / math.sqrt(2 * c.n_layer)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual = name.endswith(("wo.weight", "w_down.weight"))
                nn.init.normal_(p, std=residual_std if residual else 0.02)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(F.rms_norm(x, (x.size(-1),), self.norm, self.config.norm_eps))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_llama(config: LlamaConfig, *, batch: int, seed: int) -> Example:
    model = _seeded(partial(Llama, config), seed)
    g = _generator(seed)
    shape = (batch, config.seq_len)
    return model, (torch.randint(config.vocab, shape, generator=g),
                   torch.randint(config.vocab, shape, generator=g))


# ------------------------------------------------------------------------- ResNet


@dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    # Square input images, in pixels; the stem divides them by 4.
    image_size: int = 224
    # Channels of the four stages (ResNet-18's), each stage halving the resolution
    # after the first.
    widths: tuple[int, ...] = (64, 128, 256, 512)
    # BasicBlocks per stage (ResNet-18's 2-2-2-2).
    depths: tuple[int, ...] = (2, 2, 2, 2)
    n_class: int = 100

    @classmethod
    def small(cls) -> ResNetConfig:
        return cls(image_size=16, widths=(4, 8), depths=(1, 1), n_class=5)


class BasicBlock(nn.Module):
    """conv3×3-BN-ReLU-conv3×3-BN plus the (projected when the shape changes) input, ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, c: ResNetConfig) -> None:
        super().__init__()
        stem = c.widths[0]
        self.stem = nn.Sequential(nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks: list[nn.Module] = []
        c_in = stem
        for i, (width, depth) in enumerate(zip(c.widths, c.depths, strict=True)):
            for j in range(depth):
                blocks.append(BasicBlock(c_in, width, 2 if i > 0 and j == 0 else 1))
                c_in = width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c_in, c.n_class)

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)


def make_resnet(config: ResNetConfig, *, batch: int, seed: int) -> Example:
    model = _seeded(partial(ResNet, config), seed)
    g = _generator(seed)
    s = config.image_size
    return model, (torch.randn(batch, 3, s, s, generator=g),
                   torch.randint(config.n_class, (batch,), generator=g))


# -------------------------------------------------------------------------- U-Net


@dataclass(frozen=True, kw_only=True)
class UNetConfig:
    # Square input images; divisible by 2**len(widths) - 1 (one 2×2 pool per level).
    image_size: int = 256
    in_channels: int = 3
    # Channels per level, top to bottom; the last is the bottleneck.
    widths: tuple[int, ...] = (32, 64, 128, 256, 512)
    # Classes of the per-pixel segmentation target.
    n_class: int = 8

    @classmethod
    def small(cls) -> UNetConfig:
        return cls(image_size=16, widths=(4, 8, 16), n_class=3)


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU(), nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU())


class Down(nn.Module):
    """2×2 max-pool (except on the top level), then a double conv."""

    def __init__(self, c_in: int, c_out: int, *, pool: bool) -> None:
        super().__init__()
        self.pool = pool
        self.conv = _double_conv(c_in, c_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.max_pool2d(x, 2) if self.pool else x)


class Up(nn.Module):
    """2×2 transposed-conv upsampling, concatenation with the encoder's skip, double conv."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv = _double_conv(2 * c_out, c_out)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        return self.conv(torch.cat((skip, self.up(x)), dim=1))


class UNet(nn.Module):
    """``blocks`` = encoder levels (the last is the bottleneck), then decoder levels; each
    encoder level's output stays alive until the decoder level of the same resolution."""

    def __init__(self, c: UNetConfig) -> None:
        super().__init__()
        w = c.widths
        downs = [Down(c.in_channels if i == 0 else w[i - 1], w[i], pool=i > 0) for i in range(len(w))]
        ups = [Up(w[i], w[i - 1]) for i in range(len(w) - 1, 0, -1)]
        self.n_down = len(downs)
        self.blocks = nn.ModuleList([*downs, *ups])
        self.head = nn.Conv2d(w[0], c.n_class, 1)

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        skips: list[Tensor] = []
        x = images
        for block in self.blocks[: self.n_down]:
            x = block(x)
            skips.append(x)
        skips.pop()  # the bottleneck's output is the decoder's input, not a skip
        for block in self.blocks[self.n_down:]:
            x = block(x, skips.pop())
        return F.cross_entropy(self.head(x), labels)


def make_unet(config: UNetConfig, *, batch: int, seed: int) -> Example:
    model = _seeded(partial(UNet, config), seed)
    g = _generator(seed)
    s = config.image_size
    return model, (torch.randn(batch, config.in_channels, s, s, generator=g),
                   torch.randint(config.n_class, (batch, s, s), generator=g))


# ---------------------------------------------------------------- Hugging Face


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM returning its loss; ``blocks`` are its decoder layers."""

    def __init__(self, inner: nn.Module, layers: nn.ModuleList) -> None:
        super().__init__()
        self.inner = inner
        self.blocks = layers

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        loss: Tensor = self.inner(input_ids=idx, labels=targets).loss
        return loss


def make_hf(kind: str, *, batch: int, seed: int, small: bool = False) -> Example:
    """GPT-2 or Llama from ``transformers`` configs with random weights (no download), at
    the sizes of the hand-written ones; ``ImportError`` when transformers is missing."""
    import transformers

    d, layers, heads, seq, vocab, ff = (32, 2, 2, 16, 64, 64) if small else (512, 6, 8, 512, 8192, 1408)
    if kind == "gpt2":
        cfg: Any = transformers.GPT2Config(
            n_embd=d, n_layer=layers, n_head=heads, n_positions=seq, vocab_size=vocab,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
            bos_token_id=0, eos_token_id=0)
        cls: Any = transformers.GPT2LMHeadModel
    elif kind == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, intermediate_size=ff, max_position_embeddings=seq,
            vocab_size=vocab, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"make_hf: kind must be 'gpt2' or 'llama', got {kind!r}")
    cfg._attn_implementation = "sdpa"
    inner: Any = _seeded(lambda: cls(cfg), seed)
    inner.train()
    # GPT-2's class does not name its loss, and transformers logs its fallback inside the
    # traced forward: a logging call is a graph break.
    inner.loss_type = "ForCausalLM"
    blocks = inner.transformer.h if kind == "gpt2" else inner.model.layers
    g = _generator(seed)
    idx = torch.randint(vocab, (batch, seq), generator=g)
    # Labels equal to the inputs: the model shifts them by one itself.
    return HFCausalLM(inner, blocks), (idx, idx.clone())


# ----------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[..., Example]  # (batch=, seed=) -> (model, inputs)
    batch: int  # benchmark batch
    small: Callable[..., Example]  # the same code at toy sizes, for tests
    note: str


def _gpt(attention: str, *, batch: int, seed: int, small: bool = False, layers: int | None = None) -> Example:
    config = GPTConfig.tiny() if small else GPTConfig.gpt2_bench()
    if layers is not None and not small:
        config = replace(config, n_layer=layers)
    model, inputs = make_gpt(replace(config, attention=attention), batch=batch, seed=seed)  # type: ignore[arg-type]
    return model, inputs


MODELS: dict[str, ModelSpec] = {
    "gpt_tiny": ModelSpec(partial(_gpt, "sdpa", small=True), 2, partial(_gpt, "sdpa", small=True),
                          "rematc.models GPTConfig.tiny (2 layers, d 32): smoke tests"),
    "gpt2_sdpa": ModelSpec(partial(_gpt, "sdpa"), GPT2_BENCH_BATCH, partial(_gpt, "sdpa", small=True),
                           "GPT-2-style, 6 layers, d 512, 8 heads, T 512, vocab 8192, SDPA"),
    "gpt2_12": ModelSpec(partial(_gpt, "sdpa", layers=12), GPT2_BENCH_BATCH, partial(_gpt, "sdpa", small=True),
                         "gpt2_sdpa with 12 layers (compile time)"),
    "gpt2_math": ModelSpec(partial(_gpt, "math"), GPT2_BENCH_BATCH, partial(_gpt, "math", small=True),
                           "the same with explicit softmax(QKᵀ)V attention"),
    "llama": ModelSpec(partial(make_llama, LlamaConfig()), 8, partial(make_llama, LlamaConfig.small()),
                       "Llama-style, 6 layers, d 512, 8 heads, SwiGLU 1408, T 512, vocab 8192"),
    "resnet": ModelSpec(partial(make_resnet, ResNetConfig()), 16, partial(make_resnet, ResNetConfig.small()),
                        "ResNet-18-style, 224×224, 100 classes"),
    "unet": ModelSpec(partial(make_unet, UNetConfig()), 8, partial(make_unet, UNetConfig.small()),
                      "U-Net-style, widths 32..512, 256×256, 8 classes"),
    "hf_gpt2": ModelSpec(partial(make_hf, "gpt2"), GPT2_BENCH_BATCH, partial(make_hf, "gpt2", small=True),
                         "transformers GPT2LMHeadModel at gpt2_sdpa's sizes (needs transformers)"),
    "hf_llama": ModelSpec(partial(make_hf, "llama"), 8, partial(make_hf, "llama", small=True),
                          "transformers LlamaForCausalLM at llama's sizes (needs transformers)"),
}


def to_device(model: nn.Module, inputs: tuple[Tensor, ...], device: str | torch.device) -> tuple[Tensor, ...]:
    """Move ``model`` (in place) and return ``inputs`` on ``device``. On CUDA, fp32 matmuls
    run on TF32 tensor cores, the rate rematc's GPU device profiles assume."""
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high")
    model.to(device)
    return tuple(x.to(device) for x in inputs)


def make(name: str, *, batch: int | None = None, seed: int = 0, small: bool = False) -> Example:
    """``(model, inputs)`` of benchmark model ``name`` (its benchmark batch by default)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    spec = MODELS[name]
    factory = spec.small if small else spec.build
    return factory(batch=spec.batch if batch is None else batch, seed=seed)
