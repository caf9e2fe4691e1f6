"""Our GRPO step against TRL's GRPOTrainer loss + backward: same batch, model and LoRA, one run.

The parent process never imports torch. It starts one subprocess that builds the model
(SmolLM2-135M shapes, random weights, unless ``--model-dir``), the batch (random token ids,
advantages +-1, old log-probs = on-policy log-probs) and the LoRA's initial weights, then one
subprocess per contender, so that each process's peak RSS is its own:

- ``ours``: ``trainer.Learner.step`` (pack, chunked log-probs, loss, backward, clip, AdamW),
  with the micro-batch budget of ``--micro-batch-tokens`` and, for transparency, the default 4096;
- ``trl``: TRL's ``GRPOTrainer.compute_loss`` on the equivalent padded inputs dict, then
  ``accelerator.backward``, the same global-norm clip and the same AdamW; without gradient
  checkpointing (the same work as ours) and with it (GRPOConfig's default, which the Trainer
  switches on inside ``train()``, so it is switched on here by hand).

Both sides time the whole optimizer step; the TRL rows also show their loss + backward part.
Memory: ``getrusage`` peak RSS of the process (absolute), and the step's extra memory: the
peak during the timed steps (the kernel's high-water mark is reset after the warm-up step)
minus the RSS right after loading (every weight paged in). The first step also checks that the two agree: both see
identical weights (TRL's LoRA gets ours' initial A and B), so the losses, the pre-clip gradient
norms and the gradients' directions should match. bench/README.md says how to read the output.

    .venv/bin/python bench/train_step.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
THREADS = 2
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_R, LORA_ALPHA, LEARNING_RATE, MAX_GRAD_NORM, CLIP_EPS = 16, 32, 1e-6, 1.0, 0.2
TARGET_SPEEDUP, TARGET_MEMORY = 2.0, 0.5
# SmolLM2-135M-Instruct's LlamaConfig, less what does not change the compute.
SMOLLM2_135M: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


# --------------------------------------------------------------------- memory, in the contender's own process


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise KeyError(key)


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _page_in(model: Any) -> None:
    """Touch every weight: from_pretrained maps safetensors files, so weights join RSS when first read.

    Without this the first forward would page in the whole model (540 MB for SmolLM2-135M in
    float32) and count it as the step's own memory.
    """
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.sum()


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0); False if not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


# --------------------------------------------------------------------- the shared inputs


def _train_config(micro_batch_tokens: int) -> Any:
    from trainer import TrainConfig

    return TrainConfig(
        loss="grpo",
        clip_low=CLIP_EPS,
        clip_high=CLIP_EPS,
        lora_r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS,
        learning_rate=LEARNING_RATE,
        max_grad_norm=MAX_GRAD_NORM,
        micro_batch_tokens=micro_batch_tokens,
        dtype="float32",
    )


def _build_model(out_dir: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.float32).save_pretrained(out_dir)
    return out_dir


def prepare(work: Path, opts: argparse.Namespace) -> None:
    """Model directory, batch and initial LoRA weights, written under ``work`` for every contender."""
    import torch
    from transformers import AutoConfig

    from trainer import Learner, Sample

    torch.set_num_threads(THREADS)
    model_dir = Path(opts.model_dir) if opts.model_dir else _build_model(work / "model")
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    n, p, c = opts.samples, opts.prompt, opts.completion
    rng = torch.Generator().manual_seed(opts.seed)
    input_ids = torch.randint(0, vocab, (n, p + c), generator=rng)  # (N, P+C)
    group = max(1, opts.group_size)
    input_ids[:, :p] = input_ids[::group, :p].repeat_interleave(group, 0)[:n]  # (N, P) each group shares a prompt
    advantages = (torch.randint(0, 2, (n,), generator=rng) * 2 - 1).float()  # (N,) +-1
    learner = Learner(model_dir, _train_config(opts.micro_batch_tokens))
    samples = [Sample(row, [False] * p + [True] * c, [0.0] * (p + c), 1, 0) for row in input_ids.tolist()]
    old = torch.stack([lp[p:] for lp in learner.logprobs(samples)])  # (N, C) on-policy, the sampled tokens only
    lora = {name: w.detach().clone() for name, w in learner.model.named_parameters() if w.requires_grad}
    torch.save({"model_dir": str(model_dir), "input_ids": input_ids, "advantages": advantages,
                "old_logprobs": old, "prompt": p}, work / "batch.pt")  # fmt: skip
    torch.save(lora, work / "lora_init.pt")


def _capture_first_step_grads(optimizer: Any, named: list[tuple[str, Any]], path: Path) -> None:
    """Save the LoRA gradients that the first optimizer step applies (after clipping) to ``path``."""
    import torch

    def hook(*_: Any) -> None:
        torch.save({name: w.grad.detach().clone() for name, w in named if w.grad is not None}, path)
        handle.remove()

    handle = optimizer.register_step_pre_hook(hook)


# --------------------------------------------------------------------- the contenders


def _timed(step: Any, name: str, opts: argparse.Namespace, rss_load: int) -> dict[str, Any]:
    """Warm-up step, peak reset, ``opts.steps`` timed steps; the result dict of this contender."""
    start = time.perf_counter()
    first = step()
    warmup_s = time.perf_counter() - start
    maxrss_before = _maxrss_kib()
    reset = _reset_peak_rss()
    runs = []
    for _ in range(opts.steps):
        start = time.perf_counter()
        info = step()
        runs.append({**info, "wall_s": time.perf_counter() - start})
    maxrss_end = _maxrss_kib()
    step_peak = _status_kib("VmHWM") if reset else maxrss_end
    seconds = statistics.median(r["wall_s"] for r in runs)
    tokens = opts.samples * (opts.prompt + opts.completion)
    return {
        "name": name,
        "tokens": tokens,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "step_s_all": [r["wall_s"] for r in runs],
        "runs": runs,
        "warmup_s": warmup_s,
        "first_step": first,
        "rss_after_load_bytes": rss_load * 1024,
        "peak_rss_abs_bytes": max(maxrss_before, maxrss_end) * 1024,
        "step_extra_rss_bytes": (step_peak - rss_load) * 1024,
        "peak_reset_after_warmup": reset,
    }


def run_ours(work: Path, opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trainer import Learner, Sample, TrainItem

    torch.set_num_threads(THREADS)
    batch = torch.load(work / "batch.pt")
    learner = Learner(Path(batch["model_dir"]), _train_config(opts.micro_batch_tokens), device="cpu")
    named = [(name, w) for name, w in learner.model.named_parameters() if w.requires_grad]
    init = torch.load(work / "lora_init.pt")
    if set(init) != {name for name, _ in named} or any(not torch.equal(init[n], w) for n, w in named):
        raise SystemExit("ours: the LoRA's initial weights differ from the prepared ones")
    p = batch["prompt"]
    items = []
    for ids, adv, old in zip(batch["input_ids"].tolist(), batch["advantages"].tolist(), batch["old_logprobs"],
                             strict=True):  # fmt: skip
        c = len(ids) - p
        items.append(TrainItem(Sample(ids, [False] * p + [True] * c, [0.0] * p + old.tolist(), 1, 0), adv))
    _capture_first_step_grads(learner.optimizer, named, work / f"grads_{opts.role_name}.pt")
    _page_in(learner.model)
    rss_load = _status_kib("VmRSS")

    def step() -> dict[str, Any]:
        r = learner.step(items)
        return {"loss": r.loss, "grad_norm": r.grad_norm, "ratio_mean": r.ratio_mean, "step_result_s": r.seconds,
                "micro_batches": r.micro_batches, "tokens": r.tokens}  # fmt: skip

    result = _timed(step, opts.role_name, opts, rss_load)
    result["micro_batch_tokens"] = opts.micro_batch_tokens
    return result


def _tokenizer(model_dir: Path) -> Any:
    """The model's own tokenizer, else a tiny BPE one (GRPOTrainer wants one; compute_loss never uses it)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(model_dir)
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_model import _train_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")  # fmt: skip


def run_trl(work: Path, opts: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(THREADS)
    batch = torch.load(work / "batch.pt")
    model_dir = Path(batch["model_dir"])
    args = GRPOConfig(
        output_dir=str(work / "trl-out"),
        use_cpu=True,
        bf16=False,  # GRPOConfig's default is True; ours runs float32 on a CPU
        gradient_checkpointing=opts.trl_gradient_checkpointing,
        per_device_train_batch_size=opts.samples,
        num_generations=opts.samples,
        max_completion_length=opts.completion,
        temperature=1.0,  # compute_loss divides the logits by it
        loss_type="dapo",  # TRL's default: token-level mean over the batch, as our "grpo"
        beta=0.0,
        epsilon=CLIP_EPS,
        learning_rate=LEARNING_RATE,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["unused: compute_loss gets the batch directly"]}),
        processing_class=_tokenizer(model_dir),
        peft_config=LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                               task_type="CAUSAL_LM"),
    )  # fmt: skip
    model = trainer.model
    if args.gradient_checkpointing:  # what Trainer.train() does before its loop
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    trainer.current_gradient_accumulation_steps = 1
    named = [(name, w) for name, w in model.named_parameters() if w.requires_grad]
    init = torch.load(work / "lora_init.pt")
    if set(init) != {name for name, _ in named}:
        raise SystemExit(f"trl: LoRA parameters differ from ours: {sorted(set(init) ^ {n for n, _ in named})[:4]}")
    with torch.no_grad():
        for name, w in named:
            w.copy_(init[name])
    params = [w for _, w in named]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)  # as trainer.Learner's
    p = batch["prompt"]
    ids = batch["input_ids"]
    inputs = {
        "prompt_ids": ids[:, :p],  # (N, P)
        "prompt_mask": torch.ones_like(ids[:, :p]),  # (N, P)
        "completion_ids": ids[:, p:],  # (N, C)
        "completion_mask": torch.ones_like(ids[:, p:]),  # (N, C)
        "advantages": batch["advantages"],  # (N,)
        "old_per_token_logps": batch["old_logprobs"],  # (N, C)
        "num_items_in_batch": torch.tensor(float(ids[:, p:].numel())),  # () dapo's normalizer: loss tokens
    }
    _capture_first_step_grads(optimizer, named, work / f"grads_{opts.role_name}.pt")
    model.train()
    _page_in(model)
    rss_load = _status_kib("VmRSS")

    def step() -> dict[str, Any]:
        start = time.perf_counter()
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        loss_backward_s = time.perf_counter() - start
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": float(loss), "grad_norm": grad_norm, "loss_backward_s": loss_backward_s}

    result = _timed(step, opts.role_name, opts, rss_load)
    result["loss_backward_s"] = statistics.median(r["loss_backward_s"] for r in result["runs"])
    result["gradient_checkpointing"] = bool(args.gradient_checkpointing)
    return result


def compare(work: Path, names: list[str]) -> dict[str, Any]:
    """Cosine and relative L2 difference of each contender's first-step LoRA gradients against the first's."""
    import torch

    def flat(name: str) -> torch.Tensor:
        grads = torch.load(work / f"grads_{name}.pt")
        return torch.cat([grads[k].flatten().double() for k in sorted(grads)])

    ref = flat(names[0])
    out = {}
    for name in names[1:]:
        g = flat(name)
        out[name] = {
            "cosine": float(torch.nn.functional.cosine_similarity(ref, g, dim=0)),
            "rel_l2_diff": float((g - ref).norm() / ref.norm()),
        }
    return out


# --------------------------------------------------------------------- the parent: run, then report


def _cpu_busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _child(work: Path, opts: argparse.Namespace, role: str, name: str, extra: list[str]) -> dict[str, Any] | None:
    argv = [sys.executable, __file__, "--role", role, "--role-name", name, "--work", str(work),
            "--samples", str(opts.samples), "--prompt", str(opts.prompt), "--completion", str(opts.completion),
            "--steps", str(opts.steps), "--seed", str(opts.seed), "--group-size", str(opts.group_size),
            *extra]  # fmt: skip
    if opts.model_dir:
        argv += ["--model-dir", opts.model_dir]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
    log = work / f"{name}.log"
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before, start = _cpu_busy_s(), time.perf_counter()
    with log.open("w") as stderr:
        rc = subprocess.call(argv, cwd=REPO, env=env, stdout=stderr, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (children.ru_utime + children.ru_stime) - (children_before.ru_utime + children_before.ru_stime)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"{name} failed (exit {rc}); the end of {log}:\n{tail}")
    path = work / f"{name}.json"
    if not path.exists():
        return None
    result: dict[str, Any] = json.loads(path.read_text())
    # CPU the rest of the machine used meanwhile, in cores: near 0 on a quiet machine.
    result["other_cpu_cores"] = max(0.0, (_cpu_busy_s() - busy_before - own) / wall)
    result["process_cpu_cores"] = own / wall
    return result


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


def _versions() -> dict[str, str]:
    from importlib import metadata

    return {p: metadata.version(p) for p in ("torch", "transformers", "peft", "trl", "accelerate")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Run it on a quiet machine: the 'other CPU' column (cores used by other "
                                            "processes meanwhile) should be near 0.")  # fmt: skip
    parser.add_argument("--samples", type=int, default=8, help="samples in the batch (>= 2: TRL's num_generations)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sample")
    parser.add_argument("--completion", type=int, default=128, help="completion (sampled) tokens per sample")
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="samples per GRPO group; a group's samples share their prompt tokens (default 1: none do)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per contender, after 1 warm-up")
    parser.add_argument("--micro-batch-tokens", type=int, default=512,
                        help="our packing budget; on a CPU sdpa pays T x T per packed row, so keep it near the "
                             "sample length (a run with the default 4096 is added for transparency)")  # fmt: skip
    parser.add_argument("--model-dir", help="a Hugging Face causal LM directory (default: random SmolLM2-135M shapes)")
    parser.add_argument("--no-extras", action="store_true",
                        help="skip ours at 4096 and TRL with gradient checkpointing")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the token ids and advantages")
    parser.add_argument("--out", type=Path, help="write every number as JSON here")
    parser.add_argument("--keep-work", action="store_true", help="keep the temporary model, batch and logs")
    parser.add_argument("--role", choices=["prepare", "ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--role-name", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--trl-gradient-checkpointing", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.samples < 2:
        parser.error("--samples must be at least 2")

    if opts.role:
        if opts.role == "prepare":
            prepare(opts.work, opts)
            return 0
        result = (run_ours if opts.role == "ours" else run_trl)(opts.work, opts)
        (opts.work / f"{opts.role_name}.json").write_text(json.dumps(result, indent=2))
        return 0

    work = Path(tempfile.mkdtemp(prefix="tracetrain-train-bench-"))
    mb = str(opts.micro_batch_tokens)
    _child(work, opts, "prepare", "prepare", ["--micro-batch-tokens", mb])
    plan = [("ours", "ours", ["--micro-batch-tokens", mb]), ("trl", "trl", [])]
    if not opts.no_extras:
        if opts.micro_batch_tokens != 4096:
            plan.append(("ours", "ours-default", ["--micro-batch-tokens", "4096"]))
        plan.append(("trl", "trl-gc", ["--trl-gradient-checkpointing"]))
    results = [r for role, name, extra in plan if (r := _child(work, opts, role, name, extra)) is not None]

    import torch  # only now: the contenders have finished

    torch.set_num_threads(THREADS)
    batch = torch.load(work / "batch.pt")
    by_name = {r["name"]: r for r in results}
    gradients = compare(work, [r["name"] for r in results])
    for name, c in gradients.items():
        a, b = by_name["ours"]["first_step"], by_name[name]["first_step"]
        c["grad_norm_rel_diff"] = abs(b["grad_norm"] - a["grad_norm"]) / a["grad_norm"]
        c["loss_abs_diff"] = abs(b["loss"] - a["loss"])
    numerics = {"expected_loss": -float(batch["advantages"].mean()), "gradients": gradients}
    summary = report(opts, results, numerics)
    if opts.out:
        payload = {"options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
                   "versions": _versions(), "results": results, "numerics": numerics, **summary}  # fmt: skip
        opts.out.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {opts.out}")
    if opts.keep_work:
        print(f"(work files: {work})")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
