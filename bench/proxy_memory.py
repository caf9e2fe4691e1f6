"""The memory of one proxy replica (`tracetrain serve --no-train`) on PostgreSQL: idle, and after load.

    .venv/bin/python bench/proxy_memory.py postgresql+asyncpg://USER:PASSWORD@127.0.0.1:5432/DB [N] [CONC]

A fake vLLM (tests/fake_vllm.py) in this process; the proxy in its own process on loopback;
N non-streamed calls (default 3000), CONC at a time (default 32), each its own trajectory;
the proxy's resident memory read from /proc. It sizes the proxy's memory request in the
manifests (docs/SCALING.md). The request rate it prints is no throughput figure: the client
shares the cores with the proxy and PostgreSQL (see proxy_overhead.py for that).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_vllm import FakeVLLM, Reply, serve_in_thread

PORT = 18931


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def load(url: str, key: str, n: int, conc: int) -> float:
    gate = asyncio.Semaphore(conc)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(i: int) -> None:
            body = {"model": "agent", "messages": [{"role": "user", "content": f"task {i} " + "x " * 200}]}
            async with gate:
                response = await client.post(
                    f"{url}/v1/chat/completions", headers=headers | {"X-Trajectory-Id": f"mem-{i}"}, json=body
                )
                response.raise_for_status()

        start = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.monotonic() - start)


def wait_ready(url: str) -> None:
    for _ in range(300):
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the proxy did not become ready")


def main() -> None:
    database_url = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    conc = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    key = secrets.token_urlsafe(32)
    fake = FakeVLLM()
    fake.reply_for = lambda body: Reply("the answer is four")
    with serve_in_thread(fake.app) as upstream:
        env = os.environ | {"TRACETRAIN_API_KEYS": key, "TRACETRAIN_ADMIN_TOKEN": secrets.token_urlsafe(32)}
        argv = [sys.executable, "-m", "tracetrain_cli", "serve", "--no-train", "--upstream", f"{upstream}/v1",
                "--port", str(PORT), "--database-url", database_url, "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(
            [*argv, "--data-dir", str(Path(os.environ.get("TMPDIR", "/tmp")) / "proxy-memory")], env=env
        )
        try:
            url = f"http://127.0.0.1:{PORT}"
            wait_ready(url)
            time.sleep(2)
            print(f"idle: RSS {rss_mib(proc.pid):.0f} MiB")
            rate = asyncio.run(load(url, key, n, conc))
            time.sleep(2)
            print(f"after {n} calls at concurrency {conc}: RSS {rss_mib(proc.pid):.0f} MiB ({rate:.0f} req/s)")
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
