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

A byte budget under :data:`MIN_BYTES` (1 KiB) is refused: no training step runs in so
little, and it is almost surely a slip (``1`` for ``1.0``, i.e. 100%; ``"1.5B"`` read as
billions, where B is bytes). A :class:`Budget` passes through unchanged, so a tiny byte
budget on purpose (a synthetic problem, an impossible budget that makes the error state
the smallest feasible one) is ``Budget(nbytes=1)``.
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
# A number and an optional unit: '512MiB', '1.5 GB', '1024', '-5GiB'.
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+)\s*%\s*$")
# The least byte budget parse_budget takes: below it, almost surely a slip (module docstring).
MIN_BYTES = 1024


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
    """Parse a user's budget; a clear one-line ``ValueError`` names the accepted forms, or
    guesses the slip (a negative budget; bytes under :data:`MIN_BYTES`). A ``Budget``
    passes through unchanged, whatever its bytes."""
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise ValueError(f"budget {value!r} is a bool; expected {ACCEPTED}")
    if isinstance(value, float):
        return _fraction(value, value)
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return Budget(automatic=True)
        if m := _PERCENT.match(value):
            return _fraction(float(m.group(1)) / 100, value)
    try:
        size = parse_size(value)
    except ValueError as e:
        raise ValueError(f"budget {e}; expected {ACCEPTED}") from None
    if size is not None:
        return _bytes(size, value)
    if isinstance(value, str):
        try:
            fraction = float(value.strip())
        except ValueError:
            pass
        else:
            return _fraction(fraction, value)
    raise ValueError(f"budget {value!r} is not understood; expected {ACCEPTED}")


def parse_size(value: object) -> float | None:
    """The bytes ``value`` states as a size: an int, a string of digits, or a number with a
    unit (``"512MiB"``, ``"1.5 GB"``, ``"-5GiB"``), sign kept and range unchecked; None
    where it states no size (a fraction such as ``"0.4"``, a percentage, ``"auto"``,
    anything else). ``ValueError`` for an unknown unit, naming the known ones."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if not isinstance(value, str) or not (m := _SIZE.match(value)):
        return None
    number, unit = m.group(1), m.group(2)
    if not unit:  # digits alone are bytes; '0.4' and '1e9' are not sizes
        return int(number) if number.lstrip("+-").isdigit() else None
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"{value!r} has unknown unit {unit!r} "
                         f"(use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return float(number) * scale


def _bytes(n: float, original: object) -> Budget:
    """Whole bytes, from :data:`MIN_BYTES` to :data:`~solvers.problem.MAX_BYTES`
    (``1e400B`` parses as inf)."""
    if n < 0:
        raise ValueError(f"budget {original!r} is negative: a budget is a size of at least 1 KiB or a "
                         f"fraction in (0, 1]; expected {ACCEPTED}")
    if not n <= MAX_BYTES:
        raise ValueError(f"budget {original!r} is over {MAX_BYTES_TEXT}: no device holds that much; "
                         f"expected {ACCEPTED}")
    nbytes = math.floor(n)
    if nbytes < MIN_BYTES:
        raise ValueError(_tiny(nbytes, original))
    return Budget(nbytes=nbytes)


def _tiny(nbytes: int, original: object) -> str:
    """Why a byte budget under :data:`MIN_BYTES` is refused, and what was likely meant."""
    text = str(original).strip()
    number = re.match(r"[+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?", text)
    digits = number.group(0) if number else text
    if nbytes == 0 and float(digits) == 0:
        guess = "no limit (give no budget) or a size such as '512MiB'"
    elif float(digits) == 1:
        guess = "100% ('1.0' or '100%') or '1GiB'"
    else:
        guess = f"'{digits}GiB' (B is bytes, not billions)" if text.lower().endswith("b") else f"'{digits}GiB'"
    return (f"budget {original!r} is {nbytes} B, under 1 KiB: did you mean {guess}? "
            f"(a byte budget that small on purpose: Budget(nbytes={nbytes}))")


def _fraction(f: float, original: object) -> Budget:
    if math.isfinite(f) and f < 0:
        raise ValueError(f"budget {original!r} is negative: a fraction lies in (0, 1] (e.g. 0.4 or '40%'); "
                         f"expected {ACCEPTED}")
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
