"""The ``tracetrain`` command line.

tracetrain serve                                         vLLM + proxy + trainer on the default model
tracetrain serve --upstream http://127.0.0.1:8000/v1     proxy an existing vLLM
tracetrain model pull                                    fetch the default model, print its directory
tracetrain demo                                          the end-to-end demo (starts serve itself)
tracetrain export --min-reward 0.5 -o best.parquet       captured trajectories as a dataset (JSONL or Parquet)
tracetrain sft --min-reward 0.8                          a LoRA warm start from the best trajectories (TRL SFT)
tracetrain db current | upgrade                          the store's schema revision; bring it to this release's
tracetrain config docs                                   every command's settings (docs/CONFIGURATION.md)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tracetrain_cli._config import apply
from tracetrain_cli._config_docs import add_config_parser, run_config_docs
from tracetrain_cli._data_commands import add_export_parser, add_sft_parser, run_export, run_sft
from tracetrain_cli._db_commands import add_db_parser, run_db
from tracetrain_cli._models import add_model_parser, missing_modules, run_model_pull
from tracetrain_cli._serve_command import run_serve
from tracetrain_cli._serve_flags import add_serve_parser

_DESCRIPTION = """\
tracetrain: point an unmodified agent's OPENAI_BASE_URL at this proxy; every call is
forwarded to vLLM and recorded into a trajectory, rewards POSTed to /v1/rewards train
the policy's LoRA with GRPO.
"""


def _demo(argv: Sequence[str]) -> int:
    missing = missing_modules(("torch", "peft", "openai", "matplotlib", "psutil", "vllm"))
    if missing:
        raise SystemExit(
            f"tracetrain demo: needs the serving and training extras ({', '.join(missing)} not installed): "
            "pip install 'tracetrain[demo]' (make demo does this in .venv)"
        )
    from tracetrain_demo.run import main as demo_main

    return demo_main(argv)


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser (``demo`` has its own, ``tracetrain_demo.run.parser``)."""
    parser = argparse.ArgumentParser(prog="tracetrain", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_parser = add_serve_parser(sub)
    serve_parser.set_defaults(parser=serve_parser)  # --print-config lists its flags
    model_parser = add_model_parser(sub)
    model_parser.set_defaults(help_of=model_parser)
    add_export_parser(sub)
    add_sft_parser(sub)
    db_parser = add_db_parser(sub)
    db_parser.set_defaults(help_of=db_parser)
    config_parser = add_config_parser(sub)
    config_parser.set_defaults(help_of=config_parser)
    sub.add_parser(
        "demo",
        help="the end-to-end demo: an agent learns its task while it runs (make demo)",
        add_help=False,  # `tracetrain demo --help` is the demo's own
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    parser = build_parser()
    origins = apply(parser, argv, os.environ)  # TRACETRAIN_<FLAG> and serve's --config under the flags
    args = parser.parse_args(argv)
    args.origins = origins
    if args.command == "serve":
        return run_serve(args)
    if args.command == "model":
        if args.model_command == "pull":
            return run_model_pull(args)
        args.help_of.print_help()
        return 2
    if args.command == "export":
        return run_export(args)
    if args.command == "sft":
        return run_sft(args)
    if args.command == "config":
        if args.config_command != "docs":
            args.help_of.print_help()
            return 2
        return run_config_docs(parser)
    if args.command == "db":
        if args.db_command is None:
            args.help_of.print_help()
            return 2
        return run_db(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
