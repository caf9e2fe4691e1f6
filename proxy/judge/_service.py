"""Judging groups: which groups the judge scores, when, and how its scores are written.

Each policy's reward source decides what the judge's scores are for (``--reward-source``, or the
policy's own: ``proxy._policy_config``):

- ``external`` (the default): rewards are POSTed to ``/v1/rewards``. Nothing is judged
  on its own; ``POST /admin/groups/{id}/judge`` records the judge's scores beside the
  external rewards (a way to try the judge before relying on it).
- ``judge``: the judge's scores are the rewards. Groups are judged automatically, and
  the scores become the trajectories' rewards, so the group turns ready and trains.
  ``POST /v1/rewards`` is refused (409): one group must not mix reward sources.
- ``both``: external rewards train; every group is judged too and the judge's scores are
  recorded beside them (``rewards`` rows with source "judge"), never replacing them.
- ``human``: people score (the dashboard's review queue); nothing is judged on its own.

A person's score (source "human") is never replaced by the judge's: with ``judge`` the judge's
score is recorded beside it, and the trajectory keeps the person's.

When a group is complete. An agent whose rewards come from the judge posts nothing, so
the proxy cannot know that a trajectory ended. A group is judged once it has at least
``min_group_size`` trajectories and

- it has ``group_size`` of them and none changed for ``judge_quiet_s`` (a full group at rest), or
- with ``both``, all are rewarded externally and none changed for ``judge_quiet_s``, or
- none changed for ``judge_idle_s`` (a group that will not fill up).

``judge_quiet_s`` must outlast the agent's longest pause between two calls of a
trajectory, or a trajectory may be judged before it ends.

A background task scans each such policy's groups every few seconds (only groups created in the
last ``_HORIZON_S``: the scan stays cheap, and switching a proxy with a long history to
``both`` does not judge all of it) and judges them off the request path,
``judge_concurrency`` at a time. With ``judge`` a group is a candidate while some
trajectory lacks a reward; with ``both`` while it changed since its last successful
judgement. A failed group is tried again when it changes, or after ``judge_idle_s``; an
admin can always ask at once.

One judgement (its prompt, the cache, the writes): ``proxy.judge._judgement``.

``--reward-timeout`` judges a complete group whose rewards did not come (trigger "timeout",
``proxy.judge._timeout``): whatever ``--reward-source`` says, those scores become
the rewards of the whole group.

Several proxy replicas each run this scan; a group is judged by one of them at a time, under a
claim in the store (``proxy.judge._claims``), which asks again under the claim whether the group
is still due (another replica may have judged it since the scan read the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from proxy._periodic import every
from proxy._settings import Settings
from proxy.errors import Conflict, InvalidRequest, ProxyError
from proxy.gateway import PolicyRegistry
from proxy.judge._claims import JUDGE_LEASE_S, GroupClaims
from proxy.judge._judgement import GroupJudge, judgement_view
from proxy.training._scheduler import JobScheduler
from store import JUDGEMENT_STATES, DueRule, Store

log = logging.getLogger("tracetrain.judge")

_HORIZON_S = 24 * 3600.0


class JudgeService:
    """Judges groups on demand and, unless rewards are external only, as they complete."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        registry: PolicyRegistry,
        scheduler: JobScheduler,
        *,
        backoff_s: float = 1.0,
        lease_s: float = JUDGE_LEASE_S,
    ) -> None:
        self._settings = settings
        self._store = store
        self._claims = GroupClaims(store, lease_s=lease_s)
        self._judge = GroupJudge(settings, store, registry, scheduler, owner=self._claims.owner, backoff_s=backoff_s)
        self._slots = asyncio.Semaphore(settings.judge_concurrency)
        self._queued: set[str] = set()  # groups the scan handed to a background task
        # When each group's last judgement here ended: a scan that read the store before then
        # has not seen what that judgement wrote, so it must not start the group again.
        self._ended: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._scanner: asyncio.Task[None] | None = None
        self._registry = registry
        # As often as the shortest wait the server's and the named policies' settings ask for (a policy added at
        # run time with a shorter one is scanned at this pace, every 5 s at most).
        waits = [settings.judge_quiet_s, settings.judge_idle_s]
        waits += [w for o in settings.policy_configs.values() for w in (o.judge_quiet_s, o.judge_idle_s) if w]
        self._scan_s = min(max(min(waits) / 2, 0.05), 5.0)

    @property
    def automatic(self) -> bool:
        """Some served policy's groups are judged as they complete (its reward source is ``judge`` or ``both``)."""
        return any(served.settings.reward_source in ("judge", "both") for served in self._registry)

    def start(self) -> None:
        """Start the background scan: it judges the groups of the policies served now whose rewards come from
        (or beside) the judge, and reads nothing while there are none."""
        if self._scanner is None:
            self._scanner = asyncio.create_task(
                every(self._scan_s, self.scan_once, log, "scanning for groups to judge failed"),
                name="tracetrain-judge-scan",
            )

    async def close(self) -> None:
        """Stop scanning and cancel judgements in flight (they write nothing, or everything)."""
        tasks = [*self._tasks, *([self._scanner] if self._scanner else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._scanner = None

    # -- on demand --------------------------------------------------------------------

    async def judge_group(self, group_id: str, *, trigger: str = "admin") -> dict[str, Any]:
        """Judge one group now and return the judgement (state "ok" or "failed", with the reason).

        Raises ``Conflict`` while another replica judges it.
        """
        judged = await self._judge_claimed(group_id, trigger, only_if_due=False)
        if judged is None:
            await self._judge.load(group_id)  # a group that does not exist is a 404, not a conflict
            raise Conflict(f"Group '{group_id}' is being judged by another replica; ask again once it is done.",
                           param="group_id", code="group_being_judged")  # fmt: skip
        return judged

    async def _judge_claimed(self, group_id: str, trigger: str, *, only_if_due: bool) -> dict[str, Any] | None:
        """Judge under the group's claim; None if another replica has it (or, ``only_if_due``, when the
        group is no longer due once claimed)."""
        async with self._claims.hold(group_id) as claimed:
            if not claimed or (only_if_due and not await self._due(group_id)):
                return None
            return await self._judge.judge(group_id, trigger)

    async def list_judgements(self, *, group_id: str | None, state: str | None, limit: int) -> dict[str, Any]:
        """Judgements, newest first."""
        if state is not None and state not in JUDGEMENT_STATES:
            raise InvalidRequest(f"'state' must be one of {', '.join(JUDGEMENT_STATES)}.", param="state")
        rows = await self._store.judgements.find(group_id=group_id, state=state, limit=limit)
        return {"object": "list", "data": [judgement_view(r) for r in rows]}

    # -- automatic --------------------------------------------------------------------

    async def scan_once(self) -> list[str]:
        """Start judging every complete group not judged yet; returns the groups started."""
        started = []
        scan_began = time.monotonic()
        for group_id, trigger in await self._due():
            if group_id in self._queued or group_id in self._claims or self._ended.get(group_id, 0.0) >= scan_began:
                continue
            self._queued.add(group_id)
            task = asyncio.create_task(self._judge_in_background(group_id, trigger), name=f"judge-{group_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            started.append(group_id)
        return started

    async def _judge_in_background(self, group_id: str, trigger: str) -> None:
        try:
            async with self._slots:
                if await self._judge_claimed(group_id, trigger, only_if_due=True) is None:
                    log.debug("group %s is judged by another replica, or was judged meanwhile", group_id)
        except ProxyError as exc:  # e.g. a job took the group meanwhile
            log.info("group %s was not judged: %s", group_id, exc.message)
        except Exception:  # a bug or an unreachable store: logged; the group is tried again later
            log.exception("judging group %s failed", group_id)
        finally:
            self._queued.discard(group_id)
            self._ended[group_id] = time.monotonic()
            if len(self._ended) > 10_000:  # only recent ends matter: forget the older half
                for stale in sorted(self._ended, key=self._ended.__getitem__)[:5_000]:
                    del self._ended[stale]

    async def _due(self, group_id: str | None = None) -> list[tuple[str, str]]:
        """(group id, trigger) of the groups to judge now, of every policy judged as its groups complete (of
        ``group_id`` alone, if given)."""
        due = []
        for served in self._registry:
            s = served.settings
            if s.reward_source not in ("judge", "both"):
                continue  # posted rewards, or people's scores: nothing is judged on its own
            rule = DueRule(
                policy=s.name, scores_are_rewards=s.reward_source == "judge", group_size=s.group_size,
                min_group_size=s.min_group_size, quiet_s=s.judge_quiet_s, idle_s=s.judge_idle_s, horizon_s=_HORIZON_S,
            )  # fmt: skip
            due += await self._store.judgements.due(rule, group_id)
        return due
