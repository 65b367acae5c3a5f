"""Tests for rematc.memory (peak-memory measurement) and rematc.models (example models)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from rematc.memory import (
    MALLOC_MMAP_THRESHOLD,
    MeasurementSetupError,
    cuda_peak,
    measure_peak,
    profiler_peak,
    rss_peak,
)
from rematc.models import (
    EXAMPLES,
    GPT,
    GPT2_BENCH_BATCH,
    CNNConfig,
    GPTConfig,
    InPlaceNetConfig,
    make_cnn,
    make_gpt,
    make_inplace,
)

MiB = 1 << 20

# RSS high-water mark vs profiler peak on one eager training step: they may differ by
# this fraction of the profiler peak plus this many bytes (small heap allocations,
# page rounding, non-tensor memory). Measured difference is well under 1 MiB.
RSS_REL_TOLERANCE = 0.05
RSS_ABS_TOLERANCE = 2 * MiB

REPO_ROOT = Path(__file__).resolve().parents[1]


def alloc(nbytes: int) -> torch.Tensor:
    """One CPU allocation of exactly ``nbytes`` bytes."""
    return torch.empty(nbytes, dtype=torch.uint8)


# ------------------------------------------------------------------ profiler_peak


def test_profiler_peak_empty_step_is_zero() -> None:
    assert profiler_peak(lambda: None) == 0


def test_profiler_peak_single_allocation() -> None:
    assert profiler_peak(lambda: alloc(12345)) == 12345


def test_profiler_peak_counts_overlap_not_total() -> None:
    def step() -> None:
        a = alloc(1 * MiB)
        b = alloc(2 * MiB)
        del a  # 2 MiB live
        c = alloc(3 * MiB)  # 5 MiB live: the peak
        del b, c
        alloc(4 * MiB)  # 4 MiB alone, below the peak

    assert profiler_peak(step) == 5 * MiB


def test_profiler_peak_ignores_memory_live_before_the_step() -> None:
    held = alloc(8 * MiB)
    assert profiler_peak(lambda: alloc(MiB)) == MiB
    del held


@settings(max_examples=30, deadline=None)
@given(st.lists(st.one_of(st.integers(1, 1 << 16), st.none()), max_size=12))
def test_profiler_peak_matches_simulated_program(program: list[int | None]) -> None:
    """Each entry allocates that many bytes, or (None) frees the oldest live tensor."""
    live: list[int] = []
    expected = 0
    for op in program:
        if op is None:
            if live:
                live.pop(0)
        else:
            live.append(op)
        expected = max(expected, sum(live))

    def step() -> None:
        tensors: list[torch.Tensor] = []
        for op in program:
            if op is None:
                if tensors:
                    tensors.pop(0)
            else:
                tensors.append(alloc(op))

    assert profiler_peak(step) == expected


def test_profiler_peak_leaves_stderr_clean() -> None:
    """The profiler's native start and stop lines (``USDT ... profiler_start``) do not
    reach stderr; what the step itself writes there does."""
    code = ("import sys, torch\nfrom rematc.memory import profiler_peak\n"
            "print(profiler_peak(lambda: (torch.ones(256), print('step', file=sys.stderr))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert int(done.stdout.split()[-1]) == 1024
    assert done.stderr == "step\n"


def test_measure_peak_on_cpu_uses_profiler() -> None:
    assert measure_peak(lambda: alloc(4096), device="cpu") == 4096


@pytest.mark.parametrize(
    ("device", "method"),
    [("cpu", "cuda"), ("cuda", "rss"), ("cpu", "nvml")],
)
def test_measure_peak_rejects_method_device_mismatch(device: str, method: str) -> None:
    with pytest.raises(ValueError, match="measure_peak"):
        measure_peak(lambda: None, device=device, method=method)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- rss_peak

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="rss_peak reads Linux /proc"
)


@linux_only
def test_rss_peak_refuses_without_mmap_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with pytest.raises(MeasurementSetupError, match="MALLOC_MMAP_THRESHOLD_=65536"):
        rss_peak(lambda: None)


@linux_only
def test_rss_peak_warns_without_mmap_threshold_when_not_strict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1000000")  # too large to help
    with pytest.warns(RuntimeWarning, match="MALLOC_MMAP_THRESHOLD_"):
        peak = rss_peak(lambda: None, strict=False)
    assert peak >= 0


def _clear_refs_writable() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


# Runs in a fresh process: glibc reads MALLOC_MMAP_THRESHOLD_ only at start-up. The
# model (2 layers, d 256, T 256, batch 4, math attention) has about 66 MiB of step peak,
# dominated by the B·H·T² attention scores; one step takes well under a second.
_CROSS_CHECK_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from rematc.memory import profiler_peak, rss_peak
    from rematc.models import GPTConfig, make_gpt

    config = GPTConfig(
        n_layer=2, d_model=256, n_head=4, seq_len=256, vocab=2048, attention="math"
    )
    model, inputs = make_gpt(config, batch=4, seed=0)

    def step():
        model(*inputs).backward()

    # Warm up: lazy initialisation, thread pools, and the profiler's own start-up.
    step()
    profiler_peak(step)
    # Same pre-step state for both measurements: no gradients allocated yet.
    model.zero_grad(set_to_none=True)
    by_profiler = profiler_peak(step)
    model.zero_grad(set_to_none=True)
    by_rss = rss_peak(step)
    print("RESULT " + json.dumps({"profiler": by_profiler, "rss": by_rss}))
    """
)


@linux_only
@pytest.mark.slow
def test_profiler_peak_agrees_with_rss_peak() -> None:
    if not _clear_refs_writable():
        pytest.skip("/proc/self/clear_refs is not writable here")
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(MALLOC_MMAP_THRESHOLD)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _CROSS_CHECK_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0].removeprefix("RESULT "))
    by_profiler, by_rss = result["profiler"], result["rss"]

    # The step must be big enough that agreement means something.
    assert by_profiler > 32 * MiB
    tolerance = RSS_REL_TOLERANCE * by_profiler + RSS_ABS_TOLERANCE
    assert abs(by_profiler - by_rss) <= tolerance, (
        f"profiler {by_profiler / MiB:.2f} MiB vs RSS {by_rss / MiB:.2f} MiB, "
        f"tolerance {tolerance / MiB:.2f} MiB"
    )


# ---------------------------------------------------------------------- cuda_peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_counts_overlap() -> None:
    def step() -> None:
        a = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
        del a
        c = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        del b, c

    held = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")  # not counted
    assert cuda_peak(step) == 3 * MiB
    assert measure_peak(step, device="cuda") == 3 * MiB
    del held


# ------------------------------------------------------------------------- models


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_trains_one_step(name: str) -> None:
    model, inputs = EXAMPLES[name]()
    loss = model(*inputs)
    assert loss.dim() == 0
    assert math.isfinite(loss.item())
    loss.backward()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert params
    for param_name, p in params:
        assert p.grad is not None, f"{name}: no gradient for {param_name}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {param_name}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_is_deterministic_and_leaves_global_rng_alone(name: str) -> None:
    rng_before = torch.get_rng_state()
    model_a, inputs_a = EXAMPLES[name](seed=3)
    model_b, inputs_b = EXAMPLES[name](seed=3)
    model_c, _ = EXAMPLES[name](seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before)

    for x, y in zip(inputs_a, inputs_b, strict=True):
        assert torch.equal(x, y)
    state_a, state_b, state_c = (m.state_dict() for m in (model_a, model_b, model_c))
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_batch_size_is_respected(name: str) -> None:
    _, inputs = EXAMPLES[name](batch=3)
    assert all(t.size(0) == 3 for t in inputs)


def _gpt_loss(config: GPTConfig, *, rng_seed: int) -> float:
    model, inputs = make_gpt(config, batch=2, seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng_seed)
        return model(*inputs).item()


def test_gpt_dropout_is_active_in_training() -> None:
    config = GPTConfig.tiny(dropout=0.5)
    assert _gpt_loss(config, rng_seed=1) == _gpt_loss(config, rng_seed=1)
    assert _gpt_loss(config, rng_seed=1) != _gpt_loss(config, rng_seed=2)


def test_gpt_without_dropout_ignores_rng() -> None:
    config = GPTConfig.tiny()
    assert _gpt_loss(config, rng_seed=1) == _gpt_loss(config, rng_seed=2)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_gpt_math_attention_matches_sdpa(dropout: float) -> None:
    """Dropout sits outside attention, so the two variants draw the same masks."""
    sdpa = _gpt_loss(GPTConfig.tiny(attention="sdpa", dropout=dropout), rng_seed=7)
    math_ = _gpt_loss(GPTConfig.tiny(attention="math", dropout=dropout), rng_seed=7)
    assert sdpa == pytest.approx(math_, rel=1e-5)


def test_gpt_lm_head_is_tied_to_token_embedding() -> None:
    model, inputs = make_gpt(GPTConfig.tiny(), batch=2, seed=0)
    assert isinstance(model, GPT)
    names = [n for n, _ in model.named_parameters()]
    assert not any("head" in n for n in names)
    model(*inputs).backward()
    # The embedding gradient has rows for every vocabulary entry (from the LM head),
    # not only for the tokens that occur in the input.
    assert model.wte.weight.grad is not None
    assert (model.wte.weight.grad.abs().sum(dim=1) > 0).all()


def test_gpt_config_rejects_bad_head_count() -> None:
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig.tiny(n_head=3)


def test_gpt_rejects_sequence_longer_than_config() -> None:
    model, (idx, targets) = make_gpt(GPTConfig.tiny(), batch=1, seed=0)
    too_long = torch.cat([idx, idx], dim=1)
    with pytest.raises(ValueError, match="seq_len=16"):
        model(too_long, torch.cat([targets, targets], dim=1))


def test_gpt2_bench_config() -> None:
    config = GPTConfig.gpt2_bench()
    assert (config.n_layer, config.d_model, config.n_head) == (6, 512, 8)
    assert (config.seq_len, config.vocab, GPT2_BENCH_BATCH) == (512, 8192, 8)
    model, inputs = make_gpt(config, batch=1, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 23_371_776
    assert inputs[0].shape == (1, 512)


def test_cnn_step_updates_batchnorm_buffers() -> None:
    model, inputs = make_cnn(CNNConfig(), batch=4, seed=0)
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert bn.running_mean is not None and bn.num_batches_tracked is not None
    mean_before = bn.running_mean.clone()
    model(*inputs).backward()
    assert not torch.equal(bn.running_mean, mean_before)
    assert bn.num_batches_tracked.item() == 1


class _RecordCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.names.add(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def test_inplace_net_mutates_intermediates_not_parameters() -> None:
    model, inputs = make_inplace(InPlaceNetConfig(), batch=4, seed=0)
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with _RecordCalls() as calls:
        loss = model(*inputs)
    assert {"relu_", "add_", "mul_"} <= calls.names
    loss.backward()  # autograd accepts every mutation
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params_before[n]), n
