"""TRL's side of bench/learning.py: GRPOTrainer on the demo's task, its own sampler, for a wall-clock budget.

Run as its own process (``python bench/_learn/trl_loop.py --model-dir M --out DIR --minutes N``) so
that its threads and memory are its own. Same task, model, LoRA and step shape as the demo:
every step samples 4 training requests x 8 completions (TRL generates with transformers on the
CPU), scores them with the demo's checker and takes one AdamW step, lr 3e-4 constant, clip 0.2,
no KL, token-level mean loss (TRL's "dapo", the same objective as tracetrain's "grpo").
The adapter after every step is saved as ``DIR/step-N`` with the seconds since training began
in ``DIR/steps.jsonl``; the parent evaluates them afterwards, outside this budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tracetrain_demo import lookup  # noqa: E402  (after the path is set)
from tracetrain_demo.task import by_prompt, scenarios, score  # noqa: E402

GROUPS_PER_STEP = 4
GROUP_SIZE = 8


def reward(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """The demo's checker on a one-turn episode (TRL's prompts and completions are chat messages)."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        scenario = by_prompt()[prompt[-1]["content"]]
        rewards.append(score(scenario, completion[-1]["content"]).reward)
    return rewards


def find_hotel(city: str) -> str:
    """The hotel booked for the traveller in a city.

    Args:
        city: the city, e.g. Paris
    """
    return json.dumps(lookup.find_hotel(city))


def lookup_reward(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """The tool task's checker on TRL's multi-turn completion (assistant with tool calls, tool, assistant)."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        scenario = lookup.by_prompt()[prompt[-1]["content"]]
        calls = [c for m in completion if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
        cities = [_arguments(c).get("city") for c in calls if (c.get("function") or {}).get("name") == "find_hotel"]
        last = completion[-1] if completion else {}
        reply = "" if last.get("tool_calls") or last.get("role") != "assistant" else str(last.get("content") or "")
        rewards.append(lookup.score(scenario, cities, reply).reward)
    return rewards


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, required=True, help="training budget, model loading excluded")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--max-tokens", type=int, default=24, help="completion budget, as the demo agent's")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--task", choices=["city", "lookup"], default="city")
    args = p.parse_args()
    tools = args.task == "lookup"

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    train, _ = lookup.scenarios() if tools else scenarios()
    # The tool task's agent sends its instructions as the system turn, the request as the user turn (lookup_agent).
    system = [{"role": "system", "content": lookup.INSTRUCTIONS}] if tools else []
    dataset = Dataset.from_dict({"prompt": [[*system, {"role": "user", "content": s.prompt}] for s in train]})
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"),
        use_cpu=True,
        bf16=False,  # float32 on a CPU, as tracetrain's trainer and vLLM here
        # One optimizer step on GROUPS_PER_STEP x GROUP_SIZE completions, as tracetrain's. The tool task's
        # completions span two turns and a tool answer over a long system turn: its 32 sequences' logits in one
        # forward took 18 GB, so it trains them in micro-batches of 8 (the same step: gradients accumulated).
        per_device_train_batch_size=GROUPS_PER_STEP * GROUP_SIZE if not tools else GROUP_SIZE,
        gradient_accumulation_steps=1 if not tools else GROUPS_PER_STEP,
        num_generations=GROUP_SIZE,
        # The tool task's completion spans its turns: the call, the tool's answer, the reply (48 each at most).
        max_completion_length=args.max_tokens if not tools else 3 * 48,
        **({"max_tool_calling_iterations": 2} if tools else {}),
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        max_grad_norm=1.0,
        gradient_checkpointing=False,  # same speed here and memory is no issue for 135M
        num_train_epochs=100,  # the wall-clock budget stops it
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    if tools:  # the demo's tool template, and TRL's parser for its Hermes-style calls (Qwen's, the same format)
        from trl.chat_template_utils import qwen3_template

        tokenizer.chat_template = lookup.TEMPLATE.read_text()
        tokenizer.response_template = qwen3_template
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # as TrainConfig's
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets)
    trainer = GRPOTrainer(model=model, reward_funcs=lookup_reward if tools else reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, peft_config=lora,
                          **({"tools": [find_hotel]} if tools else {}))  # fmt: skip
    log = (args.out / "steps.jsonl").open("w")

    class Budget(TrainerCallback):  # type: ignore[misc]
        began = 0.0

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            Budget.began = time.monotonic()

        def on_log(self, _args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
            if "reward" not in (logs or {}):  # the summary logged once training stops
                return
            elapsed = time.monotonic() - Budget.began
            path = args.out / f"step-{state.global_step}"
            trainer.model.save_pretrained(path)
            log.write(json.dumps({"step": state.global_step, "seconds": elapsed, "path": str(path),
                                  "reward": (logs or {}).get("reward")}) + "\n")  # fmt: skip
            log.flush()
            print(f"step {state.global_step}: {elapsed:.0f} s, reward {(logs or {}).get('reward')}", flush=True)
            if elapsed >= args.minutes * 60:
                control.should_training_stop = True

    trainer.add_callback(Budget())
    trainer.train()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
