"""Each step's sampler/learner gap and multi-turn accounting, from the store: the warning and /metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import insert

from proxy.observability._metrics import Metrics
from proxy.training._step_watch import StepWatch, stays_high
from store import Store
from store._tables import groups, trajectories


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'tracetrain.db'}", capture=False)
    yield opened
    await opened.close()


async def finish_step(store: Store, version: int, metrics: dict[str, object]) -> None:
    """A job over one rewarded group, claimed and finished the way the trainer does it."""
    now, group_id = time.time(), f"g{version}"
    async with store.engine.begin() as conn:
        await conn.execute(insert(groups).values(id=group_id, policy="agent", state="open", created_at=now))
        await conn.execute(
            insert(trajectories).values(id=f"t{version}", group_id=group_id, policy="agent", keyed_by="header",
                                        created_at=now, updated_at=now, reward=1.0, metrics={})
        )  # fmt: skip
    job_id = await store.jobs.create("agent", [group_id])
    assert job_id is not None and await store.jobs.claim("agent", "w:1", lease_s=60) is not None
    assert await store.jobs.finish(job_id, "w:1", ok=True, metrics=metrics, version=version, error=None)


def test_a_gap_stays_high_only_when_every_one_of_the_last_steps_is_high() -> None:
    assert stays_high([0.05, 0.05, 0.05], 0.01, 3)
    assert not stays_high([0.05, 0.05], 0.01, 3)  # not enough steps yet
    assert not stays_high([0.05, 0.001, 0.05], 0.01, 3)
    assert not stays_high([0.05, None, 0.05], 0.01, 3)  # a step with nothing on-policy measures nothing...
    assert stays_high([0.05, None, 0.05, 0.05], 0.01, 3)  # ...and does not break a run


async def test_the_proxy_warns_once_when_the_gap_stays_high_and_says_when_it_falls(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    watch = StepWatch(store, threshold=0.01, steps=3)
    caplog.set_level(logging.INFO, logger="tracetrain.training")
    for version, gap in enumerate([0.002, 0.05, None, 0.04, 0.06, 0.07], start=1):
        await finish_step(store, version, {"logprob_mismatch_on_policy": gap, "sampler_correction": "none"})
        await watch.check_once()
        await watch.check_once()  # the same step read twice counts once
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "differ by 0.06 nats" in warnings[0].getMessage()
    assert "version 5" in warnings[0].getMessage()
    await finish_step(store, 7, {"logprob_mismatch_on_policy": 0.001})
    await watch.check_once()
    assert not watch.warned and "back under" in caplog.records[-1].getMessage()


async def test_metrics_show_the_newest_steps_gap_and_turn_accounting(store: Store) -> None:
    await finish_step(store, 1, {"logprob_mismatch_mean": 0.5, "calls_per_trajectory": 9.0})
    await finish_step(store, 2, {"logprob_mismatch_mean": 0.031, "logprob_mismatch_on_policy": 0.002,
                                 "calls_per_trajectory": 3.0, "samples_per_trajectory": 1.5,
                                 "samples_split_rerendered": 4, "trained_token_share": 0.9, "loss": 0.1,
                                 "forwarded_tokens": 1800, "forwarded_per_sampled_token": 2.5})  # fmt: skip
    metrics = Metrics()
    text = (await metrics.render(store, loaded_versions={"agent": 1})).decode()
    assert 'tracetrain_training_last_step{metric="logprob_mismatch_mean",policy="agent"} 0.031' in text
    assert 'tracetrain_training_last_step{metric="calls_per_trajectory",policy="agent"} 3.0' in text
    assert 'tracetrain_training_last_step{metric="samples_split_rerendered",policy="agent"} 4.0' in text
    assert 'tracetrain_training_last_step{metric="forwarded_per_sampled_token",policy="agent"} 2.5' in text
    assert 'metric="loss"' not in text  # a fixed set of series, not every key a step records
