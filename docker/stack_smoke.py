"""The compose stack's smoke test (`make stack-smoke`): an agent, a reward service and an operator against the
running stack, through its one published port (nginx, then the proxies), with the real OpenAI client.

Parts, each timed:

0. the entry point serves: first calls until one answers (each vLLM on a CPU takes its first request slowly);
   every failed try is printed with its status and body;
1. rewarded groups: two groups of two trajectories, rewarded 1 and 0, make a training job;
2. a version trained: the trainer container records policy@1 and the proxies publish it;
3. both vLLM servers serve it: each lists agent@1, and a new call is served by version 1;
4. the dashboard answers: /admin/overview with the admin token, the /admin page;
5. a proxy restarted under load: calls run while proxy-a restarts; every answered call is in the store;
6. the trainer killed mid-step: a second job runs, the trainer container is killed while it holds the job,
   comes back (restart policy) and the job ends in policy@2 or later (a warm trainer's step takes ~2 s: a job
   that ran to its end between two looks is followed by another, up to three tries).

Run it with the stack up (docker/stack.sh up docker/compose.yaml docker/compose.smoke.yaml): it reads the keys
and the engine from the environment that docker/stack.sh and .ci/engine.sh set (make stack-smoke does all
of it). Exits non-zero on the first part that fails, its last line naming the part and what the stack answered.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from openai import APIConnectionError, APIStatusError, OpenAI

POLICY = "agent"


class Stack:
    """The running stack, as its users and its operator reach it."""

    def __init__(self, base_url: str, engine: str, project: str) -> None:
        self.base_url = base_url
        self.engine = engine
        self.project = project
        first = os.environ["TRACETRAIN_API_KEYS"].split(",")[0].strip()
        self.agent = OpenAI(base_url=f"{base_url}/v1", api_key=first, max_retries=0, timeout=300)
        reward_key = os.environ["TRACETRAIN_REWARD_KEYS"].split(",")[0].strip()
        self.rewards = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {reward_key}"}, timeout=60)
        admin = os.environ["TRACETRAIN_ADMIN_TOKEN"]
        self.admin = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {admin}"}, timeout=60)

    def call(self, group: str, trajectory: str, task: str) -> str:
        """One chat call of a trajectory; returns the version that served it."""
        raw = self.agent.chat.completions.with_raw_response.create(
            model=POLICY,
            messages=[{"role": "user", "content": task}],
            max_tokens=8,
            extra_headers={"X-Group-Id": group, "X-Trajectory-Id": trajectory},
        )
        raw.parse()
        version: str = raw.headers.get("x-policy-version", "?")
        return version

    def reward(self, rewards: dict[str, float]) -> None:
        body = {"rewards": [{"trajectory_id": t, "reward": r} for t, r in rewards.items()]}
        self.rewards.post("/v1/rewards", json=body).raise_for_status()

    def adapters(self) -> dict[str, Any]:
        reply = self.admin.get("/admin/adapters", params={"policy": POLICY})
        reply.raise_for_status()
        result: dict[str, Any] = reply.json()
        return result

    def jobs(self) -> list[dict[str, Any]]:
        reply = self.admin.get("/admin/jobs", params={"policy": POLICY})
        reply.raise_for_status()
        jobs: list[dict[str, Any]] = reply.json()["data"]
        return jobs

    def container(self, service: str) -> str:
        out = self.engine_run("ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                              "--filter", f"label=com.docker.compose.service={service}")  # fmt: skip
        ids = out.split()
        if not ids:
            raise SystemExit(f"stack_smoke: no running container of the service {service}")
        return ids[0]

    def engine_run(self, *args: str) -> str:
        return subprocess.run([self.engine, *args], check=True, capture_output=True, text=True).stdout

    def ready(self, service: str) -> bool:
        """Whether the proxy in the service's container answers /readyz."""
        script = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8100/readyz', timeout=5)"
        done = subprocess.run([self.engine, "exec", self.container(service), "python3", "-c", script],
                              capture_output=True, check=False)  # fmt: skip
        return done.returncode == 0

    def vllm_models(self, service: str) -> list[str]:
        script = (
            "import json, urllib.request; "
            "print(' '.join(m['id'] for m in json.load(urllib.request.urlopen('http://127.0.0.1:8000/v1/models'))['data']))"
        )
        return self.engine_run("exec", self.container(service), "python3", "-c", script).split()


def what_failed(exc: BaseException) -> str:
    """One line: the error, what the stack answered (status, request id, body) or the causes of a broken connection."""
    line = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, APIStatusError):
        request_id = exc.response.headers.get("x-request-id") or exc.response.headers.get("x-call-id") or "-"
        line += f" (HTTP {exc.status_code}, call {request_id}, body {exc.response.text[:400]!r})"
    cause = exc.__cause__ or exc.__context__
    while cause is not None:
        line += f" <- {type(cause).__name__}: {cause}"
        cause = cause.__cause__ or cause.__context__
    return line


def first_call(stack: Stack, timeout_s: float) -> None:
    """Calls until one answers: healthy containers do not prove the path through nginx and a proxy to vLLM serves."""
    deadline = time.monotonic() + timeout_s
    tries = 0
    while True:
        tries += 1
        trajectory = f"warm-{tries}-{uuid.uuid4().hex[:8]}"
        try:
            version = stack.call(trajectory, trajectory, "Say hello.")
        except (APIStatusError, APIConnectionError) as exc:
            print(f"stack_smoke:   try {tries} failed: {what_failed(exc)}", flush=True)
            if time.monotonic() > deadline:
                raise SystemExit(f"stack_smoke: no call answered within {timeout_s:.0f} s ({tries} tries)") from exc
            time.sleep(5)
            continue
        print(f"stack_smoke:   try {tries} answered by version {version}", flush=True)
        return


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, every_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"stack_smoke: {what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


timings: list[tuple[str, float]] = []


@contextmanager
def part(name: str) -> Iterator[None]:
    print(f"stack_smoke: {name} ...", flush=True)
    start = time.monotonic()
    try:
        yield
    except Exception as exc:
        # The last line CI shows: which part, and what the stack answered (the traceback is above it).
        traceback.print_exc()
        raise SystemExit(f"stack_smoke: FAILED: {name}: {what_failed(exc)}") from None
    took = time.monotonic() - start
    timings.append((name, took))
    print(f"stack_smoke: {name}: ok, {took:.1f} s", flush=True)


def rewarded_groups(stack: Stack, step: int, groups: int) -> None:
    rewards = {}
    for g in range(groups):
        group = f"smoke-{step}-{g}-{uuid.uuid4().hex[:8]}"
        for t in range(2):
            trajectory = f"{group}-t{t}"
            stack.call(group, trajectory, f"Step {step}, task {g}: name a colour.")
            rewards[trajectory] = float(t)
    stack.reward(rewards)
    print(f"stack_smoke:   {len(rewards)} calls answered and rewarded in {groups} groups", flush=True)


def active_version(stack: Stack) -> int:
    version: int = stack.adapters()["active_version"]
    return version


def restart_under_load(stack: Stack, service: str, seconds_after: float) -> None:
    answered: list[str] = []
    failed: list[str] = []
    stop = threading.Event()

    def agent(worker: int) -> None:
        n = 0
        while not stop.is_set():
            trajectory = f"load-{worker}-{n}-{uuid.uuid4().hex[:8]}"
            n += 1
            try:
                stack.call(trajectory, trajectory, f"Load {n}: say yes.")
                answered.append(trajectory)
            except Exception as exc:  # a call cut by the restart is the caller's to retry; it is counted
                failed.append(f"{trajectory}: {what_failed(exc)[:300]}")

    threads = [threading.Thread(target=agent, args=(w,), daemon=True) for w in range(3)]
    for thread in threads:
        thread.start()
    wait_for("calls before the restart", lambda: len(answered) >= 3, 120, 0.2)
    before = len(answered)
    stack.engine_run("restart", stack.container(service))
    # Asked directly: the engine's health status can still read the healthy of before the restart.
    wait_for(f"{service} ready again", lambda: stack.ready(service), 300)
    time.sleep(seconds_after)
    stop.set()
    for thread in threads:
        thread.join(timeout=330)
    print(f"stack_smoke:   {len(answered)} calls answered ({before} before the restart), {len(failed)} failed",
          flush=True)  # fmt: skip
    for failure in failed[:5]:
        print(f"stack_smoke:   failed: {failure}", flush=True)
    missing = [t for t in answered if stack.rewards.get(f"/v1/trajectories/{t}").status_code != 200]
    if missing:
        raise SystemExit(f"stack_smoke: {len(missing)} answered calls have no record, e.g. {missing[:3]}")
    print(f"stack_smoke:   every answered call is recorded ({len(answered)})", flush=True)


def a_running_job(stack: Stack, done_before: set[str], attempts: int = 3) -> dict[str, Any]:
    """The next training job, seen while the trainer holds it: rewarded groups make one, and a job that ran to its
    end between two looks (a warm trainer's step takes ~2 s) is followed by another, up to ``attempts`` times."""
    running: dict[str, Any] = {}
    missed: list[str] = []

    def claimed_or_missed() -> bool:
        jobs = stack.jobs()
        holding = [j for j in jobs if j["state"] == "running"]
        if holding:
            running.update(holding[0])
            return True
        missed.extend(j["id"] for j in jobs if j["state"] == "succeeded" and j["id"] not in done_before | set(missed))
        return bool(missed)

    for attempt in range(1, attempts + 1):
        missed.clear()
        rewarded_groups(stack, 1 + attempt, groups=2)
        wait_for("the trainer claims the next job", claimed_or_missed, 600, 0.2)
        if running:
            return running
        done_before.update(missed)
        print(f"stack_smoke:   job {', '.join(missed)} ended before it was seen running; another (try {attempt})",
              flush=True)  # fmt: skip
    raise SystemExit(f"stack_smoke: no job was seen running in {attempts} tries: each ended between two looks")


def kill_trainer_mid_step(stack: Stack) -> None:
    done_before = {j["id"] for j in stack.jobs() if j["state"] == "succeeded"}
    running = a_running_job(stack, done_before)
    trainer = stack.container("trainer")
    started = stack.engine_run("inspect", "--format", "{{.State.StartedAt}}", trainer).strip()
    # Its process killed from the host, as the kernel's OOM killer would: a crash, which the restart policy answers.
    # (`podman kill` counts as the operator stopping it, and podman then leaves it stopped.)
    os.kill(int(stack.engine_run("inspect", "--format", "{{.State.Pid}}", trainer)), signal.SIGKILL)
    print(f"stack_smoke:   killed the trainer while it held job {running['id']} (worker {running['worker']}, "
          f"progress {running['progress']})", flush=True)  # fmt: skip

    def restarted() -> bool:
        state = stack.engine_run("inspect", "--format", "{{.State.Status}} {{.State.StartedAt}}", trainer).strip()
        return state.startswith("running") and not state.endswith(started)

    wait_for("the trainer container restarted by its restart policy", restarted, 120, 1.0)

    def finished() -> bool:
        job = next(j for j in stack.jobs() if j["id"] == running["id"])
        if job["state"] == "failed":
            raise SystemExit(f"stack_smoke: job {job['id']} failed: {job['error']}")
        return bool(job["state"] == "succeeded" and job["id"] not in done_before)

    wait_for("the job finishes after the trainer's restart", finished, 900)
    job = next(j for j in stack.jobs() if j["id"] == running["id"])
    print(f"stack_smoke:   job {job['id']} finished by worker {job['worker']} (reclaimed {job.get('reclaimed', '?')})",
          flush=True)  # fmt: skip
    wait_for("policy@2 published", lambda: active_version(stack) >= 2, 600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    port = os.environ.get("TRACETRAIN_PORT", "8100")
    parser.add_argument("--base-url", default=f"http://127.0.0.1:{port}")
    parser.add_argument("--engine", default=os.environ.get("ENGINE", "docker"))
    parser.add_argument("--project", default=os.environ.get("COMPOSE_PROJECT_NAME", "tracetrain"))
    args = parser.parse_args()
    stack = Stack(args.base_url, args.engine, args.project)
    start = time.monotonic()

    with part("the entry point serves a first call"):
        if active_version(stack) != 0:
            raise SystemExit("stack_smoke: the stack has trained before: start it with fresh volumes")
        first_call(stack, timeout_s=300)
    with part("rewarded groups through nginx and the proxies"):
        rewarded_groups(stack, 1, groups=2)
    with part("a version trained and published"):
        wait_for("policy@1 published", lambda: active_version(stack) >= 1, 900)
    with part("both vLLM servers serve it"):
        for service in ("vllm-a", "vllm-b"):
            models = stack.vllm_models(service)
            if f"{POLICY}@1" not in models:
                raise SystemExit(f"stack_smoke: {service} serves {models}, not {POLICY}@1")
            print(f"stack_smoke:   {service}: {' '.join(models)}", flush=True)
        served = stack.call("after-1", f"after-1-{uuid.uuid4().hex[:8]}", "Say hello.")
        print(f"stack_smoke:   a new call is served by version {served}", flush=True)
    with part("the dashboard answers"):
        overview = stack.admin.get("/admin/overview")
        page = stack.admin.get("/admin", follow_redirects=True)
        if overview.status_code != 200 or page.status_code != 200:
            raise SystemExit(f"stack_smoke: /admin/overview {overview.status_code}, /admin {page.status_code}")
    with part("proxy-a restarted under load, no answered call lost"):
        restart_under_load(stack, "proxy-a", seconds_after=3.0)
    with part("the trainer killed mid-step resumes"):
        kill_trainer_mid_step(stack)

    print("stack_smoke: times")
    for name, took in timings:
        print(f"stack_smoke:   {took:7.1f} s  {name}")
    print(f"stack_smoke:   {time.monotonic() - start:7.1f} s  in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
