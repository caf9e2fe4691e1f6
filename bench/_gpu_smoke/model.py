"""The model the smoke run trains, built here with random weights (no hub), and synthetic GRPO batches.

``qwen2.5-1.5b``: Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads and 2 KV heads of 128,
intermediate 8960, vocabulary 151936, tied embeddings): 1.54B parameters, 3.1 GB of bf16 safetensors.
``tiny``: the tests' 2-layer Llama, for running the script's CPU paths quickly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

QWEN_1_5B: dict[str, Any] = {
    "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip


def build_model(kind: str, out: Path, device: str) -> Path:
    """A model directory of ``kind`` under ``out`` (reused when it is there)."""
    target = out / kind
    if (target / "config.json").is_file():
        return target
    if kind == "tiny":
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_model import build_tiny_model

        return build_tiny_model(target)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**QWEN_1_5B)
    with torch.device(device if device.startswith("cuda") else "cpu"):  # random init is much faster on the GPU
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return target


def vocab_size(model_dir: Path) -> int:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def batch(vocab: int, *, groups: int, group_size: int, prompt: int, completion: int, seed: int = 0) -> list[Any]:
    """GRPO groups of ``group_size`` samples sharing a ``prompt``-token prompt; advantages -1..+1, old logprob -2."""
    import torch

    from trainer import Sample, TrainItem

    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(groups):
        head = torch.randint(3, vocab, (prompt,), generator=g).tolist()
        for k in range(group_size):
            tail = torch.randint(3, vocab, (completion,), generator=g).tolist()
            sample = Sample([*head, *tail], [False] * prompt + [True] * completion,
                            [0.0] * prompt + [-2.0] * completion, 1, 0)  # fmt: skip
            items.append(TrainItem(sample, advantage=(2 * k / max(1, group_size - 1)) - 1))
    return items
