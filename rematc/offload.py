"""The ops an offload plan emits: copy to host, copy back, wait.

Why our own ops rather than PyTorch 2.13's ``ao::offload`` / ``ao::reload`` /
``ao::wait_tensor`` (``torch/_functorch/_activation_offloading``) directly: those are the
right CUDA mechanics (a transfer stream, pinned host buffers from a pool, completion
events), and on an accelerator our ops call them, except that our wait never frees the
source itself (below). But they need ``torch.accelerator`` and fail on a CPU-only build, and PyTorch's pass
that places them decides neither *what* is offloaded nor *where* the copies run (it hoists
reloads by its own estimate). Our ops run everywhere: on the CPU a "host copy" is a plain
copy in the same memory, so an offload plan still emits, runs and is tested for
gradients on a machine without a GPU, while its placement is the plan's.

Emitted pattern for an offloaded value ``x`` (see :func:`rematc.emit.emit`)::

    forward:  h = rematc.offload(x)        after x's last forward use
              h = rematc.wait(h, x)        after the plan's offload_at step; x's last use
              ... h is saved for the backward instead of x
    backward: d = rematc.reload(h, device) before the plan's reload_at step
              d = rematc.wait(d, h)        just before d's first use

The wait is the source's last use, so the graph drops the source right after it (FX's
code sets it to None, Inductor's deletes it) and the memory goes back to the allocator
then, on the compute stream, which has waited for the copy. The wait does not free the
source's storage itself, as ``ao::wait_tensor`` does with its ``keepalive``: Inductor hands
the buffer of a tensor past its last use to a later kernel of the same size, which then
wrote into freed memory (measured on an H100: an illegal memory access in the forward).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.fx.node import has_side_effect

from rematc._torch_compat import has_ao_offload

_lib = torch.library.Library("rematc", "DEF")
# The wait returns its first argument (an alias, like ao::wait_tensor), so it cannot be
# a torch.library.custom_op, which forbids aliasing outputs.
_lib.define("wait(Tensor(a) tensor, Tensor keepalive) -> Tensor(a)")


def _on_accelerator(t: torch.Tensor) -> bool:
    return t.device.type not in ("cpu", "meta")


@torch.library.custom_op("rematc::offload", mutates_args=())
def offload(tensor: torch.Tensor) -> torch.Tensor:
    """Start copying ``tensor`` to host memory (pinned, on a transfer stream on CUDA)."""
    if _on_accelerator(tensor):
        if has_ao_offload():
            return torch.ops.ao.offload(tensor)
        return _Transfers.start(tensor, torch.empty_strided(
            tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu", pin_memory=True))
    return tensor.clone()


@offload.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")


@torch.library.custom_op("rematc::reload", mutates_args=())
def reload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Start copying host ``tensor`` back to ``device``."""
    if device.type not in ("cpu", "meta"):
        if has_ao_offload():
            return torch.ops.ao.reload(tensor, device, list(tensor.shape), list(tensor.stride()))
        return _Transfers.start(tensor, torch.empty_strided(
            tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device))
    return tensor.clone()


@reload.register_fake
def _(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)


@torch.library.impl("rematc::wait", "CompositeExplicitAutograd")
def _wait(tensor: torch.Tensor, keepalive: torch.Tensor) -> torch.Tensor:
    """Wait for the copy that made ``tensor``. ``keepalive`` is the copy's source: the
    wait is its last use, so the graph drops it right after, and only then can its memory
    go to another tensor (the compute stream has waited for the copy by then)."""
    if _on_accelerator(tensor) or _on_accelerator(keepalive):
        if has_ao_offload():  # no keepalive: it would free the source (module docstring)
            return torch.ops.ao.wait_tensor.default(tensor)
        return _Transfers.wait(tensor)
    return tensor


class _Transfers:
    """The copy mechanics where torch has no ``ao::`` offload ops (before 2.13), on CUDA:
    one transfer stream per device, a completion event per copy keyed by the destination's
    address, and a wait that makes the compute stream wait for it."""

    streams: ClassVar[dict[torch.device, torch.cuda.Stream]] = {}
    pending: ClassVar[dict[int, tuple[torch.cuda.Event, torch.device]]] = {}

    @classmethod
    def start(cls, source: torch.Tensor, destination: torch.Tensor) -> torch.Tensor:
        device = source.device if _on_accelerator(source) else destination.device
        stream = cls.streams.get(device)
        if stream is None:
            stream = cls.streams[device] = torch.cuda.Stream(device)
        # The destination is allocated on the compute stream, which uses it only after the
        # wait; the copy starts once the compute stream has made the source.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        cls.pending[destination.data_ptr()] = (done, device)
        return destination

    @classmethod
    def wait(cls, tensor: torch.Tensor) -> torch.Tensor:
        entry = cls.pending.pop(tensor.data_ptr(), None)
        if entry is None:
            raise RuntimeError("rematc.wait: no copy in flight into this tensor; every wait "
                               "follows its offload or reload")
        done, device = entry
        torch.cuda.current_stream(device).wait_event(done)
        return tensor


@torch.library.register_fake("rematc::wait")
def _wait_fake(tensor: torch.Tensor, keepalive: torch.Tensor) -> torch.Tensor:
    return tensor


has_side_effect(torch.ops.rematc.wait.default)  # never dead code: it frees the source

OFFLOAD = torch.ops.rematc.offload.default
RELOAD = torch.ops.rematc.reload.default
WAIT = torch.ops.rematc.wait.default
