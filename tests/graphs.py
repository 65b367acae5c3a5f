"""Tiny hand-built problems shared by the checker and solver tests."""

from __future__ import annotations

from solvers import Node, Problem
from solvers.problem import EVERY_COPY, Copy, chain_problem, node


def P(*nodes: Node, budget: int | None = None, host_bandwidth: float = 0.0) -> Problem:
    return Problem(nodes=nodes, budget=budget, host_bandwidth=host_bandwidth, name="t")


def chain(host_bandwidth: float = 0.0) -> Problem:
    """#0 input (resident) -> #1 f0 (2 B, 1 s) -> #2 f1 (3 B, 2 s) -> #3 f2 (5 B, 4 s);
    backward #4 g2(f2) 5 B, #5 g1(f1, g2) 3 B, #6 g0(f0, g1) 2 B, kept."""
    p = chain_problem([2, 3, 5], [1.0, 2.0, 4.0])
    return Problem(nodes=p.nodes, host_bandwidth=host_bandwidth, name="chain")


def diamond() -> Problem:
    """A residual-like diamond with a resident weight and a forward output kept to the end."""
    return P(
        node("w", size=100, resident=True),  # 0: costs nothing
        node("x", 0, size=4, time=1.0),  # 1
        node("a", 1, size=2, time=1.0),  # 2
        node("b", 1, size=6, time=3.0),  # 3
        node("loss", 2, 3, size=1, keep=True),  # 4: lives to the end
        node("gl", 4, size=1, backward=True),  # 5
        node("ga", 2, 5, size=2, backward=True),  # 6
        node("gb", 3, 5, size=6, backward=True),  # 7
        node("gx", 1, 6, 7, size=4, backward=True, keep=True),  # 8
        node("gw", 0, 8, size=3, backward=True, keep=True),  # 9
    )


def deep() -> Problem:
    """#2 u is read only by #3 w: it needs a decision only when w is recomputed."""
    return P(
        node("x", size=1, resident=True),  # 0
        node("a", 0, size=1, time=1.0),  # 1
        node("u", 1, size=4, time=2.0),  # 2
        node("w", 2, size=4, time=3.0),  # 3
        node("big", 3, size=8, time=5.0),  # 4
        node("gbig", 4, size=1, backward=True),  # 5
        node("gw", 3, 5, size=1, backward=True),  # 6
        node("ga", 1, 6, size=1, backward=True, keep=True),  # 7
    )


def offload_graph(host_bandwidth: float = 2.0, **kw: float) -> Problem:
    """#1 a (4 B) is read early in the forward and late in the backward, with long steps
    (3 s of compute) beside which its copies can run: at 2 B/s each copy takes 2 s."""
    return P(
        node("x", size=1, resident=True),  # 0
        node("a", 0, size=4, time=kw.get("a_time", 1.0)),  # 1
        node("b", 1, size=1, time=3.0),  # 2
        node("c", 2, size=1, time=3.0),  # 3
        node("loss", 3, size=1, keep=True),  # 4
        node("gl", 4, size=1, backward=True),  # 5
        node("gc", 2, 5, size=1, time=1.0, backward=True),  # 6
        node("gb", 6, size=1, time=3.0, backward=True),  # 7
        node("ga", 1, 7, size=1, backward=True, keep=True),  # 8
        host_bandwidth=host_bandwidth,
    )


def forward_takeover() -> Problem:
    """#1 y is written over #0 x, its only reader (``reuses``): x's forward copy ends at
    step 0 unless x is kept for a recomputation of y."""
    return P(
        node("x", size=2, time=1.0),  # 0
        node("y", 0, size=2, time=1.0, overwrites=0),  # 1
        node("loss", 1, size=1, keep=True),  # 2
        node("gy", 1, 2, size=1, backward=True, keep=True),  # 3
    )


def recomputed_takeover() -> Problem:
    """#2 y is written over #0 x, its last reader; #1 z reads x too and is read first in
    the backward (#4 g): a recomputed x is recomputed for z and held until y's
    recomputation takes it over."""
    return P(
        node("x", size=2, time=1.0),  # 0
        node("z", 0, size=1, time=1.0),  # 1
        node("y", 0, size=2, time=1.0, overwrites=0),  # 2
        node("loss", 1, 2, size=1, keep=True),  # 3
        node("g", 1, 3, size=1, backward=True),  # 4
        node("gy", 2, 4, size=1, backward=True, keep=True),  # 5
    )


def inline_beside_taker() -> Problem:
    """#3 y is written over #0 x, its last reader; #1 m, inline, reads x too, and #2 z
    reads m: recomputed before the same step as y, z computes m inside it and so reads x
    there, which keeps x's copy through that step."""
    return P(
        node("x", size=2, time=1.0),  # 0
        node("m", 0, size=1, time=1.0, unstored=frozenset({Copy.RECOMPUTED})),  # 1
        node("z", 1, size=1, time=1.0),  # 2
        node("y", 0, size=2, time=1.0, overwrites=0),  # 3
        node("loss", 2, 3, size=1, keep=True),  # 4
        node("g", 2, 3, 4, size=1, backward=True, keep=True),  # 5
    )


def backward_takeover(host_bandwidth: float = 0.0, *, saved_only: bool = False) -> Problem:
    """#4 g2 is written over #0 x, its last reader. #1 w is read by #5 g3, after g2: a
    recomputation of w reads x after g2, which then does not take x's copy over. With
    ``saved_only`` g2 takes x's saved copy only, not one recomputed or reloaded."""
    return P(
        node("x", size=2, time=1.0),  # 0
        node("w", 0, size=1, time=1.0),  # 1
        node("loss", 1, size=1, keep=True, time=3.0),  # 2
        node("g1", 2, size=2, backward=True, time=3.0),  # 3
        node("g2", 0, 3, size=2, backward=True, overwrites=0,
             overwrites_copies=frozenset({Copy.FORWARD}) if saved_only else EVERY_COPY),  # 4
        node("g3", 1, 4, size=1, backward=True, keep=True),  # 5
        host_bandwidth=host_bandwidth,
    )


def loss_head() -> Problem:
    """The GPT-2 loss head in miniature. #1 x (the logits) is read by #2 m (a reduction)
    and last by #3 y (the log-softmax), which is written over it, with both its copies
    unstored: recomputed, its one backward reader computes it; not saved, the loss #4
    computes it and the forward never stores it. #6 g, the loss gradient, reads y last and
    is written over y's saved copy only (``overwrites_copies`` the forward copy)."""
    return P(
        node("h", size=1, time=4.0),  # 0
        node("x", 0, size=2, time=4.0),  # 1
        node("m", 1, size=1, time=1.0),  # 2
        node("y", 1, 2, size=2, time=1.0, overwrites=1, unstored=frozenset(Copy) - {Copy.RELOADED}),  # 3
        node("loss", 3, size=1, keep=True),  # 4
        node("t", size=1, backward=True),  # 5
        node("g", 3, 5, size=2, backward=True, overwrites=3, overwrites_copies=frozenset({Copy.FORWARD})),  # 6
        node("gh", 0, 6, size=1, backward=True, keep=True),  # 7
    )


def returned_head(host_bandwidth: float = 0.0) -> Problem:
    """A loss head whose caller drops the logits when the forward returns. #2 logits is
    ``returned``: alive to the forward's last step (#5), past its last read (#3 ls), and a
    candidate (the backward reads ls, which may be recomputed from it); #4 tail, computed
    after ls, is alive beside it. Kept instead, it would live to the step's end."""
    return P(
        node("x", size=1, resident=True),  # 0
        node("h", 0, size=2, time=1.0),  # 1
        node("logits", 1, size=4, time=2.0, returned=True),  # 2
        node("ls", 2, size=4, time=1.0),  # 3
        node("tail", 3, size=3, time=1.0),  # 4
        node("loss", 4, size=1, keep=True),  # 5
        node("gls", 3, 5, size=4, backward=True),  # 6
        node("gh", 1, 6, size=2, backward=True),  # 7
        node("gx", 7, size=1, backward=True, keep=True),  # 8
        host_bandwidth=host_bandwidth,
    )


# One transformer layer in miniature, in order: (name, inputs by name, size, seconds). "x"
# is the layer's input, the residual stream; "h" and "out" end its two segments.
LAYER = (
    ("n1", ("x",), 4, 0.1), ("q", ("n1",), 4, 1.0), ("k", ("n1",), 4, 1.0), ("v", ("n1",), 4, 1.0),
    ("sc", ("q", "k"), 16, 2.0), ("p", ("sc",), 16, 0.2), ("att", ("p", "v"), 4, 2.0), ("o", ("att",), 4, 1.0),
    ("h", ("x", "o"), 4, 0.1), ("n2", ("h",), 4, 0.1), ("up", ("n2",), 11, 3.0), ("gate", ("n2",), 11, 3.0),
    ("act", ("gate",), 11, 0.2), ("m", ("act", "up"), 11, 0.2), ("down", ("m",), 4, 3.0), ("out", ("h", "down"), 4, 0.1),
)


def layers(n: int, *, unit: int = 2**20, host_bandwidth: float = 0.0) -> Problem:
    """``n`` transformer layers (``LAYER``, sizes in ``unit`` bytes) and autograd's
    mirror: each value's gradient reads the value's inputs and its users' gradients;
    the input's gradient is kept. Two segments per layer, as a traced Llama has, and 16
    values to decide in each: 1,000 decisions from 63 layers."""
    nodes = [node("x0", size=4 * unit, time=0.0, resident=True)]
    x = 0
    for layer in range(n):
        at = {"x": x}
        for name, reads, size, seconds in LAYER:
            at[name] = len(nodes)
            nodes.append(node(f"{name}{layer}", *(at[r] for r in reads), size=size * unit, time=seconds))
        x = at["out"]
    forward = len(nodes)
    users: dict[int, list[int]] = {v: [] for v in range(forward)}
    for v, n_ in enumerate(nodes):
        for d in n_.deps:
            users[d].append(v)
    grad: dict[int, int] = {}
    for v in reversed(range(forward)):
        deps = sorted({*nodes[v].deps, *(grad[u] for u in users[v])})
        grad[v] = len(nodes)
        nodes.append(node(f"g_{nodes[v].name}", *deps, size=nodes[v].size, time=nodes[v].time,
                          backward=True, keep=v == 0))
    return P(*nodes, host_bandwidth=host_bandwidth)
