"""Held-out points per minute on the tool task, with call rewards against without: pairs of demo runs, interleaved.

Each run is ``tracetrain demo --task lookup --minutes M`` as a user runs it (a fresh ``tracetrain serve`` on
DATA_DIR/demo, the reward service, the agent). The runs *with* add ``--call-rewards`` (and ``--turn-discount G`` when
given; else the demo's default): beside each attempt's reward, the reward service rewards each find_hotel call on
its own, 1 when it named the destination, else 0, by its call id. The runs alternate with, without, with, ... so that
a drift of the machine (heat, another process) falls on both alike; the two runs of a pair train for the same minutes
on the same training requests in the same order (the demo seeds each round by its number); vLLM's sampling is not
seeded.

Held-out success is the demo's own measurement (100 held-out requests x --eval-attempts): the base model's beside the
first round, the version serving after training, and with --eval-every the version serving every so many minutes
(beside training: it costs both arms the same steps).

- points per minute: (after - base) x 100 / M, where base is the mean of every run's measurement of the base model
  (one model measured 2N times: the pooled mean's error is smaller than any one run's);
- the ratio: mean points per minute with call rewards / without; its spread: the pairs' own ratios (min..max), and
  the difference in points per minute with its standard error over the pairs (defined where a ratio is not, when a
  run without call rewards gained nothing).

OUT gets each run's demo results (run-P-with/, run-P-without/: results.json, reward-curve.png, demo.log and the
store, tracetrain.db), the summary (results.json) and one plot of held-out success against minutes for every run
(call-rewards.png).

    .venv/bin/python bench/call_rewards.py --pairs 3 --out .tracetrain/bench-call-rewards
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tracetrain_demo.report import save_success_plot, success_axes
from tracetrain_demo.run import DEFAULT_TURN_DISCOUNT
from tracetrain_demo.tasks import TASKS

REPO = Path(__file__).resolve().parents[1]
_ARMS = {True: "with", False: "without"}
# A run's minutes beyond its training: serve's start (vLLM on a CPU, ~1.5), the held-out measurement after training
# (200 attempts of 2+ calls on an idle vLLM, ~2) and the stop.
_OVERHEAD_MINUTES = 4.0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/call_rewards.py", description=__doc__.split("\n\n")[0],
                                epilog="Run it on a quiet machine: it takes about 2 x PAIRS x (MINUTES + 4) "
                                "minutes.")  # fmt: skip
    p.add_argument("--pairs", type=int, default=3, help="pairs of runs, one with call rewards, one without (default 3)")
    p.add_argument("--task", choices=sorted(name for name, task in TASKS.items() if task.score_calls), default="lookup",
                   help="the demo's task whose checker judges calls (default lookup)")  # fmt: skip
    p.add_argument("--minutes", type=float, help="each run's training minutes (default: the task's, 9 for lookup)")
    p.add_argument("--turn-discount", type=float, metavar="G", default=DEFAULT_TURN_DISCOUNT,
                   help=f"the runs with call rewards: serve's --turn-discount (default {DEFAULT_TURN_DISCOUNT:g}, the "
                   "demo's)")  # fmt: skip
    p.add_argument("--eval-attempts", type=int, default=2, help="attempts per held-out request (default 2)")
    p.add_argument("--eval-every", type=float, default=0.0,
                   help="also measure the version serving every this many minutes, beside training (default 0: "
                   "before and after only)")  # fmt: skip
    p.add_argument("--data-dir", type=Path, default=REPO / ".tracetrain", help="the model; the demo runs in it")
    p.add_argument("--out", type=Path, default=REPO / ".tracetrain" / "bench-call-rewards", help="results and plot")
    p.add_argument("--port", type=int, default=8100, help="the demo's proxy port (default 8100; vLLM: the next one)")
    p.add_argument("--reuse", action="store_true", help="keep the runs already in OUT (an interrupted bench goes on)")
    args = p.parse_args(argv)
    args.minutes = TASKS[args.task].minutes if args.minutes is None else args.minutes
    if args.pairs < 1 or args.minutes <= 0 or args.eval_attempts < 1 or args.eval_every < 0:
        p.error("--pairs and --eval-attempts are at least 1, --minutes above 0, --eval-every at least 0")
    if not 0 <= args.turn_discount <= 1:
        p.error("--turn-discount is from 0 to 1")
    return args


def schedule(pairs: int) -> list[tuple[int, bool]]:
    """(pair, with call rewards) in the order run: with, without, with, without, ..."""
    return [(pair, arm) for pair in range(pairs) for arm in (True, False)]


def demo_command(args: argparse.Namespace, call_rewards: bool) -> list[str]:
    """The demo's command line for one run: training bound by minutes alone (the steps' bound out of reach)."""
    command = [sys.executable, "-m", "tracetrain_cli", "demo", "--data-dir", str(args.data_dir), "--task", args.task,
               "--minutes", str(args.minutes), "--steps", "100000", "--eval-attempts", str(args.eval_attempts),
               "--eval-every", str(args.eval_every), "--port", str(args.port)]  # fmt: skip
    return command + (["--call-rewards", "--turn-discount", str(args.turn_discount)] if call_rewards else [])


def run(args: argparse.Namespace, pair: int, call_rewards: bool) -> dict[str, Any]:
    """One demo run; its results.json and plot are copied to OUT/run-PAIR-ARM (the demo's directory is reused)."""
    kept = args.out / f"run-{pair}-{_ARMS[call_rewards]}"
    if not (args.reuse and (kept / "results.json").exists()):
        kept.mkdir(parents=True, exist_ok=True)
        _say(f"pair {pair}, {_ARMS[call_rewards]} call rewards: tracetrain demo for {args.minutes:g} minutes "
             f"(log: {kept / 'demo.log'})")  # fmt: skip
        with (kept / "demo.log").open("w") as log:
            subprocess.run(demo_command(args, call_rewards), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
        # The store too (the next run starts on a fresh one): each run's rewards, call rewards and steps stay readable.
        for name in ("results.json", "reward-curve.png", "tracetrain.db", "tracetrain.db-wal"):
            if (args.data_dir / "demo" / name).exists():
                shutil.copy2(args.data_dir / "demo" / name, kept / name)
    results = json.loads((kept / "results.json").read_text())
    return {"pair": pair, "call_rewards": call_rewards, "minutes": args.minutes, "before": results["before"],
            "after": results["after"], "steps": len(results["steps"]),
            "curve": curve(results, args.minutes)}  # fmt: skip


def curve(results: dict[str, Any], minutes: float) -> list[tuple[float, float]]:
    """(minute, held-out success) of a demo's results: the base model's first measurement at 0, each later one at the
    minute it began (the one after training at the budget's end, even of a run whose version is still the base)."""
    began = float(results["training_began"])
    return [(0.0 if i == 0 else min(max((h["started"] - began) / 60, 0.0), minutes), float(h["success"]))
            for i, h in enumerate(results["held_out"])]  # fmt: skip


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Points per minute of each run against the pooled base, and with against without over the pairs."""
    base = statistics.fmean(r["before"] for r in runs)
    rated = [{**r, "points_per_minute": (r["after"] - base) * 100 / r["minutes"]} for r in runs]
    arms = {arm: [r["points_per_minute"] for r in rated if r["call_rewards"] is arm] for arm in (True, False)}
    pairs = []
    for pair in sorted({r["pair"] for r in rated}):
        arm = {r["call_rewards"]: r["points_per_minute"] for r in rated if r["pair"] == pair}
        if len(arm) == 2:
            pairs.append({"pair": pair, "difference": arm[True] - arm[False], "ratio": _ratio(arm[True], arm[False])})
    differences = [p["difference"] for p in pairs]
    ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
    mean_with, mean_without = (statistics.fmean(arms[a]) if arms[a] else None for a in (True, False))
    return {
        "base": base,
        "runs": rated,
        "pairs": pairs,
        "points_per_minute": {"with": mean_with, "without": mean_without},
        "ratio": _ratio(mean_with, mean_without),
        "pair_ratios": {"min": min(ratios), "max": max(ratios)} if ratios else None,
        "difference": statistics.fmean(differences) if differences else None,
        "difference_se": statistics.stdev(differences) / len(differences) ** 0.5 if len(differences) > 1 else None,
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    """None where it says nothing: an arm missing, or a denominator that gained nothing (or lost)."""
    return None if numerator is None or denominator is None or denominator <= 0 else numerator / denominator


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'pair':>4} {'call rewards':>12} {'before':>7} {'after':>6} {'steps':>5} {'points/min':>10}"]
    for r in summary["runs"]:
        lines.append(f"{r['pair']:>4} {_ARMS[r['call_rewards']]:>12} {r['before']:>7.0%} {r['after']:>6.0%} "
                     f"{r['steps']:>5} {r['points_per_minute']:>+10.2f}")  # fmt: skip
    per_minute = summary["points_per_minute"]
    lines.append(f"base (every run's measurement pooled): {summary['base']:.1%}")
    lines.append(f"points per minute: with call rewards {_num(per_minute['with'])}, "
                 f"without {_num(per_minute['without'])}")  # fmt: skip
    spread, se = summary["pair_ratios"], summary["difference_se"]
    pairs = f"pairs {spread['min']:.2f}x..{spread['max']:.2f}x" if spread else "no pair's ratio defined"
    lines.append(f"with/without: {_num(summary['ratio'], 'x')} ({pairs})")
    error = f" +- {se:.2f} (standard error, {len(summary['pairs'])} pairs)" if se is not None else ""
    lines.append(f"with - without: {_num(summary['difference'])} points per minute{error}")
    return "\n".join(lines)


def _num(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.2f}{unit}" if unit else f"{value:+.2f}"


def plot(runs: Sequence[dict[str, Any]], path: Path, task: str, attempts: int) -> Path:
    fig, ax = success_axes()
    colours = [f"C{i % 10}" for i in range(max((r["pair"] for r in runs), default=0) + 1)]
    for r in runs:
        minutes, success = zip(*r["curve"], strict=True) if r["curve"] else ((), ())
        ax.plot(minutes, success, marker="o", color=colours[r["pair"]], linestyle="-" if r["call_rewards"] else "--",
                label=f"pair {r['pair']}, {_ARMS[r['call_rewards']]} call rewards")  # fmt: skip
    ax.set_xlabel("minutes of training")
    ax.set_ylabel(f"held-out success (100 requests x {attempts})")
    ax.set_title(f"The demo's {task} task: rewarding the tool call apart from the answer")
    return save_success_plot(fig, ax, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    args.out, args.data_dir = args.out.resolve(), args.data_dir.resolve()  # the demo runs from the repository's root
    args.out.mkdir(parents=True, exist_ok=True)
    hours = 2 * args.pairs * (args.minutes + _OVERHEAD_MINUTES) / 60
    _say(f"{args.pairs} pair(s) of {args.task} runs, {args.minutes:g} training minutes each: about {hours:.1f} h")
    runs = [run(args, pair, arm) for pair, arm in schedule(args.pairs)]
    summary = summarize(runs)
    recorded = {"task": args.task, "minutes": args.minutes, "turn_discount": args.turn_discount, **summary}
    (args.out / "results.json").write_text(json.dumps(recorded, indent=2))
    print(table(summary))
    _say(f"plot: {plot(runs, args.out / 'call-rewards.png', args.task, args.eval_attempts)}")
    return 0


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
