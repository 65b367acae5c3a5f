"""``bench.ab``: configurations in alternating processes, paired by round.

The pairing and the dominance verdicts on hand-written rows, and one smoke run of the tiny
GPT (toy sizes, eager codegen) so the command cannot rot.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Any

import pytest

from bench import ab
from tests.helpers import run_bench

MiB = 2**20


def row(rnd: int, config: str, step: float, peak_mib: float, ok: bool = True) -> dict[str, Any]:
    return {"round": rnd, "config": config, "ok": ok, "step_s": step, "peak_bytes": int(peak_mib * MiB)}


def test_order_rotates_so_no_configuration_always_runs_first() -> None:
    names = ["a", "b", "c"]
    rounds = [ab.order(names, i) for i in range(4)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert {r[0] for r in rounds[:3]} == set(names)


def test_ratios_pair_each_round_with_the_first_configurations_step() -> None:
    # Round 1 is slow for everyone: paired ratios stay put while raw steps move 50%.
    rows = [row(0, "base", 2.0, 900), row(0, "x", 1.8, 800),
            row(1, "x", 2.7, 800), row(1, "base", 3.0, 900)]
    base, x = ab.points(rows, ["base", "x"])
    assert base.ratios == (1.0, 1.0)
    assert x.steps == (1.8, 2.7) and x.ratios == pytest.approx((0.9, 0.9))
    assert x.ratio == pytest.approx(0.9) and x.peak == 800 * MiB


def test_a_failed_process_drops_its_round_from_the_pairing() -> None:
    rows = [row(0, "base", 2.0, 900), row(0, "x", 1.0, 800),
            row(1, "base", 2.0, 900, ok=False), row(1, "x", 5.0, 800)]
    base, x = ab.points(rows, ["base", "x"])
    assert x.ratios == (0.5,) and base.ratios == (1.0,) and x.rounds == (0,)
    # A configuration missing a round still compares with one that has it.
    y = ab.Point("y", 700 * MiB, (1.0, 1.0), (0.4, 0.45), (0, 1))
    assert ab.clearly_dominates(y, x) and not ab.clearly_dominates(x, y)


def test_dominance_needs_no_more_memory_and_a_lower_median_ratio() -> None:
    three = (0, 1, 2)
    fast_small = ab.Point("p", 800, (1.0, 1.0, 1.0), (0.90, 0.91, 0.92), three)
    slow_big = ab.Point("q", 900, (1.0, 1.0, 1.0), (0.95, 0.96, 0.90), three)
    slow_small = ab.Point("r", 700, (1.0, 1.0, 1.0), (0.99, 0.99, 0.99), three)
    assert ab.dominates(fast_small, slow_big)
    assert not ab.clearly_dominates(fast_small, slow_big)  # round 2: q was faster
    assert not ab.dominates(slow_big, fast_small)
    assert not ab.dominates(fast_small, slow_small)  # faster, but at more memory
    clear = ab.Point("s", 800, (1.0, 1.0, 1.0), (0.80, 0.80, 0.80), three)
    assert ab.clearly_dominates(clear, slow_big)


def test_markdown_marks_who_dominates_whom() -> None:
    pts = [ab.Point("base", 1000 * MiB, (2.0, 2.0), (1.0, 1.0), (0, 1)),
           ab.Point("amb", 890 * MiB, (1.9, 1.8), (0.95, 0.90), (0, 1)),
           ab.Point("rematc", 990 * MiB, (1.9, 2.0), (0.95, 1.0), (0, 1))]
    args = argparse.Namespace(configs=["base", "amb", "rematc"], rounds=2, steps=5, warmup=2, threads=1)
    text = ab.markdown("gpt_tiny", pts, args, ["--model", "gpt_tiny"])
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines() if ln.startswith("| ")}
    assert lines["rematc"].endswith("| amb |")  # lower peak, median 0.925 against 0.975
    assert lines["base"].endswith("| **amb**, rematc |")
    assert lines["amb"].endswith("| - |")


def test_parse_args_rejects_one_or_repeated_configurations() -> None:
    for bad in (["--configs", "eager"], ["--configs", "eager", "eager"], ["--configs", "eager", "nope_1"]):
        with pytest.raises(SystemExit):
            ab.parse_args(bad)


@pytest.mark.slow
def test_smoke_alternates_processes_and_writes_tables(tmp_path: Path) -> None:
    proc = run_bench("ab", "--model", "gpt_tiny", "--configs", "eager", "rematc_90%",
                     "--rounds", "2", "--small", "--rematc-compiler", "eager", "--threads", "1", "--steps", "2",
                     "--warmup", "1", "--out", str(tmp_path), timeout=300)
    with open(tmp_path / "gpt_tiny-ab.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # Two rounds, the order rotated: eager first in round 0, rematc first in round 1.
    assert [(r["round"], r["config"]) for r in rows] == [
        ("0", "eager"), ("0", "rematc_90%"), ("1", "rematc_90%"), ("1", "eager")]
    assert all(r["ok"] == "True" and float(r["step_s"]) > 0 for r in rows)
    table = (tmp_path / "gpt_tiny-ab.md").read_text()
    assert table.strip() == proc.stdout.strip()
    assert "| eager |" in table and "| rematc_90% |" in table
    assert str(tmp_path) not in (tmp_path / "machine-gpt_tiny-ab.json").read_text()
