"""rematc's own errors: each names the stage that failed and what to do about it.

``rematc.InfeasibleBudgetError`` (from :mod:`solvers`) is separate: it is not a failure
but an answer (the smallest feasible budget). Under ``torch.compile`` every error arrives
wrapped in Dynamo's ``BackendCompilerFailed``; the original is its ``inner_exception``.
"""

from __future__ import annotations


class RematcError(RuntimeError):
    """A stage of the partitioner failed; ``stage`` names it, ``__cause__`` is the original."""

    def __init__(self, stage: str, message: str) -> None:
        self.stage = stage
        super().__init__(f"rematc {stage}: {message}")


class SolverError(RematcError):
    """The solver raised: the model is not compiled. ``__cause__`` is the solver's exception."""


class NoPlanError(RematcError):
    """The solver stopped at its time limit without a plan within budget, and the greedy
    fallback found none either."""
