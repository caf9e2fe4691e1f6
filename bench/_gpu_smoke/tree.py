"""The prefix tree under flash attention on a real GPU: a split reasoning trajectory, tree against each alone.

``tree_attention``: the split samples of one agent run (each call's prompt holds the prompts before it,
as under a template that drops earlier thinking) scored and stepped by a learner on flash_attention_2
(the tree's branches as varlen sequences, their paths' keys gathered: ``trainer._attention``) and by one
on sdpa with each sample laid whole. The same weights and LoRA: the log-probs must agree to bf16's
precision and the first step's loss too; the figures are the tokens each forwards and the step times.
On this CPU the same code runs under a stand-in kernel (tests/test_trainer_prefix_tree.py); this is the
real flash-attn.
"""

from __future__ import annotations

from typing import Any

from _gpu_smoke.model import vocab_size
from _gpu_smoke.report import Skip


def split_trajectory(vocab: int, turns: int, *, prompt: int, completion: int, turn: int) -> list[Any]:
    """One run's samples: sample k is prompt k (the prompt before it and a re-rendered turn) and its completion."""
    import torch

    from trainer import Sample, TrainItem

    g = torch.Generator().manual_seed(0)
    head = torch.randint(3, vocab, (prompt,), generator=g).tolist()
    items = []
    for k in range(turns):
        tail = torch.randint(3, vocab, (completion,), generator=g).tolist()
        sample = Sample([*head, *tail], [False] * len(head) + [True] * completion,
                        [0.0] * len(head) + [-2.0] * completion, 1, 0)  # fmt: skip
        items.append(TrainItem(sample, advantage=1.0 if k % 2 else -1.0))
        head = [*head, *torch.randint(3, vocab, (turn,), generator=g).tolist()]
    return items


def tree_attention(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    import torch

    from trainer import Learner, TrainConfig
    from trainer._attention import flash_attn_available

    if ctx["device"] != "cuda":
        raise Skip("no GPU: flash attention runs on CUDA (tests/test_trainer_prefix_tree.py runs a stand-in)")
    if not flash_attn_available():
        raise Skip("the flash_attn package (2.1 or newer) is not installed")
    items = split_trajectory(vocab_size(ctx["model_dir"]), 12, prompt=1024, completion=256, turn=128)
    cfg = TrainConfig(lora_r=16, lora_alpha=32, micro_batch_tokens=8192)  # the tree (5.5k tokens) in one row
    learners = {"tree, flash_attention_2": Learner(ctx["model_dir"], cfg, device="cuda",
                                                    attn_implementation="flash_attention_2"),
                "each alone, sdpa": Learner(ctx["model_dir"], cfg.model_copy(update={"share_prefix": False}),
                                            device="cuda", attn_implementation="sdpa")}  # fmt: skip
    samples = [item.sample for item in items]
    logprobs = {name: learner.logprobs(samples) for name, learner in learners.items()}
    gap = max(float((a - b).abs().max()) for a, b in zip(*logprobs.values(), strict=True))
    steps = {}
    for name, learner in learners.items():
        learner.step(items)  # warm-up
        steps[name] = learner.step(items)
        torch.cuda.empty_cache()
    tree, alone = steps.values()
    figures.update(logprob_max_gap=round(gap, 4), forwarded_tree=tree.forwarded_tokens,
                   forwarded_alone=alone.forwarded_tokens, step_s_tree=round(tree.seconds, 3),
                   step_s_alone=round(alone.seconds, 3), loss_tree=tree.loss, loss_alone=alone.loss)  # fmt: skip
    assert gap < 0.25, f"flash tree against sdpa alone: log-probs differ by up to {gap} nats"
    return (f"{len(items)} split samples: {tree.forwarded_tokens} tokens forwarded as a tree (flash) against "
            f"{alone.forwarded_tokens} alone (sdpa), {alone.seconds / tree.seconds:.2f}x faster; log-probs within "
            f"{gap:.3f} nats")  # fmt: skip
