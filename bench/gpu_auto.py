"""``budget="auto"`` on a GPU, where the step does not fit without a plan.

A ballast tensor cuts the device's free memory to what the step needs with half its
activations (and the ``auto`` reserve on top), so that the eager step and the default
``torch.compile`` run out of memory. The same model compiled with
``budget="auto"`` then takes its budget from the free memory when it
compiles, and the check is that its steps run and that their measured peak
(``torch.cuda.max_memory_allocated`` above the bytes allocated before the first step,
the optimizer's state included, as its first step allocates it) stays within the free
memory the budget was derived from.

    python -m bench.gpu_auto OUT [--batch 32] [--precision fp32|bf16-mixed]

Writes ``OUT/gpu-auto.json`` and prints the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rematc
from rematc.devices import profile_for
from rematc.models import GPTConfig, make_gpt
from rematc.wholestep import AUTO_RESERVE, OPTIMIZERS

CONFIG = GPTConfig(n_layer=4, d_model=1024, n_head=16, seq_len=1024, vocab=8192)
STEPS = 3


def _free() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _steps(fn: Callable[..., torch.Tensor], model: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
           precision: str, steps: int = STEPS) -> dict[str, Any]:
    """``steps`` training steps (AdamW, fresh state) of ``fn``: the peak of all and of each
    above the bytes allocated before the first, or the out-of-memory error."""
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result: dict[str, Any] = {"ok": True, "each": []}
    try:
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = fn(*inputs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
            torch.cuda.synchronize()
            result["each"].append(torch.cuda.max_memory_allocated() - before)
            torch.cuda.reset_peak_memory_stats()
        result["peak"] = max(result["each"])
        result["reserved"] = torch.cuda.max_memory_reserved()
    except torch.OutOfMemoryError as error:
        result = {"ok": False, "error": str(error).splitlines()[0][:200]}
    except RuntimeError as error:  # a crash is a result of the check too, not the end of it
        result = {"ok": False, "crash": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    del opt
    model.zero_grad(set_to_none=True)
    return result


def check_auto(*, batch: int = 32, precision: str = "fp32") -> dict[str, Any]:
    """The rows of the check (module docstring); raises where the ballast cannot be sized."""
    model, inputs = make_gpt(CONFIG, batch=batch, seed=0, device="cuda")
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    adamw = OPTIMIZERS["adamw"]
    state, temporaries = adamw.state * params, adamw.foreach_temporaries * params

    unconstrained = _steps(model, model, inputs, precision, steps=1)
    assert unconstrained["ok"], unconstrained
    activations = unconstrained["peak"] - state - temporaries
    free, total = _free(), torch.cuda.mem_get_info()[1]
    reserve = math.ceil(AUTO_RESERVE * total)
    target = reserve + state + temporaries + activations // 2
    if target >= free:
        raise RuntimeError(f"the device has {free} B free, less than the {target} B the check leaves")
    ballast = torch.empty(free - target, dtype=torch.uint8, device="cuda")
    rows: dict[str, Any] = {"batch": batch, "precision": precision, "parameter_bytes": params,
                            "eager_peak_unconstrained": unconstrained["peak"], "free_left": _free(),
                            "total": total}

    rows["eager"] = _steps(model, model, inputs, precision)
    rows["free_before_default_compile"] = _free()
    torch._dynamo.reset()
    rows["default_compile"] = _steps(torch.compile(model), model, inputs, precision)

    rows["free_before_auto"] = _free()
    torch._dynamo.reset()
    rematc.clear_records()
    compiled = rematc.compile(model, budget="auto")
    rows["auto"] = _steps(compiled, model, inputs, precision)
    graphs = rematc.records()
    rows["records"] = [{"budget": r.budget, "budget_origin": r.budget_origin,
                        "predicted_peak": r.predicted_peak, "unconstrained_peak": r.unconstrained_peak,
                        "generated_peak": r.generated_peak, "generated_at": r.generated_at,
                        "generated_alive": r.generated_alive[:6], "squeezed": r.squeezed,
                        "undonated": r.undonated, "solver": r.solver,
                        "offloaded": len(r.plan.transfers)} for r in graphs]
    # Within what was free when it compiled, less the reserve the derivation keeps.
    room = rows["free_before_auto"] - reserve
    if rows["auto"]["ok"]:
        rows["auto"]["within_free_less_reserve"] = rows["auto"]["peak"] <= room
        rows["auto"]["peak_over_room"] = rows["auto"]["peak"] / room
        # The first step compiles; the later ones run the compiled code only.
        rows["auto"]["later_steps_over_room"] = max(rows["auto"]["each"][1:]) / room
        workspace = profile_for(None, device_type="cuda", device_name=torch.cuda.get_device_name()).workspace
        predicted = max(sum(r.predicted_peak for r in graphs), params + temporaries) + state + workspace
        rows["auto"]["predicted_step_peak"] = predicted
        rows["auto"]["measured_over_predicted"] = rows["auto"]["peak"] / predicted
        rows["auto"]["later_steps_over_predicted"] = max(rows["auto"]["each"][1:]) / predicted
    del ballast
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed"))
    args = parser.parse_args()
    rows = check_auto(batch=args.batch, precision=args.precision)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu-auto-{args.precision}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
