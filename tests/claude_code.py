"""Running Claude Code (``claude -p``) against a proxy, offline: what the Messages tests share.

Claude Code is configured only by its environment: the proxy's URL and a key, every model
alias set to the policy, and all its own traffic (telemetry, error reports, updates) off, so
it talks to loopback alone. Its home and config live in a temporary directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CLAUDE = shutil.which("claude")
needs_claude = pytest.mark.skipif(
    CLAUDE is None, reason="Claude Code is not installed (npm install -g @anthropic-ai/claude-code)"
)


def claude_env(base_url: str, api_key: str, home: Path, max_output_tokens: int | None = None) -> dict[str, str]:
    """The environment that points Claude Code at the proxy (also docs/APIS.md's configuration)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "ANTHROPIC_MODEL": "agent",
        "ANTHROPIC_SMALL_FAST_MODEL": "agent",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "agent",
        "ANTHROPIC_DEFAULT_SONNET_MODEL": "agent",
        "ANTHROPIC_DEFAULT_OPUS_MODEL": "agent",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    if max_output_tokens is not None:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output_tokens)
    return env


# What Claude Code prints, exiting 1, when an answer stops at max_tokens (a random tiny model never ends its turn).
MAX_TOKENS_ERROR = "output token maximum"


def run_claude(
    prompt: str, env: dict[str, str], cwd: Path, *args: str, timeout_s: float = 240, cut_off_ok: bool = False,
    expect_failure: bool = False,
) -> str:  # fmt: skip
    """``claude -p prompt``'s printed answer; a failure shows what it said.

    ``cut_off_ok``: an answer cut at max_tokens, which Claude Code reports as an API error, is no failure.
    ``expect_failure``: Claude Code must exit 1; what it printed is returned.
    """
    assert CLAUDE is not None
    done = subprocess.run(
        [CLAUDE, "-p", prompt, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if expect_failure:
        assert done.returncode == 1, f"claude exited {done.returncode}: {done.stdout[-2000:]}"
        return done.stdout + done.stderr
    cut_off = cut_off_ok and done.returncode == 1 and MAX_TOKENS_ERROR in done.stdout
    assert done.returncode == 0 or cut_off, (
        f"claude exited {done.returncode}: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    )
    return done.stdout
