"""One judgement of one group: the prompt, the cache, the judge model, and the write of all its scores.

Writing. All of a group's scores are written in one transaction, together with the
``judgements`` row: a ``rewards`` row per trajectory (source "judge", the explanation)
and, when the scores are the rewards, each trajectory's reward. If the group changed while
it was judged (a trajectory joined) or a job took it, nothing is written but a failed
judgement saying so. A failure (after the judge's bounded retries) writes only its failed
``judgements`` row, with the reason and the attempts: never a partial group.

The cache. A judgement's ``cache_key`` hashes the judge model and the whole prompt (the
rubric and every message); an ok judgement with the same key is reused without asking
the model, so re-judging an unchanged group, or a restart, costs nothing.

Each group is judged with its policy's settings (its reward source, judge model and rubric:
``proxy._policy_config``); the attempts and the time limit are the server's.

The default judge is the base model vLLM serves (``hosted_vllm/<base model>`` at the
proxy's upstream, no key needed): weak but free. Its requests go to vLLM directly, so
they are never captured as the policy's trajectories. A stronger judge is one setting
away: ``--judge-model openai/gpt-4o-mini`` with ``OPENAI_API_KEY`` in the environment. A policy may choose
another judge only among those the operator configured (``--judge-model``, ``--judge``): the URL a judge's
requests go to, and the key they carry, are never the admin API's to set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy._policy_config import PolicySettings, policy_settings, unconfigured_judge
from proxy._settings import Settings
from proxy.errors import Conflict, GroupNotFound
from proxy.gateway import PolicyRegistry
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
from store import GroupChanged, GroupState, Store

log = logging.getLogger("tracetrain.judge")

_JUDGEMENT_FIELDS = ("id", "group_id", "policy", "reward_source", "trigger", "state", "model", "cache_key", "cached",
                     "attempts", "n_trajectories", "scores", "error", "usage", "started_at", "finished_at")  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Group:
    id: str
    state: str
    trajectories: list[TrajectoryText]
    policy: str


class GroupJudge:
    """Judges one group when asked and writes what came of it; the caller holds the group's claim (``owner``)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        registry: PolicyRegistry,
        scheduler: JobScheduler,
        *,
        owner: str,
        backoff_s: float,
    ) -> None:
        self._settings = settings
        self._store = store
        self._registry = registry
        self._scheduler = scheduler
        self._owner = owner
        self._backoff_s = backoff_s

    def policy_settings(self, policy: str) -> PolicySettings:
        """The settings a group of ``policy`` is judged with: the served policy's, else (a retired one's, judged
        on an admin's demand) the server's."""
        if policy in self._registry:
            return self._registry.get(policy).settings
        return policy_settings(policy, self._settings.policy_defaults)

    async def judge(self, group_id: str, trigger: str) -> dict[str, Any]:
        """The judgement of ``group_id`` (state "ok", or "failed" with the reason), written to the store."""
        started = time.time()
        group = await self.load(group_id)
        policy = self.policy_settings(group.policy)
        source = policy.reward_source
        # --reward-timeout: the scores of a group whose rewards did not come become its rewards.
        as_rewards = source == "judge" or trigger == "timeout"
        if as_rewards and group.state != GroupState.OPEN:
            raise Conflict(
                f"Group '{group_id}' is {group.state}: its rewards are fixed once a training job took it.",
                param="group_id",
            )
        prompt = build_prompt(group.trajectories, policy.judge_rubric or DEFAULT_RUBRIC)
        try:
            model, api_base = self._model(policy)
        except _Unconfigured as exc:
            row = _new_row(group.policy, group, "judge" if as_rewards else source, trigger, policy.judge_model or "",
                           "", started)  # fmt: skip
            return await self._record_failure(row, str(exc), attempts=0)
        row = _new_row(group.policy, group, "judge" if as_rewards else source, trigger, model,
                       prompt.cache_key(model) if model else "", started)  # fmt: skip
        if not model:
            reason = "the judge is the base model served upstream, which is not known yet (is vLLM up?)"
            return await self._record_failure(row | {"model": "hosted_vllm/?"}, reason, attempts=0)
        scores = await self._cached(row["cache_key"])
        if scores is not None:
            row["cached"] = True
        else:
            judge = Judge(model, api_base=api_base, max_attempts=self._settings.judge_max_attempts,
                          backoff_s=self._backoff_s, timeout_s=self._settings.upstream_timeout_s)  # fmt: skip
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
        log.info("judged group %s (%d trajectories%s)", group_id, len(scores), ", cached" if row["cached"] else "")
        return judgement_view(row)

    async def load(self, group_id: str) -> _Group:
        """The group's trajectories as the judge reads them; ``GroupNotFound`` if it has none."""
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
        return _Group(group_id, stored.state, texts, stored.policy)

    def _model(self, policy: PolicySettings) -> tuple[str, str | None]:
        """The litellm model name and its api_base; ("", None) while the default judge is unknown.

        Raises ``_Unconfigured`` for a model the operator did not configure (a policy's stored settings from before
        it was taken off the server's list): no request leaves for a URL or with a key nobody chose."""
        model = policy.judge_model
        if model is None:  # the default judge: the base model, at the proxy's upstream
            if self._registry.base_model is None:
                return "", None
            return f"hosted_vllm/{self._registry.base_model}", self._settings.upstream
        endpoints = self._settings.judge_endpoints
        if problem := unconfigured_judge(model, endpoints):
            raise _Unconfigured(problem)
        api_base = endpoints[model]
        if api_base is None and model.startswith("hosted_vllm/"):
            api_base = self._settings.upstream
        return model, api_base

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
        await self._scheduler.rewards_written(rewards, may_train=as_rewards)

    async def _record_failure(
        self, row: dict[str, Any], reason: str, *, attempts: int, usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        row |= {"state": "failed", "error": reason, "attempts": attempts, "finished_at": time.time()}
        if usage is not None:
            row["usage"] = usage
        row["id"] = await self._store.judgements.record(row)
        return judgement_view(row)


class _Unconfigured(Exception):
    """The policy's judge is not one the operator configured; the message says which are."""


def _new_row(
    policy: str, group: _Group, source: str, trigger: str, model: str, key: str, started: float
) -> dict[str, Any]:
    return {
        "group_id": group.id, "policy": policy, "reward_source": source, "trigger": trigger, "model": model,
        "cache_key": key, "cached": False, "attempts": 0, "n_trajectories": len(group.trajectories), "scores": [],
        "error": None, "usage": {}, "started_at": started,
    }  # fmt: skip


def _score_rows(prompt: JudgePrompt, scores: Sequence[Score]) -> list[dict[str, Any]]:
    return [
        {"trajectory_id": tid, "label": s.id, "score": s.score, "explanation": s.explanation}
        for tid, s in zip(prompt.trajectory_ids, scores, strict=True)
    ]


def judgement_view(row: Any) -> dict[str, Any]:
    return {"object": "judgement", **{name: row.get(name) for name in _JUDGEMENT_FIELDS}}
