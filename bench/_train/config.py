"""What both contenders share: the threads, the LoRA, the optimizer and clipping, and our TrainConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
THREADS = 2
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_R, LORA_ALPHA, LEARNING_RATE, MAX_GRAD_NORM, CLIP_EPS = 16, 32, 1e-6, 1.0, 0.2


def train_config(micro_batch_tokens: int) -> Any:
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
