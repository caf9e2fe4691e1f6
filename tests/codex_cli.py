"""Running the Codex CLI (``codex exec``) against a proxy, offline: what the Responses tests share.

Codex is configured only by its own config file (``$CODEX_HOME/config.toml``): a model provider
whose ``base_url`` is the proxy and whose wire API is the Responses API, the policy as its model;
nothing else (its hosted web search and its sub-agent ``namespace`` tool stay on: the proxy leaves
them out with a note). Its home lives in a temporary directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CODEX = shutil.which("codex")
needs_codex = pytest.mark.skipif(CODEX is None, reason="the Codex CLI is not installed (npm install -g @openai/codex)")


def codex_config(base_url: str) -> str:
    """The config.toml that points Codex at the proxy (also docs/APIS.md's configuration)."""
    return f'''model = "agent"
model_provider = "tracetrain"

[model_providers.tracetrain]
name = "tracetrain"
base_url = "{base_url}"
env_key = "TRACETRAIN_API_KEY"
wire_api = "responses"
'''


def run_codex(
    prompt: str, base_url: str, home: Path, cwd: Path, *args: str, timeout_s: float = 240, check: bool = True
) -> str:
    """``codex exec prompt``'s output (its answer last); ``check``: a failure shows what it said."""
    assert CODEX is not None
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(codex_config(base_url))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "CODEX_HOME": str(home),
           "TRACETRAIN_API_KEY": "unused"}  # fmt: skip
    argv = [CODEX, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", *args, prompt]
    done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout_s, check=False)  # fmt: skip
    assert done.returncode == 0 or not check, (
        f"codex exited {done.returncode}: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    )
    return done.stdout + done.stderr
