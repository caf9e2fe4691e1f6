"""bench/call_rewards.py without vLLM: its arguments, the runs it would start, and its summary of recorded runs."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # bench/ is not a package: its scripts import as top-level names
    return importlib.import_module("call_rewards")


def _demo_results(before: float, after: float, steps: int, *, began: float = 1000.0) -> dict[str, Any]:
    """What ``tracetrain demo`` writes (results.json), as far as the bench reads it."""
    held_out = [{"version": 0, "success": before, "attempts": 200, "started": began - 5, "finished": began + 60},
                {"version": steps, "success": after, "attempts": 200, "started": began + 545,
                 "finished": began + 700}]  # fmt: skip
    return {"before": before, "after": after, "training_began": began, "held_out": held_out,
            "steps": [{"version": v} for v in range(1, steps + 1)]}  # fmt: skip


def test_the_bench_runs_pairs_interleaved_with_call_rewards_first_at_the_same_minutes(bench: ModuleType) -> None:
    args = bench.parse(["--pairs", "2", "--minutes", "2", "--port", "8300"])
    assert bench.schedule(args.pairs) == [(0, True), (0, False), (1, True), (1, False)]
    with_, without = bench.demo_command(args, True), bench.demo_command(args, False)
    assert with_[with_.index("--minutes") + 1] == without[without.index("--minutes") + 1] == "2.0"
    assert with_[-3:] == ["--call-rewards", "--turn-discount", "0.0"]  # the demo's default discount, recorded
    assert "--call-rewards" not in without and "--turn-discount" not in without
    assert with_[with_.index("--task") + 1] == "lookup" and without[without.index("--port") + 1] == "8300"


def test_the_bench_defaults_to_three_pairs_of_the_tool_tasks_minutes_and_refuses_nonsense(bench: ModuleType) -> None:
    args = bench.parse([])
    assert (args.pairs, args.minutes, args.task, args.turn_discount) == (3, 9.0, "lookup", 0.0)
    assert bench.parse(["--turn-discount", "0.5"]).turn_discount == 0.5
    for refused in (["--pairs", "0"], ["--minutes", "0"], ["--turn-discount", "1.5"], ["--task", "city"],
                    ["--eval-attempts", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            bench.parse(refused)


def test_points_per_minute_count_from_the_pooled_base_and_the_ratio_spreads_over_pairs(bench: ModuleType) -> None:
    def run(pair: int, arm: bool, before: float, after: float) -> dict[str, Any]:
        return {"pair": pair, "call_rewards": arm, "minutes": 10.0, "before": before, "after": after, "steps": 5}

    runs = [run(0, True, 0.10, 0.50), run(0, False, 0.20, 0.30), run(1, True, 0.20, 0.40), run(1, False, 0.10, 0.40)]
    summary = bench.summarize(runs)
    assert summary["base"] == pytest.approx(0.15)  # every run measured the one base model
    assert [r["points_per_minute"] for r in summary["runs"]] == pytest.approx([3.5, 1.5, 2.5, 2.5])
    assert summary["points_per_minute"] == pytest.approx({"with": 3.0, "without": 2.0})
    assert summary["ratio"] == pytest.approx(1.5)
    assert summary["pair_ratios"] == pytest.approx({"min": 1.0, "max": 3.5 / 1.5})
    assert summary["difference"] == pytest.approx(1.0)
    assert summary["difference_se"] == pytest.approx(1.0)  # differences 2 and 0: std sqrt(2), over sqrt(2)
    table = bench.table(summary)
    assert "with/without: 1.50x (pairs 1.00x..2.33x)" in table and "+1.00 points per minute +- 1.00" in table


def test_a_run_without_call_rewards_that_gained_nothing_leaves_its_ratio_undefined(bench: ModuleType) -> None:
    runs = [{"pair": 0, "call_rewards": True, "minutes": 5.0, "before": 0.2, "after": 0.4, "steps": 3},
            {"pair": 0, "call_rewards": False, "minutes": 5.0, "before": 0.2, "after": 0.2, "steps": 3}]  # fmt: skip
    summary = bench.summarize(runs)
    assert (summary["ratio"], summary["pair_ratios"], summary["difference_se"]) == (None, None, None)
    assert summary["difference"] == pytest.approx(4.0)
    assert "with/without: n/a (no pair's ratio defined)" in bench.table(summary)


def test_recorded_runs_are_summarized_and_plotted_without_running_them_again(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded = {(0, "with"): (0.1, 0.6, 8), (0, "without"): (0.2, 0.4, 9), (1, "with"): (0.15, 0.5, 7),
                (1, "without"): (0.15, 0.35, 8)}  # fmt: skip
    for (pair, arm), (before, after, steps) in recorded.items():
        (tmp_path / f"run-{pair}-{arm}").mkdir()
        (tmp_path / f"run-{pair}-{arm}" / "results.json").write_text(json.dumps(_demo_results(before, after, steps)))
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("a recorded run was run again"))

    assert bench.main(["--pairs", "2", "--minutes", "9", "--reuse", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["task"], results["minutes"], results["turn_discount"]) == ("lookup", 9.0, 0.0)
    assert [r["steps"] for r in results["runs"]] == [8, 9, 7, 8]
    # The base at minute 0 (measured beside the first round), the trained version at the budget's end.
    assert results["runs"][0]["curve"] == [[0.0, 0.1], [9.0, 0.6]]
    assert results["points_per_minute"]["with"] == pytest.approx(((0.6 + 0.5) / 2 - 0.15) * 100 / 9)
    assert (tmp_path / "call-rewards.png").stat().st_size > 0


def test_a_measurement_during_training_sits_at_the_minute_it_began(bench: ModuleType) -> None:
    results = _demo_results(0.1, 0.5, 6)
    results["held_out"].insert(1, {"version": 3, "success": 0.3, "attempts": 200, "started": 1000.0 + 180,
                                   "finished": 1000.0 + 300})  # fmt: skip
    assert bench.curve(results, 9.0) == [(0.0, 0.1), (3.0, 0.3), (9.0, 0.5)]
    untrained = _demo_results(0.1, 0.12, 0)  # no step landed: the version measured after training is still 0
    untrained["held_out"][1]["version"] = 0
    assert bench.curve(untrained, 9.0) == [(0.0, 0.1), (9.0, 0.12)]
