"""Offline tracing (``rematc export`` and the subcommands that take a model): every model
the backend compiles traces to its whole step, or fails in one line that says why."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import pytest
import torch
from torch import nn

from rematc.trace import TraceError, trace
from solvers import check
from solvers.baselines import save_all


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.relu(self.up(x)))).square().mean()


class Broken(nn.Module):
    """Four layers with a graph break after the second."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1:
                torch._dynamo.graph_break()
        return x.square().mean()


@pytest.mark.parametrize("target", ["inductor", "eager"])
def test_a_model_with_dropout_traces_for_both_targets(target: str) -> None:
    """Inductor's seed-fusing joint pass enters its virtualized fake mode, which the trace
    now sets as compile_fx does (a TypeError on a NullHandler before)."""
    torch.manual_seed(0)
    traced = trace(Dropped(), (torch.randn(8, 16),), target=target)
    assert traced.problem.candidates
    assert check(traced.problem, save_all(traced.problem).plan).peak > 0  # type: ignore[arg-type]


def test_a_graph_break_is_refused_in_one_line_naming_it() -> None:
    """A break used to plan the first graph only (half the model) and exit 0."""
    torch.manual_seed(0)
    with pytest.raises(TraceError) as info:
        trace(Broken(), (torch.randn(8, 16),), target="eager")
    message = str(info.value)
    assert "\n" not in message
    assert "breaks into several graphs" in message and "graph_break" in message
    assert "test_trace.py" in message  # where: the user's line


class Wrapped(nn.Module):
    """:class:`Broken` called from another module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Broken()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.inner(x)


def test_a_graph_break_in_a_submodule_is_named_at_its_own_line() -> None:
    """The line that breaks, not the outer forward's line calling the module that does
    (the outermost frame of Dynamo's user stack was named; bench/fuzz.py's export check
    found it, its models called from the loss it traces)."""
    lines, first = inspect.getsourcelines(Broken.forward)
    at = first + next(k for k, line in enumerate(lines) if "graph_break()" in line)
    torch.manual_seed(0)
    with pytest.raises(TraceError) as info:
        trace(Wrapped(), (torch.randn(8, 16),), target="eager")
    assert f"test_trace.py\", line {at}, in forward" in str(info.value)


def test_a_factory_returning_the_wrong_tuple_is_told_what_it_returned() -> None:
    """It said "got tuple" for a tuple of three, which reads as the right type."""
    from rematc.trace import TraceError, as_example

    with pytest.raises(TraceError, match=r"must return \(model, example_inputs\), got a tuple of 3 "
                                         r"\(Linear, tuple, int\)$"):
        as_example("m:f", (torch.nn.Linear(2, 2), (torch.ones(1, 2),), 3))


def test_a_transformers_model_on_meta_traces_its_backward() -> None:
    """On meta tensors aten::nll_loss has no autograd kernel: transformers' GPT-2, whose
    loss is F.cross_entropy, traced with no backward and no decision, silently. The loss
    written out holds what the library's does (the same peak on the CPU), and on meta
    the step is within 5% of the CPU's (0.7% under it: flash attention on meta)."""
    from rematc.onmeta import losses_written_out
    from tests.realmodels import hf_gpt2

    model, inputs = hf_gpt2()
    on_cpu = trace(model, inputs, device="h100", target="eager").problem
    with losses_written_out():
        written = trace(model, inputs, device="h100", target="eager").problem
    model = model.to("meta")
    on_meta = trace(model, tuple(x.to("meta") for x in inputs), device="h100", target="eager").problem
    cpu, written_peak, meta = (save_all(p).report.peak for p in (on_cpu, written, on_meta))  # type: ignore[union-attr]
    assert written_peak == cpu
    assert len(on_meta.candidates) > 0.5 * len(on_cpu.candidates) > 0
    assert abs(meta - cpu) <= 0.05 * cpu
    assert torch.nn.functional.cross_entropy.__module__ == "torch.nn.functional"


def test_a_transformers_causal_lm_on_meta_traces_flash_attention() -> None:
    """Given no attention mask, transformers checks the position ids for packed sequences;
    on meta it cannot read them and built an explicit causal mask, with which attention
    traced as softmax keeping its scores (a TinyLlama-shaped step peaked at 53.2 GB under
    checkpointing, 4.76 GB with flash attention). On meta the check answers "none packed",
    and is restored after."""
    import transformers.masking_utils as masking

    from tests.realmodels import hf_llama

    check = masking.find_packed_sequence_indices
    model, inputs = hf_llama()
    model = model.to("meta")
    problem = trace(model, tuple(x.to("meta") for x in inputs), device="h100", target="eager").problem
    ops = {n.op for n in problem.nodes}
    assert any("flash_attention" in op and "backward" in op for op in ops), sorted(ops)
    assert not {"aten._softmax", "aten._safe_softmax"} & ops, "attention traced as explicit softmax"
    assert masking.find_packed_sequence_indices is check


class MaskedAttention(nn.Module):
    """Attention under an explicit boolean causal mask, as transformers' models run it
    where they build one (under Dynamo on torch before 2.14)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.register_buffer("mask", torch.ones(64, 64, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).sum()


def test_masked_attention_on_meta_traces_a_fused_kernel() -> None:
    """A GPU's memory-efficient kernel takes a mask and keeps no scores; on meta, masked
    attention traced as softmax holding two score matrices (two 512 MiB ones per block of
    a 32-head Llama at 4 x 1,024 tokens, which made a regional survey refuse HF
    checkpointing's peak as infeasible). It traces as the fused op, the mask made
    additive as SDPA makes it."""
    with torch.device("meta"):
        model, inputs = MaskedAttention(), (torch.zeros(2, 64, 32),)
    problem = trace(model, inputs, device="h100", target="eager").problem
    ops = {n.op for n in problem.nodes}
    assert any("flash_attention" in op and "backward" in op for op in ops), sorted(ops)
    assert not {"aten._softmax", "aten._safe_softmax", "aten.bmm"} & ops, "attention traced as explicit softmax"
    scores = 2 * 4 * 64 * 64 * 4  # bytes of one score matrix of the batch's heads
    assert max(n.size for n in problem.nodes) < scores


class Weighted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.register_buffer("weight", torch.ones(4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(x), labels, weight=self.weight)


def test_a_step_traced_without_its_backward_is_refused_in_one_line() -> None:
    """A class-weighted loss keeps the library's op, which on meta has no backward: the
    trace says so instead of returning a problem with no decision."""
    with torch.device("meta"):
        model, inputs = Weighted(), (torch.zeros(8, 16), torch.zeros(8, dtype=torch.long))
    with pytest.raises(TraceError, match=r"captured a step with no backward.*on meta tensors.*nll_loss"):
        trace(model, inputs, device="h100", target="eager")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_written_out_losses_equal_the_library_s(reduction: str) -> None:
    from rematc.onmeta import losses_written_out

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)  # classes on dim 1, as F.cross_entropy takes them
    target = torch.randint(5, (3, 7), generator=g)
    target[0, :3] = -100
    results = []
    for written in (False, True):
        x = logits.clone().requires_grad_()
        with losses_written_out() if written else contextlib.nullcontext():
            ce = torch.nn.functional.cross_entropy(x, target, reduction=reduction)
            nll = torch.nn.functional.nll_loss(x.log_softmax(1), target, reduction=reduction, ignore_index=-100)
        (ce.sum() + nll.sum()).backward()
        results.append((ce.detach(), nll.detach(), x.grad))
    for plain, written_out in zip(*results, strict=True):
        torch.testing.assert_close(written_out, plain)


def test_a_broadcast_attention_bias_is_saved_for_the_efficient_attention_backward() -> None:
    """Rule 16 on fake CUDA tensors (no GPU needed). Inductor copies the bias of the
    memory-efficient attention's backward at its broadcast shape where the backward
    computes it (a recomputed mask: 512 MiB per block of a Llama on an H200, 9.7% over
    the budget, unplanned for), not where it reads it saved and broadcast in place. So
    under Inductor the mask is save-only; a bias with unaligned rows is copied whatever
    the plan, and that copy counts while the backward runs; on the CPU, nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from rematc.annotate import annotate, workspaces
    from rematc.capture import broadcast_bias_sources
    from rematc.devices import profile_for

    efficient = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default

    def step(q: torch.Tensor, mask: torch.Tensor) -> Any:
        bias = torch.zeros_like(mask, dtype=q.dtype).masked_fill(mask.logical_not(), float("-inf"))
        bias = bias.expand(q.shape[0], q.shape[1], *mask.shape[-2:])
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, bias, True)
        return efficient(out, q, q, q, bias, out, lse, seed, offset, 0.0, [True, True, True, False])

    for device, seq, saved, copied in [("cuda", 64, True, 0), ("cuda", 60, True, 2 * 8 * 60 * 60 * 4),
                                       ("cpu", 64, False, 0)]:
        with FakeTensorMode():
            q = torch.empty(2, 8, seq, 32, device=device)
            gm = make_fx(step)(q, torch.empty(2, 1, seq, seq, dtype=torch.bool, device=device))
        backward = next(iter(gm.graph.find_nodes(op="call_function", target=efficient)))
        costs = annotate(gm, profile_for("h100"), fuses=True)
        forward = frozenset(n for n in gm.graph.nodes if n is not backward and n.op != "output")
        sources = broadcast_bias_sources(list(gm.graph.nodes), forward - {backward}, costs)
        assert {n.target for n in sources} == ({torch.ops.aten.masked_fill.Scalar} if saved else set()), sources
        assert workspaces(list(gm.graph.nodes), inductor=True).get(backward, 0) == copied
        assert workspaces(list(gm.graph.nodes)).get(backward, 0) == 0  # ATen's kernel reads the broadcast
