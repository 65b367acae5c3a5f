"""Regional against whole-model compilation of a deep transformers Llama or GPT-2, side by side.

Each configuration runs in a fresh process (Dynamo and Inductor start cold; Inductor's
caches are off), the processes alternating over ``--rounds``. Each reports its first
step (compile, plan and run), the median of its next steps, and its measured peak (the
profiler's allocation events over one step, above what was alive before it). rematc's
budgets are set from HF gradient checkpointing's measured peak under the default
``torch.compile``, measured first in the same run.

    python -m bench.regions --layers 32 --rounds 2 --out bench/results/regions
    python -m bench.regions --model gpt2 --layers 32 --rounds 2 --out bench/results/regions

``--hidden``, ``--seq`` and ``--device cuda`` run a wider, longer model on a GPU (TF32
matmuls; peaks from CUDA's caching allocator, above what was alive before the step):

    python -m bench.regions --layers 8 --hidden 2048 --seq 1024 --device cuda --out bench/results/gpu-h200

``--side-by-side`` compares steps in one process instead: HF gradient checkpointing under
the default whole-model ``torch.compile`` and rematc ``regions=True`` at its measured peak
(given as ``--budget``, or measured first), both built from the same weights, their steps
alternated, each pair's ratio taken (a slow moment of the machine slows both of a pair);
prints the medians and the median ratio:

    python -m bench.regions --model gpt2 --layers 32 --side-by-side --pairs 15

Configurations: ``compile`` (default ``torch.compile``, whole model), ``compile_regional``
(each decoder layer ``.compile()``d, PyTorch's regional recipe), ``hf_ckpt`` (HF
``gradient_checkpointing_enable()``, whole-model compile), and rematc at a share of
``hf_ckpt``'s peak: ``rematc_whole@S``, ``rematc_regions@S`` and ``rematc_regions_warm@S``
(a second process reading the plan cache the first wrote).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 2**20
STEPS = 5  # steps timed after the first


MODELS = ("llama", "gpt2")


@dataclass(frozen=True)
class Shape:
    """The model of a run: transformers' causal LM of ``model``'s kind, ``layers`` deep,
    ``hidden`` wide (heads of 32 at width 128 and 256, of 64 above; Llama: half as many KV
    heads, MLP 2.6875x wide), vocabulary 1024, no dropout, random weights, on ``device``;
    steps of ``batch`` x ``seq`` tokens."""

    model: str = "llama"
    layers: int = 32
    batch: int = 4
    hidden: int = 128
    seq: int = 256
    device: str = "cpu"

    def args(self) -> list[str]:
        return ["--model", self.model, "--layers", str(self.layers), "--batch", str(self.batch),
                "--hidden", str(self.hidden), "--seq", str(self.seq), "--device", self.device]

    def stem(self) -> str:
        """llama32, gpt2-32; the width, length and device where they are not the defaults."""
        stem = f"{self.model}{'-' if self.model[-1].isdigit() else ''}{self.layers}"
        stem += f"-h{self.hidden}" if self.hidden != 128 else ""
        stem += f"-seq{self.seq}" if self.seq != 256 else ""
        return stem + (f"-{self.device}" if self.device != "cpu" else "")


def build(shape: Shape) -> tuple[Any, Any]:
    """``shape``'s model, in training mode on its device, and a batch of token ids there."""
    import torch
    import transformers

    torch.manual_seed(0)
    heads = 4 if shape.hidden <= 256 else shape.hidden // 64
    if shape.model == "gpt2":
        config: Any = transformers.GPT2Config(n_embd=shape.hidden, n_head=heads, n_layer=shape.layers,
                                              vocab_size=1024, n_positions=shape.seq, resid_pdrop=0.0,
                                              embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        config._attn_implementation = "sdpa"
        lm: Any = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.hidden * 344 // 128,
                                          num_attention_heads=heads, num_key_value_heads=heads // 2,
                                          num_hidden_layers=shape.layers, vocab_size=1024,
                                          max_position_embeddings=shape.seq, use_cache=False)
        config._attn_implementation = "sdpa"
        lm = transformers.LlamaForCausalLM(config)
    lm.train()
    ids = torch.randint(0, 1024, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(0))
    if shape.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls, as training on the GPU runs
    return lm.to(shape.device), ids.to(shape.device)


def _sync(shape: Shape) -> None:
    import torch

    if shape.device.startswith("cuda"):
        torch.cuda.synchronize(shape.device)


def worker(config: str, shape: Shape, budget: int | None, cache: str, outputs: str = "kept",
           diagnose: bool = False) -> dict[str, Any]:
    """One configuration in this process: its first step, step median, peak and loss;
    ``diagnose``: :func:`where_peaks` printed as well."""
    import torch

    import rematc
    from rematc.memory import measure_peak
    from rematc.regions import repeated_blocks

    model, ids = build(shape)
    if config == "hf_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config in ("compile", "hf_ckpt"):
        compiled: Any = torch.compile(model)
    elif config == "compile_regional":
        found = repeated_blocks(model)
        assert found is not None
        for layer in found[1]:
            layer.compile()
        compiled = model
    else:
        compiled = rematc.compile(model, budget=budget, cache_dir=cache, outputs=outputs,
                                  regions=config.startswith("rematc_regions"))

    def step() -> float:
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.item())

    t = time.perf_counter()
    loss = step()
    first = time.perf_counter() - t
    times = []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        _sync(shape)
        t = time.perf_counter()
        step()  # .item() waits for the device
        times.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    peak = measure_peak(step, device=shape.device)
    records = rematc.records()
    if diagnose:
        where_peaks(step, shape, records)
    # the step's predicted peak: the largest of what each graph's plan counts on while it
    # runs (every call, the graphs before it, the later graphs' gradients); a mix's plans
    # carry the mix's
    predicted = max((r.own_need for r in records), default=None)
    solve = sum(r.partition_time for r in records)
    # blocks whose inputs a regional plan recomputes from an earlier one's
    recomputed = max((r.inputs_recomputed for r in records), default=0)
    offloaded = max((r.inputs_offloaded for r in records), default=0)  # to host memory
    return {"config": config, "budget": budget, "first_step": first, "step": statistics.median(times),
            "peak": peak, "predicted": predicted, "loss": loss, "partition_time": solve,
            "inputs_recomputed": recomputed, "inputs_offloaded": offloaded,
            # saving everything is checked, never searched for, so never cached
            "cached": all(r.cached or r.solver == "save_all" for r in records) if records else None}


def where_peaks(step: Any, shape: Shape, records: Any, top: int = 25) -> None:
    """Prints each graph's plan (calls, holds, predicted and generated peaks, own need)
    and, on CUDA, the allocator's blocks alive at one step's peak, each with the line of
    generated code (or the Python frames) that allocated it (:func:`bench.replay.cuda_history`)."""
    import torch

    for r in records:
        print(f"plan {r.graph}: calls {r.calls}, {r.solver}, holds {r.holds:,}, predicted {r.predicted_peak:,}, "
              f"generated {r.generated_peak}, own need {r.own_need:,}, step need {r.step_need:,}, "
              f"held before {r.held_before:,}", file=sys.stderr)
    if not shape.device.startswith("cuda"):
        return
    from bench.replay import cuda_history

    device = torch.device(shape.device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    held, blocks = cuda_history(step, device, None)
    print(f"allocator: {held:,} B allocated in the step at its peak ({before:,} B before), "
          f"{len(blocks)} blocks", file=sys.stderr)
    for block in blocks[:top]:
        print(f"    {block.nbytes:>14,}  {block.where[:220]}", file=sys.stderr)


def side_by_side(shape: Shape, budget: int, pairs: int = 15) -> dict[str, Any]:
    """HF checkpointing (whole-model compile) and rematc ``regions=True`` at ``budget`` in
    this process, their steps alternated (``pairs`` of each after a first step and two
    warm-up steps): the step medians, the median of the pairs' ratios (rematc over HF's),
    and the losses of their first steps."""
    import torch

    import rematc

    hf, ids = build(shape)
    ours, _ = build(shape)
    ours.load_state_dict(hf.state_dict())
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # rematc's first step first, though either order plans alike (rematc.partition.GraphKey)
    steps = {"rematc_regions": (ours, rematc.compile(ours, budget=budget, cache_dir="off", regions=True)),
             "hf_ckpt": (hf, torch.compile(hf))}

    def step(name: str) -> tuple[float, float]:
        model, compiled = steps[name]
        model.zero_grad(set_to_none=True)
        _sync(shape)
        t = time.perf_counter()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        value = float(loss.item())
        return time.perf_counter() - t, value

    losses = {name: step(name)[1] for name in steps}
    for _ in range(2):
        for name in steps:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for k in range(pairs):
        for name in (list(steps) if k % 2 == 0 else list(steps)[::-1]):
            times[name].append(step(name)[0])
    ratios = [a / b for a, b in zip(times["rematc_regions"], times["hf_ckpt"], strict=True)]
    assert rematc.records(), "rematc planned no graph"
    return {"budget": budget, "losses": losses, "pairs": pairs,
            "step": {name: statistics.median(t) for name, t in times.items()},
            "ratio": statistics.median(ratios), "ratios": sorted(ratios)}


def run(config: str, shape: Shape, budget: int | None, cache: str, outputs: str = "kept") -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    args = [sys.executable, "-m", "bench.regions", "--worker", config, *shape.args(), "--cache", cache,
            "--outputs", outputs] + ([] if budget is None else ["--budget", str(budget)])
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        said = done.stderr.strip().splitlines() or ["?"]
        errors = [line for line in said if "Error: " in line]  # rematc's, not Dynamo's boilerplate after it
        return {"config": config, "budget": budget, "error": (errors or said)[-1]}
    return dict(json.loads(lines[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--hidden", type=int, default=128, help="the model's width")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (TF32 matmuls; peaks from CUDA's allocator)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.8])
    parser.add_argument("--only", nargs="+", help="run only the configurations named (prefixes)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker")
    parser.add_argument("--budget", type=int)
    parser.add_argument("--cache", default="off")
    parser.add_argument("--side-by-side", action="store_true",
                        help="HF checkpointing and rematc regions=True in one process, steps alternated")
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--outputs", choices=("kept", "dropped"), default="kept",
                        help="rematc's outputs option: the step keeps only the loss, so 'dropped' is its "
                             "exact count; 'kept' counts the logits alive to the step's end")
    parser.add_argument("--diagnose", action="store_true",
                        help="with --worker: each graph's plan, and on CUDA what is alive at the step's peak")
    a = parser.parse_args()
    shape = Shape(a.model, a.layers, a.batch, a.hidden, a.seq, a.device)
    if a.side_by_side:
        budget = a.budget or run("hf_ckpt", shape, None, "off")["peak"]
        result = side_by_side(shape, budget, a.pairs)
        print(json.dumps(result))
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / f"{shape.stem()}-side-by-side.json").write_text(json.dumps(result, indent=1) + "\n")
        return
    if a.worker:
        print(json.dumps(worker(a.worker, shape, a.budget, a.cache, a.outputs, a.diagnose)))
        return
    rows: list[dict[str, Any]] = []
    reference = run("hf_ckpt", shape, None, "off")
    rows.append({**reference, "round": 0})
    for r in range(a.rounds):
        plans = tempfile.mkdtemp(prefix="rematc-plans-")
        configs: list[tuple[str, int | None, str]] = [("compile", None, "off"), ("compile_regional", None, "off"),
                                                     ("hf_ckpt", None, "off")]
        for share in a.shares:
            nbytes = int(share * reference["peak"])
            configs += [(f"rematc_regions@{share}", nbytes, plans), (f"rematc_regions_warm@{share}", nbytes, plans)]
        configs.append((f"rematc_whole@{a.shares[0]}", int(a.shares[0] * reference["peak"]), "off"))
        if a.only:
            configs = [c for c in configs if any(c[0].startswith(p) for p in a.only)]
        if r % 2:  # alternate the order, the warm runs still after their cold ones
            configs = configs[::-1]
            configs = sorted(configs, key=lambda c: "_warm@" in c[0])
        for config, budget, cache in configs:
            row = {**run(config.split("@")[0].replace("_warm", ""), shape, budget, cache, a.outputs),
                   "config": config, "round": r + 1, "outputs": a.outputs}
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = render(rows, shape)
    if a.outputs == "dropped":
        table += "\n\nrematc's rows with outputs='dropped' (the step keeps only the loss)."
    print(table)
    if a.out and a.only:  # a partial run beside the last full one
        a.out = a.out / "partial"
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = shape.stem() + ("-regions-outputs-dropped" if a.outputs == "dropped" else "-regions")
        stem += f"-batch{a.batch}" if a.batch != 4 else ""
        (a.out / f"{stem}.md").write_text(table + "\n")
        (a.out / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")


def render(rows: list[dict[str, Any]], shape: Shape) -> str:
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["round"]:
            by.setdefault(row["config"], []).append(row)
    base = by.get("compile", [])
    name = "GPT-2" if shape.model == "gpt2" else "Llama"
    where = "CPU" if shape.device == "cpu" else f"{shape.device}, TF32 matmuls"
    out = [f"transformers {name}, {shape.layers} layers, hidden {shape.hidden}, batch {shape.batch}, "
           f"seq {shape.seq} ({where}, medians over rounds)", "",
           "| config | budget MiB | first step s | x compile's | step s | x hf_ckpt's | peak MiB | predicted MiB | loss |",
           "|---|---|---|---|---|---|---|---|---|"]
    ckpt = by.get("hf_ckpt", [])
    for config, runs in by.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            out.append(f"| {config} | {runs[0].get('budget')} | {runs[0]['error'][:80]} | | | | | | |")
            continue
        first = statistics.median(r["first_step"] for r in ok)
        step = statistics.median(r["step"] for r in ok)
        regional = config.startswith("rematc_regions") or config == "compile_regional"
        ref = by.get("compile_regional" if regional else "compile", base)
        ref_first = statistics.median(r["first_step"] for r in ref if "error" not in r) if ref else float("nan")
        ref_step = statistics.median(r["step"] for r in ckpt if "error" not in r) if ckpt else float("nan")
        budget = ok[0]["budget"]
        predicted = ok[0].get("predicted")
        out.append(f"| {config} | {'' if budget is None else f'{budget / MiB:.2f}'} | {first:.1f} | "
                   f"{first / ref_first:.2f} | {step:.3f} | {step / ref_step:.2f} | {max(r['peak'] for r in ok) / MiB:.2f} | "
                   f"{'' if predicted is None else f'{predicted / MiB:.2f}'} | {ok[0]['loss']:.5f} |")
    out += ["", "x compile's: the first step against the default compile of the same kind (regional "
            "against compile_regional, whole against compile)."]
    return "\n".join(out)


if __name__ == "__main__":
    main()
