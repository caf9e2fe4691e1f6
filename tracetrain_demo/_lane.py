"""One task of ``tracetrain demo`` as one policy: its agent's rounds, its held-out evaluations, its report.

With one task the policy is ``agent``; with several (``--task city,lookup``) each task is a policy named
after it, on the same ``tracetrain serve``: one vLLM, one trainer, each policy trained on its own groups.
``tracetrain_demo.run`` ticks every lane once a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tracetrain_demo import serve_api
from tracetrain_demo.report import HeldOut, Report, Step
from tracetrain_demo.tasks import TASKS, Scored
from tracetrain_proc import ChildProcess


def env_for(url: str) -> dict[str, str]:
    """The agent is configured the way any OpenAI app is: through the environment."""
    env = {k: v for k, v in os.environ.items() if k != "TRACETRAIN_ADMIN_TOKEN"}
    return {**env, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "demo")}


def episodes(log: Path) -> list[dict[str, Any]]:
    """The attempts an agent printed (one JSON object per line; its log also has a header line)."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def score(task: str, episode: dict[str, Any]) -> Scored:
    return TASKS[task].score_episode(episode)


class Evaluation:
    """The agent on every held-out request of its task, served by one version, in its own process.

    It runs beside training (vLLM batches its calls with the training round's), so measuring
    costs little wall time; only the last one waits for training to end. ``concurrency``: its attempts in
    flight (beside training, a few, so that the rounds go first).
    """

    def __init__(self, lane: Lane, version: int, attempts: int, args: argparse.Namespace,
                 children: list[ChildProcess], *, concurrency: int = 64) -> None:  # fmt: skip
        self.version, self.started, self.model = version, time.time(), f"{lane.policy}@{version}"
        tag = f"eval-{lane.policy}-v{version}"
        command = [sys.executable, "-m", "tracetrain_demo.agent", "--task", lane.task, "--split", "held-out",
                   "--model", self.model, "--attempts", str(attempts), "--temperature", str(args.temperature),
                   "--tag", tag, "--concurrency", str(concurrency),
                   *(["--structured"] if getattr(args, "structured", False) else [])]  # fmt: skip
        self._agent = ChildProcess("held-out agent", command, env_for(lane.url), lane.run_dir / "logs" / f"{tag}.jsonl")
        self._children, self._task = children, lane.task
        self._agent.start()
        children.append(self._agent)

    @property
    def done(self) -> bool:
        return self._agent.returncode is not None

    def result(self) -> HeldOut:
        """Wait for it; its success rate over every held-out attempt."""
        if self._agent.wait() != 0:
            raise SystemExit(f"tracetrain demo: the held-out evaluation of {self.model} failed:\n"
                             f"{self._agent.log_tail()}")  # fmt: skip
        self._children.remove(self._agent)
        wins = [score(self._task, e).success for e in episodes(self._agent.log_path)]
        return HeldOut(self.version, sum(wins) / max(1, len(wins)), len(wins), self.started, time.time())


class Lane:
    """One policy's part of the run: its agent's rounds, the steps it trained, its held-out evaluations."""

    def __init__(self, task: str, policy: str, url: str, run_dir: Path, rewards_port: int) -> None:
        self.task, self.policy, self.url, self.run_dir, self.rewards_port = task, policy, url, run_dir, rewards_port
        self.report = Report(policy=policy)
        self.log = run_dir / "logs" / f"agent-train-{policy}.jsonl"
        self.agent: ChildProcess | None = None
        self.round_started = 0.0
        self.seen: set[int] = set()
        self.last = time.monotonic()
        self.evaluations: list[Evaluation] = []
        self.posted = 0  # held-out results told to the server (POST /admin/evaluations)
        self.next_eval = 0.0

    def jobs(self, every: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [job for job in every if job["policy"] == self.policy]

    def next_round(self, args: argparse.Namespace, jobs: list[dict[str, Any]], children: list[ChildProcess]) -> None:
        """End the round that ended; start the next when none runs and at most one job of the policy is pending:
        vLLM samples the next round while the trainer trains the last, and the agent never runs ahead of training
        into stale, wasted samples."""
        if self.agent is not None and self.agent.returncode is not None:
            if self.agent.returncode != 0:
                raise SystemExit(f"tracetrain demo: the {self.policy} agent failed:\n{self.agent.log_tail()}")
            children.remove(self.agent)
            self.report.rounds.append((self.round_started, time.time()))
            self.agent = None
        if self.agent is None and sum(job["state"] in ("queued", "running") for job in jobs) <= 1:
            number = len(self.report.rounds) + 1
            command = [sys.executable, "-m", "tracetrain_demo.agent", "--task", self.task, "--model", self.policy,
                       "--split", "train", "--rounds", "1", "--seed", str(number), "--questions", str(args.questions),
                       "--attempts", str(args.attempts), "--temperature", str(args.temperature),
                       "--tag", f"{self.policy}-round{number}",
                       "--done-url", f"http://127.0.0.1:{self.rewards_port}/finished",
                       *(["--structured"] if getattr(args, "structured", False) else [])]  # fmt: skip
            self.agent, self.round_started = ChildProcess("agent", command, env_for(self.url), self.log), time.time()
            self.agent.start()
            children.append(self.agent)

    def new_steps(self, jobs: list[dict[str, Any]]) -> list[Step]:
        """The steps of the policy's jobs that succeeded since the last look, oldest first."""
        steps = []
        for job in reversed(jobs):
            if job["state"] != "succeeded" or job["id"] in self.seen or job["version"] is None:
                continue
            self.seen.add(job["id"])
            self.report.training.append((job["started_at"], job["finished_at"]))
            now = time.monotonic()
            steps.append(Step.of(job["version"], job["metrics"], now - self.last))
            self.last = now
        self.report.steps.extend(steps)
        return steps

    def finished_evaluations(self) -> list[HeldOut]:
        done = []
        for evaluation in [e for e in self.evaluations if e.done]:
            self.evaluations.remove(evaluation)
            self.report.held_out.append(held := evaluation.result())
            self.report.sampling.append((held.started, held.finished))
            done.append(held)
        return done

    def stop_rounds(self, children: list[ChildProcess]) -> None:
        """Its steps are done: stop the round under way (its calls would only slow the other policies down)."""
        if self.agent is not None:
            self.agent.stop()
            children.remove(self.agent)
            self.report.rounds.append((self.round_started, time.time()))
            self.agent = None

    def stop(self, children: list[ChildProcess]) -> None:
        """Training is over: stop the round under way, wait for the evaluations still running."""
        self.stop_rounds(children)
        for evaluation in self.evaluations:  # the base model's, if training ended first
            self.report.held_out.append(held := evaluation.result())
            self.report.sampling.append((held.started, held.finished))
        self.evaluations = []

    def close(self, began: float, busy_cores: float) -> None:
        """What the training window measured: when each side was busy, each version's success on its training
        attempts (as the proxy recorded them)."""
        report = self.report
        report.sampling.extend(report.rounds)
        report.training_window = (began, time.time())
        report.machine_busy_cores = busy_cores
        report.served_success = serve_api.training_success(self.url, self.policy)
        for step in report.steps:
            step.success = report.served_success.get(step.version)
