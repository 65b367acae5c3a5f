"""Whole-step memory: what one training step holds beside its activations, and its peak.

One step is ``loss = model(*inputs)``, ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad()`` (gradients set to ``None``, PyTorch's default). It holds memory
in two phases (docs/fit.md, "The whole-step model"):

* forward and backward: parameters, buffers, optimizer state, and the graph's peak under
  its plan, which counts the gradients as the backward produces them;
* the optimizer step: parameters, buffers, optimizer state, every gradient, and the
  step's temporaries.

The step's peak is the larger of the two plus a reserve for the allocator's
fragmentation (a fraction of that peak, :attr:`StepSetup.reserve`). With FSDP over N
ranks the parameters, gradients, optimizer state and temporaries are each rank's shard
(each parameter split along its first dimension, padded), and the units being gathered
or reduced are added (:func:`fsdp_buffers`).

This module is the arithmetic and the inventory of a model (:func:`model_states`,
which works on ``meta`` tensors); the activations come from rematc's plan of the traced
graph (:mod:`rematc.fit` puts the two together).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the functions that take a model
    from torch import nn

PRECISIONS = ("fp32", "bf16-mixed", "bf16")


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    """How a ``torch.optim`` optimizer holds memory, per element of the parameters."""

    name: str
    state: int  # tensors of a parameter's size it keeps per parameter (exp_avg, ...)
    # Temporaries of its step, in parameters' sizes. Foreach (torch's default on
    # accelerators): one list over all parameters of a dtype at once (Adam's sqrt of
    # exp_avg_sq). Per tensor (its default on the CPU): the most alive for one parameter.
    foreach_temporaries: int
    single_temporaries: int
    # Passes over a parameter-sized tensor its step makes (reads + writes), for its time.
    passes: int
    # One 4-byte scalar per parameter (Adam's "step"): in host memory for the foreach and
    # per-tensor steps, so counted on the CPU only; on the parameter's device when fused.
    step_counter: bool
    fused: bool = False


# From torch.optim's _multi_tensor_* and _single_tensor_* step functions, default
# arguments (docs/fit.md, "Optimizers"): AdamW decays weights in place; Adam's default
# weight decay is 0, so it makes no decayed copy of the gradients.
OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(name="adamw", state=2, foreach_temporaries=1, single_temporaries=2,
                       passes=20, step_counter=True),
    # fused=True: one kernel per parameter group, no temporaries (CUDA only).
    "adamw-fused": Optimizer(name="adamw-fused", state=2, foreach_temporaries=0,
                             single_temporaries=0, passes=7, step_counter=True, fused=True),
    "adam": Optimizer(name="adam", state=2, foreach_temporaries=1, single_temporaries=2,
                      passes=18, step_counter=True),
    "sgd-momentum": Optimizer(name="sgd-momentum", state=1, foreach_temporaries=0,
                              single_temporaries=0, passes=8, step_counter=False),
    "sgd": Optimizer(name="sgd", state=0, foreach_temporaries=0, single_temporaries=0,
                     passes=3, step_counter=False),
}


@dataclass(frozen=True, kw_only=True)
class StepSetup:
    """How the step runs, beside the model and its plan."""

    optimizer: str = "adamw"  # a key of OPTIMIZERS
    # fp32; bf16-mixed: fp32 parameters, gradients and optimizer state, bf16 autocast
    # compute; bf16: everything in bf16.
    precision: str = "fp32"
    fsdp: int = 1  # ranks the model states are sharded over (FSDP2's fully_shard); 1 = none
    # Where the step runs: "cuda" steps the optimizer foreach and keeps Adam's step
    # counters in host memory; "cpu" steps it per tensor and counts the counters.
    device_type: str = "cpu"
    # Fraction of the peak kept free for the allocator's fragmentation: 0 on the CPU
    # (malloc returns what it frees), 5% by default on a GPU (rematc fit --reserve).
    reserve: float = 0.0
    # Bytes the math libraries keep on the device (DeviceProfile.workspace); 0 on the CPU.
    workspace: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; known: {', '.join(PRECISIONS)}")
        if isinstance(self.fsdp, bool) or not isinstance(self.fsdp, int) or self.fsdp < 1:
            raise ValueError(f"fsdp must be a number of ranks from 1 up, got {self.fsdp!r}")
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}")
        if not (0.0 <= self.reserve < 1.0):
            raise ValueError(f"reserve must be a fraction in [0, 1), got {self.reserve!r}")

    @property
    def state_itemsize(self) -> int:
        """Bytes per element of parameters, gradients and optimizer state."""
        return 2 if self.precision == "bf16" else 4

    @property
    def compute_itemsize(self) -> int:
        """Bytes per element of activations and of FSDP's gathered parameters."""
        return 4 if self.precision == "fp32" else 2

    @property
    def trace_dtype(self) -> str:
        """The dtype to trace a model on ``meta`` in (autocast does not act on meta)."""
        return "float32" if self.precision == "fp32" else "bfloat16"


@dataclass(frozen=True)
class ModelStates:
    """What a model holds before any step, independent of precision."""

    shapes: tuple[tuple[int, ...], ...]  # trainable parameters (a shared one once)
    buffers: int  # bytes of buffers and frozen parameters, as the model holds them
    # FSDP units: elements of the largest block of the model's repeated blocks (its
    # largest nn.ModuleList), and of the parameters outside them (the root unit).
    unit: int = 0
    root: int = 0

    @property
    def count(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def sharded(self, ranks: int) -> int:
        """Elements of one rank's shard: each parameter split along dim 0, padded."""
        if ranks == 1:
            return self.count
        return sum(-(-s[0] // ranks) * math.prod(s[1:]) if s else 1 for s in self.shapes)


def model_states(model: nn.Module) -> ModelStates:
    """The inventory of ``model``'s parameters and buffers (works on ``meta``)."""
    seen: set[int] = set()
    shapes: list[tuple[int, ...]] = []
    buffers = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            shapes.append(tuple(p.shape))
        else:
            buffers += p.numel() * p.element_size()
    buffers += sum(b.numel() * b.element_size() for b in model.buffers())
    blocks = _repeated_blocks(model)
    unit = max((_count(b.parameters(), seen=set()) for b in blocks), default=0)
    inside = {id(p) for b in blocks for p in b.parameters()}
    root = sum(math.prod(s) for s, p in zip(shapes, _trainable(model), strict=True)
               if id(p) not in inside)
    return ModelStates(tuple(shapes), buffers, unit=unit, root=root)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            if p.requires_grad:
                out.append(p)
    return out


def _count(params: Iterable[nn.Parameter], *, seen: set[int]) -> int:
    total = 0
    for p in params:
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            total += p.numel()
    return total


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's ``nn.ModuleList`` with the most parameters (the layers
    a transformer or a CNN stage repeats): FSDP2 wraps each in its own unit."""
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return []
    best = max(lists, key=lambda m: _count(m.parameters(), seen=set()))
    return list(best)


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """Bytes one rank holds over a step, by part; :attr:`peak` is what must fit."""

    parameters: int
    gradients: int
    optimizer_state: int  # with Adam's step counters where they are device memory
    buffers: int
    # The graph's peak in forward and backward under its plan, above the model states.
    activations: int
    # True where ``activations`` counts the gradients as the backward makes them (the
    # graph traced at the step's precision, without FSDP); else all of them are added.
    activations_count_gradients: bool
    optimizer_temporaries: int
    fsdp_buffers: int = 0  # gathered parameters and unsharded gradients in flight
    workspace: int = 0  # the math libraries' workspaces, held from the first step on
    reserve_fraction: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def states(self) -> int:
        return self.parameters + self.optimizer_state + self.buffers

    @property
    def backward_peak(self) -> int:
        grads = 0 if self.activations_count_gradients else self.gradients
        return self.states + self.workspace + grads + self.activations + self.fsdp_buffers

    @property
    def optimizer_peak(self) -> int:
        return self.states + self.workspace + self.gradients + self.optimizer_temporaries

    @property
    def phase(self) -> str:
        """Where the peak is: ``"backward"`` (forward and backward) or ``"optimizer"``."""
        return "backward" if self.backward_peak >= self.optimizer_peak else "optimizer"

    @property
    def allocated(self) -> int:
        """The peak of live bytes, before the reserve."""
        return max(self.backward_peak, self.optimizer_peak)

    @property
    def reserve(self) -> int:
        return math.ceil(self.allocated * self.reserve_fraction)

    @property
    def peak(self) -> int:
        return self.allocated + self.reserve

    def parts(self) -> dict[str, int]:
        """The stacked parts at the peak's phase, which add up to :attr:`peak`."""
        backward = self.phase == "backward"
        counted = backward and self.activations_count_gradients
        return {
            "parameters": self.parameters,
            "gradients": 0 if counted else self.gradients,
            "optimizer state": self.optimizer_state,
            "buffers": self.buffers,
            "activations": self.activations if backward else 0,
            "FSDP buffers": self.fsdp_buffers if backward else 0,
            "optimizer temporaries": 0 if backward else self.optimizer_temporaries,
            "workspaces": self.workspace,
            "reserve": self.reserve,
        }


def model_state_bytes(states: ModelStates, setup: StepSetup) -> tuple[int, int, int]:
    """Bytes of one rank's parameters, gradients and optimizer state."""
    opt = OPTIMIZERS[setup.optimizer]
    shard = states.sharded(setup.fsdp) * setup.state_itemsize
    on_device = setup.device_type == "cpu" or opt.fused
    counters = 4 * len(states.shapes) if opt.step_counter and on_device else 0
    return shard, shard, opt.state * shard + counters


def optimizer_temporaries(states: ModelStates, setup: StepSetup) -> int:
    """Peak bytes the optimizer step allocates beyond the states (see :class:`Optimizer`)."""
    opt = OPTIMIZERS[setup.optimizer]
    if setup.device_type == "cuda":
        return opt.foreach_temporaries * states.sharded(setup.fsdp) * setup.state_itemsize
    largest = max((math.prod(s) for s in states.shapes), default=0)
    if setup.fsdp > 1:
        largest = max((-(-s[0] // setup.fsdp) * math.prod(s[1:]) for s in states.shapes if s), default=0)
    return opt.single_temporaries * largest * setup.state_itemsize


def fsdp_buffers(states: ModelStates, setup: StepSetup) -> int:
    """FSDP2's unsharded tensors at the backward's peak: the root unit's parameters and
    gradients (gathered for the whole step), and two blocks' parameters and gradients
    (the one computing and the one prefetched or being reduced), in the compute dtype."""
    if setup.fsdp == 1:
        return 0
    return 2 * (states.root + 2 * states.unit) * setup.compute_itemsize


def breakdown(states: ModelStates, setup: StepSetup, *, activations: int,
              activations_count_gradients: bool) -> Breakdown:
    """The step's memory for a plan whose graph peaks at ``activations`` bytes."""
    params, grads, state = model_state_bytes(states, setup)
    return Breakdown(
        parameters=params, gradients=grads, optimizer_state=state, buffers=states.buffers,
        activations=activations,
        activations_count_gradients=activations_count_gradients and setup.fsdp == 1,
        optimizer_temporaries=optimizer_temporaries(states, setup),
        fsdp_buffers=fsdp_buffers(states, setup), workspace=setup.workspace,
        reserve_fraction=setup.reserve,
    )


def activation_room(states: ModelStates, setup: StepSetup, memory: int, *,
                    activations_count_gradients: bool) -> int:
    """The largest graph peak with which the step fits in ``memory`` bytes (negative
    where the model states alone do not fit)."""
    probe = breakdown(states, setup, activations=0,
                      activations_count_gradients=activations_count_gradients)
    usable = math.floor(memory / (1 + setup.reserve))
    if probe.optimizer_peak > usable:
        return usable - probe.optimizer_peak
    return usable - probe.backward_peak


def optimizer_time(states: ModelStates, setup: StepSetup, mem_bandwidth: float) -> float:
    """Seconds of the optimizer step: memory-bound passes over one rank's states."""
    opt = OPTIMIZERS[setup.optimizer]
    return opt.passes * states.sharded(setup.fsdp) * setup.state_itemsize / mem_bandwidth


# A fraction of the device's memory ``budget="auto"`` leaves free for the allocator's
# fragmentation and the CUDA context's own allocations.
AUTO_RESERVE = 0.05


@dataclass(frozen=True)
class AutoBudget:
    """The activation budget ``budget="auto"`` derives, and how (for the record)."""

    budget: int
    derivation: str


def auto_budget(*, free: int, total: int, parameter_bytes: int, optimizer: str = "adamw",
                reserve: float = AUTO_RESERVE, workspace: int = 0) -> AutoBudget:
    """The budget for a graph compiled with ``free`` of ``total`` device bytes free, whose
    trainable parameters hold ``parameter_bytes``: the free memory less the reserve, the
    optimizer state its first step will allocate, that step's foreach temporaries and the
    math libraries' ``workspace`` (docs/fit.md, "budget='auto'"). Gradients need nothing
    here: the graph's peak counts them as its backward produces them. Raises
    ``ValueError`` where nothing is left."""
    opt = OPTIMIZERS.get(optimizer)
    if opt is None:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    kept = math.ceil(reserve * total)
    state = opt.state * parameter_bytes
    temporaries = opt.foreach_temporaries * parameter_bytes
    budget = free - kept - state - temporaries - workspace
    derivation = (f"auto: {free} B free of {total} B, less a {reserve:.0%} reserve ({kept} B), "
                  f"{optimizer}'s state ({state} B), its step's temporaries ({temporaries} B) "
                  f"and the math libraries' workspaces ({workspace} B)")
    if budget <= 0:
        raise ValueError(f"budget='auto' leaves nothing for activations: {derivation}; "
                         "free memory, shard the model (FSDP) or use a lighter optimizer")
    return AutoBudget(budget, f"{derivation} = {budget} B")
