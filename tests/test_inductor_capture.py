"""Capture for Inductor codegen: pointwise values Inductor inlines into their readers are
folded into the readers' values (``rematc.capture.fused_groups``), and only there; the
channels-last copies Inductor makes for convolutions count; a convolution's kept weight
gradient is a value of its own, and its workspace is counted."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.utils import run_and_get_code

import rematc
from rematc.capture import (
    Captured,
    accumulate_copy_bytes,
    addmm_pairs,
    held_for_addmm,
    readers_of,
    step_outputs,
)
from rematc.devices import profile_for
from rematc.models import GPTConfig, make_gpt
from rematc.partition import capture_stage
from solvers import Copy, check
from solvers.baselines import plan_with


class Mlp(nn.Module):
    """Linear, GELU-tanh (a chain of pointwise ops with a tanh), linear, a pointwise tail."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x), approximate="tanh")
        y = self.down(h)
        return ((y * 2.0 + 1.0) ** 2).mean()


class Cnn(nn.Module):
    """Two convolutions (a 3x3 weight, which Inductor copies to channels-last, and a 1x1
    one, which is channels-last already) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.point = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.point(F.relu(self.conv(x)))
        return self.head(h.mean((2, 3))).square().mean()


def joint_graph(model: nn.Module | None = None, x: torch.Tensor | None = None) -> tuple[fx.GraphModule, dict[str, Any]]:
    """A model's joint graph (Inductor's decompositions) and the partitioner's arguments."""
    grabbed: dict[str, Any] = {}

    def grab(gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        grabbed.update(gm=copy.deepcopy(gm), kwargs=kwargs)
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    torch._dynamo.reset()
    model = model or Mlp()
    nop = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=grab,
                           decompositions=select_decomp_table())
    torch.compile(model, backend=backend)(torch.randn(32, 16) if x is None else x)
    return grabbed["gm"], grabbed["kwargs"]


def captured(gm: fx.GraphModule, kwargs: dict[str, Any], *, fuses: bool) -> Captured:
    _, c = capture_stage(copy.deepcopy(gm), profile_for("cpu"), fuses=fuses,
                         num_fwd_outputs=kwargs["num_fwd_outputs"],
                         static=list(kwargs.get("static_lifetime_input_indices") or []))
    return c


@pytest.fixture(scope="module")
def both() -> tuple[Captured, Captured]:
    """The same joint graph captured plainly and with Inductor's fusion folded in."""
    gm, kwargs = joint_graph()
    return captured(gm, kwargs, fuses=False), captured(gm, kwargs, fuses=True)


def _op(n: fx.Node) -> str:
    return n.target._opname if isinstance(n.target, torch._ops.OpOverload) else ""


def folded_heads(plain: Captured, fused: Captured) -> list[tuple[int, tuple[fx.Node, ...]]]:
    """The values of the plain capture that are no value of the fused one."""
    heads = {g[0].name for g in fused.groups}
    return [(i, g) for i, g in enumerate(plain.groups) if g[0].name not in heads]


def test_folding_keeps_every_node_and_drops_only_pointwise_values(both: tuple[Captured, Captured]) -> None:
    plain, fused = both
    assert len(fused.problem.nodes) < len(plain.problem.nodes)
    names = lambda c: {n.name for g in c.groups for n in g}  # noqa: E731
    assert names(fused) == names(plain)  # nothing lost
    folded = folded_heads(plain, fused)
    assert folded
    for i, g in folded:
        head = g[0]
        assert torch.Tag.pointwise in head.target.tags or not head.all_input_nodes, head.format_node()
        assert not plain.problem.nodes[i].keep


def test_folded_value_sits_in_every_reader(both: tuple[Captured, Captured]) -> None:
    """A folded value is computed in the value of each op that reads it (its kernel)."""
    plain, fused = both
    for _, g in folded_heads(plain, fused):
        readers = {u.name for n in g for u in n.users if u not in g}
        kernels = [{n.name for n in h} for h in fused.groups]
        for u in readers:
            assert any(u in k and g[0].name in k for k in kernels), f"{g[0].name} not with {u}"


def test_extern_inputs_and_values_read_twice_stay_values(both: tuple[Captured, Captured]) -> None:
    """A matmul reads a buffer; a value read by two ops is stored."""
    _, fused = both
    heads = {g[0] for g in fused.groups}
    for g in fused.groups:
        for n in g:
            for a in n.all_input_nodes:
                if _op(n) in ("mm", "addmm") and a.op == "call_function" and _op(a) not in ("view", "t", "permute"):
                    assert a in heads, f"{a.name} feeds a matmul but was folded"
    twice = [n for g in fused.groups for n in g if _op(n) == "tanh" and len(n.users) > 1]
    assert twice and all(n in heads for n in twice)


def test_fused_problem_costs_no_more(both: tuple[Captured, Captured]) -> None:
    plain, fused = both
    p0, p1 = plain.problem, fused.problem
    # The GELU-tanh backward is one chain of pointwise ops ending in a matmul: one kernel.
    backward = lambda p: len(p.nodes) - p.n_forward  # noqa: E731
    assert backward(p1) < backward(p0) / 2
    assert check(p1, plan_with(p1, set())).peak <= check(p0, plan_with(p0, set())).peak
    # Recomputing everything costs no more once inlined pointwise ops cost nothing extra.
    all0 = check(p0, plan_with(p0, {v for v in p0.candidates if p0.nodes[v].recomputable}))
    all1 = check(p1, plan_with(p1, {v for v in p1.candidates if p1.nodes[v].recomputable}))
    assert all1.added_time <= all0.added_time + 1e-12
    assert math.isclose(sum(n.flops for n in p0.nodes), sum(n.flops for n in p1.nodes))


@pytest.fixture(scope="module")
def cnn() -> Captured:
    gm, kwargs = joint_graph(Cnn(), torch.randn(2, 3, 8, 8))
    return captured(gm, kwargs, fuses=True)


@pytest.mark.canary
def test_channels_last_copies_count_from_their_first_convolution(cnn: Captured) -> None:
    p = cnn.problem
    by_name = {n.name: (i, n) for i, n in enumerate(p.nodes)}
    convs = [g[0] for g in cnn.groups if _op(g[0]) == "convolution"]
    big, point = (c.args[1] for c in convs)  # the 3x3 and the 1x1 weights
    i, copy = by_name[big.name]
    assert not copy.resident and copy.size == 8 * 3 * 3 * 3 * 4 and not copy.recomputable
    assert i == by_name[convs[0].name][0] - 1  # placed right before the convolution
    images = convs[0].args[0]
    assert not by_name[images.name][1].resident  # the images are copied too
    assert by_name[point.name][1].resident  # a 1x1 weight is channels-last already


def test_kept_weight_gradient_is_its_own_value(cnn: Captured) -> None:
    """A convolution backward hands its gradients to values of their own right after it
    (``split_elements``): its own value, outputs and oneDNN's workspace, lives while it
    runs only."""
    p = cnn.problem
    backward_convs = [(i, n) for i, n in enumerate(p.nodes) if n.op == "aten.convolution_backward"]
    assert backward_convs
    for i, node in backward_convs:
        assert not node.keep and not p.users[i]  # dies at its own step
        elements = [i + 1 + k for k, n in enumerate(p.nodes[i + 1:]) if n.op == "getitem"][:2]
        assert elements and elements[0] == i + 1
        kept = [p.nodes[e] for e in elements if p.nodes[e].keep]
        assert kept, "the weight gradient is a kept value of its own"
        assert node.size >= sum(p.nodes[e].size for e in elements)  # its outputs, and the workspace


@pytest.mark.canary
def test_a_channels_last_weight_gradient_is_copied_after_the_backward() -> None:
    """Autograd copies a gradient whose strides are not its parameter's into a new tensor
    after the backward; a channels-last 3x3 kernel's gradient is one, a 1x1 kernel's has
    the same strides either way. The largest copy counts at the last step."""
    gm, kwargs = joint_graph(Cnn(), torch.randn(2, 3, 8, 8))
    kept = step_outputs(gm, kwargs["num_fwd_outputs"])
    assert accumulate_copy_bytes(list(gm.graph.nodes), kept) == 8 * 3 * 3 * 3 * 4


@pytest.mark.canary
def test_an_elementwise_value_read_by_an_extern_kernel_runs_after_its_recomputations(cnn: Captured) -> None:
    """Inductor emits a one-reader elementwise result when its reader, here a convolution
    backward, is lowered: after the recomputations placed before that reader. So the
    value sits just before its reader and reads the forward values the reader reads, and
    a recomputation of them comes before it (``rematc.capture.deferred_to_reader``)."""
    p = cnn.problem
    backward_convs = [i for i, n in enumerate(p.nodes) if n.op == "aten.convolution_backward"]
    assert len(backward_convs) == 2
    for i in backward_convs:
        v = i - 1
        assert p.nodes[v].backward and p.nodes[v].op in ("aten.div", "aten.where")
        assert p.users[v] == (i,)
        from_forward = {d for d in p.nodes[i].deps if not p.nodes[d].backward}
        assert from_forward and from_forward <= set(p.nodes[v].deps)


def test_in_place_kernels_take_a_dying_input_over(both: tuple[Captured, Captured]) -> None:
    """An elementwise value that reads a same-sized input last is marked to be written
    over it (Inductor's in-place reuse), and the checker ends that input a step early;
    the eager route's capture marks nothing."""
    plain, fused = both
    assert all(n.overwrites is None for n in plain.problem.nodes)
    p = fused.problem
    marked = [(v, n.overwrites) for v, n in enumerate(p.nodes) if n.overwrites is not None]
    assert marked
    for v, u in marked:
        head = fused.groups[v][0]
        assert torch.Tag.pointwise in head.target.tags, head.format_node()
        assert p.nodes[u].size == p.nodes[v].size and p.users[u][-1] == v
        assert any(fused.groups[u][0] in n.all_input_nodes for n in fused.groups[v])
        assert p.taken_over[u] == v and p.fixed_end(u) == v - 1
    unmarked = dataclasses.replace(p, nodes=tuple(dataclasses.replace(n, overwrites=None) for n in p.nodes))
    everything = plan_with(p, set())
    assert check(p, everything).peak <= check(unmarked, plan_with(unmarked, set())).peak


class BnRelu(nn.Module):
    """Convolution, BatchNorm, ReLU, twice. In the backward the ReLU's gradient
    (``threshold_backward``: read by BatchNorm's bias-gradient sum and by its
    input-gradient kernel) is computed inside both readers and stored nowhere; the
    input-gradient kernel reads the ReLU's output last, through it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).square().mean()


def test_a_kernel_takes_over_an_input_it_reads_through_an_unstored_value() -> None:
    """BatchNorm's input-gradient kernel loads the ReLU's output and the convolution's
    output itself (the ReLU's gradient and ``x - mean`` are inlined into it), and Inductor
    writes the kernel's output over one of them; the model did not see those reads and
    counted both, 32 MiB twice at the full U-Net's peak."""
    gm, kwargs = joint_graph(BnRelu(), torch.randn(2, 3, 8, 8))
    c = captured(gm, kwargs, fuses=True)
    p = c.problem
    relus = [i for i, g in enumerate(c.groups) if _op(g[0]) == "relu" and not p.nodes[i].backward]
    assert len(relus) == 2
    for u in relus:
        v = p.users[u][-1]  # BatchNorm's input-gradient kernel
        w = p.nodes[v].overwrites  # the ReLU's output or its convolution's, both die there
        assert p.nodes[v].backward and w is not None and p.taken_over[w] == v
        assert p.nodes[w].size == p.nodes[u].size
        assert not any(c.groups[w][0] in n.all_input_nodes for n in c.groups[v])  # not read directly
        assert any(p.nodes[d].size == 0 and w in p.nodes[d].deps for d in p.nodes[v].deps)


class Tied(nn.Module):
    """An embedding whose weight is also the output head: its gradient is the sum of the
    head's matmul and the embedding's scatter, ``add(mm(dlogits^T, h), scatter)``. At
    width 128 that gradient (64 x 128) outweighs the logits gradient and ``h`` the merge
    keeps alive (32 x 64 and 32 x 128); at width 16 they outweigh it."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, width)
        self.mix = nn.Linear(width, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(idx)))
        return F.cross_entropy(F.linear(h, self.emb.weight), idx)


class Grab(CustomPartitionerFn):
    """Keeps the joint graph Inductor hands its partitioner (after its joint-graph passes,
    as rematc's partitioner sees it) and partitions with PyTorch's min-cut."""

    def __init__(self) -> None:
        self.grabbed: dict[str, Any] = {}

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        self.grabbed.update(gm=copy.deepcopy(gm), kwargs=kwargs)
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> None:
        return None  # nothing to cache


def tied_joint(width: int) -> tuple[fx.GraphModule, dict[str, Any]]:
    torch._dynamo.reset()
    grab = Grab()
    with torch._inductor.config.patch(custom_partitioner_fn=grab):
        torch.compile(Tied(width))(torch.randint(0, 64, (32,)))
    return grab.grabbed["gm"], grab.grabbed["kwargs"]


@pytest.fixture(scope="module")
def tied() -> tuple[fx.GraphModule, dict[str, Any]]:
    return tied_joint(128)


@pytest.fixture(scope="module")
def tied_narrow() -> tuple[fx.GraphModule, dict[str, Any]]:
    return tied_joint(16)


def test_a_matmul_merged_into_addmm_runs_at_its_add(tied: tuple[fx.GraphModule, dict[str, Any]]) -> None:
    """Inductor rewrites add(mm(a, b), c) into addmm(c, a, b) at the add: under Inductor the
    mm's value is folded into the add's (its result never exists, its inputs are read at
    the add) and the mm moves next to the add in the graph we emit from."""
    gm, kwargs = tied
    pairs = addmm_pairs(gm)
    assert len(pairs) == 1  # the tied weight's gradient
    (mm, add), = pairs.items()
    assert mm.target is torch.ops.aten.mm.default and add.target is torch.ops.aten.add.Tensor
    # What the merge holds (the logits gradient and h) is less than the mm's result.
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert held_for_addmm(mm, add, position) == (32 * 64 + 32 * 128) * 4 < 64 * 128 * 4
    plain, fused = captured(gm, kwargs, fuses=False), captured(gm, kwargs, fuses=True)
    mm_plain = plain.value_of[next(n for n in plain.value_of if n.name == mm.name)]
    assert plain.groups[mm_plain][0].name == mm.name  # its own value without Inductor
    fused_mm = next(n for n in fused.value_of if n.name == mm.name)
    group = fused.groups[fused.value_of[fused_mm]]
    assert group[0].name == add.name and fused_mm in group
    node = fused.problem.nodes[fused.value_of[fused_mm]]
    assert node.time >= plain.problem.nodes[mm_plain].time > 0  # the matmul's time stays
    # The logits gradient the mm reads lives until the add, after the embedding's scatter.
    dlogits = next(a for a in fused_mm.all_input_nodes if a in fused.value_of)
    scatter = next(a for a in add.args if a is not mm)
    at = fused.value_of[fused_mm]
    assert fused.problem.users[fused.value_of[dlogits]][-1] == at
    assert at > next(i for n, i in fused.value_of.items() if n.name == scatter.name)


def test_addmm_conditions_follow_inductor(tied: tuple[fx.GraphModule, dict[str, Any]]) -> None:
    """No merge when the mm has a second reader or the added tensor differs in dtype."""
    gm, _ = tied
    (mm, add), = addmm_pairs(gm).items()
    g = copy.deepcopy(gm)
    mm2 = next(n for n in g.graph.nodes if n.name == mm.name)
    add2 = next(n for n in g.graph.nodes if n.name == add.name)
    with g.graph.inserting_after(add2):
        extra = g.graph.call_function(torch.ops.aten.neg.default, (mm2,))
        extra.meta["val"] = mm2.meta["val"]
    assert addmm_pairs(g) == {}
    g = copy.deepcopy(gm)
    other = next(a for a in next(n for n in g.graph.nodes if n.name == add.name).args if a.name != mm.name)
    other.meta["val"] = other.meta["val"].to(torch.float64)
    assert addmm_pairs(g) == {}


def test_a_matmul_whose_merge_would_hold_more_stays_where_autograd_put_it(
        tied_narrow: tuple[fx.GraphModule, dict[str, Any]]) -> None:
    """At width 16, running the tied weight's gradient matmul at its add would keep the
    logits gradient and ``h`` (32 x 64 and 32 x 16 floats) alive through the backward to
    save holding its 64 x 16 result: the mm stays a value of its own in the head's
    backward, where the logits gradient dies, long before the scatter, and the add becomes
    ``sub(scatter, mm, alpha=-1)``, which Inductor does not merge."""
    gm, kwargs = tied_narrow
    (mm, add), = addmm_pairs(gm).items()
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert held_for_addmm(mm, add, position) == (32 * 64 + 32 * 16) * 4
    fused = captured(gm, kwargs, fuses=True)
    by_name = {n.name: n for n in fused.value_of}
    assert add.name not in by_name
    mm_node = by_name[mm.name]
    at = fused.value_of[mm_node]
    assert tuple(fused.groups[at]) == (mm_node,) and fused.problem.nodes[at].size == 64 * 16 * 4
    (sub,) = mm_node.users
    assert sub.target is torch.ops.aten.sub.Tensor and sub.kwargs == {"alpha": -1}
    assert sub.args[1] is mm_node
    dlogits = next(a for a in mm_node.all_input_nodes if a in fused.value_of)
    scatter = fused.value_of[sub.args[0]]
    assert at in fused.problem.users[fused.value_of[dlogits]]
    assert max(at, fused.problem.users[fused.value_of[dlogits]][-1]) < scatter < fused.value_of[sub]


@pytest.mark.inductor
@pytest.mark.canary
def test_the_unmerged_matmul_is_no_addmm_in_inductors_code_and_gradients_match() -> None:
    """Compiled by Inductor, the narrow model's backward runs the tied gradient's matmul on
    its own (no ``addmm`` anywhere in it: the sub is not merged) and its gradients are
    eager's."""
    torch.manual_seed(0)
    model = Tied(16)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 64, (32,))
    reference(idx).backward()
    compiled = rematc.compile(model, budget=None, compiler="inductor", cache_dir=None)
    _, codes = run_and_get_code(lambda: compiled(idx).backward())
    (backward,) = [c for c in codes if "tangents_1" in c]
    assert "addmm" not in backward
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and r.grad is not None
        torch.testing.assert_close(p.grad, r.grad)


def test_cheap_values_read_several_times_are_inlined_when_recomputed(both: tuple[Captured, Captured]) -> None:
    """An unstored recomputed copy: an elementwise value several elementwise ops read, cheap enough that
    Inductor computes it in each reader rather than storing it (on the CPU: no tanh, exp,
    log or sigmoid in it, at most 4 buffers read). The GELU-tanh's cheap intermediates
    are; without Inductor nothing is. Its tanh, which Inductor would store, is inline
    because the backward gives each reader a copy (``per_reader``), priced per kernel that
    computes it: the recomputed GELU's and the gradient's."""
    plain, fused = both
    assert not any(not n.stores(Copy.RECOMPUTED) for n in plain.problem.nodes) and not plain.per_reader
    inline = [i for i, n in enumerate(fused.problem.nodes) if not n.stores(Copy.RECOMPUTED)]
    assert inline
    for i in inline:
        group = fused.groups[i]
        assert i in fused.per_reader or all(_op(n) != "tanh" for n in group)
        readers = readers_of(group)
        assert all(torch.Tag.pointwise in u.target.tags or torch.Tag.reduction in u.target.tags
                   for u in readers), [u.name for u in readers]
    (tanh,) = [i for i, g in enumerate(fused.groups) if any(_op(n) == "tanh" for n in g)]
    assert not fused.problem.nodes[tanh].stores(Copy.RECOMPUTED) and tanh in fused.per_reader
    (plain_tanh,) = [i for i, g in enumerate(plain.groups) if _op(g[0]) == "tanh"]
    assert fused.problem.nodes[tanh].time > plain.problem.nodes[plain_tanh].time
    # Not the matmul's input, which an extern kernel reads.
    assert not any(not fused.problem.nodes[i].stores(Copy.RECOMPUTED) for i, g in enumerate(fused.groups) if _op(g[0]) == "addmm")


class Head(nn.Module):
    """A linear layer and cross-entropy: the end of a language model's step."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.register_buffer("target", torch.arange(8) % 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.proj(x), self.target)


@pytest.fixture(scope="module")
def head() -> tuple[Captured, Captured]:
    gm, kwargs = joint_graph(Head(), torch.randn(8, 16))
    return captured(gm, kwargs, fuses=False), captured(gm, kwargs, fuses=True)


def _value(c: Captured, name: str) -> int:
    """The value of the FX node ``name`` (both captures share the joint graph's names)."""
    return c.value_of[next(n for n in c.value_of if n.name == name)]


def test_log_softmax_reads_the_logits_and_is_written_over_them(head: tuple[Captured, Captured]) -> None:
    """The logits minus their maximum, read by the exp-sum and by the log-softmax, is a
    value of its own without Inductor; with it, each reader computes its own copy (none is
    stored), so the log-softmax reads the logits directly and takes their storage over,
    so that the forward never holds two logits-sized buffers at once."""
    plain, fused = head
    assert any(_op(g[0]) == "sub" and not plain.problem.nodes[i].backward for i, g in enumerate(plain.groups))
    logits, log_softmax = _value(fused, "addmm"), _value(fused, "sub_1")
    subs = [n for g in fused.groups for n in g if _op(n) == "sub" and logits in
            {fused.value_of[a] for a in n.all_input_nodes}]
    assert len(subs) == 2 and all(fused.groups[fused.value_of[n]][0] is not n for n in subs)
    assert fused.problem.taken_over[logits] == log_softmax
    fwd = fused.problem.n_forward
    plain_fwd = max(check(plain.problem, plan_with(plain.problem, set())).timeline[:plain.problem.n_forward])
    fused_fwd = max(check(fused.problem, plan_with(fused.problem, set())).timeline[:fwd])
    logits_bytes = fused.problem.nodes[logits].size
    assert fused_fwd < 2 * logits_bytes <= plain_fwd


def test_a_backward_kernel_takes_a_saved_value_over_only_when_it_is_donated() -> None:
    """A saved forward value reaches the backward as a graph input, which Inductor writes
    over only while AOTAutograd donates saved values (``donated_buffer``): the tiny GPT's
    GELU backward takes the saved tanh over with the flag on, nothing of the forward with
    it off, where the model counts both; the forward's own take-overs stay."""
    model, (idx, targets) = make_gpt(GPTConfig.tiny(), batch=2, seed=0)

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return self.model(i, targets)

    gm, kwargs = joint_graph(Loss(), idx)

    def taken(c: Captured, *, backward: bool) -> list[tuple[str, str]]:
        p = c.problem
        return [(n.name, p.nodes[n.overwrites].name) for n in p.nodes
                if n.overwrites is not None and n.backward == backward and not p.nodes[n.overwrites].backward]

    donated = captured(gm, kwargs, fuses=True)
    with torch._functorch.config.patch(donated_buffer=False):
        kept = captured(gm, kwargs, fuses=True)
    assert any(src.startswith("tanh") for _, src in taken(donated, backward=True))
    assert taken(kept, backward=True) == []
    assert taken(kept, backward=False) == taken(donated, backward=False)
    everything = plan_with(kept.problem, set())
    assert check(kept.problem, everything).peak >= check(donated.problem, everything).peak


def test_backward_values_inductor_inlines_hold_no_memory(head: tuple[Captured, Captured]) -> None:
    """The cross-entropy backward's one_hot * grad is read by a sum and by the
    log-softmax backward, which both compute it: it holds no memory, and its readers read
    what it reads."""
    plain, fused = head
    # "mul" is one_hot * grad in this graph (its readers: "sum_4" and "sub_2").
    assert plain.problem.nodes[_value(plain, "mul")].size == 8 * 32 * 4
    i = _value(fused, "mul")
    node = fused.problem.nodes[i]
    assert node.backward and node.size == 0 and node.stores(Copy.RECOMPUTED)
    assert {fused.groups[u][0].name for u in fused.problem.users[i]} == {"sum_4", "sub_2"}
    for u in fused.problem.users[i]:
        assert set(node.deps) <= set(fused.problem.nodes[u].deps)


class Residual(nn.Module):
    """A residual stream that is the sum of two projections, read by a layer norm and by
    the next residual add: a value no backward op reads, read by elementwise and
    reduction ops only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.a(x) + self.b(x)
        return (r + self.c(self.norm(r))).square().mean()


@pytest.mark.parametrize("slack", [None, math.inf])
def test_a_sum_of_larger_inputs_stays_one_value(slack: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The residual sum's copies would keep both projections (twice its bytes) alive to
    its last reader, and a checkpoint of it would cost both: it is one stored value.
    Without the size rule (infinite slack) each reader would get its own copy."""
    if slack is not None:
        monkeypatch.setattr("rematc.capture.SPLIT_SLACK", slack)
    gm, kwargs = joint_graph(Residual(), torch.randn(8, 16))
    fused = captured(gm, kwargs, fuses=True)
    sums = [n for g in fused.groups for n in g
            if _op(n) == "add" and {_op(a) for a in n.all_input_nodes} <= {"addmm", "view"}
            and len(n.all_input_nodes) == 2 and not fused.problem.nodes[fused.value_of[n]].backward]
    if slack is None:
        assert len(sums) == 1
        i = fused.value_of[sums[0]]
        assert fused.groups[i][0] is sums[0] and len(fused.problem.users[i]) >= 2
    else:
        assert len(sums) >= 2


def test_values_read_once_in_a_graph_are_stored_only_where_the_plan_keeps_them() -> None:
    """The test GPT's log-softmax: one forward reader (the loss's gather) that computes it,
    so the forward stores it only when saved (``fused``); one backward reader (the loss
    gradient), so its recomputation is computed there, log and exp included (``inline``)."""
    from rematc.trace import trace

    config = GPTConfig(n_layer=1, d_model=64, n_head=2, seq_len=32, vocab=128)
    model, inputs = make_gpt(config, batch=2, seed=0)
    p = trace(model, inputs, name="gpt").problem
    logits = 2 * config.seq_len * config.vocab * 4
    (v,) = [v for v in p.candidates if p.nodes[v].size == logits and p.nodes[v].overwrites is not None
            and p.nodes[p.nodes[v].overwrites].op == "aten.mm"]
    assert not p.nodes[v].stores(Copy.FORWARD) and not p.nodes[v].stores(Copy.RECOMPUTED)
    assert p.nodes[p.computed_in(v)].op == "aten.gather"
    # Each LayerNorm's normalized input is read in the forward by its scale-and-shift only.
    assert any(not p.nodes[w].stores(Copy.FORWARD) and p.nodes[p.computed_in(w)].op == "aten.add" for w in p.candidates)


def test_trace_keeps_everything_the_backend_captures() -> None:
    """``rematc.trace`` (behind the CLI's ``--dump-dir`` graphs) renames the problem but
    keeps the capture: the per-reader recomputations of the GELU's tanh included (it
    rebuilt ``Captured`` positionally and dropped them)."""
    from rematc.trace import trace

    config = GPTConfig(n_layer=1, d_model=64, n_head=2, seq_len=32, vocab=128)
    model, inputs = make_gpt(config, batch=2, seed=0)
    traced = trace(model, inputs, name="gpt")
    assert traced.captured.problem is traced.problem and traced.problem.name == "gpt"
    assert traced.captured.per_reader
    assert all(not traced.problem.nodes[i].stores(Copy.RECOMPUTED) for i in traced.captured.per_reader)
