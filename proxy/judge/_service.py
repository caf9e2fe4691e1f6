"""Judging groups: which groups the judge scores, when, and how its scores are written.

The proxy's ``--reward-source`` decides what the judge's scores are for:

- ``external`` (the default): rewards are POSTed to ``/v1/rewards``. Nothing is judged
  on its own; ``POST /admin/groups/{id}/judge`` records the judge's scores beside the
  external rewards (a way to try the judge before relying on it).
- ``judge``: the judge's scores are the rewards. Groups are judged automatically, and
  the scores become the trajectories' rewards, so the group turns ready and trains.
  ``POST /v1/rewards`` is refused (409): one group must not mix reward sources.
- ``both``: external rewards train; every group is judged too and the judge's scores are
  recorded beside them (``rewards`` rows with source "judge"), never replacing them.

When a group is complete. An agent whose rewards come from the judge posts nothing, so
the proxy cannot know that a trajectory ended. A group is judged once it has at least
``min_group_size`` trajectories and

- it has ``group_size`` of them and none changed for ``judge_quiet_s`` (a full group at rest), or
- with ``both``, all are rewarded externally and none changed for ``judge_quiet_s``, or
- none changed for ``judge_idle_s`` (a group that will not fill up).

``judge_quiet_s`` must outlast the agent's longest pause between two calls of a
trajectory, or a trajectory may be judged before it ends.

A background task scans for such groups every few seconds (only groups created in the
last ``_HORIZON_S``: the scan stays cheap, and switching a proxy with a long history to
``both`` does not judge all of it) and judges them off the request path,
``judge_concurrency`` at a time. With ``judge`` a group is a candidate while some
trajectory lacks a reward; with ``both`` while it changed since its last successful
judgement. A failed group is tried again when it changes, or after ``judge_idle_s``; an
admin can always ask at once.

Writing. All of a group's scores are written in one transaction, together with the
``judgements`` row: a ``rewards`` row per trajectory (source "judge", the explanation)
and, with ``judge``, each trajectory's reward. If the group changed while it was judged
(a trajectory joined) or a job took it, nothing is written but a failed judgement
saying so. A failure (after the judge's bounded retries) writes only its failed
``judgements`` row, with the reason and the attempts: never a partial group, never a
blocked request (judging runs in its own tasks; errors are caught there and recorded).

The cache. A judgement's ``cache_key`` hashes the judge model and the whole prompt (the
rubric and every message); an ok judgement with the same key is reused without asking
the model, so re-judging an unchanged group, or a restart, costs nothing.

The default judge is the base model vLLM serves (``hosted_vllm/<base model>`` at the
proxy's upstream, no key needed): weak but free. Its requests go to vLLM directly, so
they are never captured as the policy's trajectories. A stronger judge is one setting
away: ``--judge-model openai/gpt-4o-mini`` with ``OPENAI_API_KEY`` in the environment.

``--reward-timeout`` judges a complete group whose rewards did not come (trigger "timeout",
``proxy.training._reward_timeout``): whatever ``--reward-source`` says, those scores become
the rewards of the whole group.

Several proxy replicas each run this scan; a group is judged by one of them at a time.
A judge claims the group in the store first (an owner and a lease, renewed every third of
it while the judge model thinks), asks again under the claim whether the group is still
due (another replica may have judged it since the scan read the store), and writes only
while the claim is its own. A replica that finds the claim taken skips the group; an admin
who asks then gets a 409. A replica that died mid-judgement leaves a claim that runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy._settings import Settings
from proxy.data._wire import reward_view
from proxy.errors import Conflict, GroupNotFound, InvalidRequest, ProxyError
from proxy.gateway._policies import PolicyRegistry
from proxy.judge._client import Judge, JudgeFailed
from proxy.judge._prompt import (
    DEFAULT_RUBRIC,
    JudgePrompt,
    Score,
    TrajectoryText,
    build_prompt,
    call_messages,
    trajectory_messages,
)
from proxy.training._scheduler import JobScheduler
from store import JUDGEMENT_STATES, DueRule, GroupChanged, GroupState, Store

log = logging.getLogger("tracetrain.judge")

_HORIZON_S = 24 * 3600.0
# A judge's claim on a group: renewed every third of it while the judge model thinks, so only a
# dead replica's claim runs out (and its group waits this long for another replica).
JUDGE_LEASE_S = 60.0
_JUDGEMENT_FIELDS = ("id", "group_id", "policy", "reward_source", "trigger", "state", "model", "cache_key", "cached",
                     "attempts", "n_trajectories", "scores", "error", "usage", "started_at", "finished_at")  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Group:
    id: str
    state: str
    trajectories: list[TrajectoryText]


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
        on_rewards: Callable[[list[dict[str, Any]]], None] | None = None,
        lease_s: float = JUDGE_LEASE_S,
    ) -> None:
        self._settings = settings
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"  # this judge's claims
        self._lease_s = lease_s
        self._on_rewards = on_rewards  # told of every reward written, as POST /v1/rewards answers them (metrics)
        self._store = store
        self._registry = registry
        self._scheduler = scheduler
        self._backoff_s = backoff_s
        self._rubric = settings.judge_rubric or DEFAULT_RUBRIC
        self._slots = asyncio.Semaphore(settings.judge_concurrency)
        self._queued: set[str] = set()  # groups the scan handed to a background task
        # When each group's last judgement here ended: a scan that read the store before then
        # has not seen what that judgement wrote, so it must not start the group again.
        self._ended: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # one judgement of a group at a time, per process
        self._lock_users: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._scanner: asyncio.Task[None] | None = None
        self._scan_s = min(max(min(settings.judge_quiet_s, settings.judge_idle_s) / 2, 0.05), 5.0)

    @property
    def automatic(self) -> bool:
        return self._settings.reward_source != "external"

    def start(self) -> None:
        """Start the background scan (with ``judge`` or ``both``)."""
        if self.automatic and self._scanner is None:
            self._scanner = asyncio.create_task(self._scan_forever(), name="tracetrain-judge-scan")

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
            await self._load(group_id)  # a group that does not exist is a 404, not a conflict
            raise Conflict(f"Group '{group_id}' is being judged by another replica; ask again once it is done.",
                           param="group_id", code="group_being_judged")  # fmt: skip
        return judged

    async def _judge_claimed(self, group_id: str, trigger: str, *, only_if_due: bool) -> dict[str, Any] | None:
        """Judge under this process's lock and the store's claim; None if another replica has the claim
        (or, ``only_if_due``, when the group is no longer due once claimed)."""
        lock = self._locks.setdefault(group_id, asyncio.Lock())
        self._lock_users[group_id] = self._lock_users.get(group_id, 0) + 1
        try:
            async with lock, self._claim(group_id) as claimed:
                if not claimed or (only_if_due and not await self._due(group_id)):
                    return None
                return await self._judge(group_id, trigger)
        finally:
            self._lock_users[group_id] -= 1
            if not self._lock_users[group_id]:
                del self._lock_users[group_id], self._locks[group_id]

    @contextlib.asynccontextmanager
    async def _claim(self, group_id: str) -> AsyncIterator[bool]:
        """The store's claim on the group, renewed while the block runs and given back after it."""
        judgements = self._store.judgements
        if not await judgements.claim(group_id, self._owner, self._lease_s):
            yield False
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(self._lease_s / 3)
                if not await judgements.renew(group_id, self._owner, self._lease_s):
                    return  # taken over: the write will say so

        renewing = asyncio.create_task(renew(), name=f"judge-claim-{group_id}")
        try:
            yield True
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await renewing
            await judgements.release(group_id, self._owner)

    async def list_judgements(self, *, group_id: str | None, state: str | None, limit: int) -> dict[str, Any]:
        """Judgements, newest first."""
        if state is not None and state not in JUDGEMENT_STATES:
            raise InvalidRequest(f"'state' must be one of {', '.join(JUDGEMENT_STATES)}.", param="state")
        rows = await self._store.judgements.find(group_id=group_id, state=state, limit=limit)
        return {"object": "list", "data": [judgement_view(r) for r in rows]}

    # -- one judgement ----------------------------------------------------------------

    async def _judge(self, group_id: str, trigger: str) -> dict[str, Any]:
        started = time.time()
        group = await self._load(group_id)
        source = self._settings.reward_source
        # --reward-timeout: the scores of a group whose rewards did not come become its rewards.
        as_rewards = source == "judge" or trigger == "timeout"
        if as_rewards and group.state != GroupState.OPEN:
            raise Conflict(
                f"Group '{group_id}' is {group.state}: its rewards are fixed once a training job took it.",
                param="group_id",
            )
        model, api_base = self._model()
        prompt = build_prompt(group.trajectories, self._rubric)
        key = prompt.cache_key(model) if model else ""
        row: dict[str, Any] = {
            "group_id": group_id,
            "policy": self._settings.policy,
            "reward_source": "judge" if as_rewards else source,
            "trigger": trigger,
            "model": model,
            "cache_key": key,
            "cached": False,
            "attempts": 0,
            "n_trajectories": len(group.trajectories),
            "scores": [],
            "error": None,
            "usage": {},
            "started_at": started,
        }
        if not model:
            reason = "the judge is the base model served upstream, which is not known yet (is vLLM up?)"
            return await self._record_failure(row | {"model": "hosted_vllm/?"}, reason, attempts=0)
        scores = await self._cached(key)
        if scores is not None:
            row["cached"] = True
        else:
            judge = Judge(
                model,
                api_base=api_base,
                max_attempts=self._settings.judge_max_attempts,
                backoff_s=self._backoff_s,
                timeout_s=self._settings.upstream_timeout_s,
            )
            try:
                verdict = await judge.judge(prompt)
            except JudgeFailed as exc:
                log.warning("judging group %s failed after %d attempts: %s", group_id, exc.attempts, exc.reason)
                return await self._record_failure(row, exc.reason, attempts=exc.attempts, usage=exc.usage)
            scores = verdict.scores
            row |= {"attempts": verdict.attempts, "usage": verdict.usage}
        row["scores"] = _score_rows(prompt, scores)
        try:
            await self._write(row, group, as_rewards)
        except GroupChanged as exc:
            return await self._record_failure(row | {"scores": []}, str(exc), attempts=row["attempts"])
        if as_rewards:
            await self._scheduler.maybe_create_job()
        log.info("judged group %s (%d trajectories%s)", group_id, len(scores), ", cached" if row["cached"] else "")
        return judgement_view(row)

    def _model(self) -> tuple[str, str | None]:
        """The litellm model name and its api_base; ("", None) while the default judge is unknown."""
        settings = self._settings
        model = settings.judge_model
        if model is None:
            if self._registry.base_model is None:
                return "", None
            model = f"hosted_vllm/{self._registry.base_model}"
        api_base = settings.judge_api_base
        if api_base is None and model.startswith("hosted_vllm/"):
            api_base = settings.upstream
        return model, api_base

    async def _load(self, group_id: str) -> _Group:
        stored = await self._store.judgements.group_calls(group_id)
        if stored is None:
            raise GroupNotFound(f"No group with id '{group_id}'.", param="group_id")
        texts = [
            TrajectoryText(
                tid, trajectory_messages([call_messages(c["endpoint"], c["request"] or {}, c["response"], c["error"])
                                          for c in calls])
            )
            for tid, calls in stored.calls.items()
        ]  # fmt: skip
        if not texts:
            raise GroupNotFound(f"Group '{group_id}' has no trajectories.", param="group_id")
        return _Group(group_id, stored.state, texts)

    async def _cached(self, key: str) -> list[Score] | None:
        rows = await self._store.judgements.cached_scores(key)
        if rows is None:
            return None
        return [Score(id=s["label"], score=s["score"], explanation=s["explanation"]) for s in rows]

    async def _write(self, row: dict[str, Any], group: _Group, as_rewards: bool) -> None:
        """The scores and the judgement, in one transaction; ``GroupChanged`` if the group moved on."""
        judged = [t.trajectory_id for t in group.trajectories]
        rewards = await self._store.judgements.write_scores(
            row, judged, scores_are_rewards=as_rewards, owner=self._owner
        )
        if self._on_rewards is not None:
            self._on_rewards([reward_view(r) for r in rewards])

    async def _record_failure(
        self, row: dict[str, Any], reason: str, *, attempts: int, usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        row |= {"state": "failed", "error": reason, "attempts": attempts, "finished_at": time.time()}
        if usage is not None:
            row["usage"] = usage
        row["id"] = await self._store.judgements.record(row)
        return judgement_view(row)

    # -- automatic --------------------------------------------------------------------

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan_once()
            except Exception:  # the store may be briefly unavailable; serving goes on, the next scan retries
                log.exception("scanning for groups to judge failed")
            await asyncio.sleep(self._scan_s)

    async def scan_once(self) -> list[str]:
        """Start judging every complete group not judged yet; returns the groups started."""
        started = []
        scan_began = time.monotonic()
        for group_id, trigger in await self._due():
            if group_id in self._queued or group_id in self._locks or self._ended.get(group_id, 0.0) >= scan_began:
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
        """(group id, trigger) of the groups to judge now (of ``group_id`` alone, if given)."""
        s = self._settings
        rule = DueRule(
            policy=s.policy, scores_are_rewards=s.reward_source == "judge", group_size=s.group_size,
            min_group_size=s.min_group_size, quiet_s=s.judge_quiet_s, idle_s=s.judge_idle_s, horizon_s=_HORIZON_S,
        )  # fmt: skip
        return await self._store.judgements.due(rule, group_id)


def _score_rows(prompt: JudgePrompt, scores: Sequence[Score]) -> list[dict[str, Any]]:
    return [
        {"trajectory_id": tid, "label": s.id, "score": s.score, "explanation": s.explanation}
        for tid, s in zip(prompt.trajectory_ids, scores, strict=True)
    ]


def judgement_view(row: Any) -> dict[str, Any]:
    return {"object": "judgement", **{name: row.get(name) for name in _JUDGEMENT_FIELDS}}


def refuse_external_rewards(settings: Settings) -> None:
    """With ``--reward-source judge`` the judge alone rewards: a posted reward is a 409."""
    if settings.reward_source == "judge":
        raise Conflict(
            "This proxy runs with --reward-source judge: rewards come from the LLM judge, and one group must not mix "
            "sources. Restart it with --reward-source both to post rewards and record the judge's scores beside "
            "them, or with external to post rewards only. Nothing was recorded.",
            code="rewards_come_from_the_judge",
        )
