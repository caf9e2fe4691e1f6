"""Retention of data (off by default) and disk usage in view: old trajectories deleted in batches, never an open
group's; `tracetrain db prune`; bytes per part and free space on /metrics, /readyz and the dashboard."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM

from tracetrain_cli._main import main

DAY_S = 86_400


def capture(proxy: RunningProxy, trajectory_id: str, group_id: str, turns: int = 2) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": trajectory_id, "X-Group-Id": group_id})
    messages = [{"role": "system", "content": "Be brief. " * 30}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}?"})
        reply = client.chat.completions.create(model="agent", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": trajectory_id, "reward": 1.0}).raise_for_status()


def age(db: Path, trajectory_id: str, days: float, group_state: str) -> None:
    """Make a trajectory as old as ``days`` and put its group in ``group_state``, as time and training would."""
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE trajectories SET updated_at = ?, created_at = ? WHERE id = ?",
                     (time.time() - days * DAY_S, time.time() - days * DAY_S, trajectory_id))  # fmt: skip
        conn.execute("UPDATE groups SET state = ? WHERE id = (SELECT group_id FROM trajectories WHERE id = ?)",
                     (group_state, trajectory_id))  # fmt: skip


def count(db: Path, sql: str) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute(sql).fetchone()[0])


@pytest.fixture
def aged(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    """Four trajectories: old and trained, old and trained in a shared group, old but open, recent and trained."""
    proxy = start_proxy()
    capture(proxy, "old", "g-old")
    capture(proxy, "old-shared", "g-shared")
    capture(proxy, "recent-shared", "g-shared")
    capture(proxy, "old-open", "g-open")
    age(proxy.db_path, "old", 10, "trained")
    age(proxy.db_path, "old-shared", 10, "trained")
    age(proxy.db_path, "old-open", 10, "open")
    proxy.stop()
    return proxy


def prune(proxy: RunningProxy, *flags: str) -> int:
    return main(["db", "prune", "--data-dir", str(proxy.settings.data_dir), *flags])


def test_db_prune_deletes_old_trajectories_of_closed_groups_with_their_calls_and_rewards(
    aged: RunningProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    db = aged.db_path
    before = count(db, "SELECT count(*) FROM calls")

    assert prune(aged, "--keep-trajectories", "7", "--dry-run") == 0
    assert "would delete 2 trajectories (4 calls, 2 rewards)" in capsys.readouterr().out
    assert count(db, "SELECT count(*) FROM calls") == before  # a dry run deletes nothing

    assert prune(aged, "--keep-trajectories", "7") == 0
    assert "deleted 2 trajectories (4 calls, 2 rewards, 1 groups, 0 judgements)" in capsys.readouterr().out
    left = {row[0] for row in sqlite3.connect(db).execute("SELECT id FROM trajectories")}
    assert left == {"recent-shared", "old-open"}  # an open group's trajectory stays, however old
    assert count(db, "SELECT count(*) FROM calls") == before - 4
    assert count(db, "SELECT count(*) FROM calls WHERE trajectory_id IN ('old', 'old-shared')") == 0
    assert count(db, "SELECT count(*) FROM rewards WHERE trajectory_id IN ('old', 'old-shared')") == 0
    assert {row[0] for row in sqlite3.connect(db).execute("SELECT id FROM groups")} == {"g-shared", "g-open"}


def test_db_prune_keeps_the_newest_n_and_vacuum_shrinks_the_file(
    aged: RunningProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    db = aged.db_path
    with contextlib.closing(sqlite3.connect(db)) as conn:  # rows big enough for the file to shrink measurably
        conn.execute("UPDATE calls SET response = json_object('padding', hex(randomblob(20000)))")
        conn.execute("UPDATE trajectories SET updated_at = updated_at - 3 * 3600")  # none touched recently
        conn.commit()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = db.stat().st_size

    assert prune(aged, "--keep-last", "1", "--vacuum") == 0

    assert "deleted 3 trajectories" in capsys.readouterr().out  # all but the newest, "old-open"
    assert db.stat().st_size < size * 0.75


def test_db_prune_refuses_a_rule_that_is_not_one(aged: RunningProxy) -> None:
    with pytest.raises(SystemExit) as both:
        prune(aged, "--keep-trajectories", "7", "--keep-last", "3")
    with pytest.raises(SystemExit) as zero:
        prune(aged, "--keep-trajectories", "0")
    with pytest.raises(SystemExit) as neither:
        prune(aged)
    assert both.value.code == zero.value.code == neither.value.code == 2
    assert prune(aged, "--keep-last", "-1") == 2


def test_a_trajectory_captured_compactly_reads_whole_after_older_ones_are_pruned(
    aged: RunningProxy, start_proxy: Callable[..., RunningProxy], fake: FakeVLLM
) -> None:
    assert prune(aged, "--keep-trajectories", "7") == 0
    proxy = start_proxy()
    calls = httpx.get(f"{proxy.v1}/trajectories/recent-shared").json()["calls"]
    assert calls[1]["prompt_token_ids"] == fake.tokenize(fake.render_chat(calls[1]["request"]["messages"], None))
    assert len(calls[1]["prompt_token_ids"]) > len(calls[0]["prompt_token_ids"])


def test_serve_prunes_old_trajectories_in_the_background(
    aged: RunningProxy, start_proxy: Callable[..., RunningProxy]
) -> None:
    start_proxy(keep_trajectories_days=7)
    deadline = time.monotonic() + 10
    while count(aged.db_path, "SELECT count(*) FROM trajectories") != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count(aged.db_path, "SELECT count(*) FROM trajectories") == 2


def metric(body: str, name: str) -> float:
    (line,) = [line for line in body.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_disk_usage_shows_on_metrics_the_dashboard_and_readyz(start_proxy: Callable[..., RunningProxy]) -> None:
    first = start_proxy()
    capture(first, "t", "g")
    first.stop()
    (first.settings.data_dir / "adapters" / "agent" / "1").mkdir(parents=True)
    (first.settings.data_dir / "adapters" / "agent" / "1" / "adapter_model.safetensors").write_bytes(b"w" * 5000)
    proxy = start_proxy(min_free_disk_mb=10**9)  # more than any disk here: the warning shows

    deadline = time.monotonic() + 10
    while "tracetrain_disk_free_bytes " not in (body := httpx.get(f"{proxy.url}/metrics").text):
        assert time.monotonic() < deadline, "measured at start"
        time.sleep(0.05)

    calls = metric(body, 'tracetrain_disk_bytes{part="calls"}')
    assert calls >= 4096 and metric(body, 'tracetrain_disk_bytes{part="database"}') > calls
    assert metric(body, 'tracetrain_disk_bytes{part="adapters"}') == 5000
    assert metric(body, "tracetrain_disk_free_bytes") > 0 and metric(body, "tracetrain_disk_low") == 1
    ready = httpx.get(f"{proxy.url}/readyz")
    assert ready.status_code == 200 and "under --min-free-disk" in ready.json()["warnings"][0]
    disk = httpx.get(f"{proxy.url}/admin/overview").json()["disk"]
    assert disk["parts"]["adapters"] == 5000 and disk["low"] is True
    page = httpx.get(f"{proxy.url}/admin").text
    assert 'id="disk"' in page and "under --min-free-disk" in page
