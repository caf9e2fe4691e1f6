"""What the bench scripts ask of this machine: a free port, a server that answers, busy CPU time."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_http(
    url: str, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None, timeout_s: float = 90.0
) -> None:
    """Poll ``url`` until it answers 200; fail with the server's log if ``proc`` dies or it never answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited ({proc.returncode}){_log_tail(log)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s{_log_tail(log)}")


def _log_tail(log: Path | None) -> str:
    return ":\n" + log.read_text()[-3000:] if log is not None else ""


def machine_busy_seconds() -> float:
    """CPU time all cores spent busy since boot (``/proc/stat``), in seconds."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
