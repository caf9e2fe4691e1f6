"""The parent's side: each contender in a process of its own, so that its peak RSS and CPU are its own."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _host import machine_busy_seconds

from .config import REPO

SCRIPT = REPO / "bench" / "train_step.py"


def run_child(work: Path, opts: argparse.Namespace, role: str, name: str, extra: list[str]) -> dict[str, Any] | None:
    argv = [sys.executable, str(SCRIPT), "--role", role, "--role-name", name, "--work", str(work),
            "--samples", str(opts.samples), "--prompt", str(opts.prompt), "--completion", str(opts.completion),
            "--steps", str(opts.steps), "--seed", str(opts.seed), "--group-size", str(opts.group_size),
            *extra]  # fmt: skip
    if opts.model_dir:
        argv += ["--model-dir", opts.model_dir]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
    log = work / f"{name}.log"
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before, start = machine_busy_seconds(), time.perf_counter()
    with log.open("w") as stderr:
        rc = subprocess.call(argv, cwd=REPO, env=env, stdout=stderr, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (children.ru_utime + children.ru_stime) - (children_before.ru_utime + children_before.ru_stime)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"{name} failed (exit {rc}); the end of {log}:\n{tail}")
    path = work / f"{name}.json"
    if not path.exists():
        return None
    result: dict[str, Any] = json.loads(path.read_text())
    # CPU the rest of the machine used meanwhile, in cores: near 0 on a quiet machine.
    result["other_cpu_cores"] = max(0.0, (machine_busy_seconds() - busy_before - own) / wall)
    result["process_cpu_cores"] = own / wall
    return result
