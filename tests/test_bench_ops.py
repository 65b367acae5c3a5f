"""``bench.ops``: the table of self time by op against the first configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import ops
from tests.helpers import run_bench


def row(config: str, step: float, **op: tuple[float, int]) -> dict[str, object]:
    return {"config": config, "ok": True, "step_s": step, "ops": {k: list(v) for k, v in op.items()}}


def test_the_ops_that_changed_most_come_first_with_their_change() -> None:
    base = row("none", 6.0, mm=(3.0, 50), addmm=(1.6, 25), sdpa=(0.28, 6))
    plan = row("plan", 7.0, mm=(3.0, 50), addmm=(2.3, 35), sdpa=(0.52, 11))
    plan["predicted_added_s"] = 0.86
    text = ops.table([base, plan], top=2)
    lines = text.splitlines()
    assert lines[0] == "| op | none | plan |"
    assert lines[2] == "| `addmm` | 1.600 (25) | 2.300 (35) +0.700 |"  # the largest change first
    assert lines[3] == "| `sdpa` | 0.280 (6) | 0.520 (11) +0.240 |"
    assert "`mm`" not in text  # unchanged, and only the top 2 are listed
    assert "| all ops, self | 4.880 | 5.820 +0.940 |" in text
    assert "| step (median) | 6.000 | 7.000 +1.000 |" in text
    assert "| rematc predicted added |  | 0.860 |" in text


def test_an_op_one_configuration_lacks_counts_as_zero_and_a_failure_is_named() -> None:
    base = row("none", 6.0, mm=(3.0, 50))
    plan = row("plan", 6.5, mm=(3.0, 50), sdpa=(0.25, 5))
    failed = {"config": "bad", "ok": False, "error": "InfeasibleBudgetError: budget"}
    text = ops.table([base, failed, plan])
    assert "| `sdpa` | 0.000 (0) | 0.250 (5) +0.250 |" in text
    assert "failed: bad: InfeasibleBudgetError: budget" in text
    assert ops.table([failed]) == "no configuration ran\n"


def test_an_unknown_configuration_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        ops.main(["--model", "gpt_tiny", "--configs", "eager", "nonsense"])
    assert info.value.code == 2


@pytest.mark.slow
def test_smoke_profiles_two_configurations(tmp_path: Path) -> None:
    proc = run_bench("ops", "--model", "gpt_tiny", "--configs", "rematc_none", "rematc_80%",
                     "--small", "--rematc-compiler", "eager", "--threads", "1", "--steps", "2", "--warmup", "1",
                     "--out", str(tmp_path), timeout=300)
    rows = json.loads((tmp_path / "gpt_tiny-ops.json").read_text())
    assert [r["config"] for r in rows] == ["rematc_none", "rematc_80%"]
    assert all(r["ok"] and r["ops"] and r["step_s"] > 0 for r in rows)
    assert all(seconds >= 0 and calls >= 1 for r in rows for seconds, calls in r["ops"].values())
    assert (tmp_path / "gpt_tiny-ops.md").read_text().strip().endswith(proc.stdout.strip())
    assert str(tmp_path) not in (tmp_path / "machine-gpt_tiny-ops.json").read_text()
