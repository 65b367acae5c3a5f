"""End-to-end helpers: build an example, run one training step eagerly and compiled."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import rematc
from bench import models as bench_models
from rematc.backend import _boxed_eager
from rematc.memory import profiler_peak
from rematc.models import (
    CNNConfig,
    GPTConfig,
    InPlaceNetConfig,
    MLPConfig,
    make_cnn,
    make_gpt,
    make_inplace,
    make_mlp,
)
from rematc.options import Options
from rematc.partition import RematPartitioner
from solvers import InfeasibleBudgetError
from solvers.budget import Budget

# Small but not trivial: activations dominate the step, so budgets have room to bite.
MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp": lambda: make_mlp(MLPConfig(), batch=64, seed=0),
    "gpt": lambda: make_gpt(GPTConfig.tiny(dropout=0.1), batch=4, seed=0),
    "cnn": lambda: make_cnn(CNNConfig(), batch=8, seed=0),
    "inplace": lambda: make_inplace(InPlaceNetConfig(), batch=512, seed=0),
    # transformers' GPT-2 and Llama at toy sizes (random weights, no download).
    "hf_gpt2": lambda: bench_models.make("hf_gpt2", small=True),
    "hf_llama": lambda: bench_models.make("hf_llama", small=True),
}


@dataclass
class StepResult:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def run_step(model: nn.Module, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...],
             *, seed: int = 1234) -> StepResult:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = fn(*inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return StepResult(loss.detach(), grads, buffers)


def eager_and_compiled(name: str, *, budget: object, compiler: str,
                       **options: Any) -> tuple[StepResult, StepResult, rematc.PartitionRecord]:
    """One step of the eager model and one of a fresh copy compiled by rematc (with
    ``options`` besides the budget and compiler)."""
    model, inputs = MODELS[name]()
    reference = run_step(model, model, inputs)
    model, inputs = MODELS[name]()
    compiled = rematc.compile(model, budget=budget, compiler=compiler, **options)
    before = len(rematc.records())
    result = run_step(model, compiled, inputs)
    assert len(rematc.records()) > before, "the rematc partitioner did not run"
    return reference, result, rematc.records()[-1]


def smallest_feasible_budget(name: str, *, compiler: str, **options: Any) -> int:
    """Ask for an impossible budget; the error says the smallest feasible one (found with
    ``options``, a time limit among them)."""
    model, inputs = MODELS[name]()
    compiled = rematc.compile(model, budget=Budget(nbytes=1), compiler=compiler, **options)
    try:
        compiled(*inputs).backward()
    except Exception as e:
        err = infeasible_cause(e)
        assert err is not None, f"expected an InfeasibleBudgetError, got {e!r}"
        assert err.min_feasible is not None
        return err.min_feasible
    raise AssertionError("a 1-byte budget was accepted")


def infeasible_cause(e: BaseException | None) -> InfeasibleBudgetError | None:
    """The InfeasibleBudgetError inside Dynamo's BackendCompilerFailed wrapper."""
    while e is not None:
        if isinstance(e, InfeasibleBudgetError):
            return e
        e = getattr(e, "inner_exception", None) or e.__cause__
    return None


def assert_same_step(reference: StepResult, result: StepResult, *, rtol: float, atol: float) -> None:
    torch.testing.assert_close(result.loss, reference.loss, rtol=rtol, atol=atol)
    assert result.grads.keys() == reference.grads.keys()
    for key, expected in reference.grads.items():
        torch.testing.assert_close(result.grads[key], expected, rtol=rtol, atol=atol,
                                   msg=lambda m, k=key: f"gradient of {k}: {m}")
    for key, expected in reference.buffers.items():
        torch.testing.assert_close(result.buffers[key], expected, rtol=rtol, atol=atol,
                                   msg=lambda m, k=key: f"buffer {k}: {m}")


class Spy(RematPartitioner):
    """The partitioner, keeping the graphs it emits."""

    def __init__(self, options: Options) -> None:
        super().__init__(options)
        self.graphs: list[tuple[fx.GraphModule, fx.GraphModule]] = []

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        fw, bw = super().__call__(gm, joint_inputs, **kw)
        self.graphs.append((fw, bw))
        return fw, bw


def spy_step(name: str, **options: Any) -> tuple[StepResult, Spy]:
    """One step of a fresh ``MODELS[name]`` compiled with rematc's partitioner on the eager
    route, keeping the emitted graphs."""
    spy = Spy(Options.from_mapping({"compiler": "eager", **options}))
    backend = aot_autograd(fw_compiler=_boxed_eager, bw_compiler=_boxed_eager, partition_fn=spy,
                           keep_inference_input_mutations=True)  # as rematc's eager route
    model, inputs = MODELS[name]()
    return run_step(model, torch.compile(model, backend=backend), inputs), spy


REPO_ROOT = Path(__file__).resolve().parent.parent


def run_bench(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m bench.<module> <args>`` from the repository, with it on ``PYTHONPATH``
    (as ``bench.run`` starts its workers); fails the test on a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", f"bench.{module}", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def tiny_llama(layers: int, *, seed: int = 0, vocab: int = 128) -> nn.Module:
    """transformers' ``LlamaForCausalLM`` at toy sizes (hidden 64, 4 heads, 2 key/value
    heads, vocabulary ``vocab``, no cache), random weights from ``seed``; callers skip
    without transformers."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=layers, vocab_size=vocab,
                                      max_position_embeddings=64, use_cache=False)
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def stated_budgets_hold(make: Callable[[], nn.Module], inputs: Sequence[torch.Tensor],
                         seeds: Sequence[torch.Tensor]) -> None:
    """Asks a byte budget under the step's least on the eager route, then each budget
    rematc states, until one compiles: its step's measured peak (the gradients ``seeds``
    sent back from the outputs) is within it. Four figures at most."""

    def measured(budget: int) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make()
        compiled = rematc.compile(model, budget=budget, compiler="eager", cache_dir=None)
        torch.autograd.backward(compiled(*inputs), seeds)  # compiles, or states a budget
        model.zero_grad(set_to_none=True)
        for t in inputs:
            t.grad = None
        return profiler_peak(lambda: torch.autograd.backward(compiled(*inputs), seeds))

    asked = 1024
    for _ in range(4):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                peak = measured(asked)
        except Exception as e:
            err = infeasible_cause(e)
            assert err is not None and err.min_feasible is not None and err.min_feasible > asked, repr(e)
            asked = err.min_feasible
            continue
        assert peak <= asked, f"measured {peak} B at the stated budget of {asked} B"
        return
    pytest.fail(f"no stated budget compiled after four figures (last {asked} B)")
