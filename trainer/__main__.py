"""``python -m trainer``: the trainer worker (``tracetrain serve`` starts it as a child process).

It claims queued training jobs of every policy the store serves (or of those given with --policy), the
policy trained least recently first, trains a GRPO step on the policy's LoRA and records the adapter;
the proxy publishes it. Run it beside the proxy, or on a
GPU machine of its own against the same Postgres database.

``--procs N`` trains on N processes: the command runs itself again under torchrun
(``python -m torch.distributed.run --standalone --nproc-per-node N -m trainer ...``);
under torchrun (``WORLD_SIZE`` set) it reads RANK, WORLD_SIZE and LOCAL_RANK instead.
``--shard`` splits the base over those processes (FSDP2) for a base that does not fit one device.
``--log-to tensorboard,wandb,mlflow`` writes each step's metrics and the posted evaluations to a run there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError

from store import POLICY_NAME_PATTERN
from tracetrain_core import add_train_config_flags, train_config_from
from trainer import _distributed
from trainer._attention import ATTN_CHOICES
from trainer._distributed import Ranks
from trainer._run_log import (
    MissingExtra,
    RunLog,
    RunLogs,
    check_destinations,
    check_installed,
    default_run_name,
    parse_log_to,
)
from trainer._worker import COLLECTIVE_TIMEOUT_S, Worker, WorkerSettings, follow


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    _add_job_flags(p)
    _add_process_flags(p)
    add_train_config_flags(p)
    _add_worker_flags(p)
    _add_log_flags(p)
    p.add_argument("--once", action="store_true", help="run the queued jobs, then exit")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default info)")
    args = p.parse_args(argv)
    if not args.database_url:
        p.error("the store's URL is needed: set TRACETRAIN_DATABASE_URL (or pass --database-url)")
    return args


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    """Whose jobs, from which store, on which base, and where the adapters go."""
    p.add_argument(
        "--database-url",
        default=os.environ.get("TRACETRAIN_DATABASE_URL"),
        help="the proxy's store (SQLAlchemy async URL); prefer TRACETRAIN_DATABASE_URL (a flag shows in ps, with "
        "its password). One of the two is needed",
    )
    p.add_argument("--data-dir", type=Path, required=True, help="adapters go to DATA_DIR/adapters/POLICY/N/")
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME",
        type=_policy_name,
        help="a policy whose jobs to run; repeatable (default: every policy the store serves, added ones too)",
    )
    p.add_argument("--base-model", type=Path, required=True, help="the HF model directory vLLM serves")
    p.add_argument("--init-adapter", type=Path, help="a LoRA directory to start from (e.g. an SFT warm start)")


def _add_process_flags(p: argparse.ArgumentParser) -> None:
    """Where the step runs: the device, how many processes, sharded or not, the attention kernel."""
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument(
        "--procs",
        type=int,
        default=1,
        metavar="N",
        help="train on N processes (data parallel, started with torchrun; with --device cuda, one GPU each); "
        "rank 0 alone talks to the store and writes adapters (default 1). Under torchrun its world size decides",
    )
    p.add_argument(
        "--shard",
        action="store_true",
        help="with --procs N: split the base model and the LoRA over the N processes (FSDP2) instead of each "
        "holding the whole base (DDP); for a base that does not fit one device. The adapter is the same",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=COLLECTIVE_TIMEOUT_S,
        metavar="SECONDS",
        help="with --procs N: how long a rank waits for the others in a collective before the run stops "
        f"(default {COLLECTIVE_TIMEOUT_S:.0f}, NCCL's); rank 0 keeps the others in time while it waits for a "
        "shared GPU",
    )
    p.add_argument(
        "--attn-implementation",
        choices=ATTN_CHOICES,
        default="auto",
        help="the attention kernel (default auto: flash_attention_2 on CUDA in bf16/fp16 when the flash_attn "
        "package is installed, else sdpa); the choice is logged at start",
    )


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    """The worker around each step: a GPU shared with vLLM, the versions kept, the adapter files recorded."""
    p.add_argument(
        "--share-gpu",
        action="store_true",
        help="the GPU is vLLM's too: each step waits until the proxy (tracetrain serve --share-gpu) has put vLLM to "
        "sleep, and gives the GPU back after recording its adapter",
    )
    p.add_argument(
        "--turn-discount",
        type=float,
        default=1.0,
        metavar="G",
        help="a call's reward counts for the calls before it discounted by G per call (0 to 1; a policy's own "
        "turn_discount overrides it); the trajectory's reward counts fully for every call (docs/TRAINING.md)",
    )
    p.add_argument(
        "--keep-versions",
        type=_at_least_one,
        default=3,
        metavar="K",
        help="keep the files of the newest K versions (plus the served one, every published one and the regression "
        "guard's last kept one); older versions are pruned: their directories and stored files deleted, their rows "
        "and metrics kept. optimizer.pt is kept for the newest version only (default 3)",
    )
    p.add_argument(
        "--adapter-files",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="record each adapter's files in the store, for a vLLM that cannot see this disk (tracetrain_vllm's "
        "resolver); --no-adapter-files when vLLM loads adapters by path (default: record them)",
    )


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    """Where the run's metrics go besides the store: TensorBoard, W&B, MLflow (docs/OBSERVABILITY.md)."""
    p.add_argument(
        "--log-to",
        type=_backends,
        default=(),
        metavar="BACKENDS",
        help="also log each step's metrics, the run's configuration and the posted evaluations to these, "
        "comma-separated: tensorboard (into --log-dir), wandb (its own environment: WANDB_PROJECT, WANDB_MODE, "
        "...), mlflow (MLFLOW_TRACKING_URI, default sqlite:///LOG_DIR/mlflow.db; MLFLOW_EXPERIMENT_NAME)",
    )
    p.add_argument("--log-dir", type=Path, help="where runs go (default DATA_DIR/runs)")
    p.add_argument("--run-name", help="the run's name in every backend (default POLICY-YYYYmmdd-HHMMSS)")
    p.add_argument("--check-log-to", action="store_true",
                   help="check that every --log-to backend can start a run here (a writable directory, W&B's key "
                   "or offline mode, MLflow's URI answering), print what cannot and exit (1) or not (0); "
                   "tracetrain serve asks this before it starts anything")  # fmt: skip


def _backends(text: str) -> tuple[str, ...]:
    try:
        return parse_log_to(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--log-to: ")) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    group = Ranks.from_env()
    where = f" [rank {group.rank}]" if group is not None else ""
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s")
    try:
        config = train_config_from(args, args.config.read_text() if args.config else None)
    except (OSError, ValidationError) as exc:
        raise SystemExit(f"python -m trainer: bad training configuration: {exc}") from None
    if not (args.base_model / "config.json").is_file():
        raise SystemExit(f"python -m trainer: {args.base_model} is not a Hugging Face model directory")
    if args.procs < 1 or (args.procs > 1 and args.device not in ("cpu", "cuda")):
        raise SystemExit(f"python -m trainer: --procs {args.procs} with --device {args.device}: N is at least 1, "
                         "and several processes take --device cpu or cuda (rank k on cuda:LOCAL_RANK)")  # fmt: skip
    if not args.collective_timeout > 0:
        raise SystemExit(f"python -m trainer: --collective-timeout {args.collective_timeout}: seconds, more than 0")
    if args.shard and args.procs == 1 and not _distributed.under_torchrun():
        raise SystemExit("python -m trainer: --shard splits the model over the processes of --procs N (N > 1)")
    if args.check_log_to:
        return _check_log_to(args)
    if args.procs > 1 and not _distributed.under_torchrun():
        return _relaunch(args.procs, sys.argv[1:] if argv is None else argv)
    device = args.device
    if group is not None:
        try:
            device = _distributed.start(group, device, timeout_s=args.collective_timeout)
        except ValueError as exc:
            raise SystemExit(f"python -m trainer: {exc}") from None
    settings = WorkerSettings(
        database_url=args.database_url, data_dir=args.data_dir, policies=tuple(args.policy), base_model=args.base_model,
        config=config, init_adapter=args.init_adapter, device=device, share_gpu=args.share_gpu,
        shard=args.shard, attn_implementation=args.attn_implementation, collective_timeout_s=args.collective_timeout,
        keep_versions=args.keep_versions, adapter_files=args.adapter_files, turn_discount=args.turn_discount,
    )  # fmt: skip
    try:
        if group is not None and not group.leads:
            follow(settings)
        else:
            run_log = _run_log(args, settings)
            try:
                _lead(settings, group, once=args.once, run_log=run_log)
            finally:
                if run_log is not None:
                    run_log.close()
    finally:
        _distributed.finish()
    return 0


def _policy_name(text: str) -> str:
    if not re.fullmatch(POLICY_NAME_PATTERN, text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a policy is named by letters, digits, '_', '.' and '-', starting with a letter or digit"
        )
    return text


def _run_log(args: argparse.Namespace, settings: WorkerSettings) -> RunLogs | None:
    """The runs' loggers (``--log-to``), one run per policy trained, each started with the run's configuration;
    None without the flag. A backend that cannot start a run is reported and tried again while training goes on
    (``RunLog``): ``tracetrain serve`` checked the destinations before it started (``--check-log-to``)."""
    if not args.log_to:
        return None
    try:
        check_installed(args.log_to)
    except MissingExtra as exc:
        raise SystemExit(f"python -m trainer: {exc}") from None
    several = len(settings.policies) != 1

    def open_run(policy: str) -> RunLog:
        config = {"policy": policy, "base_model": str(settings.base_model), "device": settings.device,
                  "procs": args.procs, "shard": settings.shard, "train": settings.config.to_dict()}  # fmt: skip
        name = f"{args.run_name}-{policy}" if args.run_name and several else args.run_name
        return RunLog.open(args.log_to, args.log_dir or settings.data_dir / "runs", name or default_run_name(policy),
                           config)  # fmt: skip

    return RunLogs(open_run)


def _check_log_to(args: argparse.Namespace) -> int:
    """``--check-log-to``: 0 when every backend can start a run, else 1 with what to do, one line each."""
    problems = check_destinations(args.log_to, args.log_dir or args.data_dir / "runs")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("keep at least the newest version (1 or more)")
    return value


def _lead(settings: WorkerSettings, group: Ranks | None, *, once: bool, run_log: RunLogs | None = None) -> None:
    async def run() -> None:
        worker = await Worker.open(settings, group, run_log)
        try:
            await worker.prepare()
            await worker.run(once=once)
        finally:
            await worker.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


def _relaunch(procs: int, argv: Sequence[str]) -> NoReturn:
    """Become torchrun running this command on ``procs`` processes (same pid: a supervisor still holds it)."""
    command, env = _distributed.torchrun_command(procs, argv, os.environ)
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    sys.exit(main())
