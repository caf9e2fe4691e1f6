"""TRL's side: ``GRPOTrainer.compute_loss`` on the padded inputs dict, backward, the same clip and AdamW."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .config import CLIP_EPS, LEARNING_RATE, LORA_ALPHA, LORA_R, LORA_TARGETS, MAX_GRAD_NORM, REPO, THREADS
from .measure import capture_first_step_grads, page_in, status_kib, timed


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
    capture_first_step_grads(optimizer, named, work / f"grads_{opts.role_name}.pt")
    model.train()
    page_in(model)
    rss_load = status_kib("VmRSS")

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

    result = timed(step, opts.role_name, opts, rss_load)
    result["loss_backward_s"] = statistics.median(r["loss_backward_s"] for r in result["runs"])
    result["gradient_checkpointing"] = bool(args.gradient_checkpointing)
    return result
