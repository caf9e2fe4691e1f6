"""``tracetrain demo``'s command line: its flags (each read from ``TRACETRAIN_<FLAG>`` too) and their checks."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tracetrain_core import SourceError, apply_sources
from tracetrain_demo.tasks import TASKS

# serve's --turn-discount with --call-rewards (the flag's help says why 0).
DEFAULT_TURN_DISCOUNT = 0.0


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        apply_sources(p, argv, os.environ)  # TRACETRAIN_<FLAG> under the flags, as for every command
    except SourceError as exc:
        p.error(str(exc))
    args = p.parse_args(argv)
    args.tasks = [task.strip() for task in args.task.split(",") if task.strip()]
    unknown = [task for task in args.tasks if task not in TASKS]
    if not args.tasks or unknown or len(set(args.tasks)) != len(args.tasks):
        p.error(f"--task {args.task}: name each of {', '.join(sorted(TASKS))} at most once, comma-separated")
    if args.call_rewards and not any(TASKS[task].score_calls for task in args.tasks):
        p.error(f"--call-rewards: the {args.task} task's checker judges whole attempts only (lookup, agents-sdk)")
    if args.turn_discount is not None and not (args.call_rewards and 0 <= args.turn_discount <= 1):
        p.error("--turn-discount G weighs call rewards: give --call-rewards too, and G from 0 to 1")
    if args.call_rewards and args.turn_discount is None:
        args.turn_discount = DEFAULT_TURN_DISCOUNT
    if args.structured and args.tasks != ["city"]:
        p.error("--structured is the city task's (--task city): the tool tasks constrain their first call already")
    return args


def parser() -> argparse.ArgumentParser:
    """``tracetrain demo``'s flags."""
    p = argparse.ArgumentParser(
        prog="tracetrain demo",
        description="An unmodified agent gets better at its task while it runs. Starts tracetrain serve on "
        "DATA_DIR/demo (unless --url), a reward service and the agent; trains until --steps or --minutes; prints "
        "a per-step table, held-out success before, during (--eval-every) and after, and how busy sampling and "
        "training were; writes reward-curve.png and results.json.",
    )
    p.add_argument(
        "--data-dir", type=Path, default=Path(".tracetrain"), help="models and the demo run (default .tracetrain)"
    )
    p.add_argument("--port", type=int, default=8100, help="the proxy's port (default 8100; vLLM uses the next one)")
    p.add_argument("--url", help="use a tracetrain serve already running at this root URL instead of starting one")
    p.add_argument("--steps", type=int, default=60, help="stop after this many training steps (default 60)")
    p.add_argument("--minutes", type=float,
                   help="or after this many minutes of training (default: the task's, sized so the demo ends within "
                   "6 minutes for city, 12 for lookup, 15 for agents-sdk on a 2-core CPU with bf16 units; with "
                   "several tasks, the longest)")  # fmt: skip
    p.add_argument("--questions", type=int, default=4, help="requests per round = groups per step (default 4)")
    p.add_argument("--attempts", type=int, default=8, help="attempts per request = group size (default 8)")
    p.add_argument(
        "--eval-attempts",
        type=int,
        default=2,
        help="attempts per held-out request (default 2: 100 requests x 2, a standard error of at "
        "most 3.5 points; 0: no held-out evaluation, as bench/learning.py measures them itself)",
    )
    p.add_argument(
        "--eval-every",
        type=float,
        help="measure the version serving on the held-out requests every this many minutes, beside training "
        "(0: only before and after; default: the task's, 3 for city and agents-sdk, 0 for lookup, whose 200 "
        "two-call attempts take vLLM about 3 minutes each time)",
    )
    p.add_argument(
        "--task",
        default="city",
        metavar="TASK[,TASK]",
        help="city (default): one call, name the destination as JSON; lookup: look the hotel up with a function "
        "tool, then answer (2+ calls); agents-sdk: the same lookup by an OpenAI Agents SDK agent (Runner.run "
        "through /v1/responses); city,lookup: both at once, as two policies named after them (an agent each, "
        "one vLLM and one trainer for both; --steps and --questions are per policy)",
    )
    p.add_argument(
        "--canary",
        type=float,
        metavar="FRACTION",
        help="try each new version on this share of new trajectories before it serves them all (serve --canary; "
        "default: a new version serves everything at once)",
    )
    p.add_argument(
        "--call-rewards",
        action="store_true",
        help="the reward service also rewards each find_hotel call on its own (1 when it named the destination, "
        "else 0) beside the attempt's reward (lookup and agents-sdk; docs/TRAINING.md, call rewards)",
    )
    p.add_argument(
        "--turn-discount",
        type=float,
        metavar="G",
        help="serve's --turn-discount with --call-rewards: how much a call's reward counts for the calls before it "
        "(default 0: a find_hotel call's reward judges the city it chose, which no earlier call chose; the "
        "answer's credit reaches every call undiscounted through the attempt's reward). With --url, give it to "
        "that serve instead",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="the agent's sampling temperature (default 0.7)")
    p.add_argument(
        "--structured",
        action="store_true",
        help="the city task's agent asks for its JSON answer with response_format json_schema: vLLM samples it "
        "under the schema's grammar, and the trainer scores it under the same one (docs/TRAINING.md)",
    )
    p.add_argument("--learning-rate", type=float, default=3e-4, help="the LoRA's AdamW learning rate (default 3e-4)")
    p.add_argument(
        "--sampler-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="vLLM's dtype (serve --sampler-dtype). auto (default): bfloat16 on a CPU with bf16 units (avx512_bf16, "
        "amx_bf16: about twice the tokens per second), else the trainer's (with several tasks: bfloat16 only if "
        "every one gains by it)",
    )
    p.add_argument(
        "--trainer-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the trainer's (TrainConfig.dtype; bfloat16 on a CPU: float32 weights under bf16 autocast). auto "
        "(default): bfloat16 for the tool tasks on a CPU with bf16 units (their steps train twice as fast), else "
        "float32 (with several tasks: bfloat16 only if every one gains by it; one trainer trains them all)",
    )
    p.add_argument(
        "--log-to",
        metavar="BACKENDS",
        help="serve's --log-to: the trainer also logs each step and each held-out evaluation to tensorboard "
        "(DATA_DIR/demo/runs), wandb or mlflow, comma-separated (docs/OBSERVABILITY.md)",
    )
    p.add_argument(
        "--sampler-correction",
        choices=["auto", "none", "tis", "mis"],
        help="the trainer's correction for a sampler/learner gap (default: the task's; city: auto, tis where the "
        "dtypes differ; lookup and agents-sdk: tis, as their first call is constrained)",
    )
    return p
