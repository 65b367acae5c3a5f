"""rematc: activation-memory planning for PyTorch training under a byte budget.

``torch.compile(model, backend="rematc", options={"budget": "2GiB"})`` or
``rematc.compile(model, budget="2GiB")``.

The names below are imported on first use (PEP 562), so that ``import rematc`` and the
command line do not import torch until something needs it: ``rematc solve problem.json``
plans a problem file without torch (an import of seconds). Submodules that the package
imported eagerly before (``rematc.partition``, ``rematc.backend``, ...) are still found
as attributes.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from rematc.devices import PROFILES, DeviceProfile
from rematc.errors import NoPlanError, RematcError, SolverError
from rematc.options import Options
from solvers import InfeasibleBudgetError
from solvers.budget import Budget, parse_budget

if TYPE_CHECKING:
    from rematc._torch_compat import InductorFallbackWarning
    from rematc.backend import Backend, OverBudgetWarning, compile, rematc_backend
    from rematc.calls import (
        OutputsKeptError,
        OutputsKeptWarning,
        RepeatedForwardError,
        RepeatedForwardWarning,
    )
    from rematc.donation import DonationWarning
    from rematc.generated import GeneratedCodeWarning
    from rematc.partition import (
        BudgetWarning,
        GraphBreakWarning,
        PartitionRecord,
        SolverFallbackWarning,
        clear_records,
        records,
    )
    from rematc.regions import CarriedInputError, mark_regions

# name -> the module that defines it (each imports torch)
_LAZY = {
    "Backend": "rematc.backend",
    "compile": "rematc.backend",
    "rematc_backend": "rematc.backend",
    "OverBudgetWarning": "rematc.backend",
    "DonationWarning": "rematc.donation",
    "RepeatedForwardError": "rematc.calls",
    "OutputsKeptError": "rematc.calls",
    "OutputsKeptWarning": "rematc.calls",
    "mark_regions": "rematc.regions",
    "CarriedInputError": "rematc.regions",
    "RepeatedForwardWarning": "rematc.calls",
    "GeneratedCodeWarning": "rematc.generated",
    "InductorFallbackWarning": "rematc._torch_compat",
    "BudgetWarning": "rematc.partition",
    "GraphBreakWarning": "rematc.partition",
    "PartitionRecord": "rematc.partition",
    "SolverFallbackWarning": "rematc.partition",
    "clear_records": "rematc.partition",
    "records": "rematc.partition",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # binds the submodule here too
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "PROFILES",
    "Backend",
    "Budget",
    "BudgetWarning",
    "CarriedInputError",
    "DeviceProfile",
    "DonationWarning",
    "GeneratedCodeWarning",
    "GraphBreakWarning",
    "InductorFallbackWarning",
    "InfeasibleBudgetError",
    "NoPlanError",
    "Options",
    "OutputsKeptError",
    "OutputsKeptWarning",
    "OverBudgetWarning",
    "PartitionRecord",
    "RematcError",
    "RepeatedForwardError",
    "RepeatedForwardWarning",
    "SolverError",
    "SolverFallbackWarning",
    "clear_records",
    "compile",
    "mark_regions",
    "parse_budget",
    "records",
    "rematc_backend",
]
