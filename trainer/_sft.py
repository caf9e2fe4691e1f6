"""An SFT warm start: a peft LoRA trained with TRL's SFTTrainer on the best captured trajectories.

GRPO learns only where a group's samples differ in reward; a policy that never produces a
good answer gives it nothing to work with. Supervised fine-tuning on the trajectories that
did earn a high reward moves the LoRA towards them first; the GRPO trainer then starts from
that adapter (``python -m trainer --init-adapter DIR``).

The data is ``tracetrain export``'s (JSONL or Parquet). Each answered chat call becomes one
conversational prompt/completion example: its request messages are the prompt, its response
the completion. So every assistant turn the agent produced is trained once, in the context
it was actually produced in, and nothing the agent did not write carries loss. TRL's
``completion_only_loss`` masks the prompt: the loss covers the completion's tokens as the
chat template renders them, ``<|im_end|>`` included, so the model also learns to stop.

A trajectory a person gave a demonstration (the answer they wanted, with their score on the dashboard)
gives one example whatever its reward: its last chat call's prompt, with the demonstration as the
completion, in place of the agent's own answers.

Why not ``messages`` with ``assistant_only_loss``: TRL 1.16 needs ``{% generation %}``
markers in the chat template for it and patches in only the templates it knows (Qwen,
Llama 3, Gemma, ...). SmolLM2's ChatML template and the test model's are not among them
(``SFTTrainer`` raises "patching is not supported for this template"), while prompt/completion
pairs work with any template whose rendering of the prompt is a prefix of prompt plus
completion, which ChatML's is.

The text is tokenized again by the chat template, unlike the GRPO step, which trains on the
captured token ids: a tokenization that differs from what vLLM sampled only changes how the
same text is spelled, which supervised learning tolerates.

The LoRA's rank, alpha, dropout and target modules default to ``TrainConfig``'s, the GRPO
trainer's, so the adapter fits vLLM's ``--max-lora-rank`` as the trainer's own adapters do.
The output directory holds what peft saves (``adapter_config.json``,
``adapter_model.safetensors``) and ``sft.json``, what it was trained on and how.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import torch
from datasets import Dataset, Features, Json, List, Value  # type: ignore[import-untyped]  # no stubs
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from trl import SFTConfig, SFTTrainer  # type: ignore[attr-defined]  # lazy exports mypy cannot see

from trainer._config import TrainConfig
from trainer._lora import lora_config, quiet_peft_deprecation

METADATA = "sft.json"
_FEATURES = Features({"prompt": List(Json()), "completion": List(Json()), "tools": Value("string")})


class NothingToTrain(ValueError):
    """No example passed the filters; the message says what to change."""


@dataclass(frozen=True, slots=True)
class SFTOptions:
    """How the warm start trains. ``lora``: only its LoRA fields (rank, alpha, dropout, targets) are used."""

    epochs: float = 3.0
    learning_rate: float = 2e-4
    batch_size: int = 4
    max_length: int = 2048  # longer examples keep their start; an example cut before its completion is dropped
    lora: TrainConfig = field(default_factory=TrainConfig)
    device: str = "cpu"  # "cpu" or "cuda"
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ValueError(f"epochs must be a positive number, got {self.epochs}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate}")
        if self.batch_size < 1 or self.max_length < 8:
            raise ValueError("batch_size must be at least 1 and max_length at least 8")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")


@dataclass(frozen=True, slots=True)
class Examples:
    """The SFT examples of an export and what was left out."""

    rows: list[dict[str, Any]]
    trajectories: int  # trajectories that gave at least one example
    skipped_calls: int  # calls without a chat request and an answer (errors, completions endpoint)
    reward_mean: float | None


def read_export(path: Path, *, min_reward: float | None = None, policy: str | None = None) -> Iterator[dict[str, Any]]:
    """Rows of a ``tracetrain export`` file (``.parquet``, else JSONL) that pass the filters."""

    def keep(row: Mapping[str, Any]) -> bool:
        if row.get("demonstration") and (policy is None or row.get("policy") == policy):
            return True  # a person's demonstration is an example whatever the trajectory's reward
        reward = row.get("reward")
        if min_reward is not None and (reward is None or reward < min_reward):
            return False
        return policy is None or row.get("policy") == policy

    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # type: ignore[import-untyped]  # no stubs

        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            yield from (row for row in batch.to_pylist() if keep(row))
        return
    with path.open("rb") as lines:
        for line in lines:
            if line.strip() and keep(row := orjson.loads(line)):
                yield row


def sft_examples(rows: Iterator[Mapping[str, Any]] | Sequence[Mapping[str, Any]]) -> Examples:
    """One conversational prompt/completion example per answered chat call of each trajectory."""
    examples: list[dict[str, Any]] = []
    trajectories = skipped = 0
    rewards: list[float] = []
    for row in rows:
        before = len(examples)
        if demonstration := row.get("demonstration"):
            # What a person wanted replaces what the agent answered: the last chat call's prompt, their answer.
            asked = [c for c in row.get("calls") or () if c.get("status_code") == 200 and c.get("messages")]
            if asked:
                examples.append({"prompt": [_template_message(m) for m in asked[-1]["messages"]],
                                 "completion": [{"role": "assistant", "content": str(demonstration)}],
                                 "tools": asked[-1].get("tools")})  # fmt: skip
                trajectories += 1
                continue
        for call in row.get("calls") or ():
            messages, response = call.get("messages"), call.get("response")
            if call.get("status_code") != 200 or not messages or not response:
                skipped += 1
                continue
            examples.append(
                {
                    "prompt": [_template_message(m) for m in messages],
                    "completion": [_template_message(response)],
                    "tools": call.get("tools"),
                }
            )
        if len(examples) > before:
            trajectories += 1
            if row.get("reward") is not None:
                rewards.append(float(row["reward"]))
    mean = sum(rewards) / len(rewards) if rewards else None
    return Examples(examples, trajectories, skipped, mean)


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An export message as chat templates expect it: no null fields, tool arguments as objects."""
    out = {k: v for k, v in message.items() if v is not None}
    if tool_calls := out.get("tool_calls"):
        out["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
    return out


def _template_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI's wire form is JSON text; Hugging Face templates take an object
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: the template gets the text as written
            function["arguments"] = json.loads(arguments)
    return {k: v for k, v in {**call, "function": function}.items() if v is not None}


def build_trainer(base_model: Path, examples: Examples, options: SFTOptions, scratch: Path) -> SFTTrainer:
    """An SFTTrainer on a fresh LoRA over ``base_model``; ``scratch`` takes whatever TRL writes."""
    if not examples.rows:
        raise NothingToTrain("no example to train on")
    tokenizer = AutoTokenizer.from_pretrained(str(base_model))
    if not tokenizer.chat_template:
        raise NothingToTrain(f"{base_model} has no chat template; SFT on chat trajectories needs one")
    cuda = options.device == "cuda"
    bf16 = cuda and torch.cuda.is_bf16_supported()
    torch.manual_seed(options.seed)  # the LoRA's A matrices are drawn when SFTTrainer wraps the model
    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.bfloat16 if bf16 else torch.float32)
    args = SFTConfig(
        output_dir=str(scratch),
        num_train_epochs=options.epochs,
        learning_rate=options.learning_rate,
        per_device_train_batch_size=options.batch_size,
        max_length=options.max_length,
        completion_only_loss=True,
        # TRL's default; off because LoRA on the small models this trains keeps activations small, and it is slower.
        gradient_checkpointing=False,
        bf16=bf16,  # TRL defaults to bf16 everywhere; on a CPU without bf16 units that is far slower than fp32
        use_cpu=not cuda,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        seed=options.seed,
    )
    dataset = Dataset.from_list(examples.rows, features=_FEATURES)
    with quiet_peft_deprecation():
        return SFTTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora_config(model, options.lora),
        )


def save_adapter(model: PeftModel, base_model: Path, out_dir: Path, metadata: Mapping[str, Any]) -> None:
    """Write the adapter and ``sft.json`` to ``out_dir``, whole or not at all; FileExistsError if it exists."""
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; an adapter is never overwritten, pass another output directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    # vLLM and peft read this to find the base; the directory trained on is the truthful one.
    model.peft_config[model.active_adapter].base_model_name_or_path = str(base_model.resolve())
    try:
        model.save_pretrained(str(work))
        (work / METADATA).write_text(json.dumps(dict(metadata), indent=2, sort_keys=True) + "\n")
        work.rename(out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def lora_parameters(model: PreTrainedModel | PeftModel) -> dict[str, torch.Tensor]:
    """Copies of the LoRA weights, by name: what training must move."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def train_sft(
    base_model: Path,
    data: Path,
    out_dir: Path,
    options: SFTOptions,
    *,
    min_reward: float | None = None,
    policy: str | None = None,
) -> dict[str, Any]:
    """Train the warm start on ``data`` (an export) and write it to ``out_dir``; returns its metadata.

    Raises NothingToTrain when no trajectory passes ``min_reward`` / ``policy`` or none of
    those has an answered chat call, FileExistsError when ``out_dir`` exists.
    """
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; an adapter is never overwritten, pass another output directory")
    examples = sft_examples(read_export(data, min_reward=min_reward, policy=policy))
    if not examples.rows:
        what = "no trajectory" if examples.skipped_calls == 0 else "no trajectory with an answered chat call"
        raise NothingToTrain(
            f"{what} passes the filters (min reward {min_reward}, policy {policy or 'any'}) in {data}; "
            "lower the minimum reward, or capture and reward more trajectories first"
        )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tracetrain-sft-") as scratch:
        trainer = build_trainer(base_model, examples, options, Path(scratch))
        result = trainer.train()
    model = trainer.model
    assert isinstance(model, PeftModel)
    metadata = {
        "base_model": str(base_model.resolve()),
        "data": str(data),
        "source_trajectories": examples.trajectories,
        "examples": len(examples.rows),
        "skipped_calls": examples.skipped_calls,
        "min_reward": min_reward,
        "policy": policy,
        "reward_mean": examples.reward_mean,
        "loss": float(result.training_loss),
        "loss_on": "completions: each chat call's response, the prompt masked (TRL completion_only_loss)",
        "steps": int(result.global_step),
        "epochs": options.epochs,
        "learning_rate": options.learning_rate,
        "batch_size": options.batch_size,
        "max_length": options.max_length,
        "lora_r": options.lora.lora_r,
        "lora_alpha": options.lora.lora_alpha,
        "lora_dropout": options.lora.lora_dropout,
        "target_modules": sorted(getattr(model.peft_config[model.active_adapter], "target_modules", None) or ()),
        "seed": options.seed,
        "seconds": time.perf_counter() - start,
        "created_at": time.time(),
    }
    save_adapter(model, base_model, out_dir, metadata)
    return metadata
