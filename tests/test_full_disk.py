"""A full disk loses nothing: on a real size-limited filesystem (tmpfs, ``size=``), serving goes on and counts
what it could not record, a training step fails without leaving a version, and both resume once space is freed."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import RunningProxy
from sqlalchemy import insert, select, update
from sqlalchemy.exc import OperationalError
from test_trainer_worker import A, G, J, fetch, run_worker, seed_store, settings_for

from store import FULL_DISK, connect, is_disk_full


@contextmanager
def mounted_small_disk(mount: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted at ``mount`` (root only: the test is skipped where mounting is refused)."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here ({done.stderr.decode().strip() or 'not root'})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_small_disk(tmp_path / "small-disk") as mount:
        yield mount


def fill(disk: Path) -> Path:
    """Write a file until the filesystem refuses (ENOSPC); returns it, to delete to free the space."""
    filler = disk / "filler"
    chunk = b"\0" * 65536
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        try:  # the last bytes a whole chunk did not fit
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass
    return filler


def metric(proxy: RunningProxy, line_start: str) -> float:
    body = httpx.get(f"{proxy.url}/metrics").text
    lines = [line for line in body.splitlines() if line.startswith(line_start)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def ask(proxy: RunningProxy, headers: dict[str, str], *, stream: bool = False) -> str:
    client = proxy.client(default_headers=headers)
    messages = [{"role": "user", "content": "Name a colour."}]
    if stream:
        chunks = client.chat.completions.create(model="agent", messages=messages, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(model="agent", messages=messages).choices[0].message.content or ""


def test_a_full_disk_stops_capture_not_serving_and_capture_resumes_when_space_is_freed(
    small_disk: Path, start_proxy: Callable[..., RunningProxy], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    FULL_DISK.succeeded()  # no episode of another test under way
    proxy = start_proxy(data_dir=small_disk)
    assert ask(proxy, {"X-Trajectory-Id": "before"})
    filler = fill(small_disk)

    # Keyed, unkeyed (a new trajectory whose seat cannot be written), streamed: all answered.
    answers = [ask(proxy, {"X-Trajectory-Id": "before"}), ask(proxy, {}), ask(proxy, {}, stream=True)]
    answers += [ask(proxy, {"X-Trajectory-Id": f"during-{i}"}) for i in range(3)]

    assert all(answers)
    assert metric(proxy, 'tracetrain_capture_failures_total{reason="disk_full"}') == 6
    assert httpx.get(f"{proxy.url}/healthz").status_code == 200
    disk = httpx.get(f"{proxy.url}/admin/overview").json()["disk"]
    assert disk is None or disk["capture_failures"]["disk_full"] == 6

    filler.unlink()
    assert ask(proxy, {"X-Trajectory-Id": "after"}) and ask(proxy, {}, stream=True)

    recorded = {row["trajectory_id"] for row in proxy.rows("SELECT trajectory_id FROM calls")}
    assert "after" in recorded and not any(t.startswith("during") for t in recorded)
    assert len(proxy.rows("SELECT * FROM calls")) == 1 + 2  # before, after and the stream after
    assert metric(proxy, 'tracetrain_capture_failures_total{reason="disk_full"}') == 6
    # The log tells the episode once, its start and its end, not each of the 6 writes that failed.
    told = [r.getMessage() for r in caplog.records if r.name == "tracetrain.store" and "disk" in r.getMessage()]
    assert [m.split(" (")[0].split(":")[0] for m in told] == [
        "the store's disk is full", "the store's disk takes writes again"]  # fmt: skip
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_a_training_step_on_a_full_disk_fails_without_a_version_and_the_next_one_trains(
    small_disk: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    settings = settings_for(tmp_path, tiny_model_dir, data_dir=small_disk)  # the store stays on tmp_path's disk
    url = settings.database_url
    first = asyncio.run(seed_store(url, {"g1": [1.0, 0.0, 0.5]}))
    settings.adapters_of("agent").mkdir(parents=True)
    filler = fill(small_disk)

    assert asyncio.run(run_worker(settings)) == 1  # the worker survives the failure

    (job,) = asyncio.run(fetch(url, select(J).where(J.c.id == first)))
    assert job.state == "failed" and "No space left on device" in job.error
    assert asyncio.run(fetch(url, select(A))) == []  # nothing recorded, so nothing published
    assert list(settings.adapters_of("agent").iterdir()) == []  # no half-written directory either

    filler.unlink()
    asyncio.run(_queue_again(url, first))
    assert asyncio.run(run_worker(settings)) == 1
    (adapter,) = asyncio.run(fetch(url, select(A)))
    assert adapter.version == 1 and (settings.adapters_of("agent") / "1" / "adapter_model.safetensors").is_file()


async def _queue_again(url: str, job_id: int) -> None:
    """What an operator does after freeing space: the failed step's groups trained again in a new job."""
    engine = await connect(url)
    async with engine.begin() as conn:
        (groups,) = (await conn.execute(select(J.c.group_ids).where(J.c.id == job_id))).one()
        await conn.execute(update(G).where(G.c.id.in_(groups)).values(state="training"))
        await conn.execute(insert(J).values(policy="agent", state="queued", group_ids=groups, metrics={},
                                            progress=0.0, created_at=time.time()))  # fmt: skip
    await engine.dispose()


def test_the_disk_full_check_reads_what_each_driver_raises() -> None:
    full = sqlite3.OperationalError("database or disk is full")
    assert is_disk_full(OperationalError("INSERT", {}, full))
    assert is_disk_full(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))
    assert not is_disk_full(OSError(errno.EACCES, "denied"))
