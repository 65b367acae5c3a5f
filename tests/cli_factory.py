"""A model factory for the command-line tests: ``tests.cli_factory:mlp``."""

from __future__ import annotations

import torch
from torch import nn

from rematc.models import MLPConfig, make_mlp


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A small MLP whose forward returns the loss, with example inputs."""
    return make_mlp(MLPConfig(), batch=64, seed=0)
