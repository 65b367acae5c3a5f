"""rematc's options: one frozen config, built from keyword arguments or ``options={...}``."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rematc.devices import PROFILES, DeviceProfile
from solvers import SolverConfig
from solvers.budget import Budget, parse_budget
from solvers.sat import MAX_SEED, MAX_WORKERS

# Stop within 1% of the step of the best plan, or 10 s after the last better plan: on the
# benchmark GPT-2 and Llama the bound is still far off when plans stop improving (at 45%
# of the unconstrained peak, the last better plan came at 12 s of a 60 s search), and a
# 10 s stall cost at most 0.3% of the added time in six of seven budgets measured (7% in
# the seventh, 1% of the step).
DEFAULT_SOLVER = SolverConfig(time_limit=60.0, step_gap=0.01, stall_time=10.0)
COMPILERS = ("inductor", "eager")
OUTPUTS = ("kept", "dropped")  # what the step does with the forward's outputs (Options.outputs)
# The environment variable read for a budget when none is given (as a size, a fraction
# or "auto"): a budget set without code changes.
BUDGET_ENV = "REMATC_BUDGET"
# ``cache_dir`` values: "auto" is $REMATC_CACHE_DIR when set, else ~/.cache/rematc;
# None or "off" turns the plan cache off (see rematc.plancache).
CACHE_AUTO, CACHE_OFF = "auto", "off"
# The slowest host link ``host_bandwidth`` may name, bytes/s: far below any real one (PCIe 3
# x16 moves 12 GB/s), and still enough to exercise offload plans. A link of 1e-300 made the
# solver's integer copy times overflow (a SolverError asking for a bug report); the problem
# also checks the copies it holds (solvers.Scale.MAX_COPY_UNITS).
MIN_HOST_BANDWIDTH = 1e6


@dataclass(frozen=True, kw_only=True)
class Options:
    # Peak memory of the step above what is alive before it (see docs/memory-model.md,
    # "What the budget bounds"); None plans without a limit, i.e. saves everything the
    # backward reads.
    budget: Budget | None = None
    # With budget "auto": the optimizer whose state and step the budget leaves room for
    # (a key of rematc.wholestep.OPTIMIZERS).
    optimizer: str = "adamw"
    # How the backend derived an "auto" budget, for the records; "" otherwise.
    budget_origin: str = ""
    # Codegen for the emitted forward and backward: Inductor, or plain FX run eagerly.
    compiler: str = "inductor"
    # Device profile for the runtime model: a name in rematc.devices.PROFILES or a
    # DeviceProfile; None guesses from the example inputs' device.
    device: str | DeviceProfile | None = None
    # CP-SAT limits: 60 s, and stop once the plan is provably within 1% of the step's
    # time of the best; a time-out still returns the best plan found.
    solver: SolverConfig = DEFAULT_SOLVER
    # Bytes/s each way between device and host memory, for offload decisions; None takes
    # the device profile's (0 on the CPU, where host memory is the device's own: set it
    # there only to exercise offload plans). 0 turns offloading off.
    host_bandwidth: float | None = None
    # Check the emitted graphs against the plan (use-after-def, exact recompute set,
    # one copy back per offload before its first use).
    verify: bool = True
    # Directory of the on-disk plan cache (rematc.plancache): a path, "auto"
    # ($REMATC_CACHE_DIR, else ~/.cache/rematc; resolved when a plan is cached, not at
    # import) or None/"off". On by default: a second run of a job skips every solve.
    cache_dir: str | os.PathLike[str] | None = CACHE_AUTO
    # Times each compiled forward runs before its backward in one step: 1 for a model
    # compiled whole; the number of blocks for a block compiled on its own (accelerate's
    # compile_regions, a per-block torch.compile), where every call keeps its saved values
    # until the backward. The plan leaves room for all of them (docs/reliability.md,
    # "Blocks compiled on their own").
    calls: int = 1
    # Bytes the step keeps free for memory allocated outside the compiled graphs while they
    # run, taken off every graph's budget and added to its prediction: FSDP2's gathered
    # parameters and unsharded gradients (rematc.compile sets it for a sharded model,
    # rematc.backend.fsdp_reserve), or what a user knows lies outside.
    reserve: int = 0
    # The forward's outputs other than the loss, after the forward returns: "kept" counts
    # them alive to the step's end, as a caller that holds them through the backward needs
    # (``out = model(x); out.loss.backward()``); "dropped" counts them freed as the forward
    # returns, as a caller that keeps only the loss has them (``model(x).loss.backward()``,
    # transformers' Trainer). Only a graph that returns a loss (a 0-dim tensor) drops its
    # other outputs, and a step that still holds one when its graph's backward starts stops
    # there with rematc.OutputsKeptError (a warning under a fraction budget).
    outputs: str = "kept"

    def __post_init__(self) -> None:
        from rematc.wholestep import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"option 'optimizer' must be one of {', '.join(OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        if self.outputs not in OUTPUTS:
            raise ValueError(f"option 'outputs' must be one of {OUTPUTS} (what the step does with the "
                             f"forward's outputs other than the loss), got {self.outputs!r}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"option 'compiler' must be one of {COMPILERS}, got {self.compiler!r}")
        device = self.device
        if not (device is None or isinstance(device, DeviceProfile)
                or (isinstance(device, str) and device.lower() in PROFILES)):
            raise ValueError(
                f"option 'device' must be one of {sorted(PROFILES)}, a DeviceProfile or None "
                f"(guess from the inputs), got {device!r}"
            )
        bw = self.host_bandwidth
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float))
                               or not math.isfinite(bw) or not (bw == 0 or bw >= MIN_HOST_BANDWIDTH)):
            raise ValueError(
                f"option 'host_bandwidth' must be 0 (no offloading), a number of bytes/s from "
                f"{MIN_HOST_BANDWIDTH:.0e} (1 MB/s) up, or None (the device's), got {bw!r}"
            )
        if isinstance(self.calls, bool) or not isinstance(self.calls, int) or self.calls < 1:
            raise ValueError(f"option 'calls' must be a positive int (how many times each compiled "
                             f"forward runs before its backward in one step), got {self.calls!r}")
        if isinstance(self.reserve, bool) or not isinstance(self.reserve, int) or self.reserve < 0:
            raise ValueError(f"option 'reserve' must be a non-negative int of bytes (memory outside the "
                             f"compiled graphs), got {self.reserve!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"option 'verify' must be True or False, got {self.verify!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(
                f"option 'cache_dir' must be a directory path, {CACHE_AUTO!r}, "
                f"{CACHE_OFF!r} or None, got {self.cache_dir!r}"
            )
        if isinstance(self.cache_dir, str) and not self.cache_dir.strip():
            raise ValueError(
                f"option 'cache_dir' is an empty string; pass a directory path, "
                f"{CACHE_AUTO!r}, {CACHE_OFF!r} or None"
            )

    @staticmethod
    def from_mapping(options: Mapping[str, Any] | None) -> Options:
        """From ``torch.compile(..., options={...})`` or keyword arguments.

        Keys: budget (bytes, a fraction, or "auto": docs/fit.md), optimizer (for "auto"),
        compiler, device, host_bandwidth, verify, cache_dir, calls (forwards in flight per
        step), reserve (bytes outside the compiled graphs), outputs ("kept" or "dropped": the
        forward's outputs besides the loss after the forward), and the solver's time_limit
        (seconds), workers, seed, gap (relative optimality gap to stop at), step_gap
        (stop once provably within this fraction of the step's time of the best plan),
        stall_time (stop once no better plan has been found for this many seconds; 0 never)
        and deterministic (the same plan on every run for a seed and worker count;
        :attr:`solvers.SolverConfig.deterministic`).
        """
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(
                f"rematc options must be a mapping such as {{'budget': '2GiB'}}, got "
                f"{type(options).__name__} {options!r}"
            )
        options = dict(options or {})
        if "regions" in options:
            raise ValueError(
                "option 'regions' needs the model, which a backend never sees: use "
                "rematc.compile(model, regions=True), or rematc.mark_regions(model) before "
                "torch.compile(model, backend='rematc', ...)")
        bad_keys = [k for k in options if not isinstance(k, str)]
        if bad_keys:
            raise ValueError(f"rematc option names must be strings, got {bad_keys!r}")
        solver_keys = {"time_limit": "time_limit", "workers": "workers", "seed": "seed",
                       "gap": "relative_gap", "step_gap": "step_gap", "stall_time": "stall_time"}
        own = {f.name for f in dataclasses.fields(Options)} - {"solver", "budget_origin"}
        unknown = set(options) - own - set(solver_keys) - {"deterministic"}
        if unknown:
            accepted = sorted(own | set(solver_keys) | {"deterministic"})
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, accepted, n=1))
                     else repr(k) for k in sorted(unknown)]
            raise ValueError(f"unknown rematc option(s) {', '.join(hints)}; accepted: {', '.join(accepted)}")
        solver_args: dict[str, Any] = {}
        for key, attr in solver_keys.items():
            if key in options:
                solver_args[attr] = _number(key, options.pop(key), integer=key in ("workers", "seed"))
        if "deterministic" in options:
            flag = options.pop("deterministic")
            if not isinstance(flag, bool):
                raise ValueError(f"option 'deterministic' must be True or False, got {flag!r}")
            solver_args["deterministic"] = flag
        if options.get("budget") is None and os.environ.get(BUDGET_ENV, "").strip():
            # A budget set without code changes (a trainer's compile call left as it is).
            try:
                options["budget"] = parse_budget(os.environ[BUDGET_ENV].strip())
            except ValueError as e:
                raise ValueError(f"${BUDGET_ENV}: {e}") from e
            options.setdefault("budget_origin", f"${BUDGET_ENV}={os.environ[BUDGET_ENV].strip()}")
        elif "budget" in options and options["budget"] is not None:
            options["budget"] = parse_budget(options["budget"])
        return Options(solver=dataclasses.replace(DEFAULT_SOLVER, **solver_args), **options)

    def cache_key(self) -> str:
        """Everything that changes the plan, for Inductor's FX-graph / AOT caches (where
        plans are cached on disk does not change them)."""
        return repr(dataclasses.replace(self, cache_dir=None))


# What each solver option accepts beyond "non-negative", for the checks and the messages.
_LIMITS: dict[str, tuple[float, str]] = {  # key: (largest value, note)
    "time_limit": (math.inf, " (seconds, greater than 0)"),
    "workers": (MAX_WORKERS, f" at most {MAX_WORKERS} (0 = 8, CP-SAT's full portfolio)"),
    "seed": (MAX_SEED, f" at most {MAX_SEED} (CP-SAT's seed is a 32-bit int)"),
    "gap": (1.0, " (a relative gap, at most 1: 0.05 stops within 5% of the bound)"),
    "step_gap": (1.0, " (a fraction of the step's time, at most 1: 0.01 stops within 1% of it)"),
    "stall_time": (math.inf, " (seconds without a better plan; 0 = never)"),
}


def _number(key: str, value: Any, *, integer: bool) -> float | int:
    high, note = _LIMITS[key]
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    ok = ok and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= high
    if ok and key == "time_limit" and value == 0:
        ok = False  # CP-SAT would stop before it starts
    if not ok:
        kind = "a non-negative int" if integer else "a non-negative number"
        raise ValueError(f"option {key!r} must be {kind}{note}, got {value!r}")
    return value
