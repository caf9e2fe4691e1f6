"""Real training steps: the trainer's resident memory and step peak against the plan's estimate, and a real OOM.

``steps``: a Learner on the model (bf16 LoRA r=16 on all seven projections on CUDA), one warm-up step,
then ``--steps`` steps over GRPO groups that fill ``micro_batch_tokens``-token micro-batches, as the
plan assumes. Measured: the allocated bytes once the learner and AdamW's state exist (resident), and
``max_memory_allocated`` during a step over that (the step's peak); each beside the estimate
``tracetrain_cli._gpu_estimate`` plans with, and the ratio.

``oom``: one sample long enough that its activations cannot fit the GPU: the step runs out of memory
for real. Read while the error is still referenced (as the worker holds it while the hand-over ends),
after ``trainer._memory.release_step_memory`` (what the worker does before giving the GPU back), and
nvidia-smi's view: the memory must be back at the level before the step, and the next step must work.
"""

from __future__ import annotations

import resource
import time
from typing import Any

from _gpu_smoke.memory import gib, host_rss, torch_figures
from _gpu_smoke.model import batch, vocab_size
from _gpu_smoke.report import Skip

LORA_R = 16


def steps(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    import torch

    from tracetrain_cli._gpu_estimate import TrainerNeeds, estimate_memory
    from tracetrain_cli._gpu_inputs import read_model_shape
    from trainer import Learner, TrainConfig

    device, tokens = ctx["device"], ctx["micro_batch_tokens"]
    if device == "cpu" and ctx["model"] != "tiny":
        raise Skip("no GPU: steps of a 1.5B model on a CPU take minutes (--model tiny runs this on a CPU)")
    cfg = TrainConfig(lora_r=LORA_R, lora_alpha=2 * LORA_R, micro_batch_tokens=tokens)
    rss_before = host_rss()
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    started = time.monotonic()
    learner = Learner(ctx["model_dir"], cfg, device=device)
    figures["load_s"] = round(time.monotonic() - started, 1)
    figures["host_rss_peak_gib"] = gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    figures["host_rss_after_load_gib"] = gib(host_rss() - rss_before)
    # Each group's prompt is laid once and its completions after it: rows of about `tokens` tokens.
    prompt, per_group = tokens // 4, 4
    completion = (tokens - prompt) // per_group
    vocab = vocab_size(ctx["model_dir"])
    items = batch(vocab, groups=4, group_size=per_group, prompt=prompt, completion=completion)
    learner.step(items)  # warm-up: kernels chosen, AdamW's moments allocated
    shape = read_model_shape(ctx["model_dir"])
    bytes_per_param = 2 if learner.device.type == "cuda" else 4
    needs = TrainerNeeds(lora_r=LORA_R, micro_batch_tokens=tokens, logprob_chunk_tokens=cfg.logprob_chunk_tokens,
                         bytes_per_param=bytes_per_param)  # fmt: skip
    estimate = estimate_memory(shape, needs)
    figures["host_estimate_gib"] = gib(estimate.host_trainer_load)
    results = []
    for _ in range(ctx["steps"]):
        results.append(learner.step(items))
    seconds = sorted(r.seconds for r in results)[len(results) // 2]
    figures["step_s"] = round(seconds, 2)
    figures["tokens_per_s"] = round(results[0].tokens / seconds)
    figures["micro_batches"] = results[0].micro_batches
    if device == "cuda":
        resident = torch.cuda.memory_allocated() - before
        peak = max(r.peak_memory_bytes or 0 for r in results) - torch.cuda.memory_allocated()
        figures.update(resident_gib=gib(resident), resident_estimate_gib=gib(estimate.trainer_resident),
                       resident_ratio=round(resident / estimate.trainer_resident, 2), step_peak_gib=gib(peak),
                       step_estimate_gib=gib(estimate.step), step_ratio=round(peak / estimate.step, 2),
                       peft_inputs_estimate_gib=gib(estimate.peft_inputs))  # fmt: skip
        figures.update(torch_figures("after_steps_"))
    out = ctx["out_dir"] / "adapters" / "1"
    if not out.exists():
        learner.save(out, results[-1].to_dict())
    ctx["learner"], ctx["items"], ctx["adapter"] = learner, items, out
    return f"{len(results)} steps of {results[0].tokens} tokens ({results[0].micro_batches} micro-batches)"


def oom(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    import torch

    from trainer._memory import release_step_memory

    if ctx["device"] != "cuda":
        raise Skip("no GPU: a real out-of-memory needs one")
    learner = ctx.get("learner")
    if learner is None:
        raise Skip("the steps section did not run")
    free, total = torch.cuda.mem_get_info()
    per_token = _activation_bytes_per_token(ctx)
    tokens = int(2 * free / per_token)  # twice what fits: the forward runs out of memory on the way
    figures["oom_sample_tokens"] = tokens
    figures.update(torch_figures("before_"))
    big = batch(vocab_size(ctx["model_dir"]), groups=1, group_size=1, prompt=16, completion=tokens - 16)
    try:
        learner.step(big)
    except torch.OutOfMemoryError as exc:
        figures.update(torch_figures("held_"))  # the error (and its traceback) still alive, as in the worker
        release_step_memory(exc)
        figures.update(torch_figures("released_"))
    else:
        raise AssertionError(f"a {tokens}-token sample did not run out of memory on {gib(total)} GiB")
    del big
    learner.step(ctx["items"])  # the next step works
    figures.update(torch_figures("next_step_"))
    back = figures["released_allocated_gib"] - figures["before_allocated_gib"]
    smi = (figures["released_nvidia_smi_used_mib"] or 0) - (figures["before_nvidia_smi_used_mib"] or 0)
    assert abs(back) <= 0.05, f"{back} GiB still allocated after the failed step"
    assert figures["released_reserved_gib"] <= figures["before_reserved_gib"] + 0.5, "the cache was not emptied"
    assert smi <= 512, f"nvidia-smi shows {smi} MiB more than before the step"
    return (f"out of memory at {tokens} tokens; allocated back to {figures['released_allocated_gib']} GiB, nvidia-smi "
            f"{figures['released_nvidia_smi_used_mib']} MiB (before the step: {figures['before_nvidia_smi_used_mib']}, "
            f"the cache full); the next step ran")  # fmt: skip


def _activation_bytes_per_token(ctx: dict[str, Any]) -> int:
    from tracetrain_cli._gpu_estimate import TrainerNeeds, estimate_memory
    from tracetrain_cli._gpu_inputs import read_model_shape

    memory = estimate_memory(read_model_shape(ctx["model_dir"]), TrainerNeeds(micro_batch_tokens=1024))
    return max(1, memory.activations // 1024)
