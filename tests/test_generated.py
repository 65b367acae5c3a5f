"""The check after compilation (``rematc.generated``): the walk of the generated code
gives the peak the step measures, and where a rule of the memory model does not hold
(here: a user's Inductor config that turns off in-place buffers, which the model counts
on) the backend re-plans until the generated code fits, or warns with the numbers."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.fx as fx

import rematc
import rematc.backend
from rematc.generated import Generated, WalkError, step_peak
from rematc.memory import profiler_peak
from rematc.models import GPTConfig, make_gpt
from tests.helpers import assert_same_step, run_step

# A forward that allocates, reuses, views and calls a fallback kernel, and a backward
# that frees the saved values; all sizes float32 on the CPU.
FORWARD = '''
class Runner:
    def call(self, args):
        primals_1, = args
        args.clear()
        buf0 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
        cpp_fused_0(primals_1, buf0)
        buf1 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
        extern_kernels.mm(buf0, primals_1, out=buf1)
        buf2 = buf1; del buf1  # reuse
        buf3 = torch.ops.aten.sort.default(buf2)
        buf4 = buf3[0]
        buf5 = buf3[1]
        del buf3
        del buf5
        return (reinterpret_tensor(buf2, (4096, ), (1, ), 0), buf0, buf4, )
'''
BACKWARD = '''
def call(args):
    buf0, buf4, tangents_1 = args
    args.clear()
    buf6 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    buf8 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    del buf4
    del buf8
    buf7 = reinterpret_tensor(buf0, (64, 64), (64, 1), 0); del buf0  # reuse
    kernel(buf6, buf7)
    return (buf7, )
'''


def _graph(inputs: dict[str, torch.Tensor | None], outputs: list[str]) -> fx.GraphModule:
    """An FX graph with the named inputs (their values in ``meta``) returning the named
    outputs: all the walk reads of the graphs Inductor compiled."""
    graph = fx.Graph()
    made = {}
    for name, val in inputs.items():
        node = graph.placeholder(name)
        node.meta["val"] = val
        made[name] = node
    for name in outputs:
        if name not in made:
            made[name] = graph.create_node("call_function", torch.neg,
                                           (next(iter(made.values())),), name=name)
    graph.output(tuple(made[n] for n in outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_walk_follows_allocations_reuses_views_and_fallback_outputs() -> None:
    block = 64 * 64 * 4
    forward = _graph({"primals_1": torch.empty(64, 64)}, ["view", "buf0", "buf4"])
    backward = _graph({"buf0": None, "buf4": None, "tangents_1": torch.empty(4096)}, [])
    peak = step_peak(Generated(FORWARD, forward), Generated(BACKWARD, backward), "cpu")
    # Forward: buf0, buf2 (buf1 reused) and the sort's values and int64 indices.
    assert peak.forward == 5 * block
    # Backward: buf2 (held by the caller), buf0, buf4, the tangent, buf6 and buf8.
    assert peak.backward == 6 * block
    assert peak.peak == 6 * block and peak.where == "backward: buf8 = empty_strided_cpu((64, 64), (64, 1), torch.float32)"
    assert sorted(n for n, _ in peak.alive) == ["<output>", "buf0", "buf4", "buf6", "buf8", "tangents_1"]


def test_the_walk_counts_only_the_graphs_device() -> None:
    source = FORWARD.replace("buf0 = empty_strided_cpu", "buf0 = empty_strided_cuda")
    forward = _graph({"primals_1": torch.empty(64, 64)}, ["view", "buf0", "buf4"])
    backward = _graph({"buf0": None, "buf4": None, "tangents_1": torch.empty(4096)}, [])
    on_cpu = step_peak(Generated(source, forward), Generated(BACKWARD, backward), "cpu")
    assert on_cpu.forward == 4 * 64 * 64 * 4  # buf0 is on the GPU


def test_a_statement_the_walk_cannot_follow_is_named() -> None:
    """A failed walk is reported with the graph, line and statement it stopped at (the
    post-compile check's warning carries it), not the bare error."""
    source = BACKWARD.replace("return (buf7, )", "return (buf7, unknown_name)")
    forward = _graph({"primals_1": torch.empty(64, 64)}, ["view", "buf0", "buf4"])
    backward = _graph({"buf0": None, "buf4": None, "tangents_1": torch.empty(4096)}, [])
    with pytest.raises(WalkError, match=r"^backward, line 11: return \(buf7, unknown_name\): NameError"):
        step_peak(Generated(FORWARD, forward), Generated(source, backward), "cpu")


# A backward as Inductor writes a reduction split across a workspace (on CUDA, its "mix
# order reduction"): the result is a tensor method's value over a slice of the workspace.
WORKSPACE_BACKWARD = '''
def call(args):
    buf0, buf4, tangents_1 = args
    args.clear()
    workspace_1 = empty_strided_cpu((524288, ), (1, ), torch.float32)
    kernel.run(buf0, workspace_1, stream=stream0)
    buf42 = workspace_1[0 * 256 * 2048 : (0 + 1) * 256 * 2048].view(256, 2048).sum(dim=0)
    del workspace_1
    del buf4
    return (reinterpret_tensor(buf42, (2048, ), (1, ), 0), buf0, )
'''


def test_the_walk_follows_a_reduction_over_a_workspace() -> None:
    """Inductor reduces a split reduction's workspace with tensor methods (on CUDA); the
    walk could not call one (their native code imports through the calling frame's
    builtins), so the check after compilation was off for every such graph, and a
    regional Llama step on an H200 went 9.7% over its budget unchecked. (On CUDA as it is
    written there; this build may have no CUDA to slice fake CUDA tensors with.)"""
    forward = _graph({"primals_1": torch.empty(64, 64)}, ["view", "buf0", "buf4"])
    backward = _graph({"buf0": None, "buf4": None, "tangents_1": torch.empty(4096)}, [])
    peak = step_peak(Generated(FORWARD, forward), Generated(WORKSPACE_BACKWARD, backward), "cpu")
    block, workspace, result = 64 * 64 * 4, 524288 * 4, 2048 * 4
    # buf2 (held by the caller), buf0, buf4, the tangent and the workspace, then the sum
    assert peak.backward == 4 * block + workspace + result
    assert peak.where.startswith("backward: buf42 = workspace_1[")


def _compiled_step(budget: float | None, **inductor: object) -> tuple[rematc.PartitionRecord, list[rematc.PartitionRecord], int]:
    config = GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=64, vocab=256)
    model, inputs = make_gpt(config, batch=4, seed=0)
    reference = run_step(model, model, inputs)
    model, inputs = make_gpt(config, batch=4, seed=0)
    before = len(rematc.records())
    with torch._inductor.config.patch(**inductor):
        compiled = rematc.compile(model, budget=budget)
        result = run_step(model, compiled, inputs)
    assert_same_step(reference, result, rtol=1e-4, atol=1e-5)
    records = rematc.records()[before:]
    model.zero_grad(set_to_none=True)
    measured = profiler_peak(lambda: compiled(*inputs).backward())
    return records[-1], records, measured


@pytest.mark.inductor
def test_the_generated_peak_is_the_measured_peak() -> None:
    record, records, measured = _compiled_step(0.4)
    assert len(records) == 1 and record.generated_peak is not None
    print(f"budget {record.budget} B, predicted {record.predicted_peak} B, generated "
          f"{record.generated_peak} B, measured {measured} B")
    assert abs(measured - record.generated_peak) <= 0.01 * measured
    assert record.generated_peak <= record.budget


@pytest.mark.inductor
@pytest.mark.canary
def test_a_broken_rule_is_caught_after_compilation_and_replanned() -> None:
    # The model counts on Inductor writing a kernel's output over a dying input; with
    # in-place buffers and buffer reuse off, the first plan's code peaks above its budget.
    record, records, measured = _compiled_step(0.4, inplace_buffers=False, allow_buffer_reuse=False)
    first = records[0]
    assert first.budget is not None and first.generated_peak is not None
    print([(r.budget, r.predicted_peak, r.generated_peak, r.squeezed) for r in records], measured)
    assert first.generated_peak > first.budget, "the broken rule no longer shows"
    assert 2 <= len(records) <= 1 + rematc.backend.REPLANS
    assert record.squeezed > 0 and record.generated_peak is not None
    assert record.generated_peak <= first.budget
    assert measured <= first.budget + 64  # a scalar or two the walk does not see


@pytest.mark.inductor
def test_a_plan_that_cannot_be_fitted_is_warned_about_with_its_numbers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rematc.backend, "REPLANS", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record, records, _ = _compiled_step(0.4, inplace_buffers=False, allow_buffer_reuse=False)
    over = [w for w in caught if issubclass(w.category, rematc.backend.OverBudgetWarning)]
    assert len(records) == 1 and len(over) == 1
    message = str(over[0].message)
    assert f"peaks at {record.generated_peak} B" in message
    assert f"budget of {record.budget} B" in message and "the peak is at backward" in message


@pytest.mark.inductor
@pytest.mark.slow
def test_every_byte_budget_stated_feasible_holds_in_the_generated_code() -> None:
    """With a rule of the model broken (in-place buffers off), the smallest budget the
    planner states is below what Inductor's code for it needs. Asked for, it is re-planned
    or refused with a budget that holds; that one, asked for, holds (measured). Before,
    the re-plan chose the same plan again and the step ran over, with a warning."""
    config = GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=64, vocab=256)
    inductor = {"inplace_buffers": False, "allow_buffer_reuse": False}
    budget, measured = 64 * 1024, None
    for _ in range(4):
        torch._dynamo.reset()
        model, inputs = make_gpt(config, batch=4, seed=0)
        with torch._inductor.config.patch(**inductor):
            compiled = rematc.compile(model, budget=budget)
            try:
                compiled(*inputs).backward()
            except Exception as e:
                stated = re.search(r"smallest feasible budget is (\d+) bytes", str(e))
                assert stated is not None, e
                assert int(stated.group(1)) > budget
                budget = int(stated.group(1))
                continue
            model.zero_grad(set_to_none=True)
            measured = profiler_peak(lambda: compiled(*inputs).backward())  # noqa: B023
            break
    assert measured is not None, "no stated budget compiled"
    assert measured <= budget + 64  # a scalar or two the walk does not see


@pytest.mark.inductor
def test_a_users_inductor_thresholds_are_followed() -> None:
    """Inductor stores a fused result past its ``realize_*`` thresholds. The model reads
    them from its config when the graph is captured, a user's ``config.patch`` included.
    With them lowered (3 ops, 1 read, 1 reuse), the plan without a budget: predicted
    2,233,092 B, generated 2,171,916 B (2.7% under, the safe side). With the defaults
    copied into the model instead: predicted 1,970,948 B, generated 2,254,340 B (14% over)."""
    record, records, _ = _compiled_step(None, realize_opcount_threshold=3, realize_acc_reads_threshold=1,
                                        realize_reads_threshold=1)
    print([(r.predicted_peak, r.generated_peak) for r in records])
    assert len(records) == 1 and record.generated_peak is not None
    assert 0.95 * record.predicted_peak <= record.generated_peak <= record.predicted_peak
