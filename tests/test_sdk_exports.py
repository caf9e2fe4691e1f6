"""`import tracetrain` is a small, pinned, light public face."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tracetrain

EXPECTED_EXPORTS = [
    "APIConnectionError",
    "APIError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "Call",
    "Client",
    "Group",
    "NotFoundError",
    "Page",
    "Reward",
    "RewardIn",
    "RewardLike",
    "TracetrainError",
    "Trajectory",
    "TrajectorySummary",
    "new_trajectory_id",
    "trajectory_headers",
]

# Server-side or heavy packages a user of the thin client must never pay for.
FORBIDDEN_IMPORTS = {"torch", "vllm", "fastapi", "starlette", "sqlmodel", "transformers", "proxy", "trainer"}


def test_public_names_are_pinned() -> None:
    assert tracetrain.__all__ == EXPECTED_EXPORTS


def test_every_public_name_is_defined_and_documented() -> None:
    for name in tracetrain.__all__:
        member = getattr(tracetrain, name)
        if name != "RewardLike":  # a type alias carries no docstring of its own
            assert member.__doc__, f"{name} has no docstring"


def test_import_loads_no_server_or_training_packages() -> None:
    sdk_root = str(Path(tracetrain.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([sdk_root, os.environ.get("PYTHONPATH", "")])}
    script = "import json, sys, tracetrain; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env, cwd=sdk_root
    )
    top_level = {name.partition(".")[0] for name in json.loads(result.stdout)}
    assert "tracetrain" in top_level
    assert "httpx" in top_level
    assert top_level.isdisjoint(FORBIDDEN_IMPORTS), sorted(top_level & FORBIDDEN_IMPORTS)
