"""Plans: what happens to each forward value the backward needs, and in which order.

A plan is data. ``decisions`` maps each such value to a :class:`Decision`; ``schedule``
lists the recomputations and reloads the backward runs, in execution order, each just
before a backward step; ``transfers`` says, for each offloaded value, the windows of steps
its two copies run over. :func:`plan_from_decisions` derives the canonical schedule:
each value is rematerialized right before the first backward step that needs it, directly
or through another rematerialized value, in topological order within a step; an offload
is copied out beside the step after its last forward use and back beside the step before
that first backward need.

A recomputed value may be scheduled more than once (a *multi-level* plan: the blocks
between two kept block inputs rerun to rebuild each input in turn, their values dropped
again until their own backward); every read takes the latest copy made before it, and
each copy must serve a read. An offloaded value is reloaded once.

On a single-phase problem (no backward, :attr:`Problem.single_phase`) a plan names the
recomputed values only, and its schedule may recompute a value several times, before any
steps after its own (:mod:`solvers.singlephase.anywhere`); every read takes the latest copy.
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
class Transfer:
    """The two copies of an offloaded value ``node``, each over a window of steps.

    The copy to host is issued as step ``Problem.copy_out_from(node)`` starts (after the
    last forward read) and must be done when ``offload_at`` ends, where the device copy is
    freed. The copy back is issued as ``reload_at`` starts, where the device copy is
    allocated, and must be done before its first backward consumer.
    """

    node: int
    offload_at: int
    reload_at: int


@dataclass(frozen=True)
class Plan:
    decisions: Mapping[int, Decision]
    schedule: tuple[Step, ...] = ()
    transfers: tuple[Transfer, ...] = ()

    def __post_init__(self) -> None:
        frozen = dict(self.decisions)
        for k, v in frozen.items():
            if not isinstance(v, Decision):
                raise PlanError(f"decision for value #{k} is {v!r}; use solvers.Decision")
        object.__setattr__(self, "decisions", MappingProxyType(frozen))
        object.__setattr__(self, "schedule", tuple(self.schedule))
        object.__setattr__(self, "transfers", tuple(self.transfers))

    @property
    def multilevel(self) -> bool:
        """Whether the schedule recomputes some value more than once."""
        nodes = [s.node for s in self.schedule]
        return len(nodes) != len(set(nodes))

    @property
    def key(self) -> tuple[object, ...]:
        """The plan as a hashable value, equal for equal plans (its decisions, in order,
        its schedule and its transfers): to tell distinct plans apart."""
        return tuple(sorted(self.decisions.items())), self.schedule, self.transfers

    def of(self, decision: Decision) -> tuple[int, ...]:
        return tuple(sorted(i for i, d in self.decisions.items() if d is decision))

    def transfer(self, node: int) -> Transfer | None:
        return next((t for t in self.transfers if t.node == node), None)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "decisions": {str(k): v.value for k, v in sorted(self.decisions.items())},
            "schedule": [[s.node, s.before] for s in self.schedule],
        }
        if self.transfers:
            out["transfers"] = [[t.node, t.offload_at, t.reload_at] for t in self.transfers]
        return out

    @staticmethod
    def from_json(data: Mapping[str, object]) -> Plan:
        try:
            raw = data["decisions"]
            sched = data.get("schedule", [])
            moves = data.get("transfers", [])
            assert isinstance(raw, Mapping) and isinstance(sched, list) and isinstance(moves, list)
            decisions = {int(k): Decision(v) for k, v in raw.items()}
            schedule = tuple(Step(int(a), int(b)) for a, b in sched)
            transfers = tuple(Transfer(int(a), int(b), int(c)) for a, b, c in moves)
        except (KeyError, ValueError, TypeError, AssertionError) as e:
            raise PlanError(f"malformed plan JSON: {e!r}") from None
        return Plan(decisions, schedule, transfers)


def plan_from_decisions(
    problem: Problem,
    decisions: Mapping[int, Decision],
    transfers: Mapping[int, tuple[int, int]] | None = None,
) -> Plan:
    """The canonical plan for ``decisions``: rematerialize each value right before the first
    backward step that needs it (its own backward reads, or the step of a recomputed
    forward user), in topological order within a step. Offloaded values are copied out
    beside the step after their last forward use and back beside the step before their
    anchor, unless ``transfers`` gives ``(offload_at, reload_at)`` for them.

    Values whose anchor cannot be found (never needed) keep no schedule entry; the checker
    reports them.
    """
    anchor = rematerialize_anchors(problem, decisions)
    steps = [Step(i, a) for i, a in anchor.items()]
    steps.sort(key=lambda s: (s.before, s.node))
    chosen = transfers or {}
    moves = tuple(
        Transfer(i, *chosen.get(i, (problem.copy_out_from(i), anchor[i] - 1)))
        for i in sorted(anchor)
        if decisions[i] is Decision.OFFLOAD
    )
    return Plan(decisions, tuple(steps), moves)


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
