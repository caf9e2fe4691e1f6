"""Canary trials in the store: replicas racing to start or end one agree; the trainer goes on from the right version.

Two ``Store`` instances on one database (what two proxy processes hold): SQLite, and PostgreSQL
when TRACETRAIN_TEST_POSTGRES_URL names a database it may wipe.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import insert, update
from test_replicas import database, replicas

from store import AdapterState, Store, TrialState
from store._tables import adapters as A
from store._tables import trajectories as T

__all__ = ["database", "replicas"]


async def trained(store: Store, version: int) -> None:
    await store.policies.ensure("agent", "base")
    await store.adapters.record("agent", version, f"/adapters/agent/{version}", None, {})


async def recorded_as_begun_a_minute_ago(store: Store, version: int) -> None:
    """A step that began a minute ago (before a rollback just made) records its adapter now."""
    await store.adapters.record("agent", version, f"/adapters/agent/{version}", None, {})
    async with store.engine.begin() as conn:
        await conn.execute(update(A).where(A.c.version == version).values(created_at=time.time() - 60))


async def claimed(store: Store, owner: str) -> int:
    (version, _), *_ = await store.adapters.claim_trained("agent", owner, 60, newest_only=True)
    return version


async def test_of_two_replicas_starting_trials_together_one_wins_and_the_other_waits(
    replicas: tuple[Store, Store],
) -> None:
    a, b = replicas
    await trained(a, 1)
    await trained(a, 2)
    one, two = await claimed(a, "a"), await claimed(b, "b")  # the newest each: b claims what is left
    assert (one, two) == (2, 1)

    started = await asyncio.gather(a.trials.start("agent", one, "a", 0.5), b.trials.start("agent", two, "b", 0.5))

    winners = [s for s in started if isinstance(s, dict)]
    assert len(winners) == 1 and "another trial runs" in started
    waiting, owner = (two, "b") if winners[0]["candidate"] == one else (one, "a")
    assert await b.trials.release("agent", waiting, owner)  # its claim given back: trained again, it waits
    states = {row["version"]: row["state"] for row in await a.adapters.of_policy("agent")}
    assert states == {winners[0]["candidate"]: AdapterState.PUBLISHED, waiting: AdapterState.TRAINED}


async def test_of_two_replicas_ending_a_trial_together_one_does(replicas: tuple[Store, Store]) -> None:
    a, b = replicas
    await trained(a, 1)
    trial = await a.trials.start("agent", await claimed(a, "a"), "a", 0.5)
    assert isinstance(trial, dict) and trial["baseline"] == 0

    ended = await asyncio.gather(
        a.trials.promote(trial["id"], by="test", reason="not worse", verdict=None),
        b.trials.roll_back(trial["id"], by="admin", reason="rolled back by an admin", verdict=None),
    )

    assert sorted(ended) == [False, True]
    row = await a.trials.get(trial["id"])
    assert row is not None and row["state"] in (TrialState.PROMOTED, TrialState.ROLLED_BACK)
    promoted = row["state"] == TrialState.PROMOTED
    assert await a.policies.active_version("agent") == (1 if promoted else 0)
    adapter = await a.adapters.get("agent", 1)
    expected = AdapterState.PUBLISHED if promoted else AdapterState.ROLLED_BACK
    assert adapter is not None and adapter["state"] == expected


async def test_the_trainer_goes_on_from_the_version_on_trial_and_after_a_rollback_from_the_baseline(
    replicas: tuple[Store, Store],
) -> None:
    store, _ = replicas
    await trained(store, 1)
    trial = await store.trials.start("agent", await claimed(store, "a"), "a", 0.5)
    assert isinstance(trial, dict)
    assert await store.adapters.version_to_train_on("agent") == 1  # the version on trial, not the one serving
    await trained(store, 2)
    assert await store.adapters.version_to_train_on("agent") == 2

    assert await store.trials.roll_back(trial["id"], by="test", reason="worse", verdict=None)

    assert await store.adapters.version_to_train_on("agent") == 0
    waiting = await store.adapters.get("agent", 2)
    assert waiting is not None and waiting["state"] == AdapterState.DISCARDED and "agent@1" in waiting["error"]
    # A step that began before the rollback, from @1, records after it: discarded when the publisher looks.
    await recorded_as_begun_a_minute_ago(store, 3)
    assert [v for v, _ in await store.guards.discard_stale("agent")] == [3]


async def test_a_step_begun_before_a_rollback_is_never_claimed_even_before_the_publisher_discards_it(
    replicas: tuple[Store, Store],
) -> None:
    # The publisher discards such steps, then claims what is trained: two statements. A step recorded between
    # them must not be claimed (published) by the second; it stays trained until the next discard.
    store, other = replicas
    await trained(store, 1)
    trial = await store.trials.start("agent", await claimed(store, "a"), "a", 0.5)
    assert isinstance(trial, dict)
    assert await store.trials.roll_back(trial["id"], by="test", reason="worse", verdict=None)
    await recorded_as_begun_a_minute_ago(store, 2)  # began before the rollback, from @1
    await store.adapters.record("agent", 3, "/adapters/agent/3", None, {})  # began after it

    assert [v for v, _ in await other.adapters.claim_trained("agent", "b", 60)] == [3]
    assert [v for v, _ in await store.guards.discard_stale("agent")] == [2]


@pytest.mark.parametrize("fraction", [0.1, 0.5])
async def test_a_trial_keeps_its_fraction_and_baseline(replicas: tuple[Store, Store], fraction: float) -> None:
    store, other = replicas
    await trained(store, 1)
    await store.trials.start("agent", await claimed(store, "a"), "a", fraction)
    running = await other.trials.running("agent")
    assert running is not None and (running["fraction"], running["baseline"], running["candidate"]) == (fraction, 0, 1)


async def test_a_policy_keeps_its_newest_trials_and_forgets_the_older_ended_ones(
    replicas: tuple[Store, Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    import store._trials

    monkeypatch.setattr(store._trials, "KEEP_TRIALS", 3)
    a, _ = replicas
    ids = []
    for version in range(1, 6):
        await trained(a, version)
        trial = await a.trials.start("agent", await claimed(a, "a"), "a", 0.5)
        assert isinstance(trial, dict)
        ids.append(trial["id"])
        assert await a.trials.promote(trial["id"], by="test", reason="not worse", verdict=None)
    assert [t["id"] for t in await a.trials.newest("agent", 100)] == ids[::-1][:3]
    assert await a.trials.counts("agent") == {"promoted": 3}


async def test_the_units_outside_mixed_groups_are_the_groups_one_version_served_wholly(
    replicas: tuple[Store, Store],
) -> None:
    a, b = replicas
    await trained(a, 1)
    trial = await a.trials.start("agent", await claimed(a, "a"), "a", 0.5)
    assert isinstance(trial, dict)
    t0 = float(trial["started_at"])
    rows = [  # (id, group, version, begun after the trial's start, reward, calls recorded)
        ("alone-1", "alone-1", 1, 1.0, 0.0, 1), ("alone-0", "alone-0", 0, 2.0, None, 2),
        ("mixed-a", "mixed", 0, 3.0, 1.0, 1), ("mixed-b", "mixed", 1, 3.0, 0.0, 1),
        ("one-a", "one", 0, 4.0, 1.0, 1), ("one-b", "one", 0, 5.0, 0.5, 1),
        ("before", "before", 1, -5.0, 0.0, 1), ("no-call", "no-call", 1, 6.0, None, 0),
    ]  # fmt: skip
    async with a.engine.begin() as conn:
        for trajectory, group, version, at, reward, n_calls in rows:
            await conn.execute(insert(T).values(
                id=trajectory, group_id=group, policy="agent", keyed_by="header", created_at=t0 + at,
                updated_at=t0 + at + 1, n_calls=n_calls, last_version=version, reward=reward,
                rewarded_at=None if reward is None else t0 + at + 2, metrics={},
            ))  # fmt: skip

    units = await b.trials.units(trial)

    assert [(u.group_id, u.version, u.complete, u.mean) for u in units] == [
        ("alone-1", 1, True, 0.0), ("alone-0", 0, False, 0.0), ("one", 0, True, 0.75)]  # fmt: skip
    assert units[2].begun_at == t0 + 4.0 and units[2].active_at == t0 + 6.0 and units[2].rewarded_at == t0 + 7.0
