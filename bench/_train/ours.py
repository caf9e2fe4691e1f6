"""Our side: ``trainer.Learner.step`` (pack, chunked log-probs, loss, backward, clip, AdamW)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .config import THREADS, train_config
from .measure import capture_first_step_grads, page_in, status_kib, timed


def run_ours(work: Path, opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trainer import Learner, Sample, TrainItem

    torch.set_num_threads(THREADS)
    batch = torch.load(work / "batch.pt")
    learner = Learner(Path(batch["model_dir"]), train_config(opts.micro_batch_tokens), device="cpu")
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
    capture_first_step_grads(learner.optimizer, named, work / f"grads_{opts.role_name}.pt")
    page_in(learner.model)
    rss_load = status_kib("VmRSS")

    def step() -> dict[str, Any]:
        r = learner.step(items)
        return {"loss": r.loss, "grad_norm": r.grad_norm, "ratio_mean": r.ratio_mean, "step_result_s": r.seconds,
                "micro_batches": r.micro_batches, "tokens": r.tokens}  # fmt: skip

    result = timed(step, opts.role_name, opts, rss_load)
    result["micro_batch_tokens"] = opts.micro_batch_tokens
    return result
