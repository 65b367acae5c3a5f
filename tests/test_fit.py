"""rematc fit: the sweep on meta models and transformers configs, its recommendation,
the command line and its bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rematc.cli import main
from rematc.fit import (
    STRATEGIES,
    FitError,
    causal_lm,
    count,
    describe,
    fit,
    load_config,
    load_fit_factory,
)
from rematc.llama import llama_tiny
from rematc.wholestep import StepSetup
from solvers import Problem, SolverConfig

pytestmark = pytest.mark.slow

GPU = StepSetup(optimizer="adamw", precision="bf16-mixed", device_type="cuda", reserve=0.05)
QUICK = SolverConfig(time_limit=10)

TINY_LLAMA_CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}


def test_a_sweep_plans_every_shape_three_ways_and_recommends_the_fastest_that_fits() -> None:
    report = fit(llama_tiny, device="h100", memory=1_150_000, setup=GPU, batches=(1, 4),
                 seqs=(32,), config=QUICK, name="tiny")
    assert [(s.batch, s.seq) for s in report.shapes] == [(1, 32), (4, 32)]
    for shape in report.shapes:
        assert tuple(c.strategy for c in shape.candidates) == STRATEGIES
        none, blocks, ours = shape.candidates
        assert none.breakdown and blocks.breakdown and ours.breakdown
        # Checkpointing holds less than saving everything and costs time.
        assert blocks.breakdown.activations < none.breakdown.activations
        assert blocks.added_time > 0 == none.added_time
        for c in shape.candidates:
            assert c.fits == (c.breakdown is not None and c.breakdown.peak <= report.memory)
    big = report.shapes[1]
    # At batch 4 saving everything is over the memory and rematc's plan is not.
    assert not big.candidates[0].fits and big.candidates[2].fits
    best = report.best()
    assert best is not None
    fitting = [c.tokens_per_s for s in report.shapes for c in s.candidates if c.fits]
    assert best[1].tokens_per_s == max(fitting)
    data = report.to_json()
    json.dumps(data)
    assert data["best"]["tokens_per_s"] == best[1].tokens_per_s


def test_states_that_do_not_fit_are_said_without_tracing() -> None:
    report = fit(llama_tiny, device="h100", memory=100_000, setup=GPU, batches=(2,), seqs=(16,))
    [shape] = report.shapes
    assert shape.trace_s == 0 and report.best() is None
    assert all("model states and workspaces alone need" in c.status for c in shape.candidates)


def test_fsdp_adds_the_units_in_flight_and_divides_the_states() -> None:
    one = fit(llama_tiny, device="h100", memory=10**9, setup=GPU, batches=(2,), seqs=(16,))
    four = fit(llama_tiny, device="h100", memory=10**9,
               setup=StepSetup(optimizer="adamw", precision="bf16-mixed", device_type="cuda",
                               reserve=0.05, fsdp=4), batches=(2,), seqs=(16,))
    a, b = one.shapes[0].candidates[0].breakdown, four.shapes[0].candidates[0].breakdown
    assert a and b
    assert b.parameters < a.parameters / 3 and b.fsdp_buffers > 0 == a.fsdp_buffers


def test_a_transformers_config_is_built_on_meta_with_fused_causal_attention(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA_CONFIG))
    config = load_config(str(path))
    model, (tokens,) = causal_lm(config, batch=2, seq=64)
    assert tokens.shape == (2, 64)
    assert all(p.device.type == "meta" for p in model.parameters())
    report = fit(config, device="h100", memory=10**9, setup=GPU, batches=(2,), seqs=(64,))
    [shape] = report.shapes
    none = shape.candidates[0].breakdown
    assert none is not None
    # No T x T score matrix: flash attention keeps [B, H, T] statistics only.
    scores = 2 * 4 * 64 * 64 * 2
    assert none.activations < 40 * scores
    assert shape.values > 100


def test_a_gpt2_config_states_its_shape_in_its_own_names(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                "vocab_size": 64}))
    assert load_config(str(path)).hidden_size == 64


def test_parameter_counts_are_in_sensible_units() -> None:
    """A small model's count was "0.00 B parameters"."""
    assert [count(n) for n in (830, 106_752, 1_234_567, 6_738_415_616)] == ["830", "106.8 K", "1.2 M", "6.74 B"]
    report = fit(llama_tiny, device="h100", memory=100_000, setup=GPU, batches=(2,), seqs=(16,), name="tiny")
    assert f"{count(report.parameters)} parameters" in describe(report)[0]
    assert report.parameters < 10**6 and "0.00 B" not in describe(report)[0]


def test_memory_must_be_positive() -> None:
    with pytest.raises(FitError, match="memory 0 B per rank is not positive"):
        fit(llama_tiny, device="h100", memory=0, batches=(2,), seqs=(16,))
    with pytest.raises(FitError, match="the cpu profile states no device memory; give the memory per rank"):
        fit(llama_tiny, device="cpu", batches=(2,), seqs=(16,))


def test_a_factory_must_take_batch_and_seq() -> None:
    with pytest.raises(FitError, match="must take the keyword arguments batch and seq"):
        load_fit_factory("rematc.llama:make_llama")
    build = load_fit_factory("rematc.llama:llama_tiny")
    model, inputs = build(batch=3, seq=8)
    assert inputs[0].shape == (3, 8) and inputs[0].device.type == "meta"
    assert isinstance(model, torch.nn.Module)


# ---- the command line ---------------------------------------------------------------


def test_fit_on_the_command_line_prints_tables_json_and_a_plot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["fit", "rematc.llama:llama_tiny", "--device", "h100", "--memory", "80MiB",
               "--batch", "1,2", "--seq", "16", "--plot", str(tmp_path), "--time-limit", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "fastest that fits: batch" in out and "per-block checkpointing" in out
    assert (tmp_path / "llama_tiny-fit.png").stat().st_size > 10_000
    rc = main(["fit", "rematc.llama:llama_tiny", "--memory", "80MiB", "--batch", "2", "--seq", "16",
               "--json", "--optimizer", "sgd", "--precision", "fp32"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["setup"]["optimizer"] == "sgd" and data["setup"]["reserve"] == 0.05
    assert {c["strategy"] for c in data["shapes"][0]["candidates"]} == set(STRATEGIES)


def test_fit_exits_1_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["fit", "rematc.llama:llama_tiny", "--memory", "10KiB", "--batch", "1", "--seq", "16"])
    assert rc == 1
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--optimizer", "lion"], "invalid choice: 'lion'"),
    (["--memory", "80 gigs"], "has unknown unit 'gigs'"),
    (["--memory", "50%"], "is not a size"),
    # said "the h100 profile states no device memory"
    (["--memory", "0"], "--memory '0' is zero: give bytes per rank"),
    (["--memory", "-80GiB"], "--memory '-80GiB' is negative"),
    (["--memory", "80"], "--memory '80' is 80 B, under 1 KiB: did you mean '80GiB'?"),
    (["--batch", "1,x"], "whole numbers"),
])
def test_bad_options_get_one_line_and_exit_2(args: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "rematc.llama:llama_tiny", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _config(**changes: object) -> str:
    return json.dumps({k: v for k, v in {**TINY_LLAMA_CONFIG, **changes}.items() if v is not None})


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not JSON"),
    ('{"hidden_size": 8}', "needs the field 'model_type'"),
    ('{"model_type": "no-such-model"}', "config.json"),
    # each was a traceback and exit 1 ("nothing fits"), or accepted
    (_config(hidden_size="big"), "'hidden_size' must be a whole number from 1, got 'big'"),
    (_config(num_attention_heads=5), "'num_attention_heads' 5 does not divide 'hidden_size' 64"),
    (_config(num_key_value_heads=3), "'num_key_value_heads' must be a whole number from 1 that divides"),
    (_config(vocab_size=-3), "'vocab_size' must be a whole number from 1, got -3"),
    (_config(num_hidden_layers=0), "'num_hidden_layers' must be a whole number from 1, got 0"),
    (_config(num_hidden_layers=-2), "'num_hidden_layers' must be a whole number from 1, got -2"),
    (_config(num_hidden_layers=2.5), "'num_hidden_layers' must be a whole number from 1, got 2.5"),
    # silently transformers' defaults: Llama-2-7B's hidden size and MLP
    (_config(hidden_size=None), "the field 'hidden_size' is missing: rematc fit needs the model's shape "
                                "stated, not transformers' default (4096)"),
    (_config(intermediate_size=None), "the field 'intermediate_size' is missing"),
    (json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "vocab_size": 64}),
     "the field 'n_embd' is missing"),
])
def test_a_config_that_does_not_parse_gets_one_line_and_exit_2(
        tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    assert main(["fit", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_step_traced_with_a_symbolic_batch_is_each_batchs_own_trace() -> None:
    """One trace serves every batch of a sweep: read again at batch b, the captured graph
    gives the problem a trace at b gives, value for value."""
    from rematc.llama import make_llama
    from rematc.trace import TraceError, trace

    model, inputs = make_llama("tiny", batch=2, n_layer=2)
    for x in inputs:
        torch._dynamo.mark_dynamic(x, 0)
    traced = trace(model, inputs, device="h100", dtype="bfloat16", target="eager")
    assert len(traced.batch_symbols()) == 2  # tokens and targets
    for batch in (1, 3, 8):
        ref_model, ref_inputs = make_llama("tiny", batch=batch, n_layer=2)
        ref = trace(ref_model, ref_inputs, device="h100", dtype="bfloat16", target="eager").problem
        resized = traced.at_batch(batch)
        # Names differ: the symbolic trace numbers its inputs after the size symbols.
        assert [(n.op, n.size, n.time, n.flops, n.deps, n.offloadable) for n in resized.nodes] == \
               [(n.op, n.size, n.time, n.flops, n.deps, n.offloadable) for n in ref.nodes]
    fixed = trace(*make_llama("tiny", batch=2, n_layer=2), device="h100", target="eager")
    with pytest.raises(TraceError, match="traced at a fixed batch size"):
        fixed.at_batch(4)


def test_a_sweep_of_sequences_at_one_batch_reads_each_from_one_trace_at_that_batch() -> None:
    """Batch 1 with three sequence lengths: one trace with the sequence symbolic, at batch 1
    (not at a batch of 2 that a symbolic batch would need); each shape as traced alone."""
    swept = fit(llama_tiny, device="h100", memory=10**9, setup=GPU, batches=(1,), seqs=(16, 24, 32))
    for shape in swept.shapes:
        alone = fit(llama_tiny, device="h100", memory=10**9, setup=GPU, batches=(1,),
                    seqs=(shape.seq,)).shapes[0]
        assert (shape.batch, shape.values) == (1, alone.values)
        for ours, theirs in zip(shape.candidates[:2], alone.candidates[:2], strict=True):
            assert ours.breakdown is not None and theirs.breakdown is not None
            assert ours.breakdown.activations == theirs.breakdown.activations
            # The sweep's model is built at the longest sequence: its rotary table is longer,
            # and the ops that slice it move a few more bytes by the roofline.
            assert ours.added_time == pytest.approx(theirs.added_time, rel=1e-4)


def test_a_step_traced_with_symbolic_batch_and_sequence_is_each_shapes_own_trace() -> None:
    """One trace serves a sweep over batches and sequence lengths (rematc fit traces at the
    longest): read again at (b, s), the captured graph gives the problem a trace at (b, s)
    gives. Beyond the longest, the rotary table's slice took another branch: refused."""
    from rematc.llama import LLAMA_SHAPES, Llama
    from rematc.trace import TraceError, trace

    shape = dataclasses.replace(LLAMA_SHAPES["tiny"], n_layer=2, seq_len=64)

    def step(batch: int, seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
        with torch.device("meta"):  # the model's rotary table is 64 long in each
            return Llama(shape), (torch.zeros(batch, seq, dtype=torch.long),
                                  torch.zeros(batch, seq, dtype=torch.long))

    def key(problem: Problem) -> list[tuple[Any, ...]]:
        return [(n.op, n.size, n.time, n.flops, n.deps, n.offloadable) for n in problem.nodes]

    model, inputs = step(2, 64)
    for x in inputs:
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(x, 1)
    traced = trace(model, inputs, device="h100", dtype="bfloat16", target="eager")
    assert traced.input_symbols(1)
    for batch, seq in ((1, 16), (3, 40), (8, 64)):
        ref = trace(*step(batch, seq), device="h100", dtype="bfloat16", target="eager").problem
        assert key(traced.at_sizes({0: batch, 1: seq})) == key(ref)
    with pytest.raises(TraceError, match="took a branch on its sizes"):
        traced.at_sizes({0: 2, 1: 65})
