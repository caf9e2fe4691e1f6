"""GRPO with the learner makes a rewarded behaviour more likely: the tiny model learns to say one token.

The loop is the real one in miniature: sample groups of completions from the policy
(transformers' ``generate`` through the peft model, temperature 1, no top-k/top-p, as vLLM
samples), take each sampled token's logprob from the sampler's own scores (as the proxy
takes vLLM's), reward each completion by the share of one chosen token in it, turn rewards
into group advantages and take one learner step per batch. The chosen token is the one the
untrained model emits most often (about 1% of its tokens); after training it dominates.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trainer._advantages import group_advantages
from trainer._config import TrainConfig
from trainer._learner import Learner
from trainer._samples import Sample
from trainer._step import TrainItem

PROMPTS = (
    "What is the capital of France?",
    "Say hello.",
    "Count to five.",
    "Name a color.",
    "What is 2 + 3?",
    "Describe the weather in London.",
    "Write one word.",
    "Tell me about the river.",
)
GROUP = 8  # samples per prompt
NEW_TOKENS = 16
STEPS = 20


class Sampler:
    """Groups of completions from the learner's current policy, with their sampling logprobs."""

    def __init__(self, learner: Learner, tokenizer: PreTrainedTokenizerBase) -> None:
        self.learner = learner
        self.eos = int(tokenizer.eos_token_id)
        self.pad = int(tokenizer.pad_token_id)
        self.prompts: list[list[int]] = [
            list(
                tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)["input_ids"]
            )
            for p in PROMPTS
        ]

    def sample(self, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
        """(prompt, completion up to and including eos, sampling logprob of each completion token) per sample."""
        width = max(map(len, self.prompts))
        input_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in self.prompts])  # (P, W) left-padded
        attention_mask = (input_ids != self.pad).long()
        torch.manual_seed(seed)
        self.learner.model.eval()
        with torch.no_grad():
            out = self.learner.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=NEW_TOKENS,
                num_return_sequences=GROUP,
                output_logits=True,
                return_dict_in_generate=True,
            )
        logits = torch.stack(out.logits, dim=1).float()  # (P * GROUP, NEW, V)
        completions = out.sequences[:, width:]  # (P * GROUP, NEW)
        logps = logits.log_softmax(-1).gather(-1, completions[..., None]).squeeze(-1)  # (P * GROUP, NEW)
        samples = []
        for k, (tokens, logp) in enumerate(zip(completions.tolist(), logps.tolist(), strict=True)):
            n = tokens.index(self.eos) + 1 if self.eos in tokens else len(tokens)
            samples.append((self.prompts[k // GROUP], tokens[:n], logp[:n]))
        return samples


def train_items(samples: list[tuple[list[int], list[int], list[float]]], target: int) -> tuple[float, list[TrainItem]]:
    """The mean reward of the batch and its items with group advantages (flat groups dropped)."""
    rewards = torch.tensor([completion.count(target) / len(completion) for _, completion, _ in samples])
    adv = group_advantages(rewards, torch.arange(len(samples)) // GROUP, scale=True)
    items = []
    for (prompt, completion, logp), a, keep in zip(samples, adv.advantages.tolist(), adv.keep.tolist(), strict=True):
        if keep:
            mask = [False] * len(prompt) + [True] * len(completion)
            items.append(TrainItem(Sample(prompt + completion, mask, [0.0] * len(prompt) + logp, 1, 0), a))
    return float(rewards.mean()), items


def learn(model_dir: Path, seed: int) -> list[float]:
    """Run the loop; the mean reward of each step's batch, sampled before that step trained."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    learner = Learner(model_dir, TrainConfig(learning_rate=1e-2, seed=seed))
    sampler = Sampler(learner, tokenizer)

    calibration = collections.Counter(t for _, completion, _ in sampler.sample(seed=10_000 + seed) for t in completion)
    target = next(t for t, _ in calibration.most_common() if t != sampler.eos)

    rewards: list[float] = []
    for step in range(STEPS):
        mean_reward, items = train_items(sampler.sample(seed=seed * 1_000 + step), target)
        rewards.append(mean_reward)
        if not items:  # every group scored alike: nothing to learn from this batch
            continue
        result = learner.step(items)
        if step == 0:
            # The sampler's logprobs and the learner's packed forward agree: the ratio starts at 1.
            assert result.ratio_mean == pytest.approx(1.0, abs=1e-3)
            assert result.clip_fraction == 0.0
    return rewards


def test_grpo_steps_make_the_rewarded_token_the_policys_habit(tiny_model_dir: Path) -> None:
    rewards = learn(tiny_model_dir, seed=0)  # also checked locally with seeds 1-5

    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1, rewards
    assert last >= first + 0.5, rewards
