"""Regional compilation (``rematc.compile(model, regions=True)``): the repeated blocks
compile once, on their own, and the whole step is planned under one budget: its measured
peak within it, loss and gradients equal to eager's."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from torch import nn

import rematc
import rematc.partition
import rematc.regions
from rematc.memory import profiler_peak
from rematc.regions import repeated_blocks
from tests.helpers import tiny_llama

pytest.importorskip("transformers")

LAYERS = 4
# The measured step may exceed the budget by the bytes of what runs outside every graph:
# the embedding's lookup in the skipped frame around the blocks (batch x seq x hidden x 4 B)
# and the loss's implicit gradient.
OUTSIDE = 2 * 32 * 64 * 4 + 16
# Under Inductor, the fraction the measured peak may exceed the budget by: kernels'
# workspaces the model does not see (as tests/test_measured_peak.py).
PEAK_TOLERANCE = 0.05


def llama() -> nn.Module:
    return tiny_llama(LAYERS)


IDS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))


def step(model: nn.Module) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss


def test_the_repeated_blocks_are_the_largest_list_of_one_class() -> None:
    model = llama()
    name, blocks = repeated_blocks(model)  # type: ignore[misc]
    assert name == "model.layers" and len(blocks) == LAYERS
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) is None
    mixed = nn.Module()
    mixed.parts = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
    assert repeated_blocks(mixed) is None


def test_a_model_without_repeated_blocks_is_refused_at_compile() -> None:
    with pytest.raises(ValueError, match=r"no nn\.ModuleList of two or more blocks"):
        rematc.compile(nn.Linear(4, 4), budget="1MiB", regions=True)


def test_regions_through_torch_compile_options_say_how() -> None:
    with pytest.raises(ValueError, match=r"rematc.compile\(model, regions=True\)"):
        rematc.Options.from_mapping({"regions": True})


def test_regions_with_fullgraph_is_refused() -> None:
    with pytest.raises(ValueError, match="fullgraph=False"):
        rematc.compile(llama(), budget="1MiB", regions=True, fullgraph=True)


@functools.cache
def _unconstrained_step() -> int:
    """The whole step's predicted peak when every graph saves everything, regionally (once
    per process: eight tests take their budgets from it)."""
    model = llama()
    compiled = rematc.compile(model, budget="1GiB", compiler="eager", cache_dir=None, regions=True)
    step(compiled)
    return max(r.held_before + r.predicted_peak + (r.calls - 1) * r.holds for r in rematc.records())


@pytest.mark.parametrize("share", [1.0, 0.8, 0.6])
def test_regional_step_holds_the_budget_with_eagers_gradients(share: float) -> None:
    """The block compiles to one graph planned for every layer's call; at a binding budget
    the step's measured peak is within it and loss and gradients are eager's. At 0.6 of
    the unconstrained step, no plan a search under a peak finds fits four calls, and one
    between the block checkpointed whole and saving everything does (a rung of
    ``solvers.baselines.holding_ladder``)."""
    budget = int(share * _unconstrained_step())
    model, compiled, blocks = _regional_step_as_eagers(budget)
    # Compiled once for all the layers, or once per plan of a mix, each layer run by one.
    assert (len(blocks) == 1 and blocks[0].blocks == ()) or _each_block_once(blocks)
    assert all(r.calls == 1 for r in rematc.records() if r not in blocks)
    if share < 1:
        assert all(r.solver != "save_all" for r in blocks)
    if share < 0.7:
        assert [r.solver for r in blocks] == ["holding-ladder"]
    model.zero_grad(set_to_none=True)
    peak = profiler_peak(lambda: step(compiled))
    assert peak <= budget + OUTSIDE
    # the step's peak every plan counts on (its calls, the graphs around it) is not below
    # the measured one, and within the budget
    predicted = max(r.step_need for r in rematc.records())
    assert peak <= predicted + OUTSIDE and predicted <= budget, (peak, predicted, budget)
    # the step's predicted peak (each graph's plan as it runs, without the room it kept for
    # the later ones) is not below the measured one either
    own = max(r.own_need for r in rematc.records())
    assert peak <= own + OUTSIDE and own <= predicted, (peak, own, predicted)


def _regional_step_as_eagers(budget: int) -> tuple[nn.Module, Any, list[rematc.PartitionRecord]]:
    """The tests' Llama compiled regionally at ``budget`` on the eager route, one step run
    with eager's loss and gradients checked; the model, its compiled form and the records
    of the block's graph."""
    torch._dynamo.reset()
    rematc.clear_records()
    reference, model = llama(), llama()
    expected = step(reference)
    compiled = rematc.compile(model, budget=budget, compiler="eager", cache_dir=None, regions=True)
    assert step(compiled).item() == pytest.approx(expected.item(), rel=1e-6)
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    return model, compiled, [r for r in rematc.records() if r.calls == LAYERS]


def _each_block_once(records: list[rematc.PartitionRecord]) -> bool:
    return sorted(b for r in records for b in r.blocks) == list(range(LAYERS))


def test_blocks_run_different_plans_where_a_mix_adds_less_time() -> None:
    """Where one plan for every block leaves memory unused, the first blocks (held
    longest) run a plan that holds less and the last ones a faster plan: the block's graph
    is compiled once per plan, each layer runs its own, and loss, gradients and the
    measured peak hold as for one plan."""
    budget = int(0.9 * _unconstrained_step())
    model, compiled, blocks = _regional_step_as_eagers(budget)
    assert len(blocks) >= 2 and all(r.solver == "mix" for r in blocks)
    assert _each_block_once(blocks)
    assert len({tuple(sorted(r.plan.decisions.items())) for r in blocks}) == len(blocks)
    first, last = blocks[0], blocks[-1]  # the first blocks hold least, the last add least time
    assert 0 in first.blocks and first.holds < last.holds and first.added_time > last.added_time
    model.zero_grad(set_to_none=True)
    assert profiler_peak(lambda: step(compiled)) <= budget + OUTSIDE


def test_a_second_regional_compile_takes_its_plans_from_the_cache(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's plan for all its calls (found over several budgets, or the least-peak
    plan as the last resort) goes to the plan cache with the budget it was planned at: a
    second compile of the same step takes every plan from it and runs no search."""
    budget = int(0.8 * _unconstrained_step())
    torch._dynamo.reset()
    rematc.clear_records()
    step(rematc.compile(llama(), budget=budget, compiler="eager", cache_dir=tmp_path, regions=True))
    first = {(r.calls, r.blocks): r for r in rematc.records()}
    assert any(r.calls == LAYERS and not r.cached for r in first.values())

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("a search ran although the step's plans are cached")

    monkeypatch.setattr(rematc.partition, "solve", no_search)
    torch._dynamo.reset()
    rematc.clear_records()
    step(rematc.compile(llama(), budget=budget, compiler="eager", cache_dir=tmp_path, regions=True))
    again = {(r.calls, r.blocks): r for r in rematc.records()}
    assert again.keys() == first.keys()
    for key, record in again.items():
        assert record.plan == first[key].plan and record.step_need == first[key].step_need, key
    assert all(r.cached for r in again.values() if r.calls == LAYERS)


def test_marking_twice_changes_nothing() -> None:
    model = llama()
    rematc.mark_regions(model)
    forwards = [block.forward for block in model.model.layers]
    assert rematc.mark_regions(model) == ("model.layers", LAYERS)
    assert [block.forward for block in model.model.layers] == forwards


def test_a_warm_regional_step_hands_dynamo_no_frame() -> None:
    """Once compiled, a step runs each block's wrapper without Dynamo's callback, which
    ``torch.compiler.disable(recursive=False)`` alone asks again on every call (its cost:
    docs/benchmarks.md)."""
    from torch._dynamo.utils import counters

    compiled = rematc.compile(llama(), regions=True, compiler="eager", cache_dir="off")
    for _ in range(2):
        step(compiled)
    before = counters["frames"]["total"]
    for _ in range(2):
        step(compiled)
    assert counters["frames"]["total"] == before


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("over", [False, True])
def test_regional_step_under_inductor_holds_the_budget(over: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mix of plans for the block: each of its plans is compiled, and nothing else (the
    one plan for every block, compiled first, was a third compile nothing ran). Where the
    code generated for the mix's first plan is ``over`` its room, no other plan of the mix
    is compiled, one plan for every block runs every block, and no plan is compiled twice
    (that one plan was the mix's first: compiled again, a third compile)."""
    if over:
        monkeypatch.setattr(rematc.backend, "_gap", lambda record: 10**9)
    budget = int(0.8 * _unconstrained_step())
    torch._dynamo.reset()
    rematc.clear_records()
    reference, model = llama(), llama()
    step(reference)
    forwards = []
    compile_fx, inner = rematc.backend.inductor_compile_fx()

    def counted(gm: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("is_backward"):
            forwards.append(rematc.backend._compiled_signature(gm))
        return inner(gm, *args, **kwargs)

    monkeypatch.setattr(rematc.backend, "inductor_compile_fx", lambda: (compile_fx, counted))
    mixes = []  # for each compile: whether it is of a plan of the mix
    own = rematc.backend.Backend._compile_inductor

    def compile_inductor(self: Any, gm: Any, example_inputs: Any, partitioner: Any) -> Any:
        mixes.append(partitioner.fixed is not None)
        return own(self, gm, example_inputs, partitioner)

    monkeypatch.setattr(rematc.backend.Backend, "_compile_inductor", compile_inductor)
    compiled = rematc.compile(model, budget=budget, compiler="inductor", cache_dir=None, regions=True)
    step(compiled)
    blocks = [r for r in rematc.records() if r.calls == LAYERS]
    if over:
        assert len(blocks) == 1 and blocks[0].solver != "mix"
        # the mix's first plan only, and the one plan for every block where it is another
        assert sum(mixes) == 1
        assert 1 <= len(forwards) <= 2 and len(set(forwards)) == len(forwards)
    else:
        assert len(blocks) > 1 and _each_block_once(blocks), "no mix of plans"
        assert len(forwards) == len(blocks) == sum(mixes)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
    model.zero_grad(set_to_none=True)
    assert profiler_peak(lambda: step(compiled)) <= (budget + OUTSIDE) * (1 + PEAK_TOLERANCE)


def test_the_smallest_budget_a_regional_step_states_runs_within_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Too tight a budget names the smallest that works for the whole step (the block's
    calls and the gradients of the graphs after each one counted), and that one does. The
    step compiled again at it is not surveyed again."""
    tight = int(0.3 * _unconstrained_step())
    rematc.regions.forget_surveys()  # the unconstrained step's, where it was just compiled
    surveys = count_surveys(monkeypatch)
    torch._dynamo.reset()
    compiled = rematc.compile(llama(), budget=tight, compiler="eager", cache_dir=None, regions=True)
    with pytest.raises(Exception, match="smallest feasible budget is") as info:
        step(compiled)
    stated = int(re.search(r"smallest feasible budget is (\d+) bytes", str(info.value)).group(1))  # type: ignore[union-attr]
    assert stated > tight
    torch._dynamo.reset()
    model = llama()
    compiled = rematc.compile(model, budget=stated, compiler="eager", cache_dir=None, regions=True)
    step(compiled)
    assert len(surveys) == 1
    model.zero_grad(set_to_none=True)
    assert profiler_peak(lambda: step(compiled)) <= stated + OUTSIDE


def count_surveys(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """A list that gets an item each time a step is surveyed from now on."""
    surveys: list[None] = []
    real = rematc.regions.survey

    def counted(*args: Any, **kwargs: Any) -> Any:
        surveys.append(None)
        return real(*args, **kwargs)

    monkeypatch.setattr(rematc.regions, "survey", counted)
    return surveys


def test_what_changes_a_steps_graphs_changes_its_survey_key() -> None:
    """A survey is kept per model, inputs, options and autocast state: a budget changes
    nothing it finds, but autocast, a block's training flag or transformers' gradient
    checkpointing change the graphs it surveys."""
    model = llama()
    options = rematc.Options.from_mapping({"budget": "1MiB"})
    args, kwargs = (), {"input_ids": IDS, "labels": IDS}

    def key(opts: rematc.Options = options) -> str:
        return rematc.regions._survey_key(model, args, kwargs, opts)

    first = key()
    assert key(rematc.Options.from_mapping({"budget": "2MiB"})) == first
    assert key(rematc.Options.from_mapping({"budget": "1MiB", "time_limit": 3})) != first
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key() != first
    model.model.layers[1].eval()
    assert key() != first
    model.train()
    assert key() == first
    model.gradient_checkpointing_enable()
    assert key() != first
    assert key(rematc.Options.from_mapping({"budget": "1MiB"})) == key()


def _block_masks(model: nn.Module) -> list[Any]:
    """The attention masks ``model``'s blocks are called with, as they are called."""
    masks: list[Any] = []
    for block in model.model.layers:
        block.register_forward_pre_hook(lambda m, a, k: masks.append(k.get("attention_mask")), with_kwargs=True)
    return masks


def test_a_regional_step_builds_no_causal_mask_where_eager_builds_none() -> None:
    """Given no attention mask, transformers checks the position ids for packed
    sequences; rematc runs that check eagerly in a regional step, so that the model around
    the blocks leaves causality to SDPA as an eager step does, instead of building an
    explicit mask every block's graph converts and attends with. The check is the
    library's own again after the step."""
    import transformers.masking_utils as masking

    library = masking.find_packed_sequence_indices
    torch._dynamo.reset()
    model = llama()
    eager_masks = _block_masks(model)
    step(model)
    assert eager_masks == [None] * LAYERS
    model = llama()
    masks = _block_masks(model)
    compiled = rematc.compile(model, budget="1GiB", compiler="eager", cache_dir=None, regions=True)
    step(compiled)
    step(compiled)
    assert masks and all(m is None for m in masks)
    assert masking.find_packed_sequence_indices is library


def test_packed_sequences_give_eagers_loss_and_gradients_in_a_regional_step() -> None:
    """Position ids that restart within a row (two sequences packed in one) are read by
    the eagerly run check, and the step attends within each sequence, as eager does."""
    positions = torch.arange(16).repeat(2).expand(2, 32)
    torch._dynamo.reset()
    reference, model = llama(), llama()
    masks = _block_masks(model)
    expected = reference(input_ids=IDS, labels=IDS, position_ids=positions).loss
    expected.backward()
    compiled = rematc.compile(model, budget="1GiB", compiler="eager", cache_dir=None, regions=True)
    got = compiled(input_ids=IDS, labels=IDS, position_ids=positions).loss
    got.backward()
    assert any(m is not None for m in masks)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    for (name, g), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(g.grad, want.grad, msg=name)


def _regional_records(budget: int) -> list[tuple[Any, ...]]:
    """The tests' Llama compiled regionally at ``budget``, one step run: per graph its place,
    plan, what the graphs before it hold and its budget."""
    compiled = rematc.compile(llama(), budget=budget, compiler="eager", cache_dir=None, regions=True)
    step(compiled)
    return [(r.graph.order if r.graph else None, r.solver, r.held_before, r.budget) for r in rematc.records()]


def test_a_model_compiled_before_in_the_process_leaves_the_step_in_order() -> None:
    """Dynamo numbers a frame when it first compiles its code, for whichever model: after a
    model of the same code compiled whole, the regional step's loss head had a lower frame
    number than the graph before its blocks, and the budget share, which took frame numbers
    for the step's order, planned the loss head as the step's first graph (a 32-layer GPT-2
    was then refused at HF checkpointing's peak). The plans are now those of a fresh
    process."""
    budget = int(0.8 * _unconstrained_step())
    torch._dynamo.reset()
    rematc.clear_records()
    fresh = _regional_records(budget)
    torch._dynamo.reset()
    rematc.clear_records()
    step(torch.compile(llama(), backend="eager"))
    after = _regional_records(budget)
    assert after == fresh
    assert [order for order, *_ in after] == sorted(order for order, *_ in after)


def test_what_an_inference_graph_returns_is_held_before_the_blocks() -> None:
    """transformers' rotary embedding runs under no_grad: an inference graph of the step,
    which nothing partitions or plans. Its cos and sin stay alive while every block holds
    them, so they are held before the blocks, beside the first graph's plan
    (``BudgetShare.outside``); on the 32-layer Llama of bench/regions.py they took the
    measured step 37,184 B over its budget."""
    torch._dynamo.reset()
    rematc.clear_records()
    model = llama()
    step(rematc.compile(model, budget="1GiB", compiler="eager", cache_dir=None, regions=True))
    config = model.config  # type: ignore[union-attr]
    rotary = 2 * IDS.shape[1] * (config.hidden_size // config.num_attention_heads) * 4  # cos, sin
    first, block = sorted((r for r in rematc.records() if r.graph is not None), key=lambda r: r.graph)[:2]
    assert block.calls == LAYERS and block.held_before == first.holds + rotary


# A step whose loss head needs more than a block's backward beside the other blocks'
# gradients: 8 layers, a vocabulary of 2,048 (2 MiB of logits), 32 x 16 tokens.
HEAVY_LAYERS = 8
HEAVY_IDS = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
HEAVY_INPUT = 32 * 16 * 64 * 4  # bytes of one block's input
HEAVY_OUTSIDE = HEAVY_INPUT + 16  # as OUTSIDE: the embedding's lookup and the loss's gradient


def heavy_llama() -> nn.Module:
    return tiny_llama(HEAVY_LAYERS, vocab=2048)


def heavy_step(model: nn.Module) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=HEAVY_IDS, labels=HEAVY_IDS).loss
    loss.backward()
    return loss


def _heavy_stated(budget: int, **options: Any) -> int:
    """The smallest budget a regional compile of the heavy step at ``budget`` (and
    ``options``) states (:func:`_heavy_budget` for the tests' one, found once per process)."""
    torch._dynamo.reset()
    compiled = rematc.compile(heavy_llama(), budget=budget, compiler="eager", cache_dir=None, regions=True,
                              outputs="dropped", **options)
    with pytest.raises(Exception, match="smallest feasible budget is") as info:
        heavy_step(compiled)
    return int(re.search(r"smallest feasible budget is (\d+) bytes", str(info.value)).group(1))  # type: ignore[union-attr]


@functools.cache
def _heavy_budget() -> int:
    """The smallest budget the heavy step states, asked 5 MB: its plan recomputes inputs."""
    return _heavy_stated(5_000_000)


def test_the_last_blocks_inputs_are_recomputed_where_no_plan_fits_them_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block holds its input from its forward to its backward, beside the loss
    head. Where no plan of the block fits that, the last blocks' inputs are freed as
    their forwards end and recomputed from an earlier one's when the backward starts
    (``rematc.regions.Carry``): the smallest budget stated falls by at least one input's
    bytes, and used, it holds when measured, with eager's loss and gradients."""
    with monkeypatch.context() as patched:  # every input held: the budget stated before
        patched.setattr(rematc.partition.RematPartitioner, "carrying", lambda *_: None)
        held = _heavy_stated(5_000_000)
    rematc.regions.forget_surveys()  # the survey without carrying is not the step's
    stated = _heavy_budget()
    torch._dynamo.reset()
    rematc.clear_records()
    reference, model = heavy_llama(), heavy_llama()
    expected = heavy_step(reference)
    compiled = rematc.compile(model, budget=stated, compiler="eager", cache_dir=None, regions=True,
                              outputs="dropped")
    assert heavy_step(compiled).item() == expected.item()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    [block] = [r for r in rematc.records() if r.calls == HEAVY_LAYERS]
    assert 0 < block.inputs_recomputed < HEAVY_LAYERS and block.carried == HEAVY_INPUT
    assert stated <= held - block.carried, (stated, held)
    model.zero_grad(set_to_none=True)
    peak = profiler_peak(lambda: heavy_step(compiled))
    assert peak <= stated + HEAVY_OUTSIDE, (peak, stated)


def test_recomputed_inputs_something_else_keeps_stop_the_step() -> None:
    """A forward hook that keeps every block's input holds the bytes the plan counted
    freed: the backward stops with the error, before recomputing anything."""
    budget = _heavy_budget()
    torch._dynamo.reset()
    model = heavy_llama()
    kept: list[Any] = []
    for block in model.model.layers:  # type: ignore[union-attr]
        block.register_forward_pre_hook(lambda _, args, kwargs: kept.append(kwargs.get("hidden_states", args)),
                                        with_kwargs=True)
    compiled = rematc.compile(model, budget=budget, compiler="eager", cache_dir=None, regions=True,
                              outputs="dropped")
    with pytest.raises(rematc.CarriedInputError, match=r"inputs of blocks \d+-7 .* still held when the backward starts"):
        heavy_step(compiled)


def test_each_compiled_graph_of_the_block_recomputes_as_its_own_plan_says() -> None:
    """A smaller batch compiles the block again, with a plan that recomputes fewer inputs
    (or none); a step of the first batch after it still recomputes as its own plan says,
    within the budget, with eager's loss and gradients."""
    budget = _heavy_budget()
    torch._dynamo.reset()
    rematc.clear_records()
    reference, model = heavy_llama(), heavy_llama()
    compiled = rematc.compile(model, budget=budget, compiler="eager", cache_dir=None, regions=True,
                              outputs="dropped")
    small = HEAVY_IDS[:8]
    for ids in (HEAVY_IDS, small, HEAVY_IDS):
        reference.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        expected = reference(input_ids=ids, labels=ids).loss
        expected.backward()
        got = compiled(input_ids=ids, labels=ids).loss
        got.backward()
        assert got.item() == expected.item()
        for (name, mine), want in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(mine.grad, want.grad, msg=name)
    recomputed = sorted(r.inputs_recomputed for r in rematc.records() if r.calls == HEAVY_LAYERS)
    assert len(recomputed) == 2 and recomputed[0] < recomputed[1], recomputed
    model.zero_grad(set_to_none=True)
    assert profiler_peak(lambda: heavy_step(compiled)) <= budget + HEAVY_OUTSIDE


# Copies to host this fast cost next to nothing: offloading a block's input is cheaper
# than running a block's forward again (on the CPU a "host copy" is a copy in the same
# memory, rematc.offload).
FAST_LINK = 1e13


def _moved_as(monkeypatch: pytest.MonkeyPatch, offloaded: int, recomputed: int) -> None:
    """Make a regional block's plan offload the inputs of blocks 1 to ``offloaded`` and
    recompute the last ``recomputed`` blocks' wherever it may move inputs at all."""
    monkeypatch.setattr(rematc.partition, "inputs_moved", lambda *_, carrying, **__: (
        (0, 0) if carrying is None else (offloaded, recomputed)))


def test_block_inputs_kept_offloaded_and_recomputed_give_eagers_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Of the heavy step's 8 blocks, the plan offloads the inputs of blocks 1 and 2, keeps
    those of blocks 0, 3 and 4 (the one the recomputed come from), and recomputes those of
    blocks 5 to 7: two steps give eager's loss and gradients, each copies two inputs out
    and recomputes once, and the measured peak is within the budget but for the host
    copies, which on the CPU are in the same memory."""
    budget = 17_600_000  # above what that plan needs, below what any plan holding every input needs
    _moved_as(monkeypatch, 2, 3)
    copies: list[int] = []
    offload = rematc.regions.OFFLOAD
    monkeypatch.setattr(rematc.regions, "OFFLOAD", lambda t: copies.append(t.nbytes) or offload(t))
    recomputes: list[int] = []
    recompute = rematc.regions.Carry._recompute
    monkeypatch.setattr(rematc.regions.Carry, "_recompute", lambda self: recomputes.append(1) or recompute(self))
    torch._dynamo.reset()
    rematc.clear_records()
    reference, model = heavy_llama(), heavy_llama()
    compiled = rematc.compile(model, budget=budget, compiler="eager", cache_dir=None, regions=True,
                              outputs="dropped", host_bandwidth=FAST_LINK)
    for _ in range(2):
        reference.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        assert heavy_step(compiled).item() == heavy_step(reference).item()
        for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, msg=name)
    assert copies == [HEAVY_INPUT] * 4 and len(recomputes) == 2
    [block] = [r for r in rematc.records() if r.calls == HEAVY_LAYERS]
    assert (block.inputs_offloaded, block.inputs_recomputed) == (2, 3)
    model.zero_grad(set_to_none=True)
    peak = profiler_peak(lambda: heavy_step(compiled))
    assert peak <= budget + HEAVY_OUTSIDE + 2 * HEAVY_INPUT, (peak, budget)


def test_over_a_host_link_block_inputs_are_offloaded_rather_than_recomputed() -> None:
    """With a fast host link, the heavy step's smallest budget is reached by copying block
    inputs to host memory, not by running blocks again; used, it gives eager's loss and
    gradients within itself but for the host copies. A step that keeps the inputs anyway
    stops with the error."""
    stated_without = _heavy_budget()
    rematc.regions.forget_surveys()
    stated = _heavy_stated(5_000_000, host_bandwidth=FAST_LINK)
    assert stated <= stated_without
    torch._dynamo.reset()
    rematc.clear_records()
    reference, model = heavy_llama(), heavy_llama()
    compiled = rematc.compile(model, budget=stated, compiler="eager", cache_dir=None, regions=True,
                              outputs="dropped", host_bandwidth=FAST_LINK)
    assert heavy_step(compiled).item() == heavy_step(reference).item()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    [block] = [r for r in rematc.records() if r.calls == HEAVY_LAYERS]
    assert (block.inputs_offloaded, block.inputs_recomputed) == (HEAVY_LAYERS - 1, 0)
    model.zero_grad(set_to_none=True)
    peak = profiler_peak(lambda: heavy_step(compiled))
    assert peak <= stated + HEAVY_OUTSIDE + block.inputs_offloaded * HEAVY_INPUT, (peak, stated)
    # A forward hook that keeps every block's input holds the bytes the plan counted as
    # copied out: the backward stops with the error.
    kept: list[Any] = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.register_forward_pre_hook(lambda _, args, kwargs: kept.append(kwargs.get("hidden_states", args)),
                                        with_kwargs=True)
    with pytest.raises(rematc.CarriedInputError, match=r"offloads to host memory the inputs of blocks 1-7 .* still held"):
        heavy_step(compiled)
