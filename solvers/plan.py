"""Plans: what happens to each forward value the backward needs, and in which order.

A plan is data. ``decisions`` maps each such value to a :class:`Decision`; ``schedule``
lists the recomputations and reloads the backward runs, in execution order, each just
before a backward step. :func:`plan_from_decisions` derives the canonical schedule: each
value is rematerialized right before the first backward step that needs it, directly or
through another rematerialized value, in topological order within a step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from solvers.problem import Problem


class Decision(enum.Enum):
    """The fate of one forward value the backward reads."""

    SAVE = "save"  # kept on the device from the forward to its last backward use
    RECOMPUTE = "recompute"  # freed after the forward, recomputed before its first backward use
    OFFLOAD = "offload"  # copied to host memory after its last forward use, reloaded for the backward


class PlanError(ValueError):
    """A plan that cannot run on its problem; the message names the value and the reason."""


@dataclass(frozen=True)
class Step:
    """Rematerialize (recompute or reload) value ``node`` just before backward step ``before``."""

    node: int
    before: int


@dataclass(frozen=True)
class Plan:
    decisions: Mapping[int, Decision]
    schedule: tuple[Step, ...] = ()

    def __post_init__(self) -> None:
        frozen = dict(self.decisions)
        for k, v in frozen.items():
            if not isinstance(v, Decision):
                raise PlanError(f"decision for value #{k} is {v!r}; use solvers.Decision")
        object.__setattr__(self, "decisions", MappingProxyType(frozen))
        object.__setattr__(self, "schedule", tuple(self.schedule))

    def of(self, decision: Decision) -> tuple[int, ...]:
        return tuple(sorted(i for i, d in self.decisions.items() if d is decision))

    def to_json(self) -> dict[str, object]:
        return {
            "decisions": {str(k): v.value for k, v in sorted(self.decisions.items())},
            "schedule": [[s.node, s.before] for s in self.schedule],
        }

    @staticmethod
    def from_json(data: Mapping[str, object]) -> Plan:
        try:
            raw = data["decisions"]
            sched = data.get("schedule", [])
            assert isinstance(raw, Mapping) and isinstance(sched, list)
            decisions = {int(k): Decision(v) for k, v in raw.items()}
            schedule = tuple(Step(int(a), int(b)) for a, b in sched)
        except (KeyError, ValueError, TypeError, AssertionError) as e:
            raise PlanError(f"malformed plan JSON: {e!r}") from None
        return Plan(decisions, schedule)


def plan_from_decisions(problem: Problem, decisions: Mapping[int, Decision]) -> Plan:
    """The canonical plan for ``decisions``: rematerialize each value right before the first
    backward step that needs it (its own backward reads, or the step of a recomputed
    forward user), in topological order within a step.

    Values whose anchor cannot be found (never needed) keep no schedule entry; the checker
    reports them.
    """
    anchor = rematerialize_anchors(problem, decisions)
    steps = [Step(i, a) for i, a in anchor.items()]
    steps.sort(key=lambda s: (s.before, s.node))
    return Plan(decisions, tuple(steps))


def rematerialize_anchors(problem: Problem, decisions: Mapping[int, Decision]) -> dict[int, int]:
    """For each recomputed or offloaded value, the first backward step that needs it."""
    anchor: dict[int, int] = {}
    for i in sorted(decisions, reverse=True):
        if decisions[i] is Decision.SAVE:
            continue
        needs = list(problem.backward_uses[i])
        needs += [
            anchor[u]
            for u in problem.forward_users[i]
            if decisions.get(u) is Decision.RECOMPUTE and u in anchor
        ]
        if needs:
            anchor[i] = min(needs)
    return anchor


def needed_values(problem: Problem, recomputed: Iterable[int]) -> set[int]:
    """Forward values the backward reads, directly or through the recomputed values."""
    rec = set(recomputed)
    out: set[int] = set()
    for i in range(problem.n_forward):
        node = problem.nodes[i]
        if node.resident or node.keep:
            continue
        if problem.backward_uses[i] or any(u in rec for u in problem.forward_users[i]):
            out.add(i)
    return out
