"""The processes under test: the fake vLLM, ``tracetrain serve`` and LiteLLM's proxy in front of it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from _host import free_port, machine_busy_seconds, wait_http

from .options import TRACETRAIN_APIS

REPO = Path(__file__).resolve().parents[2]
BASE_MODEL = "fake/base-model"
POLICY = "agent"
HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Server:
    """One running target: where it listens, the model name it serves, its process."""

    name: str
    port: int
    model: str
    proc: subprocess.Popen[bytes]
    log: Path
    api: str = "chat"  # what bench/wrk/chat.lua and the probes send: "chat", "responses" or "messages"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def tool(name: str) -> str:
    """A console script of the running interpreter's environment (the project's .venv)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: run this with the project's .venv (make bench-proxy)")
    return found


@contextlib.contextmanager
def _process(
    argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = REPO
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` in its own process group (in ``cwd``); stop the whole group on exit, whatever happens."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        for sig, grace_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
                break


def _litellm_config(workdir: Path, upstream_port: int) -> Path:
    path = workdir / "litellm.yaml"
    path.write_text(
        f"model_list:\n  - model_name: {POLICY}\n    litellm_params:\n      model: openai/{BASE_MODEL}\n"
        f"      api_base: http://{HOST}:{upstream_port}/v1\n      api_key: unused\n"
    )
    return path


def start_servers(
    stack: contextlib.ExitStack, targets: Sequence[str], workdir: Path, upstreams: int = 1, observe: bool = False
) -> dict[str, Server]:
    """Start the fake upstream and the proxies the run needs, each answering before this returns.

    ``upstreams`` > 1 starts more fakes ("upstream2", ...) that only tracetrain routes to.
    ``observe``: tracetrain also exports to Langfuse (the local collector) with ``--langfuse``.
    The target "exporting" is a second ``tracetrain serve`` exporting every call with ``--otlp-endpoint``
    and ``--langfuse`` to a collector on loopback (``tests/otlp_receiver.py``, its own process, which
    decodes and counts the spans: server "collector").
    """

    def start(name: str, argv: list[str], ready_path: str, model: str, env: dict[str, str] | None = None) -> Server:
        port, log = free_port(HOST), workdir / f"{name}.log"
        proc = stack.enter_context(_process([*argv, "--host", HOST, "--port", str(port)], log, env))
        wait_http(f"http://{HOST}:{port}{ready_path}", proc, log)
        return Server(name, port, model, proc, log)

    fake = start("direct", [sys.executable, "tests/fake_vllm.py"], "/v1/models", BASE_MODEL)
    servers = {"direct": fake}
    upstream = f"{fake.url}/v1"
    more = [start(f"upstream{i}", [sys.executable, "tests/fake_vllm.py"], "/v1/models", BASE_MODEL)
            for i in range(2, upstreams + 1)]  # fmt: skip
    servers |= {server.name: server for server in more}
    exporting: dict[str, str] | None = None  # the environment of a tracetrain that exports
    if "exporting" in targets or observe:
        collector = start("collector", [sys.executable, "tests/otlp_receiver.py"], "/count", "")
        servers["collector"] = collector
        exporting = {**os.environ, "LANGFUSE_PUBLIC_KEY": "pk-lf-bench", "LANGFUSE_SECRET_KEY": "sk-lf-bench",
                     "LANGFUSE_BASE_URL": collector.url}  # fmt: skip

    def serve(name: str, exports: list[str], env: dict[str, str] | None) -> Server:
        argv = [tool("tracetrain"), "serve", "--upstream", upstream, "--data-dir", str(workdir / name)]
        argv += [arg for server in more for arg in ("--upstream", f"{server.url}/v1")]
        return start(name, [*argv, "--no-train", "--log-level", "warning", *exports], "/readyz", POLICY, env)

    if set(targets) & {"tracetrain", "responses", "messages"}:
        servers["tracetrain"] = serve("tracetrain", ["--langfuse"] if observe else [], exporting)
        for name in ("responses", "messages"):  # the same process, another API
            if name in targets:
                servers[name] = dataclasses.replace(servers["tracetrain"], name=name, api=TRACETRAIN_APIS[name])
    if "exporting" in targets:
        exports = ["--otlp-endpoint", servers["collector"].url, "--langfuse"]
        servers["exporting"] = serve("exporting", exports, exporting)
    if "litellm" in targets:
        quiet = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "DISABLE_ADMIN_UI": "True", "LITELLM_LOG": "ERROR"}
        config = str(_litellm_config(workdir, fake.port))
        argv = [tool("litellm"), "--config", config, "--num_workers", "1", "--telemetry", "False"]
        servers["litellm"] = start("litellm", argv, "/health/liveliness", POLICY, {**os.environ, **quiet})
    return servers


def litellm_setup_notes(server: Server) -> list[str]:
    """What in LiteLLM's start-up could tilt the comparison: debug logging, the callbacks it runs."""
    notes = []
    if re.search(r"\bDEBUG\b", server.log.read_text(errors="replace")):
        notes.append("LiteLLM logged DEBUG lines at start-up")
    with urllib.request.urlopen(server.url + "/active/callbacks", timeout=5) as response:
        active = json.loads(response.read()).get("all_litellm_callbacks", [])
    names = sorted({re.sub(r"^<(?:bound method )?([\w.]+).*", r"\1", c).rsplit(".", 1)[-1] for c in active})
    notes.append(f"LiteLLM runs its proxy's built-in hooks only (none configured): {', '.join(names)}")
    return notes


def children(pid: int) -> list[int]:
    """The processes ``pid`` started, as the kernel lists them for each of its threads."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, all its threads (finished ones included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(servers: Sequence[Server], window_s: float = 0.3, limit_s: float = 20.0) -> None:
    """Wait until each server is idle (< 5% of a CPU: its left-over work is done) and the whole
    machine nearly so (< 15%: no other job running), for at most ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = [cpu_seconds(s.proc.pid) for s in servers], machine_busy_seconds()
        time.sleep(window_s)
        after = [cpu_seconds(s.proc.pid) for s in servers], machine_busy_seconds()
        idle = all(b - a <= 0.05 * window_s for a, b in zip(before[0], after[0], strict=True))
        if idle and after[1] - before[1] <= 0.15 * window_s:
            return
