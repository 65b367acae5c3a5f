"""rematc's options: one frozen config, built from keyword arguments or ``options={...}``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rematc.devices import PROFILES, DeviceProfile
from solvers import SolverConfig
from solvers.budget import Budget, parse_budget

COMPILERS = ("inductor", "eager")


@dataclass(frozen=True, kw_only=True)
class Options:
    # Peak memory of the step above what is alive before it (see README, "What the budget
    # bounds"); None plans without a limit, i.e. saves everything the backward reads.
    budget: Budget | None = None
    # Codegen for the emitted forward and backward: Inductor, or plain FX run eagerly.
    compiler: str = "inductor"
    # Device profile for the runtime model: a name in rematc.devices.PROFILES or a
    # DeviceProfile; None guesses from the example inputs' device.
    device: str | DeviceProfile | None = None
    # CP-SAT limits; 60 s is far above what test-sized graphs need, and a time-out still
    # returns the best plan found.
    solver: SolverConfig = field(default_factory=lambda: SolverConfig(time_limit=60.0))
    # Check the emitted graphs against the plan (use-after-def, exact recompute set).
    verify: bool = True

    def __post_init__(self) -> None:
        if self.compiler not in COMPILERS:
            raise ValueError(f"option 'compiler' must be one of {COMPILERS}, got {self.compiler!r}")
        if isinstance(self.device, str) and self.device.lower() not in PROFILES:
            raise ValueError(
                f"option 'device' must be one of {sorted(PROFILES)} or a DeviceProfile, "
                f"got {self.device!r}"
            )
        if not isinstance(self.verify, bool):
            raise ValueError(f"option 'verify' must be True or False, got {self.verify!r}")

    @staticmethod
    def from_mapping(options: Mapping[str, Any] | None) -> Options:
        """From ``torch.compile(..., options={...})`` or keyword arguments.

        Keys: budget, compiler, device, verify, and the solver's time_limit (seconds),
        workers, seed and gap (relative optimality gap to stop at).
        """
        options = dict(options or {})
        solver_keys = {"time_limit": "time_limit", "workers": "workers", "seed": "seed",
                       "gap": "relative_gap"}
        own = {f.name for f in dataclasses.fields(Options)} - {"solver"}
        unknown = set(options) - own - set(solver_keys)
        if unknown:
            accepted = ", ".join(sorted(own | set(solver_keys)))
            raise ValueError(f"unknown rematc option(s) {sorted(unknown)}; accepted: {accepted}")
        solver_args: dict[str, Any] = {}
        for key, attr in solver_keys.items():
            if key in options:
                solver_args[attr] = _number(key, options.pop(key), integer=key in ("workers", "seed"))
        if "budget" in options and options["budget"] is not None:
            options["budget"] = parse_budget(options["budget"])
        return Options(solver=SolverConfig(**{"time_limit": 60.0, **solver_args}), **options)

    def cache_key(self) -> str:
        """Everything that changes the plan, for Inductor's FX-graph / AOT caches."""
        return repr(self)


def _number(key: str, value: Any, *, integer: bool) -> float | int:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or value < 0:
        kind = "a non-negative int" if integer else "a non-negative number"
        raise ValueError(f"option {key!r} must be {kind}, got {value!r}")
    return value
