"""The worker against a real store: claim, build the batch from captured tokens, train, record."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select, update

from store import Store, connect
from store._tables import AdapterVersion, Call, Group, Policy, TrainingJob, Trajectory
from trainer import TrainConfig
from trainer._batch import TrajectoryData, build_batch
from trainer._samples import CapturedCall
from trainer._worker import Worker, WorkerSettings

# The tables, for arranging a store's state directly as another process would.
A = AdapterVersion.__table__
C = Call.__table__
G = Group.__table__
J = TrainingJob.__table__
P = Policy.__table__
T = Trajectory.__table__


CONFIG = TrainConfig(lora_r=8, lora_alpha=16, learning_rate=1e-3, dtype="float32", micro_batch_tokens=256)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


async def seed_store(
    url: str, groups: dict[str, list[float]], *, multi_turn: bool = False, seed: int = 0, new_policy: bool = True
) -> int:
    """Groups of rewarded trajectories as the proxy records them; returns the queued job's id.

    ``new_policy``: the policy's row too (False: a proxy made it already)."""
    rng = random.Random(seed)
    engine = await connect(url)
    now = time.time()
    async with engine.begin() as conn:
        if new_policy:
            await conn.execute(insert(P).values(name="agent", base_model="tiny", active_version=0, created_at=now,
                                                updated_at=now))  # fmt: skip
        for group_id, rewards in groups.items():
            await conn.execute(insert(G).values(id=group_id, policy="agent", state="training", created_at=now))
            for i, reward in enumerate(rewards):
                trajectory_id = f"{group_id}-{i}"
                await conn.execute(insert(T).values(id=trajectory_id, group_id=group_id, policy="agent",
                                                    keyed_by="header", created_at=now, updated_at=now, reward=reward,
                                                    metrics={}))  # fmt: skip
                prompt, completion = ids(rng, 12), ids(rng, 6)
                calls = [(prompt, completion)]
                if multi_turn:  # the second turn extends the first exactly; the third does not
                    calls.append(([*prompt, *completion, *ids(rng, 4)], ids(rng, 5)))
                    calls.append((ids(rng, 10), ids(rng, 5)))
                for k, (p, c) in enumerate(calls):
                    await conn.execute(insert(C).values(
                        id=f"{trajectory_id}-{k}", trajectory_id=trajectory_id, group_id=group_id, policy="agent",
                        endpoint="chat.completions", model="agent", served_model="tiny", version=0, stream=False,
                        request={}, prompt_token_ids=p, completion_token_ids=c, logprobs=[-2.0] * len(c),
                        other_choices=[], status_code=200, latency_ms=1.0, started_at=now + k))  # fmt: skip
        job = await conn.execute(insert(J).values(policy="agent", state="queued", group_ids=list(groups), metrics={},
                                                  progress=0.0, created_at=now).returning(J.c.id))  # fmt: skip
        job_id = int(job.scalar_one())
    await engine.dispose()
    return job_id


async def run_worker(settings: WorkerSettings) -> int:
    worker = await Worker.open(settings)
    try:
        return await worker.run(once=True)
    finally:
        await worker.close()


async def fetch(url: str, query: Any) -> list[Any]:
    engine = await connect(url)
    async with engine.connect() as conn:
        rows = list((await conn.execute(query)).all())
    await engine.dispose()
    return rows


def settings_for(tmp_path: Path, model: Path, **overrides: Any) -> WorkerSettings:
    options: dict[str, Any] = {
        "database_url": f"sqlite+aiosqlite:///{tmp_path / 'store.db'}",
        "data_dir": tmp_path,
        "policies": ("agent",),
        "base_model": model,
        "config": CONFIG,
    }
    return WorkerSettings(**{**options, **overrides})


def test_worker_trains_a_queued_job_and_records_the_adapter(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = settings_for(tmp_path, tiny_model_dir)
    job_id = asyncio.run(seed_store(settings.database_url, {"g1": [1.0, 0.0, 0.5], "g2": [0.2, 0.9, 0.4]},
                                    multi_turn=True))  # fmt: skip
    assert asyncio.run(run_worker(settings)) == 1
    job = asyncio.run(fetch(settings.database_url, select(J).where(J.c.id == job_id)))[0]
    assert job.state == "succeeded" and job.error is None and job.version == 1 and job.progress == 1.0
    metrics = job.metrics
    assert metrics["groups"] == 2 and metrics["trajectories"] == 6
    assert metrics["samples_merged"] == 6 and metrics["samples_mismatched"] == 6 and metrics["samples"] == 12
    assert metrics["loss_tokens"] == 6 * (6 + 5 + 5) and metrics["trained_from"] == 0
    for name in ("loss", "entropy", "clip_fraction", "grad_norm", "reward_mean", "reward_std", "seconds"):
        assert metrics[name] is not None, name
    adapter = asyncio.run(fetch(settings.database_url, select(A)))[0]
    assert (adapter.version, adapter.state, adapter.job_id) == (1, "trained", job_id)
    assert (Path(adapter.path) / "adapter_model.safetensors").is_file()
    states = {row.state for row in asyncio.run(fetch(settings.database_url, select(G.c.state)))}
    assert states == {"trained"}


def test_each_call_is_trained_at_its_requests_temperature_and_greedy_calls_are_counted(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    settings = settings_for(tmp_path, tiny_model_dir)
    url = settings.database_url
    job_id = asyncio.run(seed_store(url, {"g1": [1.0, 0.0, 0.5, 0.2]}))
    requests = {"g1-0": {"temperature": 0.7, "top_p": 0.9}, "g1-1": {"temperature": 0}, "g1-2": {},
                "g1-3": {"temperature": None, "top_k": 20}}  # fmt: skip

    async def arrange_and_read() -> list[Any]:
        engine = await connect(url)
        async with engine.begin() as conn:
            for trajectory_id, request in requests.items():
                request = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], **request}
                await conn.execute(update(C).where(C.c.trajectory_id == trajectory_id).values(request=request))
        await engine.dispose()
        store = await Store.open(url, capture=False)
        try:
            return await store.jobs.rewarded_trajectories(["g1"], policy="agent")
        finally:
            await store.close()

    stored = asyncio.run(arrange_and_read())
    read = [(c.temperature, c.top_p, c.top_k, c.min_p) for t in stored for c in t.calls]
    assert read == [(0.7, 0.9, None, None), (0.0, None, None, None), (None,) * 4, (None, None, 20.0, None)]

    assert asyncio.run(run_worker(settings)) == 1
    job = asyncio.run(fetch(url, select(J).where(J.c.id == job_id)))[0]
    assert job.state == "succeeded", job.error
    m = job.metrics
    assert (m["samples_skipped_greedy"], m["samples_truncated"], m["samples"], m["off_policy_samples"]) == (1, 2, 3, 0)
    # The seeded logprobs (-2.0 each) are not the tiny model's: the mismatch says so, and no token clamps.
    assert m["logprob_mismatch_mean"] > 0.1 and m["logprob_mismatch_max"] >= m["logprob_mismatch_mean"]
    assert (m["log_ratio_clamped"], m["step_skipped"]) == (0, False)


def test_a_job_without_reward_variance_trains_nothing_and_says_so(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = settings_for(tmp_path, tiny_model_dir)
    asyncio.run(seed_store(settings.database_url, {"g1": [1.0, 1.0], "g2": [0.0, 0.0]}))
    asyncio.run(run_worker(settings))
    job = asyncio.run(fetch(settings.database_url, select(J)))[0]
    assert job.state == "succeeded" and job.version is None
    assert job.metrics["dropped_groups_zero_variance"] == 2 and "no sample" in job.metrics["skipped"]
    assert asyncio.run(fetch(settings.database_url, select(A))) == []


def test_a_failing_job_is_marked_failed_with_the_reason(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, tmp_path / "no-such-model")
    asyncio.run(seed_store(settings.database_url, {"g1": [1.0, 0.0]}))
    asyncio.run(run_worker(settings))
    job = asyncio.run(fetch(settings.database_url, select(J)))[0]
    assert job.state == "failed" and "no-such-model" in job.error
    assert {row.state for row in asyncio.run(fetch(settings.database_url, select(G.c.state)))} == {"failed"}


def test_training_continues_from_the_newest_adapter_unless_rolled_back(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = settings_for(tmp_path, tiny_model_dir)
    url = settings.database_url

    async def queue_another(active: int, *, published: bool) -> None:
        engine = await connect(url)
        async with engine.begin() as conn:
            await conn.execute(update(P).values(active_version=active))
            if published:  # the proxy has published every adapter so far
                await conn.execute(update(A).values(state="published"))
            await conn.execute(insert(J).values(policy="agent", state="queued", group_ids=["g1"], metrics={},
                                                progress=0.0, created_at=time.time()))  # fmt: skip
        await engine.dispose()

    asyncio.run(seed_store(url, {"g1": [1.0, 0.0]}))
    asyncio.run(run_worker(settings))  # -> version 1, from the base
    asyncio.run(queue_another(active=0, published=False))  # version 1 is still being published
    asyncio.run(run_worker(settings))  # -> version 2, from version 1 (not from the base still serving)
    asyncio.run(queue_another(active=2, published=True))
    asyncio.run(run_worker(settings))  # -> version 3, from version 2
    asyncio.run(queue_another(active=0, published=True))  # rolled back to the base
    asyncio.run(run_worker(settings))  # -> version 4, from the base again
    jobs = asyncio.run(fetch(url, select(J).order_by(J.c.id)))
    assert [(j.version, j.metrics["trained_from"]) for j in jobs] == [(1, 0), (2, 1), (3, 2), (4, 0)]


def test_samples_from_versions_beyond_the_staleness_limit_are_skipped() -> None:
    fresh = CapturedCall([5, 6, 7], [8, 9], [-1.0, -1.0], version=4)
    stale = CapturedCall([5, 6, 7], [8, 10], [-1.0, -1.0], version=1)
    trajectories = [TrajectoryData("a", "g", 1.0, [fresh]), TrajectoryData("b", "g", 0.0, [stale])]
    batch = build_batch(trajectories, TrainConfig(max_staleness=2), trained_version=4)
    assert len(batch.samples) == 1 and batch.metrics["skipped_stale_samples"] == 1
    assert batch.advantages == [pytest.approx(1.0)]


def test_worker_command_line_builds_its_config_from_flags(tmp_path: Path, tiny_model_dir: Path) -> None:
    import subprocess
    import sys

    url = f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    asyncio.run(seed_store(url, {"g1": [1.0, 0.0]}))
    command = [sys.executable, "-m", "trainer", "--database-url", url, "--data-dir", str(tmp_path),
               "--base-model", str(tiny_model_dir), "--once", "--loss", "cispo", "--lora-r", "8",
               "--learning-rate", "0.001", "--log-level", "warning"]  # fmt: skip
    subprocess.run(command, check=True, timeout=120)
    saved = (tmp_path / "adapters" / "agent" / "1" / "trainer_config.json").read_text()
    assert '"loss": "cispo"' in saved and '"lora_r": 8' in saved
    bad = subprocess.run([*command[:-4], "--lora-r", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "lora_r" in bad.stderr
