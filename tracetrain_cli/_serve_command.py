"""``tracetrain serve``: the settings its flags make (``_serve_flags``), and the start of the supervisor."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from tracetrain_cli._config import config_text
from tracetrain_cli._models import LOG_BACKENDS, TRAIN_MODULES, missing_modules, resolve_model_dir
from tracetrain_cli._setting_flags import settings_from as proxy_settings

if TYPE_CHECKING:  # the serving modules load at `serve`, not for every command's --help
    from tracetrain_cli._precision import SamplerDtype
    from tracetrain_cli._serve_devices import DevicePlan
    from tracetrain_cli._vllm_process import Device, VLLMLaunch


_LOG_TO_CHECK_S = 180  # the trainer's imports (torch) and one request to each tracker


def settings_from(args: argparse.Namespace) -> Any:
    """The proxy's settings from serve's flags (``_setting_flags``), after serve's own refusals."""
    if args.replica:
        raise SystemExit(
            "tracetrain serve: --replica was removed. Name every vLLM server with --upstream (repeatable): the "
            "proxy routes calls over them itself (a trajectory stays on one server, for its prefix cache) and "
            "loads every adapter into each. Do not put a load balancer in front of them."
        )
    if given := [a for a in args.vllm_arg if a.split("=", 1)[0] == "--reasoning-parser"]:
        raise SystemExit(
            f"tracetrain serve: --vllm-arg={given[0]}: pass serve's own --reasoning-parser NAME instead, so that the "
            "proxy knows the parser too"
        )
    return proxy_settings(args)


def kept_loaded(settings: Any) -> int:
    """The adapter versions vLLM keeps loaded over every policy named: each one's --keep-versions, summed."""
    return sum(
        (o.keep_versions if (o := settings.policy_configs.get(name)) and o.keep_versions else settings.keep_versions)
        for name in settings.policies
    )


def run_serve(args: argparse.Namespace) -> int:
    import uvloop

    from tracetrain_cli._gpu_render import render_plan
    from tracetrain_cli._precision import agree, trainer_dtype
    from tracetrain_cli._serve import ServePlan, pick_device, serve, trainer_argv
    from tracetrain_cli._serve_devices import device_plan

    if args.trainer_procs < 1:
        raise SystemExit(f"tracetrain serve: --trainer-procs must be at least 1, got {args.trainer_procs}")
    settings = settings_from(args)
    if args.print_config:
        print(config_text(args, settings), end="")
        return 0
    if args.plan_only:  # before anything is checked, written or started: a GPU box may not have vLLM yet
        model_dir = _model_dir(args, settings.data_dir)
        print(render_plan(device_plan(args, pick_device(args.device), model_dir, kept_loaded(settings))))
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_private(settings.data_dir)
    if settings.admin_token is None:
        settings = settings.model_copy(update={"admin_token": _admin_token(settings.data_dir)})
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    device = pick_device(args.device)
    _refuse_missing_extras(args, device)
    model_dir = _model_dir(args, settings.data_dir)
    devices = device_plan(args, device, model_dir, kept_loaded(settings))
    print(render_plan(devices), flush=True)
    # The plan shares one GPU (or --share-gpu / TRACETRAIN_SHARE_GPU asks): vLLM sleeps around each step.
    settings = settings.model_copy(update={"share_gpu": devices.shared or settings.share_gpu})
    precision = agree(device, dtype=args.dtype, sampler_dtype=args.sampler_dtype,
                      trainer_dtype=trainer_dtype(args.trainer_arg))  # fmt: skip
    launch = None
    if args.upstream is None:
        print(precision.line(), flush=True)
        assert model_dir is not None
        settings, launch = _vllm_child(args, settings, model_dir, device, precision.sampler, devices)
    trainer = (
        None
        if model_dir is None or args.no_train
        else trainer_argv(
            settings,
            model_dir,
            device,
            [*_precision_args(precision, args), *_log_args(args), *args.trainer_arg],
            args.trainer_procs,
            devices.trainer_shard,
        )
    )
    plan = ServePlan(settings=settings, vllm=launch, trainer_argv=trainer, log_level=args.log_level, devices=devices)
    _refuse_log_to_that_cannot_start(plan)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(plan))
    return 0


def _refuse_missing_extras(args: argparse.Namespace, device: Device) -> None:
    """Exit with what to install when vLLM (unless --upstream) or the trainer (unless --no-train) cannot start."""
    from tracetrain_cli._serve import vllm_install_problem

    if args.upstream is None and (problem := vllm_install_problem(device)):
        raise SystemExit(f"tracetrain serve: {problem}")
    if not args.no_train and (missing := missing_modules(TRAIN_MODULES)):
        raise SystemExit(
            f"tracetrain serve: the trainer needs the training extra ({', '.join(missing)} not installed): "
            "pip install 'tracetrain[train]', or pass --no-train to serve and capture only"
        )
    for backend in args.log_to if not args.no_train else ():
        if missing_modules([LOG_BACKENDS[backend]]):
            raise SystemExit(f"tracetrain serve: --log-to {backend} needs the {backend} package: "
                             f"pip install 'tracetrain[{backend}]'")  # fmt: skip


def _refuse_log_to_that_cannot_start(plan: Any) -> None:
    """Exit with the reason when a ``--log-to`` backend cannot start a run, before anything starts: the trainer
    checks (``--check-log-to``) with the command line and environment it will run with. Once training runs, a
    backend that fails is reported with each step and training goes on (trainer._run_log)."""
    import subprocess

    from tracetrain_cli._serve import _trainer_env

    if plan.trainer_argv is None or not any(a.startswith("--log-to=") for a in plan.trainer_argv):
        return
    print("checking where --log-to writes", flush=True)
    try:
        done = subprocess.run([*plan.trainer_argv, "--check-log-to"], env=_trainer_env(plan), capture_output=True,
                              text=True, timeout=_LOG_TO_CHECK_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise SystemExit(f"tracetrain serve: checking --log-to took over {_LOG_TO_CHECK_S} s; nothing was started "
                         "(is MLFLOW_TRACKING_URI's server answering?)") from None  # fmt: skip
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.startswith("--log-to")]
        said = said or done.stderr.strip().splitlines()[-5:]
        raise SystemExit("tracetrain serve: --log-to cannot start a run, so nothing was started:\n  "
                         + "\n  ".join(said))  # fmt: skip


def _log_args(args: argparse.Namespace) -> list[str]:
    """The trainer's ``--log-to`` and ``--log-dir``, as serve was given them."""
    if not args.log_to:
        return []
    return [f"--log-to={','.join(args.log_to)}", *([f"--log-dir={args.log_dir.resolve()}"] if args.log_dir else [])]


def _vllm_child(args: argparse.Namespace, settings: Any, model_dir: Path, device: Device, dtype: SamplerDtype,
                devices: DevicePlan) -> tuple[Any, VLLMLaunch]:  # fmt: skip
    """The vLLM child's launch recipe, and the settings that point the proxy at it (and its resolver at the proxy)."""
    from tracetrain_cli._serve_devices import launch_options
    from tracetrain_cli._vllm_process import VLLMLaunch

    launch = VLLMLaunch(
        model=str(model_dir.resolve()),
        port=args.vllm_port or settings.port + 1,
        data_dir=settings.data_dir.resolve(),
        served_model_name=model_dir.name,
        device=device,
        dtype=dtype,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
        sleep_mode=settings.share_gpu,
        extra_args=tuple(args.vllm_arg),
        **launch_options(devices),
    )
    settings = settings.model_copy(update={"upstreams": (launch.base_url,), "served_model": model_dir.name})
    if getattr(args, "reads_images", None) is None:
        settings = settings.model_copy(update={"reads_images": reads_images(model_dir)})
    if _adapters_by_name(settings, train=not args.no_train):
        settings, launch = _with_adapter_resolver(settings, launch)
    return settings, launch


def reads_images(model_dir: Path) -> bool:
    """Whether the model sees images: its config.json has a vision tower (``vision_config``), as Hugging Face's
    image-text models do (Qwen2.5-VL, Gemma 3, Llama 4, ...)."""
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


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
        # The largest window of the policies named: each policy's downloads are kept per policy.
        adapters_keep=max(
            [settings.keep_versions, *(o.keep_versions for o in settings.policy_configs.values() if o.keep_versions)]
        ),
    )
    return settings, launch


def _model_dir(args: argparse.Namespace, data_dir: Path) -> Path | None:
    """The base model's directory (pulled on first use), unless nothing here needs it."""
    return resolve_model_dir(args.model, data_dir) if args.upstream is None or not args.no_train else None


def keep_private(data_dir: Path) -> None:
    """What ``serve`` and the children it starts (vLLM, the trainer) write is their user's alone.

    The store holds every captured prompt and reply, rewards and reviewers' notes; adapters and logs say as much.
    So the file mode creation mask is 077 from here on (inherited by the children): the SQLite database with its
    -wal and -shm, adapters, logs, every directory made, owner-only. The data directory is made 0700; one that
    exists keeps its mode (the operator may share it on purpose), with a warning when others can reach it, as
    for its adapters and logs directories.
    """
    os.umask(0o077)
    for path in (data_dir, data_dir / "adapters", data_dir / "logs"):
        try:
            mode = path.stat().st_mode & 0o777
        except FileNotFoundError:
            continue
        if mode & 0o077:
            logging.getLogger("tracetrain.serve").warning(
                "%s is open to other users (mode %o): what it holds (captured calls, rewards, adapters, logs) may be "
                "read by them; chmod 700 %s unless that is meant", path, mode, path,
            )  # fmt: skip
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)


def _admin_token(data_dir: Path) -> SecretStr:
    """The dashboard's token from DATA_DIR/admin-token (owner-only), made on first use: never printed."""
    path = data_dir / "admin-token"
    if not path.is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return SecretStr(path.read_text().strip())
