"""Llama-style decoders at the shapes people train, built on ``meta`` (no memory, no data).

RMSNorm, rotary position embeddings, grouped-query attention through
``F.scaled_dot_product_attention`` (flash attention), a SwiGLU MLP and an untied head,
returning the next-token loss. Each factory returns ``(model, (tokens, targets))`` for
``rematc export``, which traces it under a device profile and dtype:

    rematc export rematc.llama:llama2_7b --device h100 --dtype bfloat16 -o llama7b.json

``LLAMA_SHAPES`` holds the published shapes; :func:`make_llama` builds any of them with
fewer layers or another sequence length. The named factories take ``batch`` and ``seq``,
as ``rematc fit`` calls them:

    rematc fit rematc.llama:llama3_8b --device h100 --precision bf16-mixed --batch 1,2 --seq 8192
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LlamaShape:
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab: int
    seq_len: int = 4096
    batch: int = 1


LLAMA_SHAPES = {
    "llama2-7b": LlamaShape(n_layer=32, d_model=4096, n_head=32, n_kv_head=32, d_ff=11008, vocab=32000),
    "llama3-8b": LlamaShape(n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336, vocab=128256),
    "llama2-70b": LlamaShape(n_layer=80, d_model=8192, n_head=64, n_kv_head=8, d_ff=28672, vocab=32000),
    "llama3-405b": LlamaShape(n_layer=126, d_model=16384, n_head=128, n_kv_head=8, d_ff=53248,
                              vocab=128256),
    # Small enough to run on a CPU: the same ops, for tests.
    "tiny": LlamaShape(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, vocab=64, seq_len=16,
                       batch=2),
}


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.type_as(x) * self.weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = s.n_head, s.n_kv_head
        self.head_dim = s.d_model // s.n_head
        self.q = nn.Linear(s.d_model, s.n_head * self.head_dim, bias=False)
        self.k = nn.Linear(s.d_model, s.n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(s.d_model, s.n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(s.n_head * self.head_dim, s.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.gate = nn.Linear(s.d_model, s.d_ff, bias=False)
        self.up = nn.Linear(s.d_model, s.d_ff, bias=False)
        self.down = nn.Linear(s.d_ff, s.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(s.d_model), Attention(s)
        self.mlp_norm, self.mlp = RMSNorm(s.d_model), MLP(s)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    cos: Tensor  # rotary tables, [seq_len, head_dim] buffers
    sin: Tensor

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.shape = s
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.n_layer))
        self.norm = RMSNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)
        head_dim = s.d_model // s.n_head
        inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(s.seq_len).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        T = tokens.shape[1]
        cos, sin = self.cos[:T].to(self.embed.weight.dtype), self.sin[:T].to(self.embed.weight.dtype)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        # Cross-entropy written out: on meta tensors aten::nll_loss has no autograd kernel
        # in torch 2.13, so F.cross_entropy would trace without its backward.
        picked = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1))
        return -picked.mean()


def make_llama(name: str, *, device: str = "meta", **overrides: int) -> tuple[Llama, tuple[Tensor, Tensor]]:
    """The ``LLAMA_SHAPES[name]`` model (fields replaced by ``overrides``) and its inputs."""
    s = replace(LLAMA_SHAPES[name], **overrides)
    with torch.device(device):
        model = Llama(s)
        tokens = torch.zeros(s.batch, s.seq_len, dtype=torch.long)
        targets = torch.zeros(s.batch, s.seq_len, dtype=torch.long)
    return model, (tokens, targets)


def llama2_7b(*, batch: int = 1, seq: int = 4096) -> tuple[Llama, tuple[Tensor, Tensor]]:
    return make_llama("llama2-7b", batch=batch, seq_len=seq)


def llama3_8b(*, batch: int = 1, seq: int = 8192) -> tuple[Llama, tuple[Tensor, Tensor]]:
    return make_llama("llama3-8b", batch=batch, seq_len=seq)


def llama2_70b(*, batch: int = 1, seq: int = 4096) -> tuple[Llama, tuple[Tensor, Tensor]]:
    return make_llama("llama2-70b", batch=batch, seq_len=seq)


def llama3_405b(*, batch: int = 1, seq: int = 4096) -> tuple[Llama, tuple[Tensor, Tensor]]:
    return make_llama("llama3-405b", batch=batch, seq_len=seq)


def llama3_405b_128k(*, batch: int = 1, seq: int = 131072) -> tuple[Llama, tuple[Tensor, Tensor]]:
    return make_llama("llama3-405b", batch=batch, seq_len=seq)


def llama_tiny(*, batch: int = 2, seq: int = 16, n_layer: int = 4) -> tuple[Llama, tuple[Tensor, Tensor]]:
    """The toy shape on meta (four layers): for tests of tracing without the hardware."""
    return make_llama("tiny", n_layer=n_layer, batch=batch, seq_len=seq)
