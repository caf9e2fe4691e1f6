"""The report: tokens/s, step time and memory per contender, ours / TRL against the targets, first-step agreement."""

from __future__ import annotations

import argparse
from typing import Any

from .config import LORA_ALPHA, LORA_R, THREADS

TARGET_SPEEDUP, TARGET_MEMORY = 2.0, 0.5


def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


LABELS = {
    "ours": "ours (micro-batch {mb})",
    "trl": "TRL GRPOTrainer (no grad. checkpointing)",
    "trl-gc": "TRL GRPOTrainer (grad. checkpointing, its default)",
}


def _label(r: dict[str, Any]) -> str:
    if r["name"].startswith("ours"):
        return LABELS["ours"].format(mb=r["micro_batch_tokens"])
    return LABELS[r["name"]]


def _rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        lb = f"{r['loss_backward_s']:.2f}" if "loss_backward_s" in r else "-"
        rows.append([_label(r), f"{r['tokens_per_s']:.1f}", f"{r['step_s']:.2f}", lb,
                     _mib(r["rss_after_load_bytes"]), _mib(r["peak_rss_abs_bytes"]),
                     _mib(r["step_extra_rss_bytes"]), f"{r['other_cpu_cores']:.2f}"])  # fmt: skip
    return rows


HEADER = ["contender", "tokens/s", "step s", "loss+bwd s", "RSS after load", "peak RSS (abs)", "step extra RSS",
          "other CPU"]  # fmt: skip


def _verdicts(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    speed = ours["tokens_per_s"] / peer["tokens_per_s"]
    extra = ours["step_extra_rss_bytes"] / peer["step_extra_rss_bytes"]
    absolute = ours["peak_rss_abs_bytes"] / peer["peak_rss_abs_bytes"]
    return {"ours": ours["name"], "peer": peer["name"], "tokens_per_s_ratio": speed,
            "step_extra_rss_ratio": extra, "peak_rss_abs_ratio": absolute,
            "speed_target_met": speed >= TARGET_SPEEDUP, "memory_target_met": extra <= TARGET_MEMORY}  # fmt: skip


def report(opts: argparse.Namespace, results: list[dict[str, Any]], numerics: dict[str, Any]) -> dict[str, Any]:
    by_name = {r["name"]: r for r in results}
    ours = by_name["ours"]
    tokens = opts.samples * (opts.prompt + opts.completion)
    shared = f" in groups of {opts.group_size} sharing a prompt" if opts.group_size > 1 else ""
    print(f"\nbatch: {opts.samples} x ({opts.prompt} prompt + {opts.completion} completion) = {tokens} tokens{shared}, "
          f"{'random SmolLM2-135M-shaped Llama' if not opts.model_dir else opts.model_dir}, LoRA r={LORA_R} "
          f"alpha={LORA_ALPHA} on 7 projections, float32, {THREADS} threads; median of {opts.steps} steps after 1 "
          "warm-up; each contender in its own process.")  # fmt: skip
    print(
        "timed: the whole optimizer step on both sides (ours: Learner.step; TRL: compute_loss + backward + "
        "clip + AdamW; 'loss+bwd s' is TRL's compute_loss + backward alone).\n"
    )
    widths = [max(len(h), *(len(row[i]) for row in _rows(results))) for i, h in enumerate(HEADER)]
    for row in [HEADER, *_rows(results)]:
        print(
            "  ".join(
                cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    verdicts = [_verdicts(ours, by_name[peer]) for peer in ("trl", "trl-gc") if peer in by_name]
    if "ours-default" in by_name:
        verdicts += [_verdicts(by_name["ours-default"], by_name[peer]) for peer in ("trl",) if peer in by_name]
    print()
    for v in verdicts:
        o, p = _label(by_name[v["ours"]]), _label(by_name[v["peer"]])
        print(f"{o} / {p}:\n"
              f"  tokens/s {v['tokens_per_s_ratio']:.2f}x (target >= {TARGET_SPEEDUP:g}x: "
              f"{'met' if v['speed_target_met'] else 'NOT met'}); step extra RSS {v['step_extra_rss_ratio']:.2f}x "
              f"(target <= {TARGET_MEMORY:g}x: {'met' if v['memory_target_met'] else 'NOT met'}); "
              f"peak RSS (abs) {v['peak_rss_abs_ratio']:.2f}x")  # fmt: skip
    print("\nfirst step, identical weights, old log-probs = on-policy (expected: ratio 1, loss = -mean(advantage)):")
    print(f"  expected loss {numerics['expected_loss']:+.6f}")
    for r in results:
        f = r["first_step"]
        extra = f", ratio mean {f['ratio_mean']:.6f}" if "ratio_mean" in f else ""
        print(f"  {_label(r)}: loss {f['loss']:+.6f}, pre-clip grad norm {f['grad_norm']:.6f}{extra}")
    for name, c in numerics["gradients"].items():
        print(f"  LoRA gradients, {_label(by_name[name])} vs {_label(ours)}: cosine {c['cosine']:.6f}, "
              f"relative L2 difference {c['rel_l2_diff']:.2e}, pre-clip norm relative difference "
              f"{c['grad_norm_rel_diff']:.2e}, loss difference {c['loss_abs_diff']:.1e}")  # fmt: skip
    print("\nMarkdown (docs/BENCHMARKS.md):\n")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "|".join(["---", *["---:"] * (len(HEADER) - 1)]) + "|")
    for row in _rows(results):
        print("| " + " | ".join(row) + " |")
    print()
    for v in verdicts:
        o, p = _label(by_name[v["ours"]]), _label(by_name[v["peer"]])
        print(f"- {o} / {p}: tokens/s **{v['tokens_per_s_ratio']:.2f}x** (target >= {TARGET_SPEEDUP:g}x), "
              f"step extra RSS **{v['step_extra_rss_ratio']:.2f}x** (target <= {TARGET_MEMORY:g}x), "
              f"peak RSS {v['peak_rss_abs_ratio']:.2f}x")  # fmt: skip
    return {"verdicts": verdicts}
