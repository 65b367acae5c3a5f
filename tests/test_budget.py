"""Budgets as users write them, and rematc's options."""

from __future__ import annotations

import pytest

from rematc import Options
from solvers.budget import Budget, format_bytes, parse_budget


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        (1024, 1024),  # the least byte budget
        (4096, 4096),
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("800 KiB", 800 * 1024),
        ("4096B", 4096),
        ("2gib", 2 * 2**30),
        ("1024", 1024),
        (2**53, 2**53),  # the largest budget: 8 PiB
        ("8192 TiB", 2**53),
    ],
)
def test_sizes(text: object, nbytes: int) -> None:
    assert parse_budget(text) == Budget(nbytes=nbytes)
    assert parse_budget(text).resolve(10**12) == nbytes


@pytest.mark.parametrize(("text", "fraction"), [("40%", 0.4), (0.4, 0.4), ("0.25", 0.25), (1.0, 1.0), ("100%", 1.0)])
def test_fractions(text: object, fraction: float) -> None:
    budget = parse_budget(text)
    assert budget.fraction == pytest.approx(fraction)
    assert budget.resolve(1000) == int(fraction * 1000)


@pytest.mark.parametrize("bad", ["", "abc", "12 parsecs", "-5", "-1GiB", 1.5, 0.0, -0.1, "0%", "150%",
                                 True, -1, "GiB", None, [1], float("nan"),
                                 # over 2**53 bytes: an OverflowError, or a CP-SAT model that overflowed
                                 "1e400B", "1e400 GiB", 2**63, str(2**63), 2**53 + 1, "8193TiB"])
def test_malformed(bad: object) -> None:
    with pytest.raises(ValueError, match="expected an int of bytes") as info:
        parse_budget(bad)
    assert repr(bad)[:10] in str(info.value) or str(bad) in str(info.value)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        # 1 is one byte, not 100%; B is bytes, not billions: once silently a 1-byte budget
        (1, r"budget 1 is 1 B, under 1 KiB: did you mean 100% \('1.0' or '100%'\) or '1GiB'\?"),
        ("1", r"budget '1' is 1 B, under 1 KiB: did you mean 100%"),
        ("1.5B", r"budget '1.5B' is 1 B, under 1 KiB: did you mean '1.5GiB' \(B is bytes, not billions\)\?"),
        ("800", r"budget '800' is 800 B, under 1 KiB: did you mean '800GiB'\?"),
        ("1023 B", r"is 1023 B, under 1 KiB"),
        (0, r"budget 0 is 0 B, under 1 KiB: did you mean no limit \(give no budget\)"),
        ("0.5KiB", r"is 512 B, under 1 KiB"),
        # negative: argparse once took '-5GiB' for an option; now the budget says what it is
        ("-5GiB", r"budget '-5GiB' is negative"),
        ("-40%", r"budget '-40%' is negative"),
        (-0.5, r"budget -0.5 is negative"),
    ],
)
def test_slips_are_refused_with_a_guess(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_budget(bad)
    assert len(str(info.value).splitlines()) == 1


def test_a_tiny_byte_budget_on_purpose_is_a_budget_object() -> None:
    """The refusal is parse_budget's: a Budget passes through whatever its bytes (a
    synthetic problem, or an impossible budget whose error states the smallest)."""
    assert parse_budget(Budget(nbytes=1)) == Budget(nbytes=1)
    assert Options.from_mapping({"budget": Budget(nbytes=8)}).budget == Budget(nbytes=8)
    with pytest.raises(ValueError, match="under 1 KiB"):
        Options.from_mapping({"budget": 8})


def test_format_bytes() -> None:
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(12) == "12 B"


def test_options_from_mapping() -> None:
    opts = Options.from_mapping({"budget": "1GiB", "compiler": "eager", "time_limit": 5,
                                 "workers": 2, "seed": 3, "gap": 0.01, "device": "h100",
                                 "stall_time": 2.5, "deterministic": True})
    assert opts.budget == Budget(nbytes=2**30) and opts.solver.deterministic
    assert opts.solver.time_limit == 5 and opts.solver.workers == 2 and opts.solver.seed == 3
    assert opts.solver.relative_gap == 0.01 and opts.solver.stall_time == 2.5
    assert Options.from_mapping(None) == Options()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"budgt": 1}, "unknown rematc option"),
        ({"compiler": "tvm"}, "'compiler' must be one of"),
        ({"device": "tpu"}, "'device' must be one of"),
        ({"time_limit": -1}, "'time_limit' must be a non-negative number"),
        ({"workers": 1.5}, "'workers' must be a non-negative int"),
        ({"stall_time": -2}, "'stall_time' must be a non-negative number"),
        ({"verify": "yes"}, "'verify' must be True or False"),
        ({"deterministic": 1}, "'deterministic' must be True or False"),
        ({"budget": "lots"}, "budget 'lots' is not understood"),
        # beyond what the solvers take: an AttributeError, an OverflowError or a SolverError before
        ({"device": 3}, r"'device' must be one of \['a100', 'cpu', 'h100', 'h200', 'l4'\], a DeviceProfile or None .* got 3"),
        ({"budget": "1e400B"}, r"budget '1e400B' is over 2\*\*53 bytes \(8 PiB\)"),
        ({"workers": 10**6}, r"'workers' must be a non-negative int at most 1024 \(0 = 8"),
        ({"seed": 10**20}, r"'seed' must be a non-negative int at most 2147483647 \(CP-SAT's seed is a 32-bit int\)"),
        ({"seed": 2**31}, r"'seed' must be a non-negative int at most 2147483647"),
        ({"host_bandwidth": 1e-300}, r"'host_bandwidth' must be 0 \(no offloading\), a number of bytes/s from 1e\+06"),
        ({"host_bandwidth": 999_999.0}, r"'host_bandwidth' must be 0 \(no offloading\)"),
    ],
)
def test_bad_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Options.from_mapping(options)


def test_option_limits_are_accepted() -> None:
    opts = Options.from_mapping({"workers": 1024, "seed": 2**31 - 1, "host_bandwidth": 1e6, "budget": 2**53})
    assert (opts.solver.workers, opts.solver.seed, opts.host_bandwidth) == (1024, 2**31 - 1, 1e6)
    assert Options.from_mapping({"host_bandwidth": 0}).host_bandwidth == 0


@pytest.mark.parametrize(
    ("options", "key"),
    [({"device": 3}, "'device'"), ({"budget": "1e400B"}, "budget '1e400B'"), ({"workers": 10**6}, "'workers'"),
     ({"seed": 10**20}, "'seed'"), ({"host_bandwidth": 1e-300}, "'host_bandwidth'")],
)
def test_compile_rejects_bad_options_at_once(options: dict[str, object], key: str) -> None:
    """Before, these raised at the first call, if at all (a SolverError asking to report a bug)."""
    import torch

    import rematc

    with pytest.raises(ValueError, match=key):
        rematc.compile(torch.nn.Linear(2, 2), **{"budget": 0.5, "compiler": "eager", **options})
