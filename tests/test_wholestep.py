"""The whole-step memory model (rematc.wholestep): its parts against closed forms and
against torch's own optimizers, and the whole step predicted against measured on CPU."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

import rematc
from rematc.memory import profiler_peak
from rematc.models import GPTConfig, MLPConfig, make_gpt, make_mlp
from rematc.partition import clear_records, records
from rematc.wholestep import (
    OPTIMIZERS,
    StepSetup,
    activation_room,
    breakdown,
    fsdp_buffers,
    model_state_bytes,
    model_states,
    optimizer_temporaries,
)

# Whole-step predictions must be within this fraction of the measured peak (issue target).
WHOLE_STEP_TOLERANCE = 0.05

MAKERS = {
    "adamw": lambda p: torch.optim.AdamW(p),
    "adamw-fused": lambda p: torch.optim.AdamW(p, fused=True),
    "adam": lambda p: torch.optim.Adam(p),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
}


class Blocks(nn.Module):
    """Two repeated blocks between an embedding and a head (one shared with it), a
    buffer and a frozen parameter: every kind of state the inventory sorts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter
        self.frozen = nn.Parameter(torch.ones(3, 5), requires_grad=False)
        self.register_buffer("scale", torch.ones(7))


def test_the_inventory_counts_each_parameter_once_and_finds_the_blocks() -> None:
    states = model_states(Blocks())
    assert states.count == 50 * 8 + 2 * (8 * 8 + 8)
    assert len(states.shapes) == 1 + 2 * 2
    assert states.buffers == 4 * (3 * 5 + 7)
    assert states.unit == 8 * 8 + 8
    assert states.root == 50 * 8


def test_the_inventory_works_on_meta() -> None:
    with torch.device("meta"):
        model = Blocks()
    assert model_states(model) == model_states(Blocks())


def test_an_empty_model_holds_nothing() -> None:
    states = model_states(nn.Module())
    b = breakdown(states, StepSetup(), activations=0, activations_count_gradients=True)
    assert (states.count, b.peak, b.optimizer_temporaries) == (0, 0, 0)


@pytest.mark.parametrize("precision, itemsize", [("fp32", 4), ("bf16-mixed", 4), ("bf16", 2)])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_state_bytes_are_the_closed_form(optimizer: str, precision: str, itemsize: int) -> None:
    states = model_states(Blocks())
    n, tensors = states.count, len(states.shapes)
    for device_type in ("cpu", "cuda"):
        setup = StepSetup(optimizer=optimizer, precision=precision, device_type=device_type)
        params, grads, state = model_state_bytes(states, setup)
        on_device = device_type == "cpu" or optimizer == "adamw-fused"  # fused keeps them on the GPU
        counters = 4 * tensors if optimizer.startswith("adam") and on_device else 0
        copies = {"adamw": 2, "adamw-fused": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]
        assert (params, grads, state) == (n * itemsize, n * itemsize, copies * n * itemsize + counters)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_state_and_temporaries_match_torchs_optimizers_on_cpu(optimizer: str) -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 32))
    states = model_states(model)
    setup = StepSetup(optimizer=optimizer)
    opt = MAKERS[optimizer](model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # creates the state
    held = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))
    assert held == model_state_bytes(states, setup)[2]
    measured = profiler_peak(opt.step)
    predicted = optimizer_temporaries(states, setup)
    # Per tensor on the CPU: Adam's sqrt and its quotient for the largest parameter; the
    # few bytes over are Python scalars wrapped as tensors.
    assert predicted <= measured <= predicted + 64


def test_foreach_temporaries_are_one_list_over_every_parameter() -> None:
    states = model_states(Blocks())
    cuda = StepSetup(optimizer="adamw", device_type="cuda", precision="bf16")
    assert optimizer_temporaries(states, cuda) == 2 * states.count
    assert optimizer_temporaries(states, StepSetup(optimizer="sgd", device_type="cuda")) == 0


def test_fsdp_shards_each_parameter_along_its_first_dimension() -> None:
    states = model_states(Blocks())
    # Embedding [50, 8] over 3 ranks: 17 rows; each Linear weight [8, 8]: 3 rows; bias [8]: 3.
    assert states.sharded(3) == 17 * 8 + 2 * (3 * 8 + 3)
    setup = StepSetup(fsdp=3, precision="bf16-mixed", device_type="cuda")
    params, grads, _ = model_state_bytes(states, setup)
    assert params == grads == 4 * states.sharded(3)
    # The root unit and two blocks, parameters and gradients, in bf16.
    assert fsdp_buffers(states, setup) == 2 * 2 * (states.root + 2 * states.unit)
    assert fsdp_buffers(states, StepSetup(fsdp=1)) == 0


def test_the_peak_is_the_larger_phase_plus_the_reserve() -> None:
    states = model_states(Blocks())
    setup = StepSetup(optimizer="adamw", reserve=0.1)
    small = breakdown(states, setup, activations=10, activations_count_gradients=True)
    assert small.phase == "optimizer"
    assert small.allocated == small.states + small.gradients + small.optimizer_temporaries
    big = breakdown(states, setup, activations=10**6, activations_count_gradients=True)
    assert big.phase == "backward" and big.allocated == big.states + 10**6
    assert big.peak == big.allocated + math.ceil(0.1 * big.allocated)
    assert sum(big.parts().values()) == big.peak == sum(big.parts().values())
    assert sum(small.parts().values()) == small.peak
    apart = breakdown(states, setup, activations=10**6, activations_count_gradients=False)
    assert apart.backward_peak == big.backward_peak + apart.gradients


@pytest.mark.parametrize("count_gradients", [True, False])
def test_the_activation_room_is_the_largest_graph_peak_that_fits(count_gradients: bool) -> None:
    states = model_states(Blocks())
    setup = StepSetup(optimizer="adamw", reserve=0.05)
    memory = 100_000
    room = activation_room(states, setup, memory, activations_count_gradients=count_gradients)
    assert room > 0
    at = breakdown(states, setup, activations=room, activations_count_gradients=count_gradients)
    over = breakdown(states, setup, activations=room + 100, activations_count_gradients=count_gradients)
    assert at.peak <= memory < over.peak
    assert activation_room(states, setup, 1000, activations_count_gradients=count_gradients) < 0


@pytest.mark.parametrize("bad, message", [
    ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
    ({"precision": "fp8"}, "unknown precision 'fp8'"),
    ({"fsdp": 0}, "fsdp must be"),
    ({"reserve": 1.5}, "reserve must be"),
])
def test_a_bad_setup_names_what_it_accepts(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepSetup(**bad)  # type: ignore[arg-type]


# ---- measured on the CPU ------------------------------------------------------------


def _live(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of every storage the model and optimizer hold (each storage once)."""
    tensors = [*model.parameters(), *model.buffers(),
               *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _example(model: str, batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    if model == "gpt":
        return make_gpt(GPTConfig(n_layer=2, d_model=128, n_head=4, seq_len=64, vocab=4096),
                        batch=batch, seed=0)
    # Wide layers and one example: the optimizer step (every gradient, and Adam's
    # temporaries) holds more than the forward and backward.
    return make_mlp(MLPConfig(d_in=256, d_hidden=1024, n_layer=2), batch=batch, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("model, optimizer, batch, phase", [
    ("gpt", "adamw", 4, "backward"), ("gpt", "sgd-momentum", 2, "backward"),
    ("gpt", "adam", 16, "backward"), ("mlp", "adamw", 1, "optimizer"),
])
def test_the_whole_step_measures_its_prediction(model: str, optimizer: str, batch: int, phase: str,
                                                precision: str) -> None:
    """Forward, backward, optimizer.step() and zero_grad() compiled by rematc: the peak of
    live bytes (what the model and optimizer hold, plus the profiler's peak over the
    step) against the prediction from the plan's graph peak."""
    module, inputs = _example(model, batch)
    setup = StepSetup(optimizer=optimizer, precision=precision)
    compiled = rematc.compile(module, budget="60%", compiler="eager", cache_dir=None)
    opt = MAKERS[optimizer](module.parameters())

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = compiled(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()

    clear_records()
    with warnings.catch_warnings():  # the MLP cannot shrink to 60%: it runs at its least peak
        warnings.simplefilter("ignore", rematc.BudgetWarning)
        step()
    step()
    [record] = records()
    measured = _live(module, opt) + profiler_peak(step)
    b = breakdown(model_states(module), setup, activations=record.predicted_peak,
                  activations_count_gradients=True)
    assert abs(measured - b.peak) <= WHOLE_STEP_TOLERANCE * measured
    assert b.phase == phase


# ---- budget="auto" ------------------------------------------------------------------


def test_the_auto_budget_leaves_the_reserve_the_state_and_the_step() -> None:
    from rematc.wholestep import auto_budget

    auto = auto_budget(free=70 * 2**30, total=80 * 2**30, parameter_bytes=2**30, optimizer="adamw")
    # 70 GiB free - 4 GiB reserve - 2 GiB exp_avg/exp_avg_sq - 1 GiB foreach temporaries.
    assert auto.budget == 63 * 2**30
    assert "adamw's state (2147483648 B)" in auto.derivation and auto.derivation.endswith(f"= {auto.budget} B")
    assert auto_budget(free=70 * 2**30, total=80 * 2**30, parameter_bytes=2**30,
                       optimizer="sgd").budget == 66 * 2**30
    with pytest.raises(ValueError, match="leaves nothing for activations"):
        auto_budget(free=2**30, total=80 * 2**30, parameter_bytes=2**30)
    with_workspace = auto_budget(free=70 * 2**30, total=80 * 2**30, parameter_bytes=2**30,
                                 workspace=66 * 2**20)
    assert with_workspace.budget == 63 * 2**30 - 66 * 2**20
    assert "workspaces (69206016 B)" in with_workspace.derivation


def test_the_workspaces_are_held_in_both_phases() -> None:
    states = model_states(Blocks())
    setup = StepSetup(device_type="cuda")
    plain = breakdown(states, setup, activations=10**6, activations_count_gradients=True)
    held = breakdown(states, dataclasses.replace(setup, workspace=66 * 2**20), activations=10**6,
                     activations_count_gradients=True)
    assert held.backward_peak - plain.backward_peak == held.optimizer_peak - plain.optimizer_peak == 66 * 2**20
    assert held.parts()["workspaces"] == 66 * 2**20 and sum(held.parts().values()) == held.peak


def test_auto_is_resolved_from_the_devices_free_memory_and_recorded() -> None:
    from rematc.backend import resolve_auto_budget
    from rematc.options import Options

    options = Options.from_mapping({"budget": "auto", "optimizer": "sgd-momentum"})
    assert options.budget is not None and options.budget.automatic
    with torch.device("meta"):
        weight = nn.Parameter(torch.empty(1024, 1024))
        frozen = nn.Parameter(torch.empty(10), requires_grad=False)
        x = torch.empty(8, 1024)
    seen: list[torch.device] = []

    def info(device: torch.device) -> tuple[int, int]:
        seen.append(device)
        return 10 * 2**30, 16 * 2**30

    resolved = resolve_auto_budget(options, [weight, frozen, x, weight], mem_get_info=info)
    assert seen == [torch.device("meta")]
    kept = math.ceil(0.05 * 16 * 2**30)
    assert resolved.budget is not None
    assert resolved.budget.nbytes == 10 * 2**30 - kept - 4 * 2**20  # one momentum buffer
    assert resolved.budget_origin.startswith("auto: 10737418240 B free")


def test_auto_on_the_cpu_says_what_to_give_instead() -> None:
    """A module on the CPU: a ValueError from rematc.compile, as the README states (it was
    torch's BackendCompilerFailed at the first call). A function's device shows only in
    its inputs: said when its graph compiles."""
    with pytest.raises(ValueError, match="this model's parameters are on the CPU: give the budget in bytes"):
        rematc.compile(nn.Linear(8, 8), budget="auto", compiler="eager", cache_dir=None)
    with torch.device("meta"), pytest.raises(ValueError, match="parameters are on meta: give the budget"):
        rematc.compile(nn.Linear(8, 8), budget="auto", compiler="eager", cache_dir=None)
    layer = nn.Linear(8, 8)
    compiled = rematc.compile(lambda x: layer(x), budget="auto", compiler="eager", cache_dir=None)
    with pytest.raises(Exception, match="inputs are on the CPU: give the budget in bytes"):
        compiled(torch.randn(2, 8, requires_grad=True)).sum().backward()


def test_dynamo_hands_the_backend_parameters_as_parameters() -> None:
    """resolve_auto_budget finds the graph's parameters among its example inputs."""
    model = nn.Linear(8, 8)
    kinds: list[bool] = []

    def spy(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        kinds.extend(isinstance(t, nn.Parameter) for t in example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=spy)(torch.randn(2, 8))
    torch._dynamo.reset()
    assert kinds.count(True) == 2


def test_the_auto_options_are_checked() -> None:
    from rematc.options import Options

    with pytest.raises(ValueError, match="option 'optimizer' must be one of adamw"):
        Options.from_mapping({"budget": "auto", "optimizer": "lion"})
    with pytest.raises(ValueError, match="unknown rematc option"):  # the backend's, not the user's
        Options.from_mapping({"budget_origin": "mine"})
    with pytest.raises(ValueError, match="a problem file needs bytes or a fraction"):
        Options.from_mapping({"budget": "auto"}).budget.resolve(1000)  # type: ignore[union-attr]
