"""rematc: activation-memory planning for PyTorch training under a byte budget.

``torch.compile(model, backend="rematc", options={"budget": "2GiB"})`` or
``rematc.compile(model, budget="2GiB")``.
"""

from rematc.backend import Backend, compile, rematc_backend
from rematc.devices import PROFILES, DeviceProfile
from rematc.donation import DonationWarning
from rematc.errors import NoPlanError, RematcError, SolverError
from rematc.options import Options
from rematc.partition import (
    BudgetWarning,
    GraphBreakWarning,
    PartitionRecord,
    SolverFallbackWarning,
    clear_records,
    records,
)
from solvers import InfeasibleBudgetError
from solvers.budget import Budget, parse_budget

__all__ = [
    "PROFILES",
    "Backend",
    "Budget",
    "BudgetWarning",
    "DeviceProfile",
    "DonationWarning",
    "GraphBreakWarning",
    "InfeasibleBudgetError",
    "NoPlanError",
    "Options",
    "PartitionRecord",
    "RematcError",
    "SolverError",
    "SolverFallbackWarning",
    "clear_records",
    "compile",
    "parse_budget",
    "records",
    "rematc_backend",
]
