"""Joint-graph size and solve time of rematc on GPT-style models of growing depth.

Runs Dynamo, AOTAutograd and Inductor's joint-graph passes exactly as
``torch.compile(backend="rematc")`` does, then rematc's partitioner, but skips Inductor's
code generation (nothing is executed): this measures what rematc adds to a compile.

    python bench/scale_gpt.py --layers 12 32 --budget 50%
    python bench/scale_gpt.py --layers 12 --budget 30% --device h100            # with offload
    python bench/scale_gpt.py --layers 12 --budget 30% --device h100 --host-bandwidth 0
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import partition_fn as inductor_partition_fn
from torch._inductor.decomposition import select_decomp_table

import rematc
from rematc.models import GPTConfig, make_gpt
from rematc.options import Options
from rematc.partition import RematPartitioner
from solvers import Decision


def partition_only(layers: int, budget: str, *, d_model: int, seq_len: int, batch: int, vocab: int,
                   time_limit: float, device: str | None = None,
                   host_bandwidth: float | None = None) -> rematc.PartitionRecord:
    torch._dynamo.reset()
    config = GPTConfig(n_layer=layers, d_model=d_model, n_head=max(1, d_model // 64),
                       seq_len=seq_len, vocab=vocab)
    model, inputs = make_gpt(config, batch=batch, seed=0)
    options = Options.from_mapping({"budget": budget, "time_limit": time_limit, "device": device,
                                    "host_bandwidth": host_bandwidth})
    nop = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=inductor_partition_fn,
                           decompositions=select_decomp_table())
    with inductor_config.patch(custom_partitioner_fn=RematPartitioner(options)):
        compiled = torch.compile(model, backend=backend)
        compiled(*inputs)  # tracing runs the partitioner; nothing real runs past it
    return rematc.records()[-1]


def step_gap(r: rematc.PartitionRecord) -> float:
    """The proven gap as a fraction of the step's estimated time (all ops once, plus what
    the plan adds): how much faster the best plan could make a step, at most. This is the
    gap on the total-cost objective Checkmate and Moccasin minimize; ``gap`` is on the
    added time alone."""
    step = sum(n.time for n in r.problem.nodes) + r.added_time
    return r.gap * r.added_time / step if step > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 32])
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--device", default=None, help="device profile (default: the inputs')")
    parser.add_argument("--host-bandwidth", type=float, default=None,
                        help="bytes/s to host memory (default: the profile's; 0: no offload)")
    args = parser.parse_args()
    print(f"{'layers':>6} {'joint nodes':>11} {'values':>7} {'decisions':>9} {'status':>9} "
          f"{'gap':>6} {'step gap':>8} {'solve s':>8} {'partition s':>11} {'trace s':>8} {'peak/unconstr.':>14} "
          f"{'added ms':>9} {'added FLOP %':>12} {'offloaded':>9}")
    for layers in args.layers:
        t0 = time.perf_counter()
        r = partition_only(layers, args.budget, d_model=args.d_model, seq_len=args.seq_len,
                           batch=args.batch, vocab=args.vocab, time_limit=args.time_limit,
                           device=args.device, host_bandwidth=args.host_bandwidth)
        total = time.perf_counter() - t0
        print(f"{layers:>6} {r.joint_nodes:>11} {r.values:>7} {r.candidates:>9} {r.status:>9} "
              f"{r.gap:>6.2%} {step_gap(r):>8.3%} {r.solve_time:>8.2f} {r.partition_time:>11.2f} {total:>8.1f} "
              f"{r.predicted_peak / r.unconstrained_peak:>14.2f} {r.added_time * 1e3:>9.3f} "
              f"{100 * r.added_flops / max(1.0, sum(n.flops for n in r.problem.nodes)):>12.2f} "
              f"{len(r.plan.of(Decision.OFFLOAD)) if r.plan else 0:>9}",
              flush=True)


if __name__ == "__main__":
    main()
