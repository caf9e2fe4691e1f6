"""``tracetrain demo``: an unmodified agent gets better at its task while it runs.

    tracetrain serve (vLLM + proxy + trainer)  <-- agent (plain OpenAI client, OPENAI_BASE_URL)
          ^  POST /v1/rewards                       | POST /finished
          +---------- reward service <--------------+

1. Pull the default model and start ``tracetrain serve`` on a fresh demo directory
   (DATA_DIR/demo; the compile cache is kept between runs).
2. Start the reward service and measure held-out success on ``agent@0`` (the base model).
3. Run the agent on the training questions, round after round. Each round's groups are
   rewarded, trigger a training step, and the new adapter is hot-swapped in while the
   agent keeps asking ``agent``: later rounds are served by newer versions.
4. After --steps steps or --minutes minutes, measure held-out success on the newest
   version, print the per-step table and write the reward curve (reward-curve.png) and
   the numbers (results.json) to DATA_DIR/demo.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the train extra

from tracetrain_cli._child import ChildProcess
from tracetrain_demo.task import Score, by_country, score

_SERVE_READY = "ready: agents use OPENAI_BASE_URL"
# On a CPU, packed rows near the sample length keep attention cheap (see docs/TRAINING.md).
_TRAIN_CONFIG = {"micro_batch_tokens": 1024, "learning_rate": 3e-4, "max_staleness": 2}


@dataclass
class Step:
    version: int
    reward_mean: float
    loss: float
    train_s: float
    wall_s: float
    success: float | None = None  # success of the training attempts this step's adapter served


@dataclass
class Report:
    before: float = 0.0
    after: float = 0.0
    after_version: int = 0
    steps: list[Step] = field(default_factory=list)
    served_success: dict[int, float] = field(default_factory=dict)  # version -> success of what it served
    seconds: float = 0.0


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
               "--proxy", url, "--port", str(rewards_port)], _env(url), run_dir / "logs" / "rewards.log"))  # fmt: skip
        report = Report()
        report.before = _held_out(url, run_dir, "agent@0", args, children)
        _say(f"held-out success of agent@0 (the base model): {report.before:.0%}")
        _train(url, run_dir, rewards_port, args, report, children)
        version = _active_version(url, args.admin_token)
        report.after_version = version
        report.after = _held_out(url, run_dir, f"agent@{version}", args, children)
        report.seconds = time.monotonic() - started
        _summary(report, run_dir)
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
        "a per-step table and held-out success before and after; writes reward-curve.png and results.json.",
    )
    p.add_argument(
        "--data-dir", type=Path, default=Path(".tracetrain"), help="models and the demo run (default .tracetrain)"
    )
    p.add_argument("--port", type=int, default=8100, help="the proxy's port (default 8100; vLLM uses the next one)")
    p.add_argument("--url", help="use a tracetrain serve already running at this root URL instead of starting one")
    p.add_argument("--steps", type=int, default=60, help="stop after this many training steps (default 60)")
    p.add_argument("--minutes", type=float, default=11.0, help="or after this many minutes of training (default 11)")
    p.add_argument("--questions", type=int, default=4, help="questions per round = groups per step (default 4)")
    p.add_argument("--attempts", type=int, default=8, help="attempts per question = group size (default 8)")
    p.add_argument("--eval-attempts", type=int, default=4, help="attempts per held-out question (default 4)")
    p.add_argument("--temperature", type=float, default=0.7, help="the agent's sampling temperature (default 0.7)")
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
    config = run_dir / "train-config.json"
    config.write_text(json.dumps(_TRAIN_CONFIG))
    command = [
        sys.executable, "-m", "tracetrain_cli", "serve", "--model", str(model_dir), "--data-dir", str(run_dir),
        "--port", str(args.port), "--group-size", str(args.attempts), "--min-group-size", str(args.attempts),
        "--batch-groups", str(args.questions), f"--trainer-arg=--config={config}",
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


_HEADER = f"{'version':>7} {'reward':>7} {'success':>8} {'loss':>8} {'train s':>8} {'step s':>7}"


def _row(step: Step) -> str:
    success = "" if step.success is None else f"{step.success:.0%}"
    return (f"{step.version:>7} {step.reward_mean:>7.3f} {success:>8} {step.loss:>8.4f} {step.train_s:>8.1f} "
            f"{step.wall_s:>7.1f}")  # fmt: skip


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


def _held_out(url: str, run_dir: Path, model: str, args: argparse.Namespace, children: list[ChildProcess]) -> float:
    """Success rate of the agent on the held-out questions, served by ``model``."""
    _say(f"measuring held-out success of {model} ...")
    tag = f"eval-{model.replace('@', '-v')}"
    command = [sys.executable, "-m", "tracetrain_demo.agent", "--split", "held-out", "--model", model,
               "--attempts", str(args.eval_attempts), "--temperature", str(args.temperature), "--tag", tag]  # fmt: skip
    agent = ChildProcess("held-out agent", command, _env(url), run_dir / "logs" / f"{tag}.jsonl")
    _start(children, agent)
    if agent.wait() != 0:
        raise SystemExit(f"tracetrain demo: the held-out evaluation of {model} failed:\n{agent.log_tail()}")
    children.remove(agent)
    episodes = _episodes(agent.log_path)
    return sum(_score(e).success for e in episodes) / max(1, len(episodes))


def _train(url: str, run_dir: Path, rewards_port: int, args: argparse.Namespace, report: Report,
           children: list[ChildProcess]) -> None:  # fmt: skip
    """Run the agent round after round while the steps train, and show each step as it lands.

    A new round starts when the last one ended and at most one training job is pending:
    on two cores vLLM samples the next round while the trainer trains on the last one,
    and the agent never runs ahead of training into stale, wasted samples.
    """
    deadline = time.monotonic() + args.minutes * 60
    log = run_dir / "logs" / "agent-train.jsonl"
    agent: ChildProcess | None = None
    rounds = 0
    seen: set[int] = set()
    last = time.monotonic()
    with tqdm(total=args.steps, desc="training steps", unit="step") as bar:
        bar.write(_HEADER)
        while len(report.steps) < args.steps and time.monotonic() < deadline:
            jobs = _jobs(url, args.admin_token)
            if agent is not None and agent.returncode is not None:
                if agent.returncode != 0:
                    raise SystemExit(f"tracetrain demo: the agent failed:\n{agent.log_tail()}")
                children.remove(agent)
                agent = None
            if agent is None and sum(job["state"] in ("queued", "running") for job in jobs) <= 1:
                rounds += 1
                command = [sys.executable, "-m", "tracetrain_demo.agent", "--split", "train", "--rounds", "1",
                           "--seed", str(rounds), "--questions", str(args.questions), "--attempts",
                           str(args.attempts), "--temperature", str(args.temperature), "--tag", f"round{rounds}",
                           "--done-url", f"http://127.0.0.1:{rewards_port}/finished"]  # fmt: skip
                agent = ChildProcess("agent", command, _env(url), log)
                _start(children, agent)
            for job in reversed(jobs):
                if job["state"] != "succeeded" or job["id"] in seen or job["version"] is None:
                    continue
                seen.add(job["id"])
                metrics, now = job["metrics"], time.monotonic()
                step = Step(job["version"], metrics["reward_mean"], metrics["loss"], metrics["seconds"], now - last)
                last = now
                report.steps.append(step)
                bar.update(1)
                bar.set_postfix(reward=f"{step.reward_mean:.2f}")
                bar.write(_row(step))
            time.sleep(1.0)
    if agent is not None:
        agent.stop()
        children.remove(agent)
    report.served_success = _training_success(log)
    for step in report.steps:
        step.success = report.served_success.get(step.version)


def _training_success(log: Path) -> dict[int, float]:
    """Success of the training attempts, by the version that served their final reply."""
    wins: dict[int, list[bool]] = {}
    for episode in _episodes(log):
        version = int(str(episode["served_by"]).rpartition("@")[2] or 0)
        wins.setdefault(version, []).append(_score(episode).success)
    # A version that served only the stragglers of a round says nothing.
    return {v: sum(w) / len(w) for v, w in wins.items() if len(w) >= 16}


def _episodes(log: Path) -> list[dict[str, Any]]:
    """The attempts an agent printed (one JSON object per line; its log also has a header line)."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def _summary(report: Report, run_dir: Path) -> None:
    print()
    print(_HEADER)
    for step in report.steps:
        print(_row(step))
    gain = (report.after - report.before) * 100
    print(f"\nheld-out success: agent@0 {report.before:.0%} -> agent@{report.after_version} {report.after:.0%} "
          f"({gain:+.0f} points) in {report.seconds / 60:.1f} min")  # fmt: skip
    results = {"before": report.before, "after": report.after, "after_version": report.after_version,
               "minutes": report.seconds / 60, "steps": [vars(s) for s in report.steps],
               "served_success": report.served_success}  # fmt: skip
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    png = _plot(report, run_dir / "reward-curve.png")
    print(f"reward curve: {png}\nnumbers: {run_dir / 'results.json'}")
    print(f"captured trajectories stay in {run_dir}: tracetrain serve --data-dir {run_dir} to browse them")


def _plot(report: Report, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    versions = [s.version for s in report.steps]
    ax.plot(versions, [s.reward_mean for s in report.steps], marker="o", label="mean reward of the step's batch")
    served = sorted(report.served_success.items())
    ax.plot([v for v, _ in served], [rate for _, rate in served], marker=".", linestyle="--",
            label="success of the training attempts each version served")  # fmt: skip
    ax.scatter([0, report.after_version], [report.before, report.after], color="black", zorder=3,
               label="held-out success")  # fmt: skip
    ax.set_xlabel("adapter version (training step)")
    ax.set_ylim(0, 1)
    ax.set_title(f"tracetrain demo: held-out {report.before:.0%} -> {report.after:.0%}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _admin_get(url: str, path: str, token: str, **params: Any) -> dict[str, Any]:
    response = httpx.get(f"{url}{path}", params=params, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    response.raise_for_status()
    return dict(response.json())


def _jobs(url: str, token: str) -> list[dict[str, Any]]:
    return list(_admin_get(url, "/admin/jobs", token, limit=200)["data"])


def _active_version(url: str, token: str) -> int:
    return int(_admin_get(url, "/admin/adapters", token)["active_version"])


def _score(episode: dict[str, Any]) -> Score:
    return score(by_country()[episode["country"]], episode["reply"], episode["turns"])


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
