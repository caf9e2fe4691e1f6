"""The processes under test and the faults done to them: vLLM killed and started again, the disk filled.

The fake vLLM (``_chaos/fake.py``) and ``tracetrain serve`` each run in a process group of their own.
The fake's URL carries a user and a password (the fake ignores them), so that the run can look for
the password wherever the proxy shows, logs or stores anything. The proxy's data directory is a
size-limited tmpfs (root only: elsewhere the full-disk fault is skipped and says so); the disk is
filled the way ``tests/test_full_disk.py`` fills it, with a file written until ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from _host import free_port, wait_http

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
PASSWORD = "chaos-pw-5b3e9d"


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as sink:
        return subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace_s: float = 15.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@dataclass
class Upstream:
    """The fake vLLM on a fixed port, so that it can be killed and started again where the proxy looks."""

    port: int
    log: Path
    token_delay_s: float
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://bench:{PASSWORD}@{HOST}:{self.port}/v1"

    def start(self) -> None:
        argv = [sys.executable, "bench/_chaos/fake.py", "--port", str(self.port), "--token-delay",
                str(self.token_delay_s)]  # fmt: skip
        self.proc = _start(argv, self.log)
        wait_http(f"http://{HOST}:{self.port}/health", self.proc, self.log)

    def kill(self) -> None:
        """SIGKILL: what a crash (or the OOM killer) does; streams in flight are cut."""
        if self.proc is not None:
            _stop(self.proc, signal.SIGKILL)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None


@dataclass
class Proxy:
    proc: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


@contextlib.contextmanager
def proxy(upstream: Upstream, data_dir: Path, log: Path, seat_timeout_s: float) -> Iterator[Proxy]:
    """``tracetrain serve`` in front of ``upstream``: capture on, no trainer, the defaults otherwise."""
    port = free_port(HOST)
    tracetrain = Path(sys.executable).parent / "tracetrain"
    argv = [str(tracetrain), "serve", "--upstream", upstream.url, "--data-dir", str(data_dir), "--port", str(port),
            "--no-train", "--log-level", "warning", "--seat-timeout", str(seat_timeout_s)]  # fmt: skip
    proc = _start(argv, log)
    try:
        wait_http(f"http://{HOST}:{port}/readyz", proc, log)
        yield Proxy(proc, port, data_dir, log)
    finally:
        _stop(proc, grace_s=40)


@contextlib.contextmanager
def small_disk(where: Path, size_mb: int) -> Iterator[Path | None]:
    """A tmpfs of ``size_mb`` MiB mounted at ``where``; None (and ``where`` a plain directory) where mounting is
    refused."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
                          capture_output=True, check=False)  # fmt: skip
    if done.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> Path:
    """Write a file until the filesystem refuses (ENOSPC); delete it to free the space."""
    filler = disk / "filler"
    chunk = b"\0" * (1 << 20)
    with filler.open("wb", buffering=0) as f:
        for size in (1 << 20, 65536, 512):
            chunk = b"\0" * size
            try:
                while True:
                    f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return filler
