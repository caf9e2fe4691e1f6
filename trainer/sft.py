"""``python -m trainer.sft``: train an SFT warm-start LoRA on a ``tracetrain export`` file.

``tracetrain sft`` exports the best trajectories and runs this as a child process, so the
proxy's command line never imports torch; it also runs alone on any export file (JSONL or
Parquet), e.g. on a GPU machine. Exit status 0 when the adapter is written, 2 when nothing
passes the filters, 1 for a bad option, model directory, data file or existing output
directory, each said in one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from trainer._config import TrainConfig


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m trainer.sft",
        description="Supervised fine-tuning of a LoRA (TRL's SFTTrainer) on the answered chat calls of the "
        "trajectories in a `tracetrain export` file; the loss covers each call's completion only. Writes a peft "
        "adapter directory with sft.json beside it, which `python -m trainer --init-adapter DIR` starts from.",
    )
    p.add_argument("--data", type=Path, required=True, help="a `tracetrain export` file (.jsonl or .parquet)")
    p.add_argument("--base-model", type=Path, required=True, help="the Hugging Face model directory vLLM serves")
    p.add_argument("--output", type=Path, required=True, help="the adapter directory to create (must not exist)")
    p.add_argument("--min-reward", type=float, help="only trajectories rewarded this or more (default: all)")
    p.add_argument("--policy", help="only trajectories of this policy (default: all)")
    p.add_argument("--epochs", type=float, default=3.0, help="passes over the examples (default 3)")
    p.add_argument("--learning-rate", type=float, default=2e-4, help="AdamW learning rate (default 2e-4)")
    p.add_argument("--lora-r", type=int, default=defaults.lora_r, help=f"LoRA rank (default {defaults.lora_r})")
    p.add_argument(
        "--lora-alpha", type=int, default=defaults.lora_alpha, help=f"LoRA alpha (default {defaults.lora_alpha})"
    )
    p.add_argument("--batch-size", type=int, default=4, help="examples per optimizer step (default 4)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens an example is cut to (default 2048)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="(default auto)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # torch, transformers and TRL load in seconds; --help and bad flags answer before that.
    import torch

    from trainer._sft import NothingToTrain, SFTOptions, train_sft

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        lora = TrainConfig(lora_r=args.lora_r, lora_alpha=args.lora_alpha)
        options = SFTOptions(
            epochs=args.epochs, learning_rate=args.learning_rate, batch_size=args.batch_size,
            max_length=args.max_length, lora=lora, device=device, seed=args.seed,
        )  # fmt: skip
    except (ValidationError, ValueError) as exc:
        print(f"tracetrain sft: bad options: {exc}", file=sys.stderr)
        return 1
    if not (args.base_model / "config.json").is_file():
        print(f"tracetrain sft: {args.base_model} is not a Hugging Face model directory", file=sys.stderr)
        return 1
    if not args.data.is_file():
        print(f"tracetrain sft: no export file at {args.data}; write one with `tracetrain export`", file=sys.stderr)
        return 1
    try:
        meta = train_sft(
            args.base_model, args.data, args.output, options, min_reward=args.min_reward, policy=args.policy
        )
    except NothingToTrain as exc:
        print(f"tracetrain sft: {exc}", file=sys.stderr)
        return 2
    except FileExistsError as exc:
        print(f"tracetrain sft: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(
        f"tracetrain sft: trained on {meta['examples']} calls of {meta['source_trajectories']} trajectories "
        f"(final loss {meta['loss']:.4f}); the adapter is in {args.output.resolve()}\n"
        f"start GRPO from it: tracetrain serve --trainer-arg=--init-adapter={args.output.resolve()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
