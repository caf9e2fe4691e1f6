"""``tracetrain demo``: an unmodified agent gets better at its task while it runs.

    tracetrain serve (vLLM + proxy + trainer)  <-- agent (an OpenAI client or Agents SDK app, OPENAI_BASE_URL)
          ^  POST /v1/rewards                       | POST /finished
          +---------- reward service <--------------+

1. Pull the default model and start ``tracetrain serve`` on a fresh demo directory
   (DATA_DIR/demo; the compile cache is kept between runs); go on once its proxy answers
   (the trainer loads while the first round samples).
2. Start the reward service; measure held-out success of ``agent@0`` (the base model)
   beside the first rounds, a few attempts at a time so that the rounds go first.
3. Run the agent on the training requests, round after round. Each round's groups are
   rewarded, trigger a training step, and the new adapter is hot-swapped in while the
   agent keeps asking ``agent``: later rounds are served by newer versions. vLLM samples
   the next round while the trainer trains the last (a round starts while at most one
   job is pending). Every --eval-every minutes the version serving is measured too. When
   the regression guard rolls a version back and pauses training, the demo says why and
   resumes (the next step trains on the version restored).
4. After --steps steps or --minutes minutes (the task's default), measure held-out success
   on the version serving, print the per-step table, how busy each side was, and write the plot
   (reward-curve.png) and the numbers (results.json) to DATA_DIR/demo. Each held-out success is also
   posted to the server (``POST /admin/evaluations``): with ``--log-to`` the trainer logs it into its run.

``--task city,lookup`` runs both tasks at once as two policies (``city`` and ``lookup``) on the one
``tracetrain serve``: an agent and a reward service each, trained on their own groups by the one
trainer, served by the one vLLM; each policy gets its own table, plot and numbers
(``reward-curve-POLICY.png``, ``results-POLICY.json``). One task's lane: ``tracetrain_demo._lane``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the train extra

from tracetrain_demo import serve_api
from tracetrain_demo._args import DEFAULT_TURN_DISCOUNT as DEFAULT_TURN_DISCOUNT
from tracetrain_demo._args import parse as _parse
from tracetrain_demo._args import parser as parser
from tracetrain_demo._lane import Evaluation, Lane, env_for
from tracetrain_demo.report import HEADER, busy_cpu_seconds, row, summary
from tracetrain_demo.tasks import TASKS, Task, precision
from tracetrain_proc import ChildProcess

# serve's line once the proxy answers (before its trainer has loaded: the first round samples meanwhile).
_SERVE_READY = "proxy ready: "
# Held-out attempts in flight while training rounds sample: a few, so that vLLM serves the rounds (and the first
# step lands) sooner; the evaluation after training takes the agent's default (64) on an idle vLLM.
_BESIDE_TRAINING = 16
# TrainConfig's defaults (docs/TRAINING.md says how they were chosen), except: on a CPU, packed rows
# near the sample length keep attention cheap.
_TRAIN_CONFIG = {"micro_batch_tokens": 1024}


def train_config(tasks: Sequence[Task], learning_rate: float, dtype: str, correction: str | None) -> dict[str, object]:
    """The trainer's settings for the run's tasks: TrainConfig's defaults but for ``_TRAIN_CONFIG`` and the flags.

    One trainer trains every policy: the strictest task's sampler correction (lookup's tis) serves them all unless
    ``correction`` (the flag) names one, and advantages are scaled by the group's std unless no task wants them so.
    """
    chosen = [task.sampler_correction for task in tasks if task.sampler_correction != "auto"]
    return {**_TRAIN_CONFIG, "learning_rate": learning_rate, "dtype": dtype,
            "sampler_correction": correction or (chosen[0] if chosen else "auto"),
            "scale_rewards": any(task.scale_rewards for task in tasks)}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if "agents-sdk" in args.tasks and importlib.util.find_spec("agents") is None:
        raise SystemExit("tracetrain demo: the agents-sdk task's agent needs the OpenAI Agents SDK: "
                         "pip install 'tracetrain[demo]' (or 'openai-agents>=0.20,<0.21')")  # fmt: skip
    started = time.monotonic()
    data_dir: Path = args.data_dir
    run_dir = data_dir / "demo"
    children: list[ChildProcess] = []
    try:
        url = args.url or _start_serve(args, data_dir, run_dir, children)
        args.admin_token = serve_api.admin_token(run_dir)
        lanes = []
        for task in args.tasks:
            policy = "agent" if len(args.tasks) == 1 else task
            port = _free_port()
            _start(children, ChildProcess(f"reward service ({task})", [sys.executable, "-m",
                   "tracetrain_demo.reward_service", "--proxy", url, "--port", str(port), "--task", task,
                   *(["--call-rewards"] if args.call_rewards and TASKS[task].score_calls else [])], env_for(url),
                   run_dir / "logs" / f"rewards-{policy}.log"))  # fmt: skip
            lanes.append(Lane(task, policy, url, run_dir, port))
        if args.eval_attempts:
            _say("measuring held-out success of the base model while the first round samples")
        _train(url, lanes, args, children)
        for lane in lanes:
            version = serve_api.active_version(url, args.admin_token, lane.policy)
            if args.eval_attempts:
                _say(f"measuring held-out success of {lane.policy}@{version} ...")
                lane.report.held_out.append(Evaluation(lane, version, args.eval_attempts, args, children).result())
                _post_evaluations(url, args.admin_token, lane)
        for lane in lanes:
            lane.report.seconds = time.monotonic() - started
            summary(lane.report, run_dir, suffix="" if len(lanes) == 1 else f"-{lane.policy}")
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    finally:
        for child in reversed(children):
            child.stop(grace_s=60)  # serve drains its requests, then stops the trainer and vLLM
    return 0


def _start_serve(args: argparse.Namespace, data_dir: Path, run_dir: Path, children: list[ChildProcess]) -> str:
    model_dir = _pull_model(data_dir)
    for old in ("tracetrain.db", "tracetrain.db-wal", "tracetrain.db-shm", "adapters", "logs"):
        path = run_dir / old
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    tasks = [TASKS[task] for task in args.tasks]
    sampler, trainer = _precision(args)
    if "bfloat16" in (sampler, trainer) and "auto" in (args.sampler_dtype, args.trainer_dtype):
        _say(f"this CPU has bf16 units: vLLM samples in {sampler}, the trainer learns in {trainer} "
             "(--sampler-dtype/--trainer-dtype float32 for float32)")  # fmt: skip
    config = run_dir / "train-config.json"
    config.write_text(json.dumps(train_config(tasks, args.learning_rate, trainer, args.sampler_correction)))
    policies = ["agent"] if len(tasks) == 1 else [task.name for task in tasks]
    command = [
        sys.executable, "-m", "tracetrain_cli", "serve", "--model", str(model_dir), "--data-dir", str(run_dir),
        "--port", str(args.port), "--group-size", str(args.attempts), "--min-group-size", str(args.attempts),
        "--batch-groups", str(args.questions), f"--trainer-arg=--config={config}",
        *(arg for policy in policies for arg in ("--policy", policy)),
        *dict.fromkeys(arg for task in tasks for arg in task.serve_args),
        f"--sampler-dtype={sampler}", *([f"--log-to={args.log_to}"] if args.log_to else []),
        *([f"--canary={args.canary}"] if args.canary else []),
        *([f"--turn-discount={args.turn_discount}"] if args.call_rewards else []),
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


def _minutes(args: argparse.Namespace) -> float:
    """Minutes of training: --minutes, else the task's default (with several tasks, the longest)."""
    return float(args.minutes or max(TASKS[task].minutes for task in args.tasks))


def _eval_every(args: argparse.Namespace, task: str) -> float:
    """Minutes between a task's held-out measurements during training: --eval-every, else the task's own."""
    return float(TASKS[task].eval_every if args.eval_every is None else args.eval_every)


def _precision(args: argparse.Namespace, cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, str]:
    """(vLLM's dtype, the trainer's): each task's (``tasks.precision``); where the tasks disagree, float32 (one vLLM
    and one trainer serve them all)."""
    chosen = [precision(TASKS[task], args.sampler_dtype, args.trainer_dtype, cpuinfo) for task in args.tasks]
    samplers, trainers = {sampler for sampler, _ in chosen}, {trainer for _, trainer in chosen}
    return (samplers.pop() if len(samplers) == 1 else "float32", trainers.pop() if len(trainers) == 1 else "float32")


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


def _train(url: str, lanes: list[Lane], args: argparse.Namespace, children: list[ChildProcess]) -> None:
    """Run each policy's agent round after round while the steps train, and show each step as it lands.

    On two cores vLLM samples the next round while the trainer trains on the last one (a lane starts a
    round when at most one job of its policy is pending). The base model's held-out evaluation of each
    task runs beside the first round, and every --eval-every minutes the newest version's beside the
    rounds of the moment, a few attempts at a time (the rounds go first). When the regression guard rolls a
    version back and pauses a policy's training, the demo says why and resumes it.
    """
    began, cpu_before = time.time(), busy_cpu_seconds()
    deadline = time.monotonic() + _minutes(args) * 60
    several = len(lanes) > 1
    for lane in lanes:
        lane.next_eval = time.monotonic() + _eval_every(args, lane.task) * 60
        if args.eval_attempts:
            lane.evaluations.append(Evaluation(lane, 0, args.eval_attempts, args, children,
                                               concurrency=_BESIDE_TRAINING))  # fmt: skip
    with tqdm(total=args.steps * len(lanes), desc="training steps", unit="step") as bar:
        bar.write(("policy  " if several else "") + HEADER)
        while any(len(lane.report.steps) < args.steps for lane in lanes) and time.monotonic() < deadline:
            every_job = serve_api.jobs(url, args.admin_token)
            for lane in lanes:
                if len(lane.report.steps) >= args.steps:
                    lane.stop_rounds(children)  # done: the other policies get the machine
                    continue
                if (reason := serve_api.resume_if_paused(url, args.admin_token, lane.policy)) is not None:
                    lane.report.rollbacks.append(reason)
                    restored = serve_api.active_version(url, args.admin_token, lane.policy)
                    bar.write(f"{reason}\nthe demo resumes training from {lane.policy}@{restored}")
                jobs = lane.jobs(every_job)
                lane.next_round(args, jobs, children)
                for step in lane.new_steps(jobs):
                    bar.update(1)
                    bar.set_postfix(reward=f"{step.reward_mean:.2f}")
                    bar.write((f"{lane.policy:<7} " if several else "") + row(step))
                finished = lane.finished_evaluations()
                _post_evaluations(url, args.admin_token, lane)
                for held in finished:
                    bar.write(f"held-out success of {lane.policy}@{held.version}: {held.success:.0%} "
                              f"({held.attempts} attempts)")  # fmt: skip
                every = _eval_every(args, lane.task)
                periodic = every > 0 and args.eval_attempts > 0
                if periodic and time.monotonic() >= lane.next_eval and lane.report.steps and not lane.evaluations:
                    lane.next_eval = time.monotonic() + every * 60
                    # The version serving now, not the newest trained: that one may not be published yet, or at all
                    # (the regression guard may have rolled it back).
                    version = serve_api.active_version(url, args.admin_token, lane.policy)
                    lane.evaluations.append(Evaluation(lane, version, args.eval_attempts, args, children,
                                                       concurrency=_BESIDE_TRAINING))  # fmt: skip
            time.sleep(1.0)
    busy_cores = (busy_cpu_seconds() - cpu_before) / max(time.time() - began, 1e-9)
    for lane in lanes:
        lane.stop(children)
        _post_evaluations(url, args.admin_token, lane)
        lane.close(began, busy_cores)


def _post_evaluations(url: str, token: str, lane: Lane) -> None:
    """Tell the server (and through it, the trainer's run loggers) each held-out success not told yet."""
    for held in lane.report.held_out[lane.posted :]:
        try:
            serve_api.post_evaluation(url, token, lane.policy, held)
        except httpx.HTTPError as exc:  # the demo's own report has them anyway
            _say(f"could not post the held-out evaluation of {lane.policy}@{held.version}: {exc}")
    lane.posted = len(lane.report.held_out)


def _start(children: list[ChildProcess], child: ChildProcess) -> None:
    child.start()
    children.append(child)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(message: str) -> None:
    tqdm.write(f"[demo] {message}")
