"""The front door under hostile and broken traffic: ordinary clients beside everything that could harm them.

``tracetrain serve`` (capture on, SQLite on a size-limited tmpfs, no trainer) in front of the fake vLLM
of ``tests/fake_vllm.py`` (``_chaos/fake.py``: it fails on request, as vLLM 0.32 fails). For
``--duration`` seconds:

- ``--concurrency`` ordinary clients call every API (chat, completions, Responses, Messages; streamed
  and not), each call a new trajectory of one of 40 tasks (so calls share derived groups), and post
  a reward for each trajectory as a reward service would;
- ``--hostile`` workers send a stream of hostile and broken calls (``_chaos/hostile.py``: bodies
  nested too deep or too large, browsers' cross-site requests, DNS rebinding, huge prompt lists,
  bad admin credentials, engine failures inside streams, dropped upstream connections, clients
  hanging up mid-stream) on the same tasks, and in the run's first seconds 40 calls carry a 2 MB
  field vLLM never renders (compact capture's memory);
- 20 connections send half their headers and wait (Slowloris);
- vLLM is killed (SIGKILL) at 35% of the run and started again 5 s later; the disk is filled for
  10 s at 65%.

Then the rewards still missing are posted, the run waits out the seat timeout, and it reads the store:
ordinary calls answered and failed (apart: failed while vLLM was dead), records lost, broken calls
trained on, groups stuck, the proxy's memory over the run, and whether the upstream's password
showed anywhere. Targets: 0 ordinary calls failed that the upstream answered, 0 lost, 0 broken calls
trained on, 0 groups stuck, memory flat. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

# bench/ is not a package: its helpers import as top-level names (see proxy_overhead.py).
from _chaos.calls import APIS, Outcome, call
from _chaos.faults import PASSWORD, Proxy, Upstream, fill, proxy, small_disk
from _chaos.hostile import Slowloris, memory_hog, pick
from _chaos.verdict import judge, report
from _host import free_port

TASKS = [f"Task {i}: name a colour and a number, briefly." for i in range(40)]
MEMORY_HOGS = 40  # the case: 40 calls carrying a 2 MB field


class Run:
    """The load, the faults and what the clients saw."""

    def __init__(self, opts: argparse.Namespace, served: Proxy, upstream: Upstream, disk: Path | None) -> None:
        self.opts, self.proxy, self.upstream, self.disk = opts, served, upstream, disk
        self.outcomes: list[Outcome] = []
        self.rewards: dict[str, int] = {}  # trajectory id -> the last reward post's status
        self.vllm_down: list[tuple[float, float]] = []
        self.disk_full: list[tuple[float, float]] = []
        self.memory: list[tuple[float, float]] = []  # (seconds into the run, RSS MB)
        self.stop = asyncio.Event()
        self.started = time.monotonic()

    async def go(self) -> None:
        # Idle connections dropped before the proxy drops them (uvicorn: after 5 s), as well-behaved clients do.
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=3.0)
        async with httpx.AsyncClient(base_url=self.proxy.url, limits=limits, timeout=60) as client:
            self.client = client
            slowloris = Slowloris("127.0.0.1", self.proxy.port)
            self.slowloris = slowloris
            work = [asyncio.create_task(self._ordinary(i)) for i in range(self.opts.concurrency)]
            work += [asyncio.create_task(self._hostile()) for _ in range(self.opts.hostile)]
            work += [asyncio.create_task(slowloris.run(self.stop)), asyncio.create_task(self._sample_memory()),
                     asyncio.create_task(self._memory_hogs())]  # fmt: skip
            await self._faults()
            self.stop.set()
            await asyncio.gather(*work)
            await self._settle()

    async def _ordinary(self, worker: int) -> None:
        kinds = itertools.cycle([(api, stream) for api in APIS for stream in (False, True)])
        for _ in range(worker):
            next(kinds)
        while not self.stop.is_set():
            api, stream = next(kinds)
            outcome = await call(self.client, "ordinary", api, random.choice(TASKS), stream=stream)
            self.outcomes.append(outcome)
            await self._reward(outcome.trajectory_id, 1.0 if outcome.whole else 0.0)

    async def _hostile(self) -> None:
        while not self.stop.is_set():
            _, send, api = pick()
            outcome = await send(self.client, random.choice(TASKS), api)
            self.outcomes.append(outcome)
            if outcome.trajectory_id:
                await self._reward(outcome.trajectory_id, 0.0)
            await asyncio.sleep(random.uniform(0.02, 0.1))

    async def _memory_hogs(self) -> None:
        """The issue's case, early in the run: 40 calls carrying 2 MB that vLLM never renders. What compact capture
        holds of them is bounded in bytes, so the proxy's memory stays flat from there on."""
        for _ in range(MEMORY_HOGS):
            if self.stop.is_set():
                return
            outcome = await memory_hog(self.client, random.choice(TASKS), "chat")
            self.outcomes.append(outcome)
            await self._reward(outcome.trajectory_id, 0.5)
            await asyncio.sleep(0.1)

    async def _reward(self, trajectory_id: str, value: float) -> None:
        """A reward service's post; one not taken now (the store was down, the disk full) is posted again at the end."""
        try:
            response = await self.client.post("/v1/rewards", json={"trajectory_id": trajectory_id, "reward": value})
            self.rewards[trajectory_id] = response.status_code
        except httpx.HTTPError:
            self.rewards[trajectory_id] = 0

    async def _sample_memory(self) -> None:
        while not self.stop.is_set():
            self.memory.append((time.monotonic() - self.started, self.proxy.rss_mb()))
            await asyncio.sleep(1.0)

    async def _faults(self) -> None:
        duration = self.opts.duration
        await self._until(0.35 * duration)
        killed = time.monotonic()
        await asyncio.to_thread(self.upstream.kill)
        await asyncio.sleep(5.0)
        await asyncio.to_thread(self.upstream.start)
        await self._until_ready()
        self.vllm_down.append((killed, time.monotonic() + 3.0))  # and a health check's worth after
        await self._until(0.65 * duration)
        if self.disk is not None:
            filled = time.monotonic()
            filler = await asyncio.to_thread(fill, self.disk)
            await asyncio.sleep(10.0)
            filler.unlink()
            self.disk_full.append((filled, time.monotonic() + 1.0))
        await self._until(duration)

    async def _until(self, seconds_in: float) -> None:
        await asyncio.sleep(max(0.0, self.started + seconds_in - time.monotonic()))

    async def _until_ready(self) -> None:
        """Until the proxy's router has the restarted vLLM in rotation again (/readyz)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await self.client.get("/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.2)

    async def _settle(self) -> None:
        """Post the rewards not taken, then wait out the seat timeout and the sweep after it."""
        for _ in range(3):
            missing = [t for t, status in self.rewards.items() if status not in (200, 404)]
            for trajectory_id in missing:
                await self._reward(trajectory_id, 0.0)
        await asyncio.sleep(self.opts.seat_timeout + min(60.0, self.opts.seat_timeout / 2) + 2.0)


def _secrets_shown(served: Proxy) -> list[str]:
    """Where the upstream's password shows: /metrics, /readyz, the admin overview, the log, stored errors."""
    token = (served.data_dir / "admin-token").read_text().strip()
    places = {
        "/metrics": httpx.get(f"{served.url}/metrics").text,
        "/readyz": httpx.get(f"{served.url}/readyz").text,
        "/admin/overview": httpx.get(f"{served.url}/admin/overview", headers={"Authorization": f"Bearer {token}"}).text,
        "proxy log": served.log.read_text(errors="replace"),
    }
    shown = [where for where, text in places.items() if PASSWORD in text]
    import sqlite3

    with sqlite3.connect(f"file:{served.data_dir / 'tracetrain.db'}?mode=ro", uri=True) as conn:
        if conn.execute("SELECT count(*) FROM calls WHERE error LIKE ?", (f"%{PASSWORD}%",)).fetchone()[0]:
            shown.append("calls.error")
    return shown


def _metrics(served: Proxy) -> dict[str, float]:
    wanted = ("tracetrain_compact_capture_held", "tracetrain_capture_failures_total", "tracetrain_refused_requests")
    found = {}
    for line in httpx.get(f"{served.url}/metrics").text.splitlines():
        if line.startswith(wanted) and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def _notes(run: Run, metrics: dict[str, float], shown: list[str], tracebacks: int) -> list[str]:
    """What else the run showed: the proxy's memory over it, the slow connections, secrets, counters."""
    memory = [mb for _, mb in run.memory]
    at = [memory[min(len(memory) - 1, int(len(memory) * q))] for q in (0.1, 0.25, 0.5, 0.75)] + [memory[-1]]
    held_mb = metrics.get('tracetrain_compact_capture_held{what="bytes"}', 0.0) / 1e6
    return [
        "proxy memory (RSS, MB) at 10%, 25%, 50%, 75%, end: " + ", ".join(f"{m:.0f}" for m in at)
        + f"; compact capture holds {held_mb:.1f} MB (its bound: 64 MB)",
        f"slowloris: {run.slowloris.closed} half-sent connections closed by the proxy, the longest open "
        f"{run.slowloris.longest_s:.1f} s",
        f"the upstream's password shown in: {', '.join(shown) or 'nowhere'}",
        f"tracebacks in the proxy's log: {tracebacks}",
        f"capture failures: {_labelled(metrics, 'tracetrain_capture_failures_total')}",
        f"refused at the door: {_labelled(metrics, 'tracetrain_refused_requests_total')}",
    ]  # fmt: skip


def _labelled(metrics: dict[str, float], name: str) -> str:
    """``name``'s series as "label value, ...", e.g. ``disk_full 100``."""
    series = [(key.split('"')[1], value) for key, value in metrics.items() if key.startswith(name + "{")]
    return ", ".join(f"{label} {value:.0f}" for label, value in series) or "none"


def _cpu() -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), "?")
    flags = next((x.split(":", 1)[1].split() for x in info if x.startswith("flags")), [])
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16") if f in flags]
    return f"{model}, {len([x for x in info if x.startswith('processor')])} cores, flags {' '.join(shown)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=32, help="ordinary clients")
    parser.add_argument("--hostile", type=int, default=4, help="workers sending hostile and broken calls")
    parser.add_argument("--seat-timeout", type=float, default=20.0, help="the proxy's --seat-timeout")
    parser.add_argument("--token-delay", type=float, default=0.002, help="the fake vLLM's seconds per token")
    parser.add_argument("--disk-mb", type=int, default=512, help="size of the tmpfs the store lives on")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the logs and a copy of the store")
    opts = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="tracetrain-chaos-"))
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        disk = stack.enter_context(small_disk(workdir / "disk", opts.disk_mb))
        if disk is None:
            notes.append("full disk: skipped (mounting a tmpfs needs root)")
        upstream = Upstream(free_port(), workdir / "vllm.log", opts.token_delay)
        upstream.start()
        stack.callback(upstream.stop)
        served = stack.enter_context(proxy(upstream, workdir / "disk" / "data", workdir / "proxy.log",
                                           opts.seat_timeout))  # fmt: skip
        print(f"chaos: proxy {served.url}, vLLM on port {upstream.port}, {opts.duration:.0f} s of load ...", flush=True)
        run = Run(opts, served, upstream, disk)
        asyncio.run(run.go())
        verdict = judge(run.outcomes, served.data_dir / "tracetrain.db", run.vllm_down, run.disk_full)
        shown, metrics = _secrets_shown(served), _metrics(served)
        tracebacks = served.log.read_text(errors="replace").count("Traceback")
        if opts.keep:  # the store goes with the tmpfs
            for part in served.data_dir.glob("tracetrain.db*"):
                shutil.copy(part, workdir / part.name)
    notes += _notes(run, metrics, shown, tracebacks)
    meta: dict[str, Any] = {
        "started": run.started, "duration_s": opts.duration, "concurrency": opts.concurrency,
        "hostile_workers": opts.hostile, "cpu": _cpu(), "notes": notes, "vllm_down": run.vllm_down,
        "disk_full": run.disk_full,
    }  # fmt: skip
    lines = report(verdict, meta)
    print("\n".join(lines))
    if opts.out:
        opts.out.write_text(json.dumps({"meta": meta, "report": lines, "memory": run.memory}, indent=2) + "\n")
    if opts.keep:
        print(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if verdict.targets_met and not shown else 1


if __name__ == "__main__":
    raise SystemExit(main())
