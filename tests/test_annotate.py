"""Cost annotation of FX nodes: FLOPs from torch's registry, bytes by storage, roofline time,
and what a recomputation adds on each route."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from rematc.annotate import annotate, transcendentals
from rematc.capture import recompute_seconds
from rematc.devices import PROFILES, TRANSCENDENTAL_WEIGHT, DeviceProfile

CPU = PROFILES["cpu"]


def costs_by_name(fn, *args, device: DeviceProfile = CPU, fuses: bool = True):
    gm = make_fx(fn, tracing_mode="fake")(*args)  # fake tensors share storage like AOT's
    return {node.name: cost for node, cost in annotate(gm, device, fuses=fuses).items()}


def test_matmul_flops_come_from_the_registry_and_its_time_is_the_compute_roofline():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    (mm,) = [c for c in costs_by_name(torch.mm, a, b).values() if c.flops]
    assert mm.flops == 2 * 64 * 32 * 16 and mm.flops_source == "registry"
    assert mm.nbytes == 64 * 16 * 4
    assert mm.bytes_moved == (64 * 32 + 32 * 16 + 64 * 16) * 4
    memory = mm.bytes_moved / CPU.mem_bandwidth
    assert mm.time == pytest.approx(max(mm.flops / CPU.flops_fp32, memory) + CPU.launch_overhead)
    assert mm.recompute_time == mm.time  # not pointwise: recomputed at full price


def test_a_view_owns_no_bytes_and_costs_nothing():
    costs = costs_by_name(lambda x: x.view(8, 8).t() * 2, torch.randn(64))
    views = [c for c in costs.values() if c.is_view]
    assert len(views) == 2
    assert all(c.nbytes == 0 and c.time == 0.0 for c in views)
    (mul,) = [c for name, c in costs.items() if name.startswith("mul")]
    assert mul.nbytes == 64 * 4 and mul.owner == "mul"
    assert all(c.owner == "x_1" for c in views)


def test_a_fused_recomputation_costs_a_launch_plus_its_transcendentals():
    x = torch.randn(4096)
    costs = costs_by_name(lambda x: torch.tanh(x) + 1, x)
    tanh, add = costs["tanh"], costs["add"]
    arithmetic = 4096 * TRANSCENDENTAL_WEIGHT["tanh"] * CPU.transcendental_time
    assert tanh.recompute_time == pytest.approx(CPU.launch_overhead + arithmetic)
    assert add.recompute_time == pytest.approx(CPU.launch_overhead)
    assert add.recompute_time < add.time  # the add's pass over memory is gone
    # On this CPU a tanh's arithmetic outlasts its memory traffic even in its own kernel.
    memory = tanh.bytes_moved / CPU.mem_bandwidth
    assert arithmetic > memory
    assert tanh.time == pytest.approx(arithmetic + CPU.launch_overhead)


def test_on_the_eager_route_a_recomputation_costs_its_whole_roofline_time():
    costs = costs_by_name(lambda x: torch.tanh(x) + 1, torch.randn(4096), fuses=False)
    assert costs["tanh"].recompute_time == costs["tanh"].time
    assert costs["add"].recompute_time == costs["add"].time


def test_a_transcendental_bound_op_is_timed_by_its_arithmetic():
    # 0.4 ns per exp-equivalent beats the memory side once bandwidth is high enough.
    fast_memory = DeviceProfile(name="fast", flops_fp32=1e12, flops_16bit=1e12, mem_bandwidth=1e12,
                                host_bandwidth=0.0, transcendental_time=1e-9)
    x = torch.randn(1 << 16)
    tanh = costs_by_name(torch.tanh, x, device=fast_memory)["tanh"]
    assert tanh.time == pytest.approx((1 << 16) * TRANSCENDENTAL_WEIGHT["tanh"] * 1e-9)


def test_gpu_profiles_count_transcendentals_as_free():
    costs = costs_by_name(lambda x: torch.exp(x) * 2, torch.randn(1 << 20), device=PROFILES["h100"])
    assert costs["exp"].recompute_time == pytest.approx(PROFILES["h100"].launch_overhead)


@pytest.mark.parametrize(("fn", "weight"), [
    (lambda x: F.gelu(x, approximate="tanh"), TRANSCENDENTAL_WEIGHT["tanh"]),
    (F.gelu, TRANSCENDENTAL_WEIGHT["erf"]),
    (lambda x: F.silu(x), TRANSCENDENTAL_WEIGHT["sigmoid"]),
    (torch.sigmoid, TRANSCENDENTAL_WEIGHT["sigmoid"]),
    (lambda x: torch.softmax(x, -1), TRANSCENDENTAL_WEIGHT["exp"]),
    (torch.sqrt, 0.0),
    (torch.relu, 0.0),
])
def test_transcendentals_count_each_output_element_at_its_function_weight(fn, weight):
    gm = make_fx(fn)(torch.randn(8, 16))
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert transcendentals(node) == pytest.approx(weight * 8 * 16)


def test_a_stored_pointwise_value_pays_its_pass_over_memory_when_recomputed():
    """``rematc.capture.recompute_seconds``: ``tanh(x) * 2`` read by a matmul is one value
    whose kernel computes the tanh inline. Inline into its readers, its recomputation costs
    a launch and the tanh; stored (the matmul needs a buffer), the multiply's pass over
    memory too."""
    gm = make_fx(lambda x, w: (torch.tanh(x) * 2) @ w, tracing_mode="fake")(
        torch.randn(256, 256), torch.randn(256, 64))
    costs = annotate(gm, CPU, fuses=True)
    by_name = {n.name: n for n in gm.graph.nodes}
    tanh, mul, mm = by_name["tanh"], by_name["mul"], by_name["mm"]
    group, own = [tanh, mul], [mul]
    tanh_time = costs[tanh].transcendental_time
    assert tanh_time == pytest.approx(256 * 256 * TRANSCENDENTAL_WEIGHT["tanh"] * CPU.transcendental_time)
    inline = recompute_seconds(group, own, costs, stored=False)
    stored = recompute_seconds(group, own, costs, stored=True)
    assert inline == pytest.approx(CPU.launch_overhead + tanh_time)
    assert stored == pytest.approx(costs[mul].time + tanh_time)
    assert stored - inline == pytest.approx(costs[mul].bytes_moved / CPU.mem_bandwidth)
    # A matmul pays its roofline either way.
    assert recompute_seconds([mm], [mm], costs, stored=True) == costs[mm].time
