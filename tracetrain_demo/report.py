"""What ``tracetrain demo`` measured: its steps, held-out evaluations and busy time, printed and plotted."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]  # no stubs in the demo extra


@dataclass
class Step:
    version: int
    reward_mean: float
    loss: float
    train_s: float
    wall_s: float
    success: float | None = None  # success of the training attempts this step's adapter served
    samples: int = 0
    off_policy: int = 0  # samples a version older than the one trained sampled (importance-corrected)
    stale: int = 0  # samples dropped: more than max_staleness versions behind
    # Multi-turn accounting (trainer._batch.turns, trainer._samples.SampleStats) of the step's trajectories.
    trajectories: int = 0
    calls: int = 0
    merged: int = 0  # calls merged into the sample before them
    retokenized: int = 0  # ...of which across a turn re-rendered to the same text in other token ids
    split_rerendered: int = 0  # calls that started a new sample: their prompt re-rendered the previous turn
    split_not_extended: int = 0  # ...their prompt did not keep what came before
    trained_tokens: int = 0
    completion_tokens: int = 0  # sampled tokens captured
    forwarded_tokens: int = 0  # what the samples forward in training
    captured_tokens: int = 0  # prompt + completion tokens of every call
    mismatch: float | None = None  # mean |learner - sampler| log-prob per token, nats
    mismatch_on_policy: float | None = None  # ...over the tokens the trained version sampled itself
    # ...split by kind: on-policy tokens sampled under a grammar (structured outputs) and the others
    mismatch_constrained: float | None = None
    mismatch_unconstrained: float | None = None
    constrained_tokens: int = 0
    grammar_fallbacks: int = 0  # constrained calls scored unmasked (their grammar could not be rebuilt)
    mask_ms: float = 0.0
    correction: str = "none"

    @classmethod
    def of(cls, version: int, m: dict[str, Any], wall_s: float) -> Step:
        """A step from its job's metrics (what the trainer recorded)."""
        return cls(version, m["reward_mean"], m["loss"], m["seconds"], wall_s, samples=m.get("samples", 0),
                   off_policy=m.get("off_policy_samples", 0), stale=m.get("skipped_stale_samples", 0),
                   trajectories=m.get("samples_trajectories", 0), calls=m.get("samples_calls", 0),
                   merged=m.get("samples_merged", 0), retokenized=m.get("samples_merged_retokenized", 0),
                   split_rerendered=m.get("samples_split_rerendered", 0),
                   split_not_extended=m.get("samples_split_not_extended", 0),
                   trained_tokens=m.get("trained_tokens", 0), completion_tokens=m.get("samples_completion_tokens", 0),
                   forwarded_tokens=m.get("samples_tokens", 0), captured_tokens=m.get("samples_call_tokens", 0),
                   mismatch=m.get("logprob_mismatch_mean"), mismatch_on_policy=m.get("logprob_mismatch_on_policy"),
                   correction=m.get("sampler_correction", "none"),
                   mismatch_constrained=m.get("logprob_mismatch_constrained"),
                   mismatch_unconstrained=m.get("logprob_mismatch_unconstrained"),
                   constrained_tokens=m.get("constrained_tokens", 0), grammar_fallbacks=m.get("grammar_fallbacks", 0),
                   mask_ms=m.get("mask_ms", 0.0))  # fmt: skip


@dataclass(frozen=True)
class HeldOut:
    version: int
    success: float  # of every attempt at every held-out request
    attempts: int
    started: float  # time.time()
    finished: float


@dataclass
class Report:
    policy: str = "agent"  # the policy this report is of (one per task with several tasks)
    held_out: list[HeldOut] = field(default_factory=list)  # the base model's first, the newest version's last
    steps: list[Step] = field(default_factory=list)
    served_success: dict[int, float] = field(default_factory=dict)  # version -> success of what it served
    seconds: float = 0.0
    # Busy time, as (start, end) of time.time(): agent rounds and evaluations (vLLM samples), training jobs.
    rounds: list[tuple[float, float]] = field(default_factory=list)
    sampling: list[tuple[float, float]] = field(default_factory=list)
    training: list[tuple[float, float]] = field(default_factory=list)
    training_window: tuple[float, float] = (0.0, 0.0)
    machine_busy_cores: float = 0.0  # of psutil.cpu_count() cores, averaged over the training phase
    rollbacks: list[str] = field(default_factory=list)  # the regression guard's reasons (the demo resumed each time)

    def busy(self) -> dict[str, float]:
        """The fraction of the training phase's wall time vLLM was sampling, the trainer training, and both."""
        start, end = self.training_window
        sampling, training = _union(self.sampling, start, end), _union(self.training, start, end)
        both = _union([(max(a, c), min(b, d)) for a, b in sampling for c, d in training if max(a, c) < min(b, d)],
                      start, end)  # fmt: skip
        wall = max(end - start, 1e-9)
        return {name: sum(b - a for a, b in spans) / wall
                for name, spans in (("sampling", sampling), ("training", training), ("both", both))}  # fmt: skip


def busy_cpu_seconds() -> float:
    """CPU seconds every core of the machine spent busy so far (anything not idle or waiting on I/O)."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def _union(spans: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """Disjoint spans covering the same time as ``spans``, cut to [start, end]."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


HEADER = f"{'version':>7} {'reward':>7} {'success':>8} {'loss':>8} {'train s':>8} {'step s':>7}"


def row(step: Step) -> str:
    success = "" if step.success is None else f"{step.success:.0%}"
    return (f"{step.version:>7} {step.reward_mean:>7.3f} {success:>8} {step.loss:>8.4f} {step.train_s:>8.1f} "
            f"{step.wall_s:>7.1f}")  # fmt: skip


def summary(report: Report, run_dir: Path, suffix: str = "") -> None:
    """Print the report and write its numbers (``results{suffix}.json``) and plot (``reward-curve{suffix}.png``)."""
    name = report.policy
    print(f"\n{name}:" if suffix else "")
    print(HEADER)
    for step in report.steps:
        print(row(step))
    if report.held_out:
        first, last = report.held_out[0], report.held_out[-1]
        print("\nheld-out success: " + ", ".join(f"{name}@{h.version} {h.success:.0%}" for h in report.held_out))
        print(f"{name}@0 {first.success:.0%} -> {name}@{last.version} {last.success:.0%} "
              f"({(last.success - first.success) * 100:+.0f} points) in {report.seconds / 60:.1f} min")  # fmt: skip
    else:
        print(f"\nheld-out success: not measured (--eval-attempts 0); {report.seconds / 60:.1f} min")
    busy = report.busy()
    print(f"while training: vLLM sampling {busy['sampling']:.0%} of the time, the trainer training "
          f"{busy['training']:.0%}, both at once {busy['both']:.0%}; the machine's {psutil.cpu_count()} cores "
          f"{report.machine_busy_cores:.2f} busy on average")  # fmt: skip
    samples = sum(s.samples for s in report.steps)
    print(f"trained on {samples} samples: {sum(s.off_policy for s in report.steps)} sampled by the version before "
          f"the one trained (importance-corrected), {sum(s.stale for s in report.steps)} dropped as stale")  # fmt: skip
    for line in turns(report.steps):
        print(line)
    if report.rollbacks:
        print(f"the regression guard rolled back {len(report.rollbacks)} version(s); the demo resumed training from "
              "the version restored each time")  # fmt: skip
    held = report.held_out
    results = {"policy": name, "before": held[0].success if held else None,
               "after": held[-1].success if held else None,
               "after_version": held[-1].version if held else None, "minutes": report.seconds / 60,
               "training_began": report.training_window[0], "held_out": [vars(h) for h in held], "busy": busy,
               "machine_busy_cores": report.machine_busy_cores, "steps": [vars(s) for s in report.steps],
               "served_success": report.served_success, "rollbacks": report.rollbacks}  # fmt: skip
    (run_dir / f"results{suffix}.json").write_text(json.dumps(results, indent=2))
    png = _plot(report, run_dir / f"reward-curve{suffix}.png")
    print(f"reward curve: {png}\nnumbers: {run_dir / f'results{suffix}.json'}")
    print(f"captured trajectories stay in {run_dir}: tracetrain serve --data-dir {run_dir} to browse them")


def turns(steps: list[Step]) -> list[str]:
    """The multi-turn accounting over every step, and the sampler/learner gap: lines for the summary."""
    trajectories = sum(s.trajectories for s in steps)
    if not trajectories:
        return []
    calls, samples = sum(s.calls for s in steps), sum(s.samples + s.stale for s in steps)
    rerendered, not_extended = sum(s.split_rerendered for s in steps), sum(s.split_not_extended for s in steps)
    trained, sampled = sum(s.trained_tokens for s in steps), sum(s.completion_tokens for s in steps)
    forwarded, captured = sum(s.forwarded_tokens for s in steps), sum(s.captured_tokens for s in steps)
    lines = [
        f"turns: {calls / trajectories:.2f} calls and {samples / trajectories:.2f} samples per trajectory "
        f"({sum(s.merged for s in steps)} calls merged into the one before, {sum(s.retokenized for s in steps)} of "
        f"them across a turn re-rendered in other token ids; split: {rerendered} because the prompt "
        f"re-rendered the previous turn, {not_extended} because it did not extend it)",
        f"tokens: {trained} trained of {sampled} sampled ({trained / max(sampled, 1):.0%}); training forwarded "
        f"{forwarded} of the {captured} captured (prompts shared by merged calls count once)",
    ]
    gaps = [s.mismatch for s in steps if s.mismatch is not None]
    on_policy = [s.mismatch_on_policy for s in steps if s.mismatch_on_policy is not None]
    if gaps:
        lines.append(
            f"sampler/learner gap: {sum(gaps) / len(gaps):.4f} nats per token on average over the steps"
            + (f" ({sum(on_policy) / len(on_policy):.4f} on-policy)" if on_policy else "")
            + f"; correction: {', '.join(sorted({s.correction for s in steps}))}"
        )
    if any(s.constrained_tokens for s in steps):
        lines.append(_structured_line(steps))
    return lines


def _structured_line(steps: list[Step]) -> str:
    """Structured outputs: the gap on the tokens sampled under a grammar against the others, and the masks' cost."""

    def mean(values: list[float | None]) -> str:
        known = [v for v in values if v is not None]
        return f"{sum(known) / len(known):.4f}" if known else "-"

    constrained = sum(s.constrained_tokens for s in steps)
    fallbacks = sum(s.grammar_fallbacks for s in steps)
    return (
        f"structured outputs: {constrained} tokens sampled under a grammar; on-policy gap "
        f"{mean([s.mismatch_constrained for s in steps])} nats per token on them, "
        f"{mean([s.mismatch_unconstrained for s in steps])} on the others; masks "
        f"{sum(s.mask_ms for s in steps) / len(steps):.0f} ms per step"
        + (f"; {fallbacks} constrained calls scored unmasked (grammar not rebuilt)" if fallbacks else "")
    )


def success_axes() -> tuple[Any, Any]:
    """A figure for success rates (0 to 1), drawn without a display: the demo's plot and bench/learning.py's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4), dpi=120)


def save_success_plot(fig: Any, ax: Any, path: Path) -> Path:
    """Finish a ``success_axes`` figure (the 0-1 scale, a light grid, the legend) and write it to ``path``."""
    import matplotlib.pyplot as plt

    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot(report: Report, path: Path) -> Path:
    fig, ax = success_axes()
    versions = [s.version for s in report.steps]
    ax.plot(versions, [s.reward_mean for s in report.steps], marker="o", label="mean reward of the step's batch")
    served = sorted(report.served_success.items())
    ax.plot([v for v, _ in served], [rate for _, rate in served], marker=".", linestyle="--",
            label="success of the training attempts each version served")  # fmt: skip
    held = report.held_out
    if held:
        ax.plot([h.version for h in held], [h.success for h in held], color="black", marker="s", zorder=3,
                label="held-out success (requests never trained on)")  # fmt: skip
    ax.set_xlabel("adapter version (training step)")
    gain = f"held-out {held[0].success:.0%} -> {held[-1].success:.0%}" if held else "held-out not measured"
    title = "tracetrain demo" if report.policy == "agent" else f"tracetrain demo, {report.policy}"
    ax.set_title(f"{title}: {gain} in {report.seconds / 60:.1f} min")
    return save_success_plot(fig, ax, path)
