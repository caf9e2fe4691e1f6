"""``tracetrain export`` and ``tracetrain sft``: the captured data as a dataset, and a LoRA warm start from it.

Both read the store the proxy writes (``tracetrain_cli._export``) and never import torch: ``sft``
exports the trajectories that pass ``--min-reward`` to a temporary JSONL file and trains
on it in a child process, ``python -m trainer.sft``, as ``tracetrain model pull`` does
with ``python -m trainer.pull``.

Exit status: 0 done; 1 something is missing (the store, a dependency, the model);
2 nothing to export or train on (the message says what to change); the child's own
status for ``sft`` otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from store import ExportFilter, Store
from tracetrain_cli._export import (
    FORMATS,
    ExportFormat,
    export_trajectories,
    parquet_problem,
)
from tracetrain_cli._models import DEFAULT_MODEL, missing_modules, resolve_model_dir

# What `python -m trainer.sft` imports, checked without importing them.
_SFT_MODULES = ("torch", "transformers", "peft", "trl", "datasets")


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def _default_data_dir() -> Path:
    from proxy import Settings

    return Path(os.environ.get("TRACETRAIN_DATA_DIR") or Settings.model_fields["data_dir"].default)


def add_store_flags(p: argparse.ArgumentParser) -> None:
    """--data-dir and --database-url, as every command that opens the store takes them (see ``store_url``)."""
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="the data directory `tracetrain serve` used; its SQLite store DATA_DIR/tracetrain.db is opened "
        "(default $TRACETRAIN_DATA_DIR, else .tracetrain)",
    )
    p.add_argument(
        "--database-url",
        metavar="URL",
        help="open this store instead, e.g. postgresql+asyncpg://user@host/db (default $TRACETRAIN_DATABASE_URL, "
        "else SQLite in the data directory)",
    )


def _store_flags(p: argparse.ArgumentParser) -> None:
    add_store_flags(p)
    p.add_argument("--policy", metavar="NAME", help="only trajectories of this policy (default: every policy)")


def add_export_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write captured trajectories to a JSONL or Parquet dataset (HF datasets loads it)",
        description=(
            "Write the captured trajectories to one file, one row per trajectory: id, group_id, policy, reward, "
            "reward_source (service, judge or human: a person's score), reward_note, metrics, created_at, the calls "
            "in order (each with its request messages or prompt, its response message, prompt_token_ids, "
            "completion_token_ids, logprobs, finish_reason and the policy version that served it) and `messages`, "
            "the whole conversation (the last call's request messages plus "
            "its response) for supervised fine-tuning. Token ids are exactly those vLLM sampled. Load it with "
            "datasets.load_dataset('json' or 'parquet', data_files=FILE). Reads the store while `tracetrain serve` "
            "runs; trajectories recorded after the export starts are not included."
        ),
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="jsonl (no extra dependency) or parquet (needs pyarrow) (default: from --output's suffix, else jsonl)",
    )
    p.add_argument(
        "--min-reward",
        type=_finite,
        metavar="X",
        help="only trajectories rewarded X or more (default: all, unrewarded ones included)",
    )
    _store_flags(p)
    p.add_argument(
        "--output",
        "-o",
        type=Path,
        metavar="FILE",
        help="the file to write, replaced if it exists (default DATA_DIR/exports/trajectories-TIME.FORMAT)",
    )


def add_sft_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sft",
        help="train a LoRA warm start on the best trajectories (supervised, TRL's SFTTrainer)",
        description=(
            "Supervised fine-tuning of a LoRA on the trajectories rewarded --min-reward or more: each answered chat "
            "call becomes one example (its request messages as the prompt, its response as the completion), and "
            "the loss covers the assistant's completion only. Trained with TRL's SFTTrainer in a child process "
            "(python -m trainer.sft; needs pip install 'tracetrain[train]'). The output directory is a peft LoRA "
            "adapter with sft.json beside it (source trajectories, min reward, base model, loss); GRPO starts from "
            "it with `tracetrain serve --trainer-arg=--init-adapter=DIR` (before the policy's first trained "
            "version). The LoRA rank, alpha and target modules default to the GRPO trainer's, so vLLM's "
            "--max-lora-rank (16) fits it. Exits with status 2 when no trajectory passes --min-reward."
        ),
    )
    p.add_argument(
        "--min-reward",
        type=_finite,
        required=True,
        metavar="X",
        help="train on trajectories rewarded X or more (required: a warm start learns from the best)",
    )
    _store_flags(p)
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="ALIAS_OR_DIR",
        help=f"the base model, as for `tracetrain serve`: a Hugging Face model directory, or an alias pulled into "
        f"DATA_DIR/models/ on first use (default {DEFAULT_MODEL}); use the model that serves the policy",
    )
    p.add_argument(
        "--output",
        "-o",
        type=Path,
        metavar="DIR",
        help="the adapter directory to create; it must not exist (default DATA_DIR/sft/POLICY-TIME)",
    )
    p.add_argument("--epochs", type=float, metavar="N", help="passes over the examples (default 3)")
    p.add_argument("--learning-rate", type=float, metavar="LR", help="AdamW learning rate (default 2e-4)")
    p.add_argument(
        "--lora-rank",
        type=int,
        metavar="R",
        help="LoRA rank (default 16, the GRPO trainer's); vLLM's --max-lora-rank must be at least this",
    )
    p.add_argument("--lora-alpha", type=int, metavar="A", help="LoRA alpha (default 32, the GRPO trainer's)")
    p.add_argument("--batch-size", type=int, metavar="N", help="examples per optimizer step (default 4)")
    p.add_argument(
        "--max-length", type=int, metavar="TOKENS", help="longer examples are cut to this many tokens (default 2048)"
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to train: auto picks cuda when torch sees a GPU (default auto)",
    )


def store_url(args: argparse.Namespace, command: str) -> tuple[str, Path]:
    """The store's URL and the data directory from ``add_store_flags``; SystemExit when a SQLite store is not there."""
    data_dir = args.data_dir or _default_data_dir()
    url = args.database_url or os.environ.get("TRACETRAIN_DATABASE_URL")
    if url:
        return url, data_dir
    db = data_dir / "tracetrain.db"
    if not db.is_file():
        raise SystemExit(
            f"tracetrain {command}: no store at {db}: pass --data-dir of the `tracetrain serve` run that captured "
            "the trajectories, or --database-url"
        )
    return f"sqlite+aiosqlite:///{db.resolve()}", data_dir


async def _count(url: str, where: ExportFilter) -> tuple[int, str]:
    """How many trajectories pass, and (when none) a hint about what the store holds."""
    store = await Store.open(url, capture=False)
    try:
        n = await store.export.count(where)
        if n:
            return n, ""
        summary = await store.export.reward_summary(where.policy)
    finally:
        await store.close()
    scope = f" of policy {where.policy}" if where.policy else ""
    if summary.trajectories == 0:
        return 0, f"the store holds no trajectory{scope}"
    if summary.best is None:
        return 0, f"the store holds {summary.trajectories} trajectories{scope}, none rewarded yet"
    return 0, (
        f"the store holds {summary.trajectories} trajectories{scope}, {summary.rewarded} rewarded, the best "
        f"reward {summary.best:g}"
    )


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def run_export(args: argparse.Namespace) -> int:
    suffix = args.output.suffix if args.output else ""
    fmt = cast(ExportFormat, args.format or ("parquet" if suffix == ".parquet" else "jsonl"))
    if fmt == "parquet" and (problem := parquet_problem()):
        raise SystemExit(f"tracetrain export: {problem}; or pass --format jsonl")
    url, data_dir = store_url(args, "export")
    where = ExportFilter(min_reward=args.min_reward, policy=args.policy)
    total, hint = asyncio.run(_count(url, where))
    if total == 0:
        print(f"tracetrain export: no trajectory matches ({where.describe()}); {hint}. Nothing written.",
              file=sys.stderr)  # fmt: skip
        return 2
    out: Path = args.output or data_dir / "exports" / f"trajectories-{_stamp()}.{fmt}"
    progress, done = _progress(total)
    try:
        written = asyncio.run(export_trajectories(url, out, fmt, where, on_rows=progress))
    finally:
        done()
    print(f"tracetrain export: wrote {written} trajectories ({fmt}) to {out.resolve()}")
    return 0


def _progress(total: int) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A tqdm bar on stderr when tqdm is installed (the train extra has it); nothing otherwise."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the train extra
    except ImportError:
        return None, lambda: None
    bar = tqdm(total=total, unit="trajectory", file=sys.stderr, disable=None, desc="tracetrain export")
    return bar.update, bar.close


def run_sft(args: argparse.Namespace) -> int:

    if missing := missing_modules(_SFT_MODULES):
        raise SystemExit(
            f"tracetrain sft: needs the training extra ({', '.join(missing)} not installed): "
            "pip install 'tracetrain[train]'"
        )
    url, data_dir = store_url(args, "sft")
    where = ExportFilter(min_reward=args.min_reward, policy=args.policy)
    total, hint = asyncio.run(_count(url, where))
    if total == 0:
        print(
            f"tracetrain sft: no trajectory passes --min-reward {args.min_reward:g}"
            f"{f' (policy {args.policy})' if args.policy else ''}; {hint}. Lower --min-reward, or capture and "
            "reward more trajectories first.",
            file=sys.stderr,
        )
        return 2
    out: Path = args.output or data_dir / "sft" / f"{args.policy or 'all'}-{_stamp()}"
    if out.exists():
        raise SystemExit(f"tracetrain sft: {out} exists; pass another --output (an adapter is never overwritten)")
    model_dir = resolve_model_dir(args.model, data_dir, command="sft")
    with tempfile.TemporaryDirectory(prefix="tracetrain-sft-") as scratch:
        data = Path(scratch) / "trajectories.jsonl"
        asyncio.run(export_trajectories(url, data, "jsonl", where))
        command = [
            sys.executable, "-m", "trainer.sft",
            "--data", str(data),
            "--base-model", str(model_dir.resolve()),
            "--output", str(out),
            "--min-reward", repr(args.min_reward),
            "--device", args.device,
        ]  # fmt: skip
        for flag, value in (
            ("--policy", args.policy),
            ("--epochs", args.epochs),
            ("--learning-rate", args.learning_rate),
            ("--lora-r", args.lora_rank),
            ("--lora-alpha", args.lora_alpha),
            ("--batch-size", args.batch_size),
            ("--max-length", args.max_length),
        ):
            if value is not None:
                command += [flag, str(value)]
        try:
            return subprocess.run(command, check=False).returncode
        except KeyboardInterrupt:
            return 130
