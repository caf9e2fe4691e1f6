"""One judge for both sides of bench/learning.py: every adapter measured the same way, after the runs.

A vLLM server (the demo's launch: float32, LoRA on, `--block-size 32`) loads each adapter in
turn through `/v1/load_lora_adapter`; the demo's own agent runs on every held-out request
against it (OPENAI_BASE_URL points at vLLM itself, no proxy) and the demo's checker scores the
replies. The base model is measured once. Nothing here counts toward either side's minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from _host import free_port

from tracetrain_cli import VLLMLaunch, VLLMProcess
from tracetrain_demo.tasks import TASKS

REPO = Path(__file__).resolve().parents[2]


class Judge:
    """A vLLM server and the held-out agent; ``success(name, adapter)`` is the held-out success rate."""

    def __init__(self, model_dir: Path, work: Path, attempts: int, task: str = "city") -> None:
        self._work, self._attempts, self._task = work, attempts, task
        # The task's serve arguments name vLLM's (the tool task's chat template); hermes parses tool calls.
        extra = tuple(a.removeprefix("--vllm-arg=") for a in TASKS[task].serve_args if a.startswith("--vllm-arg="))
        launch = VLLMLaunch(model=str(model_dir), port=free_port(), data_dir=work, served_model_name="base",
                            dtype="float32", tool_call_parser="hermes", extra_args=extra)  # fmt: skip
        self._vllm = VLLMProcess(launch)
        self._seen: dict[str, float] = {}

    def __enter__(self) -> Judge:
        self._vllm.start()
        self._vllm.wait_ready(timeout_s=600)
        return self

    def __exit__(self, *_: object) -> None:
        self._vllm.stop()

    def success(self, name: str, adapter: Path | None) -> float:
        """Held-out success of the base model (adapter None) or of the base with this LoRA adapter."""
        key = str(adapter)
        if key in self._seen:
            return self._seen[key]
        model = "base"
        if adapter is not None:
            model = name
            response = httpx.post(f"{self._vllm.base_url}/load_lora_adapter",
                                  json={"lora_name": name, "lora_path": str(adapter)}, timeout=120)  # fmt: skip
            response.raise_for_status()
        try:
            self._seen[key] = self._run_agent(model)
        finally:
            if adapter is not None:
                httpx.post(f"{self._vllm.base_url}/unload_lora_adapter", json={"lora_name": name}, timeout=120)
        return self._seen[key]

    def _run_agent(self, model: str) -> float:
        log = self._work / f"eval-{model}.jsonl"
        env = {**os.environ, "OPENAI_BASE_URL": self._vllm.base_url, "OPENAI_API_KEY": "unused",
               "PYTHONPATH": str(REPO)}  # fmt: skip
        command = [sys.executable, "-m", "tracetrain_demo.agent", "--task", self._task, "--split", "held-out",
                   "--model", model,
                   "--attempts", str(self._attempts), "--tag", f"eval-{model}"]  # fmt: skip
        with log.open("w") as out:
            subprocess.run(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=True)
        episodes = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        wins = [TASKS[self._task].score_episode(e).success for e in episodes]
        return sum(wins) / max(1, len(wins))
