"""One rank of the distributed test: train the tiny GPT a few SGD steps under DDP and
FSDP2 (fully_shard), compiled with rematc and with aot_eager, and report the losses.

Run as ``python -m tests.dist_worker OUT_JSON`` with MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE set (what torchrun sets).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import rematc
from rematc.models import GPTConfig, make_gpt

STEPS = 3
BATCH = 2
BLOCKS_SHARE = 0.8  # of the per-block reference's measured peak: the budget per rank
# torchtitan's recipe runs on a longer sequence and a larger batch than the tiny GPT's: its
# activations, not its parameters (which FSDP2 gathers outside the graphs), make the step's
# peak, so that a budget below the reference's binds beside the room kept for FSDP2.
BLOCKS_CONFIG = GPTConfig.tiny(seq_len=64)
BLOCKS_BATCH = 4


def sgd_steps(model: torch.nn.Module, compiled: Any, idx: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """:data:`STEPS` SGD steps of ``compiled`` (``model``, compiled); their losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = compiled(idx, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train(wrapper: str, backend: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    model, _ = make_gpt(GPTConfig.tiny(), batch=BATCH, seed=0)
    _, (idx, targets) = make_gpt(GPTConfig.tiny(), batch=BATCH, seed=100 + rank)  # own data
    if wrapper == "ddp":
        wrapped: torch.nn.Module = DistributedDataParallel(model)
    else:
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        wrapped = fully_shard(model)
    compiled = torch.compile(wrapped, backend=backend)
    before = len(rematc.records())
    losses = sgd_steps(model, compiled, idx, targets)
    new = rematc.records()[before:]
    return {"losses": losses, "graphs": len(new),
            "budgets": [r.budget for r in new], "peaks": [r.predicted_peak for r in new],
            "recomputed": sum(len(r.recomputed) for r in new),
            "collectives": sum(1 for r in new for n in r.problem.nodes if "c10d" in n.op)}


def train_blocks(route: str, budget: int | None) -> dict[str, Any]:
    """torchtitan's recipe: ``fully_shard`` each block and the root, then compile each
    block (``route`` "blocks", with ``aot_eager`` for the reference) or the model
    regionally ("regions"); the step's peak measured at the last step."""
    from rematc.memory import profiler_peak

    rank = dist.get_rank()
    model, _ = make_gpt(BLOCKS_CONFIG, batch=BLOCKS_BATCH, seed=0)
    _, (idx, targets) = make_gpt(BLOCKS_CONFIG, batch=BLOCKS_BATCH, seed=100 + rank)
    blocks = model.blocks  # type: ignore[union-attr]
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    options = {"budget": budget, "compiler": "eager", "workers": 1, "cache_dir": None}
    if route == "reference":
        for block in blocks:
            block.compile(backend="aot_eager")
        compiled: Any = model
    elif route == "blocks":
        backend = rematc.Backend(rematc.Options.from_mapping({**options, "calls": len(blocks)}))
        for block in blocks:
            block.compile(backend=backend)
        compiled = model
    else:
        compiled = rematc.compile(model, regions=True, **options)  # type: ignore[arg-type]
    losses = sgd_steps(model, compiled, idx, targets)
    model.zero_grad(set_to_none=True)
    peak = profiler_peak(lambda: compiled(idx, targets).backward())
    return {"losses": losses, "peak": peak, "budget": budget}


def train_blocks_saying(route: str, budget: int, said: str) -> dict[str, Any]:
    """:func:`train_blocks`, and whether a warning of the step's says ``said``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train_blocks(route, budget)
    return {**result, "warned": any(said in str(w.message) for w in caught)}


# What rematc.compile says of the room it keeps for FSDP2 (rematc.backend.compile), and what
# a backend given ``calls`` says of the memory outside its graphs (Backend._say_outside).
SHARDED_SAID = "is sharded with FSDP2"
OUTSIDE_SAID = "not counted"


def train_regions_within(budget: int) -> dict[str, Any]:
    """:func:`train_blocks` regionally at ``budget``, or where rematc states it cannot be
    met, at the smallest budget it states (both ranks agree on it: the same shapes)."""
    try:
        return {**train_blocks_saying("regions", budget, SHARDED_SAID), "asked": budget}
    except torch._dynamo.exc.BackendCompilerFailed as e:
        inner = e.inner_exception
        if not isinstance(inner, rematc.InfeasibleBudgetError) or inner.min_feasible is None:
            raise
        stated = inner.min_feasible
    torch._dynamo.reset()
    return {**train_blocks_saying("regions", stated, SHARDED_SAID), "asked": budget}


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    # DDP under torch.compile splits the graph at bucket boundaries (DDPOptimizer); one
    # graph per step keeps the comparison about rematc, not about the split.
    torch._dynamo.config.optimize_ddp = False
    results: dict[str, Any] = {}
    try:
        for wrapper in ("ddp", "fsdp2"):
            torch._dynamo.reset()
            results[f"{wrapper}/reference"] = train(wrapper, "aot_eager")
            torch._dynamo.reset()
            results[f"{wrapper}/rematc"] = train(
                wrapper, rematc.Backend(rematc.Options.from_mapping(
                    {"budget": "93%", "compiler": "eager", "workers": 1, "cache_dir": None})))
        torch._dynamo.reset()
        reference = train_blocks("reference", None)
        results["blocks/reference"] = reference
        budget = int(BLOCKS_SHARE * reference["peak"])
        torch._dynamo.reset()
        results["blocks/blocks"] = train_blocks_saying("blocks", budget, OUTSIDE_SAID)
        torch._dynamo.reset()
        results["blocks/regions"] = train_regions_within(budget)
        with open(f"{out_path}.{os.environ['RANK']}", "w") as f:
            json.dump(results, f)
        # Neither rank tears down while the other still talks to it (rank 0 hosts the store).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    # Skip interpreter finalization: gloo's C++ threads can still hold Python objects
    # then, and their release aborts the process ("terminate called without an active
    # exception", seen once in CI on one rank; pytorch#179291 describes the mechanism).
    # An error above still exits non-zero through its exception.
    os._exit(0)


if __name__ == "__main__":
    main()
