"""A model factory for the command-line tests: ``tests.cli_factory:mlp``."""

from __future__ import annotations

import torch
from torch import nn

from rematc.models import MLPConfig, make_mlp


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A small MLP whose forward returns the loss, with example inputs."""
    return make_mlp(MLPConfig(), batch=64, seed=0)


class _Loss(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).sum()


def mismatched() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A model whose second layer does not fit its first: tracing fails with a shape error."""
    return _Loss(nn.Sequential(nn.Linear(8, 4), nn.Linear(5, 1))), (torch.randn(2, 8),)
