"""Measured peak memory of one training step.

All functions take a zero-argument ``step`` (typically forward + ``backward()``), run
it once, and return the peak number of bytes live during the step *above what was
live just before it*: parameters, inputs and anything else allocated before the call
are not counted. Warm the step up first: a first call also measures lazy
initialisation (and, for a compiled model, compilation).

Keep frees of pre-existing tensors out of the step (call
``model.zero_grad(set_to_none=True)`` before it, not inside): ``profiler_peak`` cannot
see them and ``rss_peak`` can, so with them the two methods measure different things.

Three methods:

* ``profiler_peak`` — CPU (or any device the profiler reports): allocator events from
  ``torch.profiler``. The primary metric.
* ``rss_peak`` — Linux: the process's resident-set high-water mark. An independent
  cross-check for ``profiler_peak``; needs the process started with
  ``MALLOC_MMAP_THRESHOLD_=65536``.
* ``cuda_peak`` — CUDA: the caching allocator's own peak statistics.

``measure_peak(step, device=...)`` picks the primary method for a device.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = [
    "MALLOC_MMAP_THRESHOLD",
    "MeasurementSetupError",
    "cuda_peak",
    "measure_peak",
    "profiler_peak",
    "rss_peak",
]

Step = Callable[[], object]

# Value of glibc's MALLOC_MMAP_THRESHOLD_ under which rss_peak tracks live bytes: every
# allocation of 64 KiB or more gets its own mmap and is unmapped (leaves RSS) on free.
MALLOC_MMAP_THRESHOLD = 65536


class MeasurementSetupError(RuntimeError):
    """The process or platform cannot give a trustworthy measurement with this method."""


def profiler_peak(step: Step, *, device: str | torch.device = "cpu") -> int:
    """Peak bytes allocated on ``device`` during ``step()``, above the pre-step live set:
    the maximum (and 0) of the running sum of the profiler's ``[memory]`` events. Frees of
    memory allocated before the step are not seen, so they do not lower the result.
    Raises :class:`MeasurementSetupError` when the profiler returns no results. See
    docs/memory-model.md, "Measuring peak memory on CPU"."""
    dev = torch.device(device)
    device_type = dev.type.upper()
    activities = [ProfilerActivity.CPU]
    if device_type == "CUDA":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, profile_memory=True)
    with _native_stderr_quiet():  # the profiler's start and stop print a line each there
        prof.start()
    try:
        step()
    finally:
        with _native_stderr_quiet():
            prof.stop()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise MeasurementSetupError(
            "profiler_peak: the profiler returned no results; is another profiler "
            "already running in this process?"
        )
    events = sorted(
        (
            e
            for e in results.events()
            if e.name() == "[memory]"
            and e.device_type().name == device_type
            and (dev.index is None or e.device_index() == dev.index)
        ),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()  # type: ignore[attr-defined]  # not in torch's stubs
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _native_stderr_quiet() -> Iterator[None]:
    """File descriptor 2 points at the null device inside the block (what native code
    prints there, Python's ``sys.stderr`` included, is dropped); unchanged where it cannot
    be redirected."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (e.g. ``VmRSS``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise MeasurementSetupError(f"rss_peak: /proc/self/status has no {field} field")


def _check_mmap_threshold(*, strict: bool) -> None:
    # glibc reads the variable once, at process start, so it must already be in the
    # environment this process was started with; setting it now has no effect.
    value = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if value is not None and value.strip().isdigit() and int(value) <= MALLOC_MMAP_THRESHOLD:
        return
    message = (
        f"rss_peak: MALLOC_MMAP_THRESHOLD_ is {value!r}; start the process with "
        f"MALLOC_MMAP_THRESHOLD_={MALLOC_MMAP_THRESHOLD} in its environment. Without it "
        "glibc keeps freed tensor memory in the heap and the RSS peak is not the peak "
        "of live tensors"
    )
    if strict:
        raise MeasurementSetupError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def rss_peak(step: Step, *, strict: bool = True) -> int:
    """Growth of the process's peak resident set (``VmHWM``) during ``step()``, in bytes:
    live tensor bytes only in a process started with ``MALLOC_MMAP_THRESHOLD_=65536``.
    Raises :class:`MeasurementSetupError` off Linux or where ``VmHWM`` cannot be reset, and
    where that variable is missing or larger (``strict=False``: warns instead). See
    docs/memory-model.md, "Measuring peak memory on CPU"."""
    if not sys.platform.startswith("linux"):
        raise MeasurementSetupError(
            f"rss_peak: needs Linux /proc (VmHWM, clear_refs); this is {sys.platform}. "
            "Use profiler_peak instead"
        )
    _check_mmap_threshold(strict=strict)
    # Release garbage left by earlier code so it cannot be freed during the step.
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:
        raise MeasurementSetupError(
            f"rss_peak: cannot reset the RSS high-water mark ({e}); writing "
            "/proc/self/clear_refs needs a kernel ≥ 4.0 and is blocked in some sandboxes. "
            "Use profiler_peak instead"
        ) from e
    before = _status_bytes("VmRSS")
    step()
    return _status_bytes("VmHWM") - before


def cuda_peak(step: Step, *, device: str | torch.device = "cuda") -> int:
    """Peak bytes allocated by the CUDA caching allocator during ``step()``, above the
    bytes allocated before it.

    Uses ``torch.cuda.reset_peak_memory_stats`` and ``max_memory_allocated``, which
    count tensor allocations (rounded up to the allocator's 512-byte blocks), not
    memory reserved by the cache.
    """
    if not torch.cuda.is_available():
        raise MeasurementSetupError("cuda_peak: CUDA is not available; use profiler_peak")
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


Method = Literal["profiler", "rss", "cuda"]


def measure_peak(step: Step, *, device: str | torch.device, method: Method | None = None) -> int:
    """Peak bytes of ``step()`` above the pre-step live set, measured on ``device``.

    By default CPU uses ``profiler_peak`` and CUDA uses ``cuda_peak``; pass ``method``
    to choose (``"rss"`` is CPU-only).
    """
    device_type = torch.device(device).type
    if method is None:
        method = "cuda" if device_type == "cuda" else "profiler"
    if method == "profiler":
        return profiler_peak(step, device=device)
    if method == "cuda":
        if device_type != "cuda":
            raise ValueError(f"measure_peak: method='cuda' on device {device!s}; use 'profiler'")
        return cuda_peak(step, device=device)
    if method == "rss":
        if device_type != "cpu":
            raise ValueError(
                f"measure_peak: method='rss' measures host memory, not {device!s}; use 'cuda'"
            )
        return rss_peak(step)
    raise ValueError(f"measure_peak: unknown method {method!r}; expected profiler, rss or cuda")
