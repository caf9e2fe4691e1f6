"""``--log-to`` when a tracker cannot work: refused when ``tracetrain serve`` starts, before it starts anything;
once training runs, a tracker that fails is reported with each step (the dashboard, ``/metrics``) and training
goes on without it.

The trackers are the real libraries: MLflow refuses a URI it has no store for and one whose server does not
answer; W&B online has no key here (``NETRC`` names an empty file); TensorBoard's directory is under a file.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from test_run_log import STEP
from test_serve import free_port
from test_trainer_worker import seed_store, settings_for

import trainer._run_log as run_loggers
from store import Store
from trainer._run_log import RunLog, RunLogs, check_destinations
from trainer._worker import Worker


@pytest.fixture
def no_tracker_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No W&B key anywhere it looks, no MLflow URI: what a fresh machine has."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DIR", "WANDB_BASE_URL",
                 "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "netrc"
    empty.write_text("")
    monkeypatch.setenv("NETRC", str(empty))
    return tmp_path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nothing answers there


class Taking:
    def __init__(self) -> None:
        self.values: list[tuple[int, dict[str, float]]] = []

    def scalars(self, values: dict[str, float], version: int) -> None:
        self.values.append((version, dict(values)))

    def close(self) -> None:
        pass


def test_destinations_that_cannot_start_a_run_are_named_with_what_to_do(
    no_tracker_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a_file = no_tracker_env / "a-file"
    a_file.write_text("")
    [tensorboard] = check_destinations(("tensorboard",), a_file / "runs")
    assert "--log-to tensorboard" in tensorboard and "--log-dir" in tensorboard

    [wandb] = check_destinations(("wandb",), no_tracker_env / "runs")
    assert "no API key for api.wandb.ai" in wandb and "WANDB_MODE=offline" in wandb
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert check_destinations(("wandb",), no_tracker_env / "runs") == []  # offline: runs on disk, no key needed

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nowhere://tracking")
    [mlflow] = check_destinations(("mlflow",), no_tracker_env / "runs")
    assert "--log-to mlflow" in mlflow and "nowhere" in mlflow and "MLFLOW_TRACKING_URI" in mlflow
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://me:s3cret@127.0.0.1:{closed_port()}")
    began = time.monotonic()
    [down] = check_destinations(("mlflow",), no_tracker_env / "runs")
    assert time.monotonic() - began < 60  # one request, no retries for minutes
    assert "s3cret" not in down and "127.0.0.1" in down


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")  # MLflow's own SQLAlchemy use
def test_the_default_destinations_can_start_a_run(no_tracker_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert check_destinations(("tensorboard", "wandb", "mlflow"), no_tracker_env / "runs") == []
    assert (no_tracker_env / "runs" / "mlflow.db").is_file()  # MLflow's default: sqlite under the log directory


def test_a_run_that_cannot_start_is_reported_tried_again_and_never_stops_the_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    taking, tries = Taking(), []

    def mlflow_down() -> Taking:
        tries.append(time.monotonic())
        if len(tries) == 1:
            raise ConnectionError("http://me:s3cret@mlflow:5000 refused the connection")
        return taking

    log = RunLog({}, {"mlflow": mlflow_down})
    log.step(1, STEP)  # the run could not start: the step goes on
    assert list(log.problems) == ["mlflow"] and "refused the connection" in log.problems["mlflow"]
    assert "s3cret" not in log.problems["mlflow"] and "s3cret" not in caplog.text
    assert "starting the run to mlflow failed; training goes on without it" in caplog.text
    assert len(tries) == 1  # not again at once: a tracker that is down may take a minute to say so
    log._tried_at["mlflow"] -= run_loggers._RETRY_START_S  # the wait has passed
    log.step(2, STEP)
    assert len(tries) == 2 and log.problems == {}
    assert [version for version, _ in taking.values] == [2]

    runs = RunLogs(lambda policy: RunLog({}, {"mlflow": mlflow_down}))
    tries.clear()
    runs.log_step("agent", 1, STEP)
    trouble = runs.trouble("agent")
    assert trouble["run_log_failing"] == 1 and trouble["run_log_error"].startswith("mlflow: starting the run failed")


def test_a_failing_tracker_is_recorded_with_the_step_and_the_step_is_kept(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = settings_for(tmp_path, tiny_model_dir)
    asyncio.run(seed_store(settings.database_url, {"g1": [1.0, 0.0, 0.5], "g2": [0.2, 0.9, 0.4]}))

    def never_starts() -> Taking:
        raise ConnectionError("mlflow:5000 refused the connection")

    async def train() -> dict[str, Any]:
        store = await Store.open(settings.database_url, capture=False)
        runs = RunLogs(lambda policy: RunLog({}, {"mlflow": never_starts}))
        worker = Worker(settings, store, run_log=runs)
        try:
            assert await worker.run(once=True) == 1
            [job] = await store.jobs.newest(1)
            assert job["state"] == "succeeded" and job["version"] == 1
            return dict(job["metrics"])
        finally:
            runs.close()
            await store.close()

    metrics = asyncio.run(train())
    assert metrics["run_log_failing"] == 1
    assert "mlflow: starting the run failed: ConnectionError" in metrics["run_log_error"]


def test_serve_refuses_a_tracker_that_cannot_start_a_run_before_it_starts_anything(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACETRAIN_", "MLFLOW_"))}
    env["MLFLOW_TRACKING_URI"] = "nowhere://tracking"
    port = free_port()
    serve = subprocess.run(
        [sys.executable, "-m", "tracetrain_cli", "serve", "--port", str(port), "--data-dir", str(tmp_path / "data"),
         "--upstream", f"http://127.0.0.1:{closed_port()}/v1", "--model", str(tiny_model_dir), "--log-to", "mlflow"],
        capture_output=True, text=True, check=False, env=env, timeout=300,
    )  # fmt: skip
    assert serve.returncode == 1, serve.stderr
    assert "--log-to cannot start a run, so nothing was started" in serve.stderr
    assert "nowhere" in serve.stderr and "MLFLOW_TRACKING_URI" in serve.stderr
    assert not (tmp_path / "data" / "logs" / "trainer.log").exists()
    assert "ready" not in serve.stdout
    with socket.socket() as s:  # the proxy never listened
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_the_dashboard_and_metrics_show_a_step_the_tracker_did_not_take(proxy: RunningProxy) -> None:
    failing = {"loss": 0.1, "run_log_failing": 1, "run_log_error": "mlflow: logging failed: ConnectionError: refused"}
    for version, metrics in enumerate([failing, {"loss": 0.2, "run_log_failing": 0}], start=1):
        proxy.rows(
            "INSERT INTO training_jobs (policy, state, group_ids, version, metrics, progress, created_at, finished_at)"
            " VALUES ('agent', 'succeeded', '[]', ?, ?, 1.0, 0, ?)",
            version, json.dumps(metrics), version,
        )  # fmt: skip
    page = httpx.get(f"{proxy.url}/admin/ui/training").text
    assert page.count("not logged to --log-to") == 1 and "mlflow: logging failed: ConnectionError: refused" in page
    scraped = httpx.get(f"{proxy.url}/metrics").text
    assert 'tracetrain_training_last_step{metric="run_log_failing",policy="agent"} 0.0' in scraped  # it recovered
