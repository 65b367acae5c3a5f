"""transformers' GPT-2, Llama, BERT, T5 and ViT from tiny configs (random weights, nothing
downloaded) and a ResNet, each as a module returning its loss, for the end-to-end tests.

Each factory takes ``checkpointing`` (``gradient_checkpointing_enable()``, non-reentrant;
for the ResNet, ``torch.utils.checkpoint`` around each block) and ``split`` (the model
returns its logits and the loss is computed after a graph break, as transformers' GPT-2
does when its loss type is unnamed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from bench.models import ResNetConfig, make_resnet

BATCH, SEQ, HIDDEN, VOCAB, LAYERS, HEADS = 2, 16, 32, 64, 2, 2

Example = tuple[nn.Module, tuple[Tensor, ...]]


class Wrapped(nn.Module):
    """``inner(**kwargs)`` with the loss computed by ``loss_of(outputs, labels)``; with
    ``split``, after a graph break."""

    def __init__(self, inner: nn.Module, keys: tuple[str, ...],
                 loss_of: Callable[[Any, Tensor], Tensor], *, split: bool) -> None:
        super().__init__()
        self.inner, self.keys, self.loss_of, self.split = inner, keys, loss_of, split

    def forward(self, *args: Tensor) -> Tensor:
        *inputs, labels = args
        kwargs = dict(zip(self.keys, inputs, strict=True))
        if not self.split:
            loss: Tensor = self.inner(**kwargs, labels=labels).loss
            return loss
        out = self.inner(**kwargs)
        torch._dynamo.graph_break()
        return self.loss_of(out, labels)


def _token_loss(out: Any, labels: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.flatten(0, -2).float(), labels.flatten())


def _causal_loss(out: Any, labels: Tensor) -> Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, -2).float(), labels[:, 1:].flatten())


def _class_loss(out: Any, labels: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.float(), labels)


def _hf(build: Callable[[], Any], *, checkpointing: bool) -> Any:
    torch.manual_seed(0)
    model = build()
    model.config._attn_implementation = "sdpa"
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def hf_gpt2(*, checkpointing: bool = False, split: bool = False) -> Example:
    import transformers

    cfg = transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ,
                                  vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    model = _hf(lambda: transformers.GPT2LMHeadModel(cfg), checkpointing=checkpointing)
    model.loss_type = "ForCausalLM"
    idx = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return Wrapped(model, ("input_ids",), _causal_loss, split=split), (idx, idx.clone())


def hf_llama(*, checkpointing: bool = False, split: bool = False) -> Example:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=1,
                                   intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ,
                                   vocab_size=VOCAB, use_cache=False)
    model = _hf(lambda: transformers.LlamaForCausalLM(cfg), checkpointing=checkpointing)
    idx = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return Wrapped(model, ("input_ids",), _causal_loss, split=split), (idx, idx.clone())


def hf_bert(*, checkpointing: bool = False, split: bool = False) -> Example:
    import transformers

    cfg = transformers.BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                                  max_position_embeddings=SEQ, vocab_size=VOCAB,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _hf(lambda: transformers.BertForMaskedLM(cfg), checkpointing=checkpointing)
    idx = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return Wrapped(model, ("input_ids",), _token_loss, split=split), (idx, idx.clone())


def hf_t5(*, checkpointing: bool = False, split: bool = False) -> Example:
    import transformers

    cfg = transformers.T5Config(d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN,
                                num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
                                vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0, use_cache=False)
    model = _hf(lambda: transformers.T5ForConditionalGeneration(cfg), checkpointing=checkpointing)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)
    if split:  # without labels T5 needs the decoder's inputs: the labels shifted right
        shifted = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
        return (Wrapped(model, ("input_ids", "decoder_input_ids"), _token_loss, split=True),
                (src, shifted, labels))
    return Wrapped(model, ("input_ids",), _token_loss, split=False), (src, labels)


def hf_vit(*, checkpointing: bool = False, split: bool = False) -> Example:
    import transformers

    cfg = transformers.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                 num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                                 image_size=32, patch_size=8, num_labels=10,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 # set as the first step would: its loss sets the config's
                                 # problem type, and Dynamo then compiles the step again
                                 problem_type="single_label_classification")
    model = _hf(lambda: transformers.ViTForImageClassification(cfg), checkpointing=checkpointing)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH, 3, 32, 32, generator=g)
    labels = torch.randint(10, (BATCH,), generator=g)
    return Wrapped(model, ("pixel_values",), _class_loss, split=split), (images, labels)


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = checkpoint(self.block, x, use_reentrant=False)
        return out


class _ResNetLoss(nn.Module):
    def __init__(self, resnet: nn.Module, *, split: bool) -> None:
        super().__init__()
        self.resnet, self.split = resnet, split

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        r: Any = self.resnet
        x = r.stem(images)
        for block in r.blocks:
            x = block(x)
        logits = r.head(x.mean(dim=(2, 3)))
        if self.split:
            torch._dynamo.graph_break()
        return F.cross_entropy(logits.float(), labels)


def resnet(*, checkpointing: bool = False, split: bool = False) -> Example:
    model, inputs = make_resnet(ResNetConfig(image_size=32, widths=(8, 16, 32), depths=(1, 1, 1),
                                             n_class=10), batch=BATCH * 2, seed=0)
    if checkpointing:
        model.blocks = nn.ModuleList(_Checkpointed(b) for b in model.blocks)  # type: ignore[assignment]
    return _ResNetLoss(model, split=split), inputs


MODELS: dict[str, Callable[..., Example]] = {
    "gpt2": hf_gpt2, "llama": hf_llama, "bert": hf_bert, "t5": hf_t5, "vit": hf_vit,
    "resnet": resnet,
}
