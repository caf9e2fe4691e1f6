"""A reasoning agent's 20-turn trajectory, trained: each split sample forwarded alone, against one prefix tree.

A reasoning template drops earlier turns' thinking when it renders the history, so every call of the
trajectory becomes a sample of its own (``build_samples``: ``split_rerendered``) whose prompt holds the
prompts before it. The trace is synthetic but tokenized for real: ``--model-dir``'s tokenizer renders each
prompt with a Qwen3-style template that drops thinking (ChatML; an earlier assistant turn keeps its
answer, a tool call, and loses its ``<think>...</think>``), and each completion is the model's tokens
for thinking, the tool call and ``<|im_end|>``. A tool's result follows each call.

Two contenders take the real trainer step (``trainer.Learner.step``: pack, chunked log-probs, GRPO loss,
backward, clip, AdamW) on the same samples, weights and LoRA, each in a process of its own (so its peak
RSS is its own):

- ``alone``: ``share_prefix=False``, each sample laid whole (the trainer before the prefix tree);
- ``tree``:  the default, the samples laid as their prefix tree, each shared prefix forwarded once.

Each runs one warm-up step and ``--steps`` timed ones. Printed side by side: tokens forwarded, per
sampled token, step time, peak RSS, the ratios, and the first step's loss and gradient norm (the same
math: they agree to float32 noise). The old log-probs are a constant (-2.0): the step's cost does not
depend on them.

    .venv/bin/python bench/reasoning_trace.py --out results.json
    .venv/bin/python bench/reasoning_trace.py --tiny --turns 6        # a smoke run on the tiny test model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / ".tracetrain" / "models" / "smollm2-135m-instruct"
CONTENDERS = {"alone": False, "tree": True}  # name -> TrainConfig.share_prefix

# Qwen3's rule for a history: an assistant turn is rendered from its answer alone, its thinking dropped.
DROPPING_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WORDS = ("the", "city", "weather", "station", "reports", "rain", "and", "wind", "from", "north", "so", "query",
         "should", "name", "region", "first", "then", "date", "range", "unit", "compare", "two", "answers", "before",
         "deciding", "which", "tool", "to", "call", "next", "because", "last", "result", "was", "incomplete", "user",
         "asked", "for", "a", "short", "summary", "with", "numbers", "in", "celsius")  # fmt: skip


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def trajectory(tokenizer: Any, turns: int, seed: int, *, system_words: int, think_words: int,
               tool_words: int) -> list[dict[str, Any]]:  # fmt: skip
    """The calls of one agent run: each prompt as the dropping template renders it, each completion's ids."""
    rng = random.Random(seed)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "system", "content": "You are a research agent. " + words(rng, system_words)},
                {"role": "user", "content": "Find the rainfall of the last week. " + words(rng, 20)}]  # fmt: skip
    calls = []
    for turn in range(turns):
        prompt = tokenizer.apply_chat_template(messages, chat_template=DROPPING_TEMPLATE, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)  # fmt: skip
        call = {"name": "search", "arguments": {"query": words(rng, 6), "page": turn}}
        answer = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        thinking = f"<think>\n{words(rng, rng.randint(think_words // 2, think_words * 3 // 2))}\n</think>\n\n"
        completion = [*tokenizer.encode(thinking + answer, add_special_tokens=False), stop]
        calls.append({"prompt": list(prompt), "completion": completion})
        messages += [{"role": "assistant", "content": answer}, {"role": "tool", "content": words(rng, tool_words)}]
    return calls


def prepare(opts: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    """The samples (through the trainer's own build_samples) and what they cost, written for the contenders."""
    from transformers import AutoTokenizer

    from trainer import CapturedCall, build_samples
    from trainer._prefix_tree import tree_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    samples = []
    stats = None
    for t in range(opts.trajectories):
        calls = trajectory(tokenizer, opts.turns, opts.seed + t, system_words=opts.system_words,
                           think_words=opts.think_words, tool_words=opts.tool_words)  # fmt: skip
        built, built_stats = build_samples([CapturedCall(c["prompt"], c["completion"], [-2.0] * len(c["completion"]))
                                            for c in calls])  # fmt: skip
        samples += built
        stats = built_stats if stats is None else stats + built_stats
    assert stats is not None
    (work / "samples.json").write_text(json.dumps([[s.token_ids, s.loss_mask, s.old_logprobs] for s in samples]))
    return {"calls": stats.calls, "samples": stats.samples, "split_rerendered": stats.split_rerendered,
            "merged": stats.merged, "sample_tokens": stats.tokens, "sampled_tokens": stats.loss_tokens,
            "tree_tokens": tree_tokens([s.token_ids for s in samples]),
            "longest_sample": max(len(s.token_ids) for s in samples)}  # fmt: skip


def contend(opts: argparse.Namespace, model_dir: Path, work: Path, name: str) -> None:
    """One contender's steps, in its own process: one warm-up, then ``--steps`` timed."""
    import torch

    from trainer import Learner, Sample, TrainConfig, TrainItem

    torch.set_num_threads(opts.threads or torch.get_num_threads())
    raw = json.loads((work / "samples.json").read_text())
    items = [TrainItem(Sample(ids, mask, old, 1, 0), advantage=1.0) for ids, mask, old in raw]
    cfg = TrainConfig(dtype=opts.dtype, micro_batch_tokens=opts.micro_batch_tokens, share_prefix=CONTENDERS[name])
    learner = Learner(model_dir, cfg)
    steps = [learner.step(items) for _ in range(1 + opts.steps)]
    first, timed = steps[0], steps[1:]
    (work / f"{name}.json").write_text(json.dumps({
        "first_loss": first.loss, "first_grad_norm": first.grad_norm, "forwarded_tokens": first.forwarded_tokens,
        "forwarded_per_sampled_token": first.forwarded_per_sampled_token, "micro_batches": first.micro_batches,
        "seconds": [s.seconds for s in timed], "peak_rss_bytes": steps[-1].peak_memory_bytes,
    }))  # fmt: skip


def run_contender(opts: argparse.Namespace, model_dir: Path, work: Path, name: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--role", name, "--work", str(work), "--model-dir", str(model_dir),
            "--steps", str(opts.steps), "--dtype", opts.dtype, "--micro-batch-tokens", str(opts.micro_batch_tokens),
            "--threads", str(opts.threads)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "sdk")])}  # fmt: skip
    print(f"[{time.strftime('%H:%M:%S')}] {name}: 1 warm-up step and {opts.steps} timed ...", flush=True)
    log = work / f"{name}.log"
    with log.open("w") as out:
        rc = subprocess.call(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"{name} failed (exit {rc}); the end of {log}:\n{log.read_text()[-3000:]}")
    result: dict[str, Any] = json.loads((work / f"{name}.json").read_text())
    return result


def report(trace: dict[str, Any], results: dict[str, dict[str, Any]], opts: argparse.Namespace) -> str:
    alone, tree = results["alone"], results["tree"]
    mean = {name: sum(r["seconds"]) / len(r["seconds"]) for name, r in results.items()}
    lines = [
        f"trace: {opts.trajectories} trajectory x {opts.turns} turns -> {trace['calls']} calls, {trace['samples']} "
        f"samples ({trace['split_rerendered']} splits: the template dropped the thinking), {trace['sampled_tokens']} "
        f"sampled tokens, {trace['sample_tokens']} tokens in samples, {trace['tree_tokens']} in their prefix tree, "
        f"longest sample {trace['longest_sample']}",
        "",
        "| | alone (share_prefix=False) | tree (default) | alone / tree |",
        "|---|---|---|---|",
        f"| tokens forwarded | {alone['forwarded_tokens']} | {tree['forwarded_tokens']} | "
        f"{alone['forwarded_tokens'] / tree['forwarded_tokens']:.2f}x |",
        f"| forwarded per sampled token | {alone['forwarded_per_sampled_token']:.2f} | "
        f"{tree['forwarded_per_sampled_token']:.2f} | |",
        f"| micro-batches | {alone['micro_batches']} | {tree['micro_batches']} | |",
        f"| step time, mean of {opts.steps} (s) | {mean['alone']:.2f} | {mean['tree']:.2f} | "
        f"{mean['alone'] / mean['tree']:.2f}x |",
        f"| peak RSS (GiB) | {alone['peak_rss_bytes'] / 2**30:.2f} | {tree['peak_rss_bytes'] / 2**30:.2f} | |",
        f"| first step's loss | {alone['first_loss']:.6g} | {tree['first_loss']:.6g} | |",
        f"| first step's grad norm | {alone['first_grad_norm']:.6g} | {tree['first_grad_norm']:.6g} | |",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model-dir", type=Path, help=f"a Hugging Face causal LM (default {DEFAULT_MODEL})")
    parser.add_argument("--tiny", action="store_true", help="the tiny random test model instead (a smoke run)")
    parser.add_argument("--turns", type=int, default=20, help="calls in the trajectory (default 20)")
    parser.add_argument("--trajectories", type=int, default=1, help="trajectories of the task (default 1)")
    parser.add_argument("--system-words", type=int, default=150, help="words in the system prompt (default 150)")
    parser.add_argument("--think-words", type=int, default=80, help="mean words of thinking per turn (default 80)")
    parser.add_argument("--tool-words", type=int, default=40, help="words in each tool result (default 40)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per contender, after 1 warm-up")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="what the trainer computes in (default float32, its default on a CPU)")  # fmt: skip
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="the packing budget (default 4096)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per contender (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write every number as JSON here")
    parser.add_argument("--role", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "sdk"), str(REPO / "tests")]
    if opts.role:
        contend(opts, opts.model_dir, opts.work, opts.role)
        return 0
    with tempfile.TemporaryDirectory(prefix="reasoning-trace-") as tmp:
        work = Path(tmp)
        if opts.tiny:
            from tiny_model import build_tiny_model

            model_dir = build_tiny_model(work / "tiny", reasoning=True)
        else:
            model_dir = opts.model_dir or DEFAULT_MODEL
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"{model_dir}: not a model directory (tracetrain model pull, or --model-dir, or --tiny)")
        trace = prepare(opts, model_dir, work)
        results = {name: run_contender(opts, model_dir, work, name) for name in CONTENDERS}
    print(f"\nmodel {model_dir.name}, {opts.dtype}, micro-batch budget {opts.micro_batch_tokens}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")  # fmt: skip
    print(report(trace, results, opts))
    if opts.out:
        opts.out.write_text(json.dumps({"trace": trace, "results": results, "options": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()}}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
