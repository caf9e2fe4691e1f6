"""``--log-to``: the trainer's run in TensorBoard, W&B and MLflow, written by their own libraries and read back
by their own readers (TensorBoard's ``EventAccumulator``, W&B's record protobufs, ``MlflowClient``).

W&B runs offline (``WANDB_MODE=offline``) and MLflow on a file store (``MLFLOW_ALLOW_FILE_STORE=true``),
as they would on a machine with no tracking server. The worker test trains a real step on the tiny
model and logs it with the evaluations posted to the store; the serve test goes through every process:
``tracetrain serve --log-to tensorboard``, rewards over HTTP, ``POST /admin/evaluations``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_serve import READY, free_port, start_serve
from test_trainer_worker import seed_store, settings_for
from wandb.proto import wandb_internal_pb2

import trainer._run_log as run_loggers
from store import Store
from tracetrain_cli._models import LOG_BACKENDS
from tracetrain_cli._serve_flags import log_backends
from trainer._run_log import RunLog, RunLogs, parse_log_to
from trainer._worker import Worker

CONFIG = {"policy": "agent", "base_model": "/models/tiny", "train": {"learning_rate": 3e-4, "lora_r": 8}}
STEP = {"loss": 0.25, "reward_mean": 0.5, "reward_std": 0.4, "logprob_mismatch_mean": 0.01, "trained_tokens": 96,
        "samples_call_tokens": 400, "seconds": 1.5, "sampling_seconds": 7.0, "sampler_correction": "tis",
        "kl": None, "step_skipped": False}  # fmt: skip


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """W&B offline, MLflow on a file store under ``tmp_path``: what the libraries read from the environment."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return tmp_path


def tensorboard(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def wandb_records(run_file: Path) -> list[wandb_internal_pb2.Record]:
    """The records of an offline run's ``.wandb`` file: W&B's log format (LevelDB's: 32 KiB blocks, 7-byte
    record headers) around its own ``Record`` protobufs."""
    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    position, chunks, pending = 7, [], b""
    while position + 7 <= len(data):
        if (left := 32768 - position % 32768) < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        if kind == 1:  # whole
            chunks.append(chunk)
        elif kind in (2, 3):  # first, middle
            pending = chunk if kind == 2 else pending + chunk
        elif kind == 4:  # last
            chunks.append(pending + chunk)
    return [wandb_internal_pb2.Record.FromString(chunk) for chunk in chunks]


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    rows = [r.history for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
    # A key W&B keeps whole is in ``nested_key`` (one part), an older one in ``key``.
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in row.item} for row in rows]


def test_a_step_and_evaluations_reach_tensorboard_wandb_and_mlflow(offline: Path) -> None:
    runs = offline / "runs"
    log = RunLog.open(("tensorboard", "wandb", "mlflow"), runs, "agent-test", CONFIG)
    log.evaluation(0, "held_out_success", 0.05, samples=200)
    log.step(1, STEP)
    log.step(2, STEP | {"loss": 0.125, "reward_mean": 0.75})
    log.evaluation(2, "held_out_success", 0.5, samples=200)
    mlflow_run = log.writers["mlflow"].run_id  # type: ignore[attr-defined]
    log.close()

    events = tensorboard(runs / "agent-test")
    assert scalars(events, "train/loss") == [(1, 0.25), (2, 0.125)]
    assert scalars(events, "train/reward_mean") == [(1, 0.5), (2, 0.75)]
    assert scalars(events, "train/version") == [(1, 1.0), (2, 2.0)]
    assert scalars(events, "eval/held_out_success") == [(0, pytest.approx(0.05)), (2, 0.5)]
    assert "train/sampler_correction" not in events.Tags()["scalars"]  # words and booleans are not scalars
    assert "train/step_skipped" not in events.Tags()["scalars"] and "train/kl" not in events.Tags()["scalars"]
    assert "learning_rate" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()

    [run_file] = (runs / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project) == ("agent-test", "tracetrain")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"] == {"learning_rate": 3e-4, "lora_r": 8}
    history = wandb_history(run_file)
    losses = [(row["version"], row["train/loss"]) for row in history if "train/loss" in row]
    assert losses == [(1, 0.25), (2, 0.125)]
    evaluations = [(row["version"], row["eval/held_out_success"]) for row in history if "eval/held_out_success" in row]
    assert evaluations == [(0, 0.05), (2, 0.5)]  # against the version, though version 0 came before step 1's
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    against_version = {(m.glob_name, m.step_metric) for m in metrics if m.glob_name}
    assert against_version >= {("train/*", "version"), ("eval/*", "version")}

    client = MlflowClient()  # MLFLOW_TRACKING_URI: the file store
    history_of = {name: [(m.step, m.value) for m in client.get_metric_history(mlflow_run, name)]
                  for name in ("train/loss", "eval/held_out_success", "eval/held_out_success_samples")}  # fmt: skip
    assert history_of["train/loss"] == [(1, 0.25), (2, 0.125)]
    assert history_of["eval/held_out_success"] == [(0, 0.05), (2, 0.5)]
    assert history_of["eval/held_out_success_samples"] == [(0, 200.0), (2, 200.0)]
    stored = client.get_run(mlflow_run)
    assert stored.info.run_name == "agent-test" and stored.info.status == "FINISHED"
    assert stored.data.params["train.learning_rate"] == "0.0003" and stored.data.params["policy"] == "agent"
    assert client.get_experiment(stored.info.experiment_id).name == "tracetrain"


def test_the_worker_logs_each_step_and_the_evaluations_posted_to_the_store(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    settings = settings_for(tmp_path, tiny_model_dir)
    asyncio.run(seed_store(settings.database_url, {"g1": [1.0, 0.0, 0.5], "g2": [0.2, 0.9, 0.4]}, multi_turn=True))

    async def evaluate_then_train() -> tuple[int, dict[str, Any]]:
        store = await Store.open(settings.database_url, capture=False)
        await store.evaluations.record("agent", 0, {"held_out_success": 0.25}, samples=8)
        await store.evaluations.record("other-policy", 0, {"held_out_success": 0.99})  # another policy's: not ours
        runs = RunLogs(lambda policy: RunLog.open(("tensorboard",), tmp_path / "runs", f"{policy}-worker",
                                                  {"policy": policy}))  # fmt: skip
        worker = Worker(settings, store, run_log=runs)
        try:
            done = await worker.run(once=True)
            await store.evaluations.record("agent", 1, {"held_out_success": 0.5})
            await worker.log_evaluations()  # what the worker's next beat does
            assert runs.policies == ["agent"]  # a run per policy trained, none for another policy's evaluations
            [job] = await store.jobs.newest(1)
            return done, job["metrics"]
        finally:
            runs.close()
            await store.close()

    done, metrics = asyncio.run(evaluate_then_train())
    assert done == 1
    events = tensorboard(tmp_path / "runs" / "agent-worker")
    tags = set(events.Tags()["scalars"])
    for name in ("loss", "reward_mean", "reward_std", "logprob_mismatch_mean", "trained_tokens",
                 "samples_call_tokens", "samples_completion_tokens", "seconds", "job_seconds", "sampling_seconds",
                 "version"):  # fmt: skip
        assert f"train/{name}" in tags, name
    assert scalars(events, "train/loss") == [(1, pytest.approx(metrics["loss"]))]
    assert scalars(events, "train/reward_mean") == [(1, pytest.approx(metrics["reward_mean"]))]
    # seed_store's three calls per trajectory: started 0, 1 and 2 s after the first, each answered in 1 ms.
    assert metrics["sampling_seconds"] == pytest.approx(2.001, abs=1e-5)
    assert scalars(events, "eval/held_out_success") == [(0, 0.25), (1, 0.5)]
    assert scalars(events, "eval/held_out_success_samples") == [(0, 8.0)]


class Broken:
    def scalars(self, values: Mapping[str, float], version: int) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        raise OSError("disk full")


def test_a_failing_backend_never_fails_a_step(caplog: pytest.LogCaptureFixture) -> None:
    log = RunLog({"tensorboard": Broken()})
    with caplog.at_level(logging.WARNING):
        log.step(1, STEP)
        log.step(2, STEP)
        log.evaluation(2, "held_out_success", 0.5)
        log.close()
    assert caplog.text.count("logging to tensorboard failed") == 1  # once a minute, not once a step


def test_log_to_names_backends_once_each_and_refuses_unknown_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_log_to("wandb, TensorBoard,wandb") == ("tensorboard", "wandb")
    assert log_backends("wandb, TensorBoard,wandb") == ("tensorboard", "wandb")  # serve's reading is the same
    assert tuple(LOG_BACKENDS) == run_loggers.BACKENDS
    with pytest.raises(ValueError, match="unknown neptune; choose from tensorboard, wandb, mlflow"):
        parse_log_to("tensorboard,neptune")
    monkeypatch.setattr(run_loggers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(run_loggers.MissingExtra, match=r"pip install 'tracetrain\[wandb\]'"):
        RunLog.open(("wandb",), Path("unused"), "run", {})


def test_the_trainer_and_serve_refuse_an_unknown_backend_at_once(tmp_path: Path) -> None:
    trainer = subprocess.run([sys.executable, "-m", "trainer", "--database-url", "sqlite+aiosqlite://",
                              "--data-dir", str(tmp_path), "--base-model", str(tmp_path), "--log-to", "neptune"],
                             capture_output=True, text=True, check=False)  # fmt: skip
    assert trainer.returncode == 2 and "unknown neptune" in trainer.stderr
    serve = subprocess.run([sys.executable, "-m", "tracetrain_cli", "serve", "--log-to", "neptune"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    assert serve.returncode == 2 and "unknown neptune" in serve.stderr


@pytest.mark.slow
async def test_serve_logs_the_trainers_steps_and_the_posted_evaluations_to_tensorboard(
    tmp_path: Path, fake: FakeVLLM, tiny_model_dir: Path
) -> None:
    port = free_port()
    serve = start_serve(tmp_path, port, "--upstream", f"{fake.url}/v1", "--model", str(tiny_model_dir),
                        "--log-to", "tensorboard", "--log-dir", str(tmp_path / "tb"))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await serve.wait_for_output(READY, timeout_s=180)
        token = (tmp_path / "data" / "admin-token").read_text().strip()
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as admin:
            before = {"version": 0, "scores": {"held_out_success": 0.125}, "samples": 16}
            assert (await admin.post("/admin/evaluations", json=before)).status_code == 200
            # Rewarded groups as the proxy records them, with token ids the tiny model knows (the fake's do not
            # all fit its vocabulary), and their job queued: the trainer serve started claims it.
            database = f"sqlite+aiosqlite:///{tmp_path / 'data' / 'tracetrain.db'}"
            await seed_store(database, {"g1": [1.0, 0.0, 0.5], "g2": [0.2, 0.9, 0.4]}, new_policy=False)
            deadline = time.monotonic() + 180
            while not (await admin.get("/admin/adapters")).json()["data"]:
                assert time.monotonic() < deadline, serve.log_path.read_text()[-3000:]
                await asyncio.sleep(0.5)
            after = await admin.post("/admin/evaluations", json={"version": 1, "scores": {"held_out_success": 0.5}})
            assert after.status_code == 200, after.text
        [run_dir] = (tmp_path / "tb").iterdir()
        deadline = time.monotonic() + 60
        while len(scalars_or_none(run_dir, "eval/held_out_success")) < 2:  # the worker's next beat logs it
            assert time.monotonic() < deadline, serve.log_path.read_text()[-3000:]
            await asyncio.sleep(0.5)
        events = tensorboard(run_dir)
        assert [step for step, _ in scalars(events, "train/loss")] == [1]
        assert scalars(events, "eval/held_out_success") == [(0, 0.125), (1, 0.5)]
        assert run_dir.name.startswith("agent-")
    finally:
        code = serve.stop(grace_s=30)
    assert code == 0, serve.log_path.read_text()[-3000:]


def scalars_or_none(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = tensorboard(run_dir)
    return scalars(events, tag) if tag in events.Tags()["scalars"] else []
