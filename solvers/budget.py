"""Memory budgets as users write them: bytes, size strings, or a fraction.

A budget bounds the peak of memory allocated while the step's forward and backward run,
above what is alive when the step starts (see ``solvers.problem``). Accepted forms:

* an ``int`` number of bytes: ``2_000_000_000``;
* a size string with a unit: ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``, ``"800 KiB"``,
  ``"4096B"`` (binary units KiB/MiB/GiB/TiB are powers of 1024, decimal KB/MB/GB/TB of
  1000; case-insensitive);
* a fraction of the unconstrained activation memory (the peak when everything the
  backward reads is saved): a ``float`` in (0, 1] such as ``0.4``, or a percentage
  string such as ``"40%"``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from solvers.problem import MAX_BYTES, MAX_BYTES_TEXT

ACCEPTED = (
    "an int of bytes (2000000000), a size string ('512MiB', '2GB', '1.5GiB'), "
    "a fraction of the unconstrained activation memory (0.4 or '40%'), "
    "or 'auto' (an accelerator's free memory, in rematc's backend)"
)

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]+)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


@dataclass(frozen=True)
class Budget:
    """An absolute number of bytes, a fraction of the unconstrained peak, or ``auto``:
    what a device has free when a graph compiles (resolved to bytes by rematc's backend)."""

    nbytes: int | None = None
    fraction: float | None = None
    automatic: bool = False  # "auto"

    def resolve(self, unconstrained_peak: int) -> int:
        """Bytes, given the peak of the plan that saves everything."""
        if self.nbytes is not None:
            return self.nbytes
        if self.automatic:
            raise ValueError("budget 'auto' is a device's free memory when a graph compiles; "
                             "a problem file needs bytes or a fraction")
        assert self.fraction is not None
        return math.floor(self.fraction * unconstrained_peak)

    def __str__(self) -> str:
        if self.nbytes is not None:
            return format_bytes(self.nbytes)
        if self.automatic:
            return "auto"
        return f"{self.fraction:.1%} of unconstrained"


def parse_budget(value: object) -> Budget:
    """Parse a user's budget; a clear ``ValueError`` names the accepted forms."""
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise ValueError(f"budget {value!r} is a bool; expected {ACCEPTED}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"budget {value!r} is negative; expected {ACCEPTED}")
        return _bytes(value, value)
    if isinstance(value, float):
        return _fraction(value, value)
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return Budget(automatic=True)
        if m := _PERCENT.match(value):
            return _fraction(float(m.group(1)) / 100, value)
        if m := _SIZE.match(value):
            unit = _UNITS.get(m.group(2).lower())
            if unit is None:
                raise ValueError(
                    f"budget {value!r} has unknown unit {m.group(2)!r} "
                    f"(use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB); expected {ACCEPTED}"
                )
            return _bytes(float(m.group(1)) * unit, value)
        stripped = value.strip()
        if stripped.isdigit():
            return _bytes(int(stripped), value)
        try:
            return _fraction(float(stripped), value)
        except ValueError:
            pass
    raise ValueError(f"budget {value!r} is not understood; expected {ACCEPTED}")


def _bytes(n: float, original: object) -> Budget:
    """Whole bytes, at most :data:`~solvers.problem.MAX_BYTES` (``1e400B`` parses as inf)."""
    if not n <= MAX_BYTES:
        raise ValueError(f"budget {original!r} is over {MAX_BYTES_TEXT}: no device holds that much; "
                         f"expected {ACCEPTED}")
    return Budget(nbytes=math.floor(n))


def _fraction(f: float, original: object) -> Budget:
    if not (math.isfinite(f) and 0 < f <= 1):
        raise ValueError(
            f"budget {original!r} as a fraction must lie in (0, 1] (e.g. 0.4 or '40%'); "
            f"expected {ACCEPTED}"
        )
    return Budget(fraction=f)


def format_bytes(n: float) -> str:
    """Binary units with two decimals: ``format_bytes(1536) == '1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
