"""What a long compile is doing: one status line while a graph is planned.

A plan that takes more than :data:`STATUS_AFTER` seconds shows, on a terminal, one line
on stderr rewritten every :data:`TICK` seconds and erased when the plan is done: the
graph, its decisions, the time spent and left of the solver's time limit, and the
search's last incumbent and gap (:func:`solvers.sat.latest`). Where stderr is not a
terminal (a log file, a notebook's captured stream, a job scheduler), the same line goes
to the ``rematc.status`` logger at INFO every :data:`LOG_EVERY` seconds instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from solvers.sat import latest

log = logging.getLogger(__name__)

STATUS_AFTER = 5.0  # seconds of planning before the first status line
TICK = 1.0  # seconds between rewrites of the line on a terminal
LOG_EVERY = 15.0  # seconds between log records where stderr is no terminal

# What is being planned, for the line: set by the partitioner around a graph's plan.
_PLANNED: contextvars.ContextVar[str] = contextvars.ContextVar("rematc_planned", default="a graph")


@contextlib.contextmanager
def naming(what: str) -> Iterator[None]:
    """Inside the block, status lines name ``what`` (e.g. "graph 0 of frame 1")."""
    token = _PLANNED.set(what)
    try:
        yield
    finally:
        _PLANNED.reset(token)


def line(what: str, decisions: int, elapsed: float, time_limit: float) -> str:
    """The status line (no newline)."""
    text = (f"rematc: planning {what}: {decisions} decisions, {elapsed:.0f} s "
            f"({max(0.0, time_limit - elapsed):.0f} s left of the time limit)")
    found = latest(since=time.perf_counter() - elapsed)
    if found is not None and found.added is not None and found.bound is not None:
        text += f"; best plan +{found.added:.3g} s, bound +{found.bound:.3g} s (gap {found.gap:.1%})"
    elif found is not None:
        text += f"; gap of the best plan {found.gap:.1%}"
    return text


@contextlib.contextmanager
def planning(decisions: int, time_limit: float, *, stream: TextIO | None = None) -> Iterator[None]:
    """Show the status of the plan made inside the block on ``stream`` (stderr), as the
    module's docstring says."""
    what = _PLANNED.get()
    after, tick, every = STATUS_AFTER, TICK, LOG_EVERY
    out = stream if stream is not None else sys.stderr
    try:
        terminal = out.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        terminal = False
    done = threading.Event()
    started = time.perf_counter()

    def report() -> None:
        if done.wait(after):
            return
        logged = -every
        shown = False
        while True:
            elapsed = time.perf_counter() - started
            text = line(what, decisions, elapsed, time_limit)
            try:
                if terminal:
                    out.write("\r\x1b[2K" + text)
                    out.flush()
                    shown = True
                elif elapsed - logged >= every:
                    log.info(text)
                    logged = elapsed
            except (OSError, ValueError):  # the stream went away: stop reporting
                return
            if done.wait(tick):
                break
        if shown:
            with contextlib.suppress(OSError, ValueError):
                out.write("\r\x1b[2K")
                out.flush()

    reporter = threading.Thread(target=report, name="rematc-status", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
