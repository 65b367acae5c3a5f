"""The time limit of one solve, shared by its stages: made once from the config by the
top-level solve and handed down, each stage asking it for its share and what is left.

It counts wall seconds or, under ``deterministic``, work: the deterministic seconds of
every CP-SAT solve the stages run (:meth:`Deadline.count`), and the values the checker
replays in this thread at ``VALUES_PER_SECOND`` (:func:`solvers.checker.replayed`), so
that where a stage stops does not depend on the machine's load. A stage that plans a
part of the problem with the planner hands it a :meth:`Deadline.part`, whose work counts
in its own. Read in the thread that made it. Imports no solver; see docs/solvers.md,
"Time".
"""

from __future__ import annotations

import math
import time
from typing import Protocol

from solvers.checker import replayed

# Under ``deterministic``, the wall seconds a solve may take, as a multiple of its limit.
# The work a limit counts (CP-SAT's deterministic seconds, and the checker's replays) ran
# 4-5x slower than the clock on a busy 2-core machine (a Llama-2-70B step at a 20 s limit:
# 89-95 s, docs/scale.md, "Time limits"); past this the solve stops anyway, and its plan
# may then differ between runs (:attr:`Deadline.by_wall`). A quarter over the limit keeps
# a 20 s solve within 30 s with the fixed work after it.
WALL_BACKSTOP = 1.25

# The checker's pace, in values replayed per second (random layered graphs of 100-1000
# values at 80-90% budgets, one core: 0.58-0.84 million): turns a replay into the work a
# deterministic limit counts.
VALUES_PER_SECOND = 700_000


class Limits(Protocol):
    """What a deadline reads of a config (:class:`solvers.result.SolverConfig`)."""

    @property
    def time_limit(self) -> float: ...

    @property
    def deterministic(self) -> bool: ...


class Deadline:
    """``seconds`` from when it is made: of wall time, or under ``deterministic`` of the
    work counted since (by it and by its parts), and then also, as a backstop, of
    ``WALL_BACKSTOP`` times as many wall seconds."""

    def __init__(self, seconds: float, *, deterministic: bool = False, parent: Deadline | None = None) -> None:
        if math.isnan(seconds) or seconds < 0:
            raise ValueError(f"a deadline of {seconds} s: give a time limit of 0 s or more")
        self.seconds = seconds
        self.deterministic = deterministic
        self.parent = parent
        self.started = time.perf_counter()
        self.replays_from = replayed()
        self.work = 0.0  # CP-SAT's deterministic seconds, of the solves here and in its parts
        # The wall clock's backstop under ``deterministic``, of this deadline and of every
        # one it is a part of (a stage's share of the work gets its share of the wall
        # clock), and whether it ended a stage before the work did.
        self.wall = seconds * WALL_BACKSTOP if deterministic else math.inf
        self.by_wall = False

    @classmethod
    def of(cls, config: Limits) -> Deadline:
        """A deadline of ``config.time_limit``, counting work under ``config.deterministic``."""
        return cls(config.time_limit, deterministic=config.deterministic)

    def spent(self) -> float:
        """What the stages have used of it: wall seconds, or the work counted."""
        if self.deterministic:
            return self.work + (replayed() - self.replays_from) / VALUES_PER_SECOND
        return time.perf_counter() - self.started

    def left(self) -> float:
        """What is left (0 at least), of this deadline and of every one it is a part of;
        under ``deterministic`` no more than the wall clock's backstop leaves."""
        own = self.seconds - self.spent()
        if self.parent is not None:
            own = min(own, self.parent.left())
        if self.deterministic:
            wall = self.wall_left()
            if wall < own:
                own = wall
                self.root().by_wall = True
        return max(0.0, own)

    def wall_left(self) -> float:
        """Wall seconds left before the backstop (:data:`WALL_BACKSTOP`), of this deadline
        and of every one it is a part of; infinite where the deadline counts wall time
        itself."""
        own = self.wall - (time.perf_counter() - self.started)
        if self.parent is not None:
            own = min(own, self.parent.wall_left())
        return max(0.0, own)

    def root(self) -> Deadline:
        """The first deadline, which this one is a part of (itself where none)."""
        return self if self.parent is None else self.parent.root()

    def expired(self) -> bool:
        return self.left() <= 0.0

    def part(self, seconds: float) -> Deadline:
        """A deadline of ``seconds`` (0 at least, what is left at most) for a stage: its
        work counts here too, and it ends where this one does."""
        return Deadline(max(0.0, min(seconds, self.left())), deterministic=self.deterministic, parent=self)

    def count(self, work: float) -> None:
        """Count a CP-SAT solve's ``work`` (deterministic seconds), here and in every
        deadline this is a part of."""
        self.work += work
        if self.parent is not None:
            self.parent.count(work)
