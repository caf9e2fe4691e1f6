"""The shared inputs: the model, the batch and the LoRA's initial weights, written once for every contender."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .config import THREADS, train_config

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
    learner = Learner(model_dir, train_config(opts.micro_batch_tokens))
    samples = [Sample(row, [False] * p + [True] * c, [0.0] * (p + c), 1, 0) for row in input_ids.tolist()]
    old = torch.stack([lp[p:] for lp in learner.logprobs(samples)])  # (N, C) on-policy, the sampled tokens only
    lora = {name: w.detach().clone() for name, w in learner.model.named_parameters() if w.requires_grad}
    torch.save({"model_dir": str(model_dir), "input_ids": input_ids, "advantages": advantages,
                "old_logprobs": old, "prompt": p}, work / "batch.pt")  # fmt: skip
    torch.save(lora, work / "lora_init.pt")
