"""The rematc partitioner: a straight line of named stages over AOTAutograd's joint graph.

capture (prepare + annotate + build problem) -> solve -> check plan -> emit -> verify.

It plugs into Inductor as ``config_patches={"custom_partitioner_fn": RematPartitioner(...)}``
(after Inductor's joint-graph passes, so ``replace_random`` and friends have run), or into
``aot_autograd(partition_fn=...)`` for the eager route.
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.compile_utils import fx_graph_cse
from torch._functorch.partitioners import (
    force_save_bw_mutation_src,
    force_save_collectives,
    force_save_effectful_ops,
)
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

from rematc.annotate import annotate
from rematc.capture import capture
from rematc.devices import DeviceProfile, profile_for
from rematc.emit import emit, verify
from rematc.options import Options
from solvers import Plan, Problem, SolveResult, check, save_all, solve

log = logging.getLogger(__name__)

_SOURCES = tuple(
    sorted(str(p) for pkg in ("rematc", "solvers")
           for p in (pathlib.Path(__file__).parent.parent / pkg).glob("*.py"))
)


@dataclass(frozen=True)
class PartitionRecord:
    """What one partitioning decided and predicted; ``rematc.records()`` lists them."""

    joint_nodes: int  # FX nodes in the joint graph handed to us
    values: int  # storages in the problem
    candidates: int  # forward values that needed a decision
    budget: int | None  # bytes
    unconstrained_peak: int  # bytes: the checker's peak when everything is saved
    predicted_peak: int  # bytes: the checker's peak of the chosen plan
    added_time: float  # seconds of recomputation, by the device model
    added_flops: float
    status: str  # the solver's status
    gap: float
    solve_time: float  # seconds in the solver
    partition_time: float  # seconds for the whole partitioning
    saved: tuple[str, ...]  # FX names of saved tensors
    recomputed: tuple[str, ...]  # FX names of forward nodes recomputed in the backward
    problem: Problem
    plan: Plan


_RECORDS: deque[PartitionRecord] = deque(maxlen=64)


def records() -> list[PartitionRecord]:
    """Partition records of this process, oldest first (the last 64)."""
    return list(_RECORDS)


class RematPartitioner(CustomPartitionerFn):
    def __init__(self, options: Options) -> None:
        self.options = options

    def uuid(self) -> str:
        # Our sources and every option that changes the plan: a cached graph is reused
        # only for the same budget, solver settings and code.
        return f"{get_hash_for_files(_SOURCES)!r}-{self.options.cache_key()}"

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOTAutograd passes ``num_fwd_outputs`` and ``static_lifetime_input_indices``
        (and ``compiler``, which we ignore)."""
        t0 = time.perf_counter()
        num_fwd_outputs: int = kwargs["num_fwd_outputs"]
        static = list(kwargs.get("static_lifetime_input_indices") or [])
        joint = prepare(gm)
        device = device_of(joint, self.options)
        costs = annotate(joint, device, fuses=self.options.compiler == "inductor")
        captured = capture(joint, costs, num_fwd_outputs=num_fwd_outputs,
                           static_lifetime_input_indices=static,
                           host_bandwidth=device.host_bandwidth)
        unconstrained = save_all(captured.problem).report
        assert unconstrained is not None
        budget = None if self.options.budget is None else self.options.budget.resolve(unconstrained.peak)
        problem = captured.problem.with_budget(budget)
        result = plan_for(problem, self.options)
        assert result.plan is not None
        report = check(problem, result.plan)
        if not report.fits:
            raise AssertionError(f"plan peaks at {report.peak} B over budget {budget} B")
        emitted = emit(joint, captured, result.plan, num_fwd_outputs=num_fwd_outputs,
                       static_lifetime_input_indices=static)
        if self.options.verify:
            verify(joint, captured, result.plan, emitted)
        record = PartitionRecord(
            joint_nodes=len(joint.graph.nodes), values=len(problem.nodes),
            candidates=len(problem.candidates), budget=budget,
            unconstrained_peak=unconstrained.peak, predicted_peak=report.peak,
            added_time=report.added_time, added_flops=report.added_flops,
            status=result.status.value, gap=result.gap, solve_time=result.wall_time,
            partition_time=time.perf_counter() - t0, saved=emitted.saved,
            recomputed=emitted.recomputed, problem=problem, plan=result.plan,
        )
        _RECORDS.append(record)
        log.info("rematc: %d values, budget %s B, predicted peak %d B (unconstrained %d B), "
                 "+%.3g s, %s in %.2f s", record.values, budget, report.peak,
                 unconstrained.peak, report.added_time, record.status, record.solve_time)
        return emitted.forward, emitted.backward


def prepare(gm: fx.GraphModule) -> fx.GraphModule:
    """Dead-code elimination and CSE first (so the plan is made on the graph we emit and
    no later CSE can merge a recomputation away), then PyTorch's own must-save marks."""
    gm.graph.eliminate_dead_code()
    gm.graph = fx_graph_cse(gm.graph)
    gm.recompile()
    force_save_collectives(gm)
    force_save_effectful_ops(gm)
    force_save_bw_mutation_src(gm)
    return gm


def plan_for(problem: Problem, options: Options) -> SolveResult:
    """Saving everything is optimal whenever it fits (it adds no time): no search then."""
    unconstrained = save_all(problem)
    if unconstrained.plan is not None:
        return unconstrained
    return solve(problem, options.solver)


def device_of(gm: fx.GraphModule, options: Options) -> DeviceProfile:
    """The configured profile, else a guess from the device of the graph's inputs."""
    for n in gm.graph.find_nodes(op="placeholder"):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            kind = val.device.type
            name = torch.cuda.get_device_name(val.device) if kind == "cuda" else ""
            return profile_for(options.device, device_type=kind, device_name=name)
    return profile_for(options.device)
