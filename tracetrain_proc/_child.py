"""A command run as a child process group, its output appended to a log file.

`tracetrain serve` runs vLLM and the trainer worker this way. Each child gets its own
process group (vLLM forks an engine core and workers), so `stop()` reaches all of it,
and a Ctrl-C in the terminal reaches only the supervisor, which then stops its
children in order. On Linux a child is also sent SIGTERM when its parent dies, however
it dies: a supervisor killed with SIGKILL leaves no vLLM behind holding 3 GB.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["ChildExited", "ChildProcess"]

_LOG_TAIL_LINES = 40


class ChildExited(RuntimeError):
    """The child exited while something waited for it; the message ends with its log tail."""


class ChildProcess:
    """`argv` run with `env`, stdout and stderr appended to `log_path`.

    `start()` returns at once; `returncode` is None while it runs; `stop()` is idempotent.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self._popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_offset = 0  # where this start's output begins in the log

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def returncode(self) -> int | None:
        """None while running (or before start), else the exit status."""
        return None if self._popen is None else self._popen.poll()

    def start(self) -> None:
        """Spawn the command; its output is appended to `log_path`."""
        if self._popen is not None:
            raise RuntimeError(f"this {self.name} process was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.argv}\n".encode())
        self._log.flush()
        self._log_offset = self._log.tell()
        try:
            self._popen = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches its children too
                preexec_fn=_DIE_WITH_PARENT,
            )
        except OSError:
            self._log.close()
            self._log = None
            raise

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until the child exits (`subprocess.TimeoutExpired` after `timeout_s`); its status."""
        if self._popen is None:
            raise RuntimeError(f"wait() called before start() of {self.name}")
        return self._popen.wait(timeout=timeout_s)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, wait up to `grace_s`, then SIGKILL what is left.

        Returns the exit status (None if it was never started).
        """
        popen = self._popen
        if popen is None:
            return None
        if popen.poll() is None:
            _signal_group(popen.pid, signal.SIGTERM)
            try:
                popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(popen.pid, signal.SIGKILL)
                popen.wait()
        # A grandchild (vLLM's engine core) may outlive the leader; it is in the same group.
        _signal_group(popen.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return popen.returncode

    async def wait_for_output(self, text: str, timeout_s: float, *, poll_interval_s: float = 0.5) -> None:
        """Wait until this start of the child has written `text` to its log.

        Raises `ChildExited` if it exits first and `TimeoutError` when `timeout_s` passes.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                if text.encode() in log.read():
                    return
            if (code := self.returncode) is not None:
                raise ChildExited(f"{self.name} exited with status {code}; last lines of {self.log_path}:\n"
                                  f"{self.log_tail()}")  # fmt: skip
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} did not say {text!r} within {timeout_s:.0f} s; see {self.log_path}")
            await asyncio.sleep(poll_interval_s)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the log."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 64 * 1024))
                data = log.read()
        except FileNotFoundError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook asking Linux to SIGTERM the child when its parent dies (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl  # loaded before any fork
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return hook


_DIE_WITH_PARENT = _die_with_parent()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
