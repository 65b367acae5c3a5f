"""Device models: how long an op takes, estimated by a roofline.

``time = max(flops / peak_flops(dtype), bytes_moved / mem_bandwidth) + launch_overhead``

``bytes_moved`` is what the op reads plus what it writes (storage bytes of its tensor
inputs and outputs); views move nothing and cost nothing. Peak rates are the vendors'
dense datasheet numbers (no sparsity); CPU figures are the order of magnitude of a small
cloud instance and are meant to be overridden (``DeviceProfile(...)`` or ``options``).
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

    def peak_flops(self, itemsize: int) -> float:
        return self.flops_16bit if itemsize <= 2 else self.flops_fp32

    def op_time(self, *, flops: float, bytes_moved: int, itemsize: int) -> float:
        """Roofline estimate in seconds."""
        compute = flops / self.peak_flops(itemsize) if flops else 0.0
        memory = bytes_moved / self.mem_bandwidth
        return max(compute, memory) + self.launch_overhead


PROFILES: dict[str, DeviceProfile] = {
    # A 2-core x86 cloud VM: ~100 GFLOP/s fp32 with AVX2 FMA, ~20 GB/s DRAM. CPU "offload"
    # would be host-to-host, so there is no host tier.
    "cpu": DeviceProfile(name="cpu", flops_fp32=100e9, flops_16bit=50e9, mem_bandwidth=20e9,
                         host_bandwidth=0.0, launch_overhead=2e-6),
    # NVIDIA datasheets: A100 SXM 80GB (TF32 156 TF, bf16 312 TF, 2.04 TB/s, PCIe 4 x16).
    "a100": DeviceProfile(name="a100", flops_fp32=156e12, flops_16bit=312e12, mem_bandwidth=2.04e12,
                          host_bandwidth=25e9, launch_overhead=5e-6),
    # H100 SXM (TF32 495 TF, bf16 989 TF dense, 3.35 TB/s, PCIe 5 x16).
    "h100": DeviceProfile(name="h100", flops_fp32=495e12, flops_16bit=989e12, mem_bandwidth=3.35e12,
                          host_bandwidth=50e9, launch_overhead=5e-6),
    # H200 SXM: H100 compute with 4.8 TB/s HBM3e.
    "h200": DeviceProfile(name="h200", flops_fp32=495e12, flops_16bit=989e12, mem_bandwidth=4.8e12,
                          host_bandwidth=50e9, launch_overhead=5e-6),
    # L4 (TF32 60 TF, bf16 121 TF, 300 GB/s, PCIe 4 x16).
    "l4": DeviceProfile(name="l4", flops_fp32=60e12, flops_16bit=121e12, mem_bandwidth=300e9,
                        host_bandwidth=25e9, launch_overhead=5e-6),
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
