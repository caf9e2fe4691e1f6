"""``tracetrain demo``: an unmodified agent gets better at its task while it runs.

    tracetrain serve (vLLM + proxy + trainer)  <-- agent (plain OpenAI client, OPENAI_BASE_URL)
          ^  POST /v1/rewards                       | POST /finished
          +---------- reward service <--------------+

1. Pull the default model and start ``tracetrain serve`` on a fresh demo directory
   (DATA_DIR/demo; the compile cache is kept between runs).
2. Start the reward service; measure held-out success of ``agent@0`` (the base model)
   beside the first round.
3. Run the agent on the training requests, round after round. Each round's groups are
   rewarded, trigger a training step, and the new adapter is hot-swapped in while the
   agent keeps asking ``agent``: later rounds are served by newer versions. vLLM samples
   the next round while the trainer trains the last (a round starts while at most one
   job is pending). Every --eval-every minutes the newest version is measured too.
4. After --steps steps or --minutes minutes, measure held-out success on the newest
   version, print the per-step table, how busy each side was, and write the plot
   (reward-curve.png) and the numbers (results.json) to DATA_DIR/demo.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the train extra

from tracetrain_demo.report import HEADER, HeldOut, Report, Step, busy_cpu_seconds, row, summary
from tracetrain_demo.tasks import TASKS, Scored, sampler_dtype
from tracetrain_proc import ChildProcess

_SERVE_READY = "ready: agents use OPENAI_BASE_URL"
# TrainConfig's defaults (docs/TRAINING.md says how they were chosen), except: on a CPU, packed rows
# near the sample length keep attention cheap.
_TRAIN_CONFIG = {"micro_batch_tokens": 1024}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    data_dir: Path = args.data_dir
    run_dir = data_dir / "demo"
    children: list[ChildProcess] = []
    try:
        url = args.url or _start_serve(args, data_dir, run_dir, children)
        args.admin_token = _admin_token(run_dir)
        rewards_port = _free_port()
        _start(children, ChildProcess("reward service", [sys.executable, "-m", "tracetrain_demo.reward_service",
               "--proxy", url, "--port", str(rewards_port), "--task", args.task], _env(url),
               run_dir / "logs" / "rewards.log"))  # fmt: skip
        report = Report()
        if args.eval_attempts:
            _say("measuring held-out success of agent@0 (the base model) while the first round samples")
        _train(url, run_dir, rewards_port, args, report, children)
        version = _active_version(url, args.admin_token)
        if args.eval_attempts:
            _say(f"measuring held-out success of agent@{version} ...")
            report.held_out.append(_Evaluation(url, run_dir, version, args.eval_attempts, args, children).result())
        report.seconds = time.monotonic() - started
        summary(report, run_dir)
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    finally:
        for child in reversed(children):
            child.stop(grace_s=60)  # serve drains its requests, then stops the trainer and vLLM
    return 0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tracetrain demo",
        description="An unmodified agent gets better at its task while it runs. Starts tracetrain serve on "
        "DATA_DIR/demo (unless --url), a reward service and the agent; trains until --steps or --minutes; prints "
        "a per-step table, held-out success before, during (--eval-every) and after, and how busy sampling and "
        "training were; writes reward-curve.png and results.json.",
    )
    p.add_argument(
        "--data-dir", type=Path, default=Path(".tracetrain"), help="models and the demo run (default .tracetrain)"
    )
    p.add_argument("--port", type=int, default=8100, help="the proxy's port (default 8100; vLLM uses the next one)")
    p.add_argument("--url", help="use a tracetrain serve already running at this root URL instead of starting one")
    p.add_argument("--steps", type=int, default=60, help="stop after this many training steps (default 60)")
    p.add_argument("--minutes", type=float, default=6.0, help="or after this many minutes of training (default 6)")
    p.add_argument("--questions", type=int, default=4, help="requests per round = groups per step (default 4)")
    p.add_argument("--attempts", type=int, default=8, help="attempts per request = group size (default 8)")
    p.add_argument(
        "--eval-attempts",
        type=int,
        default=2,
        help="attempts per held-out request (default 2: 100 requests x 2, a standard error of at "
        "most 3.5 points; 0: no held-out evaluation, as bench/learning.py measures them itself)",
    )
    p.add_argument(
        "--eval-every",
        type=float,
        default=3.0,
        help="measure the newest version on the held-out requests every this many minutes, beside "
        "training (default 3; 0: only before and after)",
    )
    p.add_argument(
        "--task",
        choices=sorted(TASKS),
        default="city",
        help="city (default): one call, name the "
        "destination as JSON; lookup: look the hotel up with a function tool, then answer (2+ calls)",
    )
    p.add_argument(
        "--canary",
        type=float,
        metavar="FRACTION",
        help="try each new version on this share of new trajectories before it serves them all (serve --canary; "
        "default: a new version serves everything at once)",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="the agent's sampling temperature (default 0.7)")
    p.add_argument("--learning-rate", type=float, default=3e-4, help="the LoRA's AdamW learning rate (default 3e-4)")
    p.add_argument(
        "--sampler-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="vLLM's dtype (serve --sampler-dtype). auto (default): bfloat16 for the city task on a CPU with bf16 "
        "units (avx512_bf16, amx_bf16: about twice the steps; the trainer stays in float32 and its loss corrects for "
        "the gap), else the trainer's, float32",
    )
    p.add_argument(
        "--sampler-correction",
        choices=["auto", "none", "tis", "mis"],
        help="the trainer's correction for a sampler/learner gap (default: the task's; city: auto, tis where the "
        "dtypes differ; lookup: tis, as its first call is constrained)",
    )
    return p.parse_args(argv)


def _start_serve(args: argparse.Namespace, data_dir: Path, run_dir: Path, children: list[ChildProcess]) -> str:
    model_dir = _pull_model(data_dir)
    for old in ("tracetrain.db", "tracetrain.db-wal", "tracetrain.db-shm", "adapters", "logs"):
        path = run_dir / old
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    sampler = sampler_dtype(TASKS[args.task], args.sampler_dtype)
    if args.sampler_dtype == "auto" and sampler:
        _say(f"vLLM samples in {sampler}: this CPU has bf16 units (--sampler-dtype float32 for the trainer's dtype)")
    config = run_dir / "train-config.json"
    config.write_text(json.dumps({**_TRAIN_CONFIG, "learning_rate": args.learning_rate,
                                  "sampler_correction": args.sampler_correction
                                  or TASKS[args.task].sampler_correction}))  # fmt: skip
    command = [
        sys.executable, "-m", "tracetrain_cli", "serve", "--model", str(model_dir), "--data-dir", str(run_dir),
        "--port", str(args.port), "--group-size", str(args.attempts), "--min-group-size", str(args.attempts),
        "--batch-groups", str(args.questions), f"--trainer-arg=--config={config}", *TASKS[args.task].serve_args,
        *([f"--sampler-dtype={sampler}"] if sampler else []), *([f"--canary={args.canary}"] if args.canary else []),
    ]  # fmt: skip
    serve = ChildProcess("tracetrain serve", command, dict(os.environ), run_dir / "logs" / "serve.log")
    _say(f"starting tracetrain serve on port {args.port} (vLLM on the CPU: ~1 min; log: {serve.log_path})")
    _start(children, serve)
    with tqdm(desc="starting", bar_format="{desc} ({elapsed})", leave=False) as spinner:

        async def ready() -> None:
            waiting = asyncio.create_task(serve.wait_for_output(_SERVE_READY, timeout_s=900))
            while not waiting.done():
                spinner.set_description_str(_last_status(serve.log_path), refresh=True)
                await asyncio.sleep(0.5)
            waiting.result()

        asyncio.run(ready())
    url = f"http://127.0.0.1:{args.port}"
    _say(f"tracetrain serve is ready: {url}/v1")
    if "TRACETRAIN_ADMIN_TOKEN" not in os.environ:
        _say(f"watch it at {url}/admin (log in with the admin token in {run_dir / 'admin-token'})")
    return url


def _admin_token(run_dir: Path) -> str:
    """The admin token serve uses: TRACETRAIN_ADMIN_TOKEN, else the one it made in DATA_DIR/demo/admin-token."""
    if token := os.environ.get("TRACETRAIN_ADMIN_TOKEN"):
        return token
    path = run_dir / "admin-token"
    if not path.is_file():
        raise SystemExit(
            f"tracetrain demo: no admin token for the dashboard API: set TRACETRAIN_ADMIN_TOKEN to the one the "
            f"tracetrain serve at --url uses (or run that serve with --data-dir {run_dir})"
        )
    return path.read_text().strip()


def _last_status(log: Path) -> str:
    """What serve said last, e.g. "starting vLLM", for the spinner."""
    said = [line for line in log.read_text(errors="replace").splitlines() if "tracetrain.serve: " in line]
    return said[-1].partition("tracetrain.serve: ")[2].split(" (")[0] if said else "starting"


def _pull_model(data_dir: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "trainer.pull", "--data-dir", str(data_dir)],
                          stdout=subprocess.PIPE, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit("tracetrain demo: could not pull the model (see above)")
    return Path(done.stdout.strip().splitlines()[-1])


class _Evaluation:
    """The agent on every held-out request, served by one version, in its own process.

    It runs beside training (vLLM batches its calls with the training round's), so measuring
    costs little wall time; only the last one waits for training to end.
    """

    def __init__(self, url: str, run_dir: Path, version: int, attempts: int, args: argparse.Namespace,
                 children: list[ChildProcess]) -> None:  # fmt: skip
        self.version, self.started = version, time.time()
        model = f"agent@{version}"
        tag = f"eval-agent-v{version}"
        command = [sys.executable, "-m", "tracetrain_demo.agent", "--task", args.task, "--split", "held-out",
                   "--model", model,
                   "--attempts", str(attempts), "--temperature", str(args.temperature), "--tag", tag]  # fmt: skip
        self._agent = ChildProcess("held-out agent", command, _env(url), run_dir / "logs" / f"{tag}.jsonl")
        self._children, self._task = children, args.task
        _start(children, self._agent)

    @property
    def done(self) -> bool:
        return self._agent.returncode is not None

    def result(self) -> HeldOut:
        """Wait for it; its success rate over every held-out attempt."""
        if self._agent.wait() != 0:
            raise SystemExit(f"tracetrain demo: the held-out evaluation of agent@{self.version} failed:\n"
                             f"{self._agent.log_tail()}")  # fmt: skip
        self._children.remove(self._agent)
        wins = [_score(self._task, e).success for e in _episodes(self._agent.log_path)]
        return HeldOut(self.version, sum(wins) / max(1, len(wins)), len(wins), self.started, time.time())


def _train(url: str, run_dir: Path, rewards_port: int, args: argparse.Namespace, report: Report,
           children: list[ChildProcess]) -> None:  # fmt: skip
    """Run the agent round after round while the steps train, and show each step as it lands.

    A new round starts when the last one ended and at most one training job is pending:
    on two cores vLLM samples the next round while the trainer trains on the last one,
    and the agent never runs ahead of training into stale, wasted samples. The base
    model's held-out evaluation runs beside the first round, and every --eval-every
    minutes the newest version's beside the rounds of the moment.
    """
    began, cpu_before = time.time(), busy_cpu_seconds()
    deadline = time.monotonic() + args.minutes * 60
    log = run_dir / "logs" / "agent-train.jsonl"
    evaluations = [_Evaluation(url, run_dir, 0, args.eval_attempts, args, children)] if args.eval_attempts else []
    next_eval = time.monotonic() + args.eval_every * 60
    agent: ChildProcess | None = None
    round_started = 0.0
    seen: set[int] = set()
    last = time.monotonic()
    with tqdm(total=args.steps, desc="training steps", unit="step") as bar:
        bar.write(HEADER)
        while len(report.steps) < args.steps and time.monotonic() < deadline:
            jobs = _jobs(url, args.admin_token)
            if agent is not None and agent.returncode is not None:
                if agent.returncode != 0:
                    raise SystemExit(f"tracetrain demo: the agent failed:\n{agent.log_tail()}")
                children.remove(agent)
                report.rounds.append((round_started, time.time()))
                agent = None
            if agent is None and sum(job["state"] in ("queued", "running") for job in jobs) <= 1:
                command = _round_command(args, len(report.rounds) + 1, rewards_port)
                agent, round_started = ChildProcess("agent", command, _env(url), log), time.time()
                _start(children, agent)
            for job in reversed(jobs):
                if job["state"] != "succeeded" or job["id"] in seen or job["version"] is None:
                    continue
                seen.add(job["id"])
                report.training.append((job["started_at"], job["finished_at"]))
                metrics, now = job["metrics"], time.monotonic()
                step = Step.of(job["version"], metrics, now - last)
                last = now
                report.steps.append(step)
                bar.update(1)
                bar.set_postfix(reward=f"{step.reward_mean:.2f}")
                bar.write(row(step))
            for evaluation in [e for e in evaluations if e.done]:
                evaluations.remove(evaluation)
                report.held_out.append(held := evaluation.result())
                report.sampling.append((held.started, held.finished))
                bar.write(f"held-out success of agent@{held.version}: {held.success:.0%} ({held.attempts} attempts)")
            periodic = args.eval_every > 0 and args.eval_attempts > 0
            if periodic and time.monotonic() >= next_eval and report.steps and not evaluations:
                next_eval = time.monotonic() + args.eval_every * 60
                # The version serving now, not the newest trained: that one may not be published yet, or at all
                # (the regression guard may have rolled it back).
                evaluations.append(_Evaluation(url, run_dir, _active_version(url, args.admin_token),
                                               args.eval_attempts, args, children))  # fmt: skip
            time.sleep(1.0)
    if agent is not None:
        agent.stop()
        children.remove(agent)
        report.rounds.append((round_started, time.time()))
    for evaluation in evaluations:  # the base model's, if training ended first
        report.held_out.append(held := evaluation.result())
        report.sampling.append((held.started, held.finished))
    _close(report, began, cpu_before, args.task, log)


def _round_command(args: argparse.Namespace, number: int, rewards_port: int) -> list[str]:
    """The agent's command line for training round ``number`` (its seed and its tag)."""
    return [sys.executable, "-m", "tracetrain_demo.agent", "--task", args.task, "--split", "train", "--rounds", "1",
            "--seed", str(number), "--questions", str(args.questions), "--attempts", str(args.attempts),
            "--temperature", str(args.temperature), "--tag", f"round{number}",
            "--done-url", f"http://127.0.0.1:{rewards_port}/finished"]  # fmt: skip


def _close(report: Report, began: float, cpu_before: float, task: str, log: Path) -> None:
    """What the training window measured: when each side was busy, the machine's load, each version's success."""
    report.sampling.extend(report.rounds)
    report.training_window = (began, time.time())
    report.machine_busy_cores = (busy_cpu_seconds() - cpu_before) / max(time.time() - began, 1e-9)
    report.served_success = _training_success(task, log)
    for step in report.steps:
        step.success = report.served_success.get(step.version)


def _training_success(task: str, log: Path) -> dict[int, float]:
    """Success of the training attempts, by the version that served their final reply."""
    wins: dict[int, list[bool]] = {}
    for episode in _episodes(log):
        version = int(str(episode["served_by"]).rpartition("@")[2] or 0)
        wins.setdefault(version, []).append(_score(task, episode).success)
    # A version that served only the stragglers of a round says nothing.
    return {v: sum(w) / len(w) for v, w in wins.items() if len(w) >= 16}


def _episodes(log: Path) -> list[dict[str, Any]]:
    """The attempts an agent printed (one JSON object per line; its log also has a header line)."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def _admin_get(url: str, path: str, token: str, **params: Any) -> dict[str, Any]:
    response = httpx.get(f"{url}{path}", params=params, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    response.raise_for_status()
    return dict(response.json())


def _jobs(url: str, token: str) -> list[dict[str, Any]]:
    return list(_admin_get(url, "/admin/jobs", token, limit=200)["data"])


def _active_version(url: str, token: str) -> int:
    return int(_admin_get(url, "/admin/adapters", token)["active_version"])


def _score(task: str, episode: dict[str, Any]) -> Scored:
    return TASKS[task].score_episode(episode)


def _start(children: list[ChildProcess], child: ChildProcess) -> None:
    child.start()
    children.append(child)


def _env(url: str) -> dict[str, str]:
    # The agent is configured the way any OpenAI app is: through the environment.
    env = {k: v for k, v in os.environ.items() if k != "TRACETRAIN_ADMIN_TOKEN"}
    return {**env, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "demo")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(message: str) -> None:
    tqdm.write(f"[demo] {message}")
