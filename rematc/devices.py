"""Device models: how long an op takes, estimated by a roofline.

``time = max(flops / (peak_flops(dtype) * efficiency) + transcendentals * transcendental_time,
bytes_moved / mem_bandwidth) + launch_overhead``

``efficiency`` is ``attention_efficiency`` for fused attention kernels, 1 for the rest.

``bytes_moved`` is what the op reads plus what it writes (storage bytes of its tensor
inputs and outputs); views move nothing and cost nothing. ``transcendentals`` counts the
elementwise exp-class functions an op evaluates (:data:`TRANSCENDENTAL_WEIGHT` per
element): pointwise ops count no FLOPs, and on a CPU a tanh is not free once its memory
traffic is gone, which is what happens to a recomputation fused into its reader.

GPU peak rates are the vendors' dense datasheet numbers (no sparsity); their attention
runs at the matmul peak and their transcendentals are free, both unmeasured. The CPU
figures were measured on a 2-core cloud VM with one thread (docs/architecture.md,
"2. annotate") and are meant to be overridden (``DeviceProfile(...)`` or ``options``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    name: str
    flops_fp32: float  # FLOP/s for 32-bit matmuls (TF32 tensor cores where the vendor quotes them)
    flops_16bit: float  # FLOP/s for bf16/fp16 matmuls
    mem_bandwidth: float  # bytes/s of device memory
    host_bandwidth: float  # bytes/s each way to pinned host memory; 0 where there is no host tier
    launch_overhead: float = 0.0  # seconds per op (kernel launch / dispatch)
    # Seconds per element of one exp in a vectorized kernel; 0 where special-function
    # units keep pace with memory (GPUs).
    transcendental_time: float = 0.0
    # Fraction of the matmul peak that fused attention kernels reach (their softmax and
    # blocking cost beside the two matmuls).
    attention_efficiency: float = 1.0
    # Bytes of device memory (nvidia-smi's total); 0 where it is the host's (the CPU).
    memory: int = 0
    # Bytes the math libraries keep on the device once a training step has run: torch
    # gives each thread that runs matmuls a cuBLAS workspace (the forward's and autograd's
    # backward thread), 32 MiB each on Hopper and 8.125 MiB before it, by torch's default
    # CUBLAS_WORKSPACE_CONFIG. Measured on an H100 with torch 2.11: 66 MiB (docs/fit.md).
    workspace: int = 0

    def peak_flops(self, itemsize: int) -> float:
        return self.flops_16bit if itemsize <= 2 else self.flops_fp32

    def op_time(self, *, flops: float, bytes_moved: int, itemsize: int,
                transcendentals: float = 0.0, attention: bool = False) -> float:
        """Roofline estimate in seconds."""
        peak = self.peak_flops(itemsize) * (self.attention_efficiency if attention else 1.0)
        compute = flops / peak if flops else 0.0
        compute += transcendentals * self.transcendental_time
        memory = bytes_moved / self.mem_bandwidth
        return max(compute, memory) + self.launch_overhead


# Cost of one element of each elementwise transcendental, in units of one exp, as measured
# on the CPU profile's machine; ops missing here (sqrt, rsqrt) count nothing. The
# measurements: docs/architecture.md, "2. annotate".
TRANSCENDENTAL_WEIGHT: dict[str, float] = {
    "exp": 1.0, "sigmoid": 1.1, "erf": 1.25, "log": 1.4, "sin": 0.9, "cos": 0.9, "tanh": 2.5,
}


# DeviceProfile.workspace: Hopper's as measured (two 32 MiB cuBLAS workspaces and 2 MiB
# more); before Hopper the same with torch's smaller default workspace, not measured.
_HOPPER_WORKSPACE = 66 * 2**20
_PRE_HOPPER_WORKSPACE = 2 * (8 * 2**20 + 128 * 2**10) + 2 * 2**20

PROFILES: dict[str, DeviceProfile] = {
    # A 2-core x86 cloud VM with one thread, calibrated there (docs/architecture.md,
    # "2. annotate"). CPU "offload" would be host-to-host, so there is no host tier.
    "cpu": DeviceProfile(name="cpu", flops_fp32=100e9, flops_16bit=50e9, mem_bandwidth=20e9,
                         host_bandwidth=0.0, launch_overhead=2e-6, transcendental_time=0.4e-9,
                         attention_efficiency=0.45),
    # NVIDIA datasheets: A100 SXM 80GB (TF32 156 TF, bf16 312 TF, 2.04 TB/s, PCIe 4 x16).
    "a100": DeviceProfile(name="a100", flops_fp32=156e12, flops_16bit=312e12, mem_bandwidth=2.04e12,
                          host_bandwidth=25e9, launch_overhead=5e-6, memory=81920 * 2**20,
                          workspace=_PRE_HOPPER_WORKSPACE),
    # H100 SXM (TF32 495 TF, bf16 989 TF dense, 3.35 TB/s, PCIe 5 x16).
    "h100": DeviceProfile(name="h100", flops_fp32=495e12, flops_16bit=989e12, mem_bandwidth=3.35e12,
                          host_bandwidth=50e9, launch_overhead=5e-6, memory=81559 * 2**20,
                          workspace=_HOPPER_WORKSPACE),
    # H200 SXM: H100 compute with 4.8 TB/s HBM3e.
    "h200": DeviceProfile(name="h200", flops_fp32=495e12, flops_16bit=989e12, mem_bandwidth=4.8e12,
                          host_bandwidth=50e9, launch_overhead=5e-6, memory=143771 * 2**20,
                          workspace=_HOPPER_WORKSPACE),
    # L4 (TF32 60 TF, bf16 121 TF, 300 GB/s, PCIe 4 x16).
    "l4": DeviceProfile(name="l4", flops_fp32=60e12, flops_16bit=121e12, mem_bandwidth=300e9,
                        host_bandwidth=25e9, launch_overhead=5e-6, memory=23034 * 2**20,
                        workspace=_PRE_HOPPER_WORKSPACE),
}


def profile_for(device: str | DeviceProfile | None, *, device_type: str = "cpu",
                device_name: str = "") -> DeviceProfile:
    """A profile by name, or the best guess for a device type ('cpu'/'cuda') and name."""
    if isinstance(device, DeviceProfile):
        return device
    if device is not None:
        try:
            return PROFILES[device.lower()]
        except KeyError:
            raise ValueError(
                f"unknown device profile {device!r}; known: {', '.join(sorted(PROFILES))} "
                "(or pass a rematc.DeviceProfile)"
            ) from None
    if device_type == "cuda":
        lowered = device_name.lower()
        for key in ("h200", "h100", "a100", "l4"):
            if key in lowered:
                return PROFILES[key]
        return PROFILES["a100"]
    return PROFILES["cpu"]
