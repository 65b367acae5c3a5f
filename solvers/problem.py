"""The rematerialization problem: one frozen, torch-free description of a training step.

A problem is a DAG of *values* in a fixed topological order. Each value is one storage
(a tensor's memory): the adapter that builds problems from FX graphs folds views and the
elements of multi-output ops into the value that owns their storage, so every byte is
counted once. All forward values come before all backward values; executing the problem
means running node ``i`` at timeline step ``i``.

Memory model (the plan checker in :mod:`solvers.checker` implements it, the CP-SAT model
in :mod:`solvers.cpsat` encodes it):

* a resident value (parameters, inputs: alive before the step starts) costs nothing;
* any other value occupies ``size`` bytes from the step that computes it to the step of
  its last use (inclusive: an op's inputs and its output coexist while it runs);
* ``keep`` values (the forward's outputs, the gradients) stay until the end of the step;
  ``returned`` ones (forward outputs the caller drops when the forward returns) until the
  forward's last step, and past it only as a plan's saved or offloaded copy;
* a value whose storage its last reader writes over (``Node.overwrites``: a kernel writes
  its output into a same-sized input that dies there) ends one step early, so the two do
  not both count at that step: each copy whose last read is that reader's
  (:attr:`Problem.taken_over`), or that reader's recomputation, where it is a forward op.
  A saved or offloaded forward copy is a forward output, which is never overwritten in
  the forward; a backward reader whose ``overwrites_copies`` leaves out the copies the
  backward makes writes over the saved forward copy only;
* in a two-phase problem a copy named in ``Node.unstored`` holds no memory: the ops that
  read it compute it themselves, so what it reads is read at each of their steps
  instead. An unstored ``RECOMPUTED`` copy is computed inside each reader of the
  recomputation; an unstored ``FORWARD`` copy, unless the value is saved or offloaded
  (then the forward stores it), inside its one forward reader.

These effects are the problem's whole vocabulary for what a compiler does to memory; the
rules that set them for Inductor are ``rematc.inductor_rules``.

The budget bounds the peak of that sum over the step, in bytes.

Time model: step ``k`` computes for ``nodes[k].time`` seconds. Copies to and from host
memory (offloads) run on their own streams beside the compute, one copy engine each way,
each over a window of steps (``solvers.plan.Transfer``); the compute waits where a
window ends before its copy is done, so a copy costs nothing where its window's compute
covers it (``solvers.checker.transfer_stalls``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

# The most bytes a problem may hold, all its values together, and the largest budget:
# 2**53 (8 PiB), far beyond any device's memory. Byte counts stay exact as floats
# (fractions, reports), and the CP-SAT models' sums of sizes stay far inside its 64-bit
# integers (a value of 2**62 bytes overflowed them).
MAX_BYTES = 2**53
MAX_BYTES_TEXT = "2**53 bytes (8 PiB)"


class ProblemError(ValueError):
    """A problem that is not well formed; the message names the node and the mistake."""


class Copy(Enum):
    """The copies of a value a plan may make."""

    FORWARD = "forward"  # the forward computes it (kept to the backward where saved)
    RECOMPUTED = "recomputed"  # the backward recomputes it
    RELOADED = "reloaded"  # copied back from host memory after an offload


EVERY_COPY = frozenset(Copy)


@dataclass(frozen=True, kw_only=True)
class Node:
    """One value of the step: the op that produces it and what it costs."""

    name: str
    op: str = ""  # producing op, for reports only (e.g. "aten.mm")
    deps: tuple[int, ...] = ()  # indices of the values this op reads; all smaller than ours
    backward: bool = False  # computed by the backward (tangents and all that follows them)
    size: int = 0  # bytes of the storage this value owns
    time: float = 0.0  # seconds one recomputation of it adds (the device model's estimate)
    flops: float = 0.0  # floating-point operations: for reports, and none marks a free value
    recomputable: bool = True  # False for random ops and values that must be saved
    offloadable: bool = True  # False where no copy can stand in for it (views, symbolic sizes)
    resident: bool = False  # alive before the step (parameters, inputs): costs no budget
    keep: bool = False  # stays until the end of the step (outputs, gradients)
    # A forward output the caller drops when the forward returns: its forward copy lives to
    # the forward's last step (the forward hands it over there), not to the step's end.
    returned: bool = False
    # A dep of the same size whose storage this op writes its output into where it reads
    # that dep's copy last.
    overwrites: int | None = None
    # The copies of ``overwrites`` it writes into: every copy, or the forward one only (a
    # backward op that writes over a saved copy but never over one the backward makes).
    overwrites_copies: frozenset[Copy] = EVERY_COPY
    # Copies of this value that hold no memory: each op that reads one computes it itself.
    # FORWARD: unless saved or offloaded, its one forward reader computes it. RECOMPUTED:
    # each reader of its recomputation computes it.
    unstored: frozenset[Copy] = frozenset()

    def stores(self, copy: Copy) -> bool:
        """Whether this value's ``copy`` holds memory of its own (see ``unstored``)."""
        return copy not in self.unstored

    @property
    def overwrites_backward_copies(self) -> bool:
        """Whether ``overwrites`` covers the copies the backward makes (recomputed, reloaded)."""
        return Copy.RECOMPUTED in self.overwrites_copies


@dataclass(frozen=True)
class Scale:
    """Integer units for CP-SAT, chosen once per problem and reported back in real units.

    ``bytes_per_unit`` is the gcd of all value sizes, so memory in units is exact.
    ``seconds_per_unit`` makes the longest op ``TIME_RESOLUTION`` units, so times are
    exact to one part in a million of the longest op.
    """

    bytes_per_unit: int
    seconds_per_unit: float

    TIME_RESOLUTION = 1_000_000
    # The most time units one copy of every value that may be offloaded may add up to:
    # the objective multiplies time by its tie-break (up to twice the number of values)
    # and offers each copy beside up to 6 steps each way, so at 2**40 a problem of 10**5
    # values stays inside CP-SAT's 64-bit integers (200 values overflowed them near 2**50).
    MAX_COPY_UNITS = 2**40

    def mem(self, nbytes: int) -> int:
        """Bytes to memory units, rounded up (sizes are exact multiples by construction)."""
        return -(-nbytes // self.bytes_per_unit)

    def capacity(self, nbytes: int) -> int:
        """A budget in bytes to memory units, rounded down (never above the budget)."""
        return nbytes // self.bytes_per_unit

    def time(self, seconds: float) -> int:
        return round(seconds / self.seconds_per_unit)


@dataclass(frozen=True, kw_only=True)
class Problem:
    """A training step to plan: values in topological order, forward first."""

    nodes: tuple[Node, ...]
    budget: int | None = None  # bytes; None when only asked for a report
    host_bandwidth: float = 0.0  # bytes/s each way between device and host; 0: no offload
    name: str = ""
    meta: dict[str, str] = field(default_factory=dict, compare=False)  # provenance only

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        _validate(self)

    # ---- derived structure, computed once -------------------------------------------

    @cached_property
    def n_forward(self) -> int:
        """Number of forward values; steps ``0 .. n_forward-1`` are the forward."""
        return sum(1 for n in self.nodes if not n.backward)

    @cached_property
    def single_phase(self) -> bool:
        """No backward values: a graph without a forward/backward split (Checkmate's and
        Moccasin's random benchmark graphs). Any value may then be recomputed before any
        later step, as often as pays (:mod:`solvers.singlephase.anywhere`), rather than
        once in the backward."""
        return bool(self.nodes) and self.n_forward == len(self.nodes)

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for d in sorted(set(n.deps)):
                out[d].append(i)
        return tuple(tuple(u) for u in out)

    @cached_property
    def last_step(self) -> int:
        return len(self.nodes) - 1

    @cached_property
    def last_forward_use(self) -> tuple[int, ...]:
        """Step of the last forward read of each value (its own step if none); the
        forward's last step for a ``returned`` value, which the forward hands over there."""
        f = self.n_forward
        return tuple(
            max([i, *(u for u in self.users[i] if u < f), *([f - 1] if n.returned else [])])
            for i, n in enumerate(self.nodes)
        )

    @cached_property
    def backward_uses(self) -> tuple[tuple[int, ...], ...]:
        """Backward steps that read each value directly."""
        f = self.n_forward
        return tuple(tuple(u for u in us if u >= f) for us in self.users)

    @cached_property
    def forward_users(self) -> tuple[tuple[int, ...], ...]:
        f = self.n_forward
        return tuple(tuple(u for u in us if u < f) for us in self.users)

    @cached_property
    def candidates(self) -> tuple[int, ...]:
        """Forward values that may need a decision: the backward reads them directly or
        through a chain of forward values that could be recomputed."""
        f = self.n_forward
        reach = [False] * f
        for i in reversed(range(f)):
            node = self.nodes[i]
            if node.resident:
                continue
            reach[i] = bool(self.backward_uses[i]) or any(
                reach[u] and self.nodes[u].recomputable for u in self.forward_users[i]
            )
        return tuple(i for i in range(f) if reach[i] and not self.nodes[i].keep)

    @cached_property
    def taken_over(self) -> dict[int, int]:
        """``u -> v``: v is written into u's storage where v is the last read of u's copy,
        so that copy lives to step v - 1.

        v must be u's last reader of all, and both ordinary values of a two-phase problem
        (in a single-phase one any value may be recomputed). A decision may still decide
        whether v reads a copy last: a candidate saved or offloaded keeps its forward copy
        past its last forward reader (a forward output is never overwritten), and a
        recomputation that reads u after v keeps its backward copy. Where v is a forward op,
        v's recomputation reading u's backward copy last takes it over too (the checker's
        :func:`~solvers.checker.value_intervals`)."""
        if self.single_phase:
            return {}
        out: dict[int, int] = {}
        for v, n in enumerate(self.nodes):
            u = n.overwrites
            if u is None:
                continue
            src = self.nodes[u]
            if src.resident or src.keep or src.returned or src.size != n.size or self.users[u][-1] != v:
                continue
            out[u] = v
        return out

    def computed_in(self, i: int) -> int | None:
        """The forward step that computes a value whose forward copy is unstored
        (``Copy.FORWARD`` in ``Node.unstored``) when the forward does not store it: its one
        forward reader; None for any other value."""
        return self.computed_by.get(i)

    @cached_property
    def computed_by(self) -> dict[int, int]:
        """:meth:`computed_in` of every value it is not None for, in value order, found
        once (the checker reads it on every replay)."""
        if self.single_phase:
            return {}
        return {i: self.forward_users[i][0] for i, n in enumerate(self.nodes) if not n.stores(Copy.FORWARD)}

    def copy_out_from(self, i: int) -> int:
        """The first forward step a copy of value ``i`` to the host may run beside: after
        its last forward read, counting the reads of the values with an unstored forward
        copy that read it, which their readers make when those values are not stored."""
        computing = [r for u in self.forward_users[i] if (r := self.computed_in(u)) is not None]
        return max([self.last_forward_use[i], *computing]) + 1

    def fixed_end(self, i: int) -> int:
        """The last step a value lives when it has one copy, read by ops only: its last
        reader's step (one before it, where that reader takes its storage over); for a
        ``returned`` value, not before the forward's last step."""
        return self._fixed_ends[i]

    @cached_property
    def _fixed_ends(self) -> tuple[int, ...]:
        return tuple(self._fixed_end(i) for i in range(len(self.nodes)))

    def _fixed_end(self, i: int) -> int:
        v = self.taken_over.get(i)
        if v is not None:
            return v - 1
        users = self.users[i]
        end = max(i, users[-1]) if users else i
        return max(end, self.n_forward - 1) if self.nodes[i].returned else end

    def forward_end(self, i: int) -> int:
        """The last step a forward value's forward copy lives unless it is saved or
        offloaded: its last forward reader's step, or one before it where that reader takes
        its storage over."""
        lf = self.last_forward_use[i]
        return lf - 1 if self.taken_over.get(i) == lf else lf

    @cached_property
    def scale(self) -> Scale:
        sizes = [n.size for n in self.nodes if n.size > 0 and not n.resident]
        unit = math.gcd(*sizes) if sizes else 1
        longest = max((n.time for n in self.nodes), default=0.0)
        seconds = longest / Scale.TIME_RESOLUTION if longest > 0 else 1.0
        return Scale(bytes_per_unit=unit, seconds_per_unit=seconds)

    @cached_property
    def capacity(self) -> int:
        """floor(B/q): the budget in memory units; without a budget, every byte (all fits)."""
        return self.scale.capacity(self.budget if self.budget is not None else sum(n.size for n in self.nodes))

    def transfer_time(self, i: int) -> float:
        """Seconds one copy of value ``i`` takes over the host link (inf without one)."""
        if self.host_bandwidth <= 0:
            return math.inf
        return self.nodes[i].size / self.host_bandwidth

    def index(self, name: str) -> int:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no value named {name!r} in problem {self.name!r}") from None

    @cached_property
    def _by_name(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    def with_budget(self, budget: int | None) -> Problem:
        """This problem at ``budget``. Only the budget is validated again, and the structure
        derived from the nodes (users, candidates, scale, ...) is carried over, not
        computed anew: a solver asks for many budgets of one problem (on Llama-2-70B's
        step, validating every copy took 3 of an infeasible budget's 30 s)."""
        out = object.__new__(Problem)
        for name, value in (("nodes", self.nodes), ("budget", budget), ("host_bandwidth", self.host_bandwidth),
                            ("name", self.name), ("meta", dict(self.meta))):
            object.__setattr__(out, name, value)
        _validate_budget(out)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k in _OF_THE_NODES})
        return out

    def describe(self, i: int) -> str:
        n = self.nodes[i]
        phase = "backward" if n.backward else "forward"
        return f"#{i} {n.name} ({n.op or 'value'}, {phase}, {n.size} B)"


def _validate(p: Problem) -> None:
    # Types are checked before values, so a wrongly typed field is a ProblemError too,
    # never a TypeError from comparing it.
    seen: set[str] = set()
    in_backward = False
    total = 0
    for i, n in enumerate(p.nodes):
        if not isinstance(n, Node):
            raise ProblemError(f"node #{i} is a {type(n).__name__}, not a solvers.Node")
        if not isinstance(n.name, str) or not n.name:
            raise ProblemError(f"node #{i} needs a non-empty str name, got {n.name!r}")
        where = f"node #{i} {n.name!r}"
        if n.name in seen:
            raise ProblemError(f"{where}: the name is used twice; names must be unique")
        seen.add(n.name)
        if not _is_int(n.size) or n.size < 0:
            raise ProblemError(f"{where}: size must be a non-negative int of bytes, got {n.size!r}")
        total += n.size
        if n.size > MAX_BYTES:
            raise ProblemError(f"{where}: size {n.size} is over {MAX_BYTES_TEXT}: no device holds that much")
        if total > MAX_BYTES:
            raise ProblemError(f"{where}: the sizes of values #0 to #{i} add up to {total} bytes, over "
                               f"{MAX_BYTES_TEXT}: no device holds that much")
        for field_, unit in (("time", "seconds"), ("flops", "FLOPs")):
            x = getattr(n, field_)
            if not _is_real(x) or not (math.isfinite(x) and x >= 0):
                raise ProblemError(f"{where}: {field_} must be finite and >= 0 {unit}, got {x!r}")
        if not isinstance(n.deps, tuple):
            raise ProblemError(f"{where}: deps must be a tuple of node indices, got {n.deps!r}")
        for d in n.deps:
            if not _is_int(d) or not 0 <= d < i:
                raise ProblemError(
                    f"{where}: dependency {d!r} is not an earlier node; "
                    "nodes must be listed in topological order"
                )
            if n.backward is False and p.nodes[d].backward:
                raise ProblemError(f"{where}: a forward value cannot read backward value #{d}")
        if n.backward:
            in_backward = True
        elif in_backward:
            raise ProblemError(f"{where}: forward value after the first backward value")
        if n.resident and (n.deps or n.backward):
            raise ProblemError(f"{where}: a resident value must be a forward input with no deps")
        if n.overwrites is not None and (not _is_int(n.overwrites) or n.overwrites not in n.deps):
            raise ProblemError(f"{where}: overwrites must be one of its deps {list(n.deps)}, got {n.overwrites!r}")
        _check_copies(n.overwrites_copies, f"{where}: overwrites_copies")
        if Copy.FORWARD not in n.overwrites_copies or (
                (Copy.RECOMPUTED in n.overwrites_copies) != (Copy.RELOADED in n.overwrites_copies)):
            raise ProblemError(f"{where}: overwrites_copies must be every copy or the forward one only, "
                               f"got {sorted(c.value for c in n.overwrites_copies)}")
        _check_copies(n.unstored, f"{where}: unstored")
        if Copy.RELOADED in n.unstored:
            raise ProblemError(f"{where}: unstored cannot hold the reloaded copy (a copy back is stored)")
        if not n.stores(Copy.FORWARD) and (n.backward or n.resident or n.keep or n.returned):
            raise ProblemError(f"{where}: only an ordinary forward value may leave its forward copy "
                               "unstored (not a backward, resident, kept or returned one)")
        if n.returned and (n.backward or n.resident or n.keep):
            raise ProblemError(f"{where}: returned marks a forward output the caller drops after the "
                               "forward; a backward, resident or kept value cannot be one")
    for i, n in enumerate(p.nodes):
        if not n.stores(Copy.FORWARD) and not p.single_phase:
            readers = p.forward_users[i]
            if len(readers) != 1 or not p.nodes[readers[0]].stores(Copy.FORWARD):
                raise ProblemError(f"node #{i} {n.name!r}: an unstored forward copy needs exactly one "
                                   f"forward reader whose own forward copy is stored, it has {len(readers)}")
    _validate_budget(p)
    bw = p.host_bandwidth
    if not _is_real(bw) or not (math.isfinite(bw) and bw >= 0):
        raise ProblemError(f"host_bandwidth must be >= 0 bytes/s, got {bw!r}")
    _check_copy_time(p)


def _validate_budget(p: Problem) -> None:
    if p.budget is not None and (not _is_int(p.budget) or p.budget < 0):
        raise ProblemError(f"budget must be a non-negative int of bytes, got {p.budget!r}")
    if p.budget is not None and p.budget > MAX_BYTES:
        raise ProblemError(f"budget {p.budget} is over {MAX_BYTES_TEXT}: no device holds that much")


# The cached properties of a Problem that depend on its nodes alone (every one but the
# budget in memory units): Problem.with_budget carries them over.
_OF_THE_NODES = frozenset(name for name, attr in vars(Problem).items()
                          if isinstance(attr, cached_property) and name != "capacity")


def _check_copy_time(p: Problem) -> None:
    """The copies a plan may make must fit the solvers' integer time scale
    (:attr:`Scale.MAX_COPY_UNITS`); a host link slow enough to break it is a mistake."""
    bw = p.host_bandwidth
    if bw <= 0 or p.single_phase:
        return
    nbytes = sum(p.nodes[i].size for i in p.candidates if p.nodes[i].offloadable)
    seconds = nbytes / bw
    unit = p.scale.seconds_per_unit
    limit = Scale.MAX_COPY_UNITS * unit
    if seconds > limit:
        raise ProblemError(
            f"host_bandwidth {bw!r} bytes/s is too slow for this problem: one copy of each "
            f"value that may be offloaded ({nbytes} bytes) takes {seconds:.3g} s, over the "
            f"{limit:.3g} s (2**40 of the solvers' time units, {unit:.3g} s each) that their "
            "64-bit arithmetic is sized for; raise host_bandwidth, or set it to 0 to plan "
            "without offloading"
        )


def _check_copies(copies: object, where: str) -> None:
    if not isinstance(copies, frozenset) or not all(isinstance(c, Copy) for c in copies):
        raise ProblemError(f"{where} must be a frozenset of solvers.Copy, got {copies!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def node(
    name: str,
    *deps: int,
    size: int = 1,
    time: float = 1.0,
    backward: bool = False,
    **kw: object,
) -> Node:
    """Short constructor for hand-built graphs in tests and examples."""
    return Node(name=name, deps=tuple(deps), size=size, time=time, backward=backward, **kw)  # type: ignore[arg-type]


def chain_problem(sizes: Sequence[int], times: Sequence[float], *, budget: int | None = None) -> Problem:
    """A forward chain x0 -> x1 -> ... and its mirrored backward, as autograd builds it:
    backward step k reads forward value n-1-k and the previous gradient."""
    n = len(sizes)
    nodes: list[Node] = [Node(name="input", resident=True, size=sizes[0] if sizes else 0)]
    for k in range(n):
        nodes.append(Node(name=f"f{k}", deps=(k,), size=sizes[k], time=times[k]))
    for k in range(n):
        fwd = n - k  # index of f{n-1-k}
        prev = (len(nodes) - 1,) if k else ()
        nodes.append(
            Node(
                name=f"g{n - 1 - k}",
                deps=(fwd, *prev),
                size=sizes[n - 1 - k],
                time=times[n - 1 - k],
                backward=True,
                keep=(k == n - 1),
            )
        )
    return Problem(nodes=tuple(nodes), budget=budget, name="chain")
