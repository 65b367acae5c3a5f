"""Inductor's buffer pool under a budget: reuse only by the very next kernel (rematc.backend).

The rule is checked on Inductor's own ``AllocateLine`` method, swapped in only while a
rematc compile runs; an Inductor compile under a budget then measures within its
prediction in ``tests/test_measured_peak.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from torch._inductor.codegen.wrapper import AllocateLine

from rematc.backend import adjacent_reuse, inductor_patches
from rematc.options import Options
from rematc.partition import RematPartitioner


def decide(free_index: int, alloc_index: int, *, comm: bool = False) -> bool:
    alloc = SimpleNamespace(comm_buffer=comm, scheduler_node_index=alloc_index)
    free = SimpleNamespace(scheduler_node_index=free_index)
    return bool(AllocateLine.should_reuse_buffer(alloc, free, 1 << 20))  # type: ignore[arg-type]


def test_only_the_next_kernel_reuses_a_freed_buffer_during_a_compile() -> None:
    inductor_rule = AllocateLine.should_reuse_buffer
    seen: dict[str, Any] = {}

    def inner(*args: Any, **kwargs: Any) -> str:
        seen["next"] = decide(4, 5)
        seen["later"] = [decide(4, k) for k in (6, 9)]
        seen["comm"] = decide(1, 9, comm=True)
        return "compiled"

    assert adjacent_reuse(inner)() == "compiled"
    assert seen == {"next": True, "later": [False, False], "comm": True}
    assert AllocateLine.should_reuse_buffer is inductor_rule  # restored


def test_the_rule_is_restored_when_the_compile_fails() -> None:
    inductor_rule = AllocateLine.should_reuse_buffer

    def failing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("lowering failed")

    with pytest.raises(RuntimeError, match="lowering failed"):
        adjacent_reuse(failing)()
    assert AllocateLine.should_reuse_buffer is inductor_rule


@pytest.mark.parametrize("budget", [None, "1MiB"])
def test_the_pool_stays_on(budget: str | None) -> None:
    options = Options.from_mapping({"budget": budget})
    patches = inductor_patches(options, RematPartitioner(options))
    assert "allow_buffer_reuse" not in patches
