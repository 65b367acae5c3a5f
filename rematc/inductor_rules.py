"""What rematc's memory model follows of Inductor: one ordered table of named rules.

Inductor does not allocate one buffer per FX node: it writes kernels over dying inputs,
inlines cheap values into their readers, keeps a pool of dead buffers, and so on. Each such
behaviour that rematc follows is a :class:`InductorRule` here, in the order and with the
numbers of ``docs/inductor-memory.md`` (a test checks the two agree). A rule names what it
matches, the memory effect it gives the torch-free problem, the code that applies it, the
torch releases and devices it was checked on, and its canary: a test that fails when
Inductor stops behaving that way. Most canaries run Inductor and compare what its
generated code holds, or what a step measures, with the model; those of rules 8, 9 and 12
check the capture against Inductor's own layout decision (``decide_layout_opt``) only.

Adding a rule: a row here, an item in the doc, the code, and a canary.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

Release = tuple[int, int]


@dataclass(frozen=True)
class InductorRule:
    item: int  # its number in docs/inductor-memory.md
    name: str  # the item's title there
    matches: str  # what in the joint graph (or Inductor's code) it applies to
    effect: str  # what it does to the problem, in the IR's words
    code: tuple[str, ...]  # the module attributes that apply it
    canary: str  # pytest node id of the test that fails when Inductor changes
    releases: tuple[Release, Release] = ((2, 11), (2, 14))  # first and last torch checked
    devices: frozenset[str] = frozenset({"cpu", "cuda"})


RULES: tuple[InductorRule, ...] = (
    InductorRule(
        1, "In-place kernels",
        "an elementwise kernel reading a same-sized input for the last time",
        "Node.overwrites: the value takes the input's storage over (no new bytes)",
        ("rematc.capture.with_inplace_reuse",),
        "tests/test_generated.py::test_a_broken_rule_is_caught_after_compilation_and_replanned"),
    InductorRule(
        2, "`addmm`",
        "add(mm(a, b), c) where Inductor merges the matmul into the add",
        "the matmul joins the add's value: never stored, run and recomputed with the add",
        ("rematc.capture.addmm_pairs",),
        "tests/test_inductor_capture.py::test_the_unmerged_matmul_is_no_addmm_in_inductors_code_and_gradients_match"),
    InductorRule(
        3, "Inlined recomputations",
        "a cheap elementwise value several elementwise ops read, within realize_reads_threshold",
        "Node.unstored RECOMPUTED: recomputed, it holds no memory; a heavy one is emitted per reader",
        ("rematc.capture.inline_values", "rematc.capture.per_reader_values"),
        "tests/test_measured_peak.py::test_a_recomputed_tanh_is_computed_in_each_reader"),
    InductorRule(
        4, "Shared elementwise values",
        "a forward-only elementwise value whose inputs hold no more bytes than it",
        "a copy per reader before planning, each computed in its reader",
        ("rematc.capture.split_shared_pointwise",),
        "tests/test_measured_peak.py::test_measured_peak_within_budget_inductor"),
    InductorRule(
        5, "Recomputations written in place",
        "a recomputation whose op takes its input's storage over",
        "Node.overwrites_copies: it takes the input's backward copy over, or the forward one only",
        ("rematc.capture.with_inplace_reuse",),
        "tests/test_measured_peak.py::test_measured_peak_within_budget_inductor"),
    InductorRule(
        6, "The buffer pool",
        "a dead buffer a later allocation of the same size can take (allow_buffer_reuse)",
        "held only where the plan's timeline has room under its peak",
        ("rematc.reuse.planned_reuse",),
        "tests/test_buffer_reuse.py::test_an_inductor_step_reuses_buffers_across_kernels_at_its_predicted_peak"),
    InductorRule(
        7, "Fusions across an extern kernel",
        "a horizontal or vertical fusion with an extern kernel between its halves",
        "refused, so kernels run in the plan's order",
        ("rematc.fusion.keep_plan_order",),
        "tests/test_fusion.py::test_a_llama_measures_its_prediction"),
    InductorRule(
        8, "Elementwise values emitted at their extern reader",
        "a one-reader elementwise value whose reader is an extern kernel",
        "the value sits just before its reader, after the recomputations placed there",
        ("rematc.capture.deferred_to_reader",),
        "tests/test_inductor_capture.py::test_an_elementwise_value_read_by_an_extern_kernel_runs_after_its_recomputations"),
    InductorRule(
        9, "Convolution layouts and workspaces",
        "convolutions under Inductor's layout optimization",
        "channels-last copies of inputs and weights as values of their own",
        ("rematc.annotate.channels_last_convolutions", "rematc.capture.layout_copies"),
        "tests/test_inductor_capture.py::test_channels_last_copies_count_from_their_first_convolution"),
    InductorRule(
        10, "Values a kernel computes inside its only reader",
        "a forward value with one forward reader that can compute it",
        "Node.unstored FORWARD: stored only when saved or offloaded",
        ("rematc.capture.fused_groups",),
        "tests/test_measured_peak.py::test_a_recomputed_log_softmax_is_not_stored_by_the_forward"),
    InductorRule(
        11, "Scratch memory of backward kernels, measured",
        "backward ops with a workspace (oneDNN's convolution backward)",
        "the op's value is its outputs and workspace, alive while it runs",
        ("rematc.annotate.workspaces", "rematc.capture.split_elements"),
        "tests/test_measured_peak.py::test_a_convolution_backward_scratchpad_counts_eager_route"),
    InductorRule(
        12, "Gradients copied into their parameters' layout",
        "a channels-last weight gradient of a convolution backward",
        "the largest such copy counts at the step's end",
        ("rematc.capture.accumulate_copy_bytes",),
        "tests/test_inductor_capture.py::test_a_channels_last_weight_gradient_is_copied_after_the_backward"),
    InductorRule(
        13, "Constants in the backward",
        "a constant CSE shares between the forward and the backward",
        "the backward computes its own copy; nothing saved for it",
        ("rematc.capture.copy_constants_to_backward",),
        "tests/test_measured_peak.py::test_a_bf16_loss_gradient_stores_no_fp32_logits_inductor"),
    InductorRule(
        14, "Shared elementwise values the backward reads too",
        "a shared elementwise value (item 4) that a backward op reads",
        "it keeps its first forward reader (fused); the others get copies",
        ("rematc.capture.split_shared_pointwise",),
        "tests/test_measured_peak.py::test_a_bf16_loss_gradient_stores_no_fp32_logits_inductor"),
    InductorRule(
        15, "Constants and the zeros a scatter copies",
        "a constant read by several kernels; an input of a copying scatter or an indexed load",
        "Node.unstored RECOMPUTED: no buffer of its own",
        ("rematc.capture.inline_values", "rematc.capture.COPYING_SCATTERS"),
        "tests/test_inductor_rules.py::test_an_embedding_gradient_peaks_where_the_model_says"),
    InductorRule(
        16, "Broadcast attention biases of the memory-efficient backward",
        "a value the memory-efficient attention's backward reads through a broadcast as its bias (CUDA)",
        "save-only (recomputed, Inductor writes it out at the broadcast shape); unaligned rows: "
        "that copy counts as the backward's workspace",
        ("rematc.capture.broadcast_bias_sources", "rematc.annotate.dense_bias_bytes"),
        "tests/test_gpu.py::test_a_broadcast_attention_mask_is_saved_not_copied_on_cuda",
        releases=((2, 11), (2, 13)), devices=frozenset({"cuda"})),
)


_WARNED: set[Release] = set()


def check_release(torch_release: Release, device: str | None = None) -> bool:
    """Whether every rule was checked on ``torch_release`` (every rule for ``device``'s
    type where one is given); if not, warn once per release (the check after compilation
    still re-plans where the generated code peaks above the budget, and a canary run on
    that torch says which rule broke)."""
    outside = [r.item for r in RULES if not r.releases[0] <= torch_release <= r.releases[1]
               and (device is None or device in r.devices)]
    if outside and torch_release not in _WARNED:
        _WARNED.add(torch_release)
        first = min(r.releases[0] for r in RULES)
        last = max(r.releases[1] for r in RULES)
        warnings.warn(
            f"rematc: its model of Inductor was checked on torch {first[0]}.{first[1]} to "
            f"{last[0]}.{last[1]}, not {torch_release[0]}.{torch_release[1]} (rules "
            f"{', '.join(map(str, outside))}); the check after compilation re-plans where the "
            "generated code peaks above the budget, and `pytest -m canary` says which rule "
            "no longer holds", UserWarning, stacklevel=2)
    return not outside
