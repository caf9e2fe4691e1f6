"""The admin service: what the dashboard shows, read from the store.

Every page of the dashboard renders one of these results, and the admin JSON API
returns the same result, so whatever an operator sees can also be scripted. Each function
reads what ``Sources`` names: the app's services (``proxy._services.Services``) are such.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Protocol

from proxy._settings import Settings
from proxy.admin._token_texts import TokenTexts
from proxy.data import _service as _data
from proxy.data._wire import trajectory_view
from proxy.errors import Conflict, NotFound, ProxyError
from proxy.gateway import PolicyRegistry
from proxy.gateway.upstream import Router, Server
from proxy.judge import JudgeService
from proxy.observability import Metrics
from proxy.observability._disk import DiskWatch
from proxy.training import Canary, HandoverCoordinator, JobScheduler, Publisher
from proxy.training._guard import resume_training as resume
from store import (
    ADAPTER_FIELDS,
    JOB_FIELDS,
    JobState,
    Store,
    TrainingState,
)
from tracetrain_core import call_messages, call_reply, common_prefix, same_message
from tracetrain_core import group_advantages as advantages_of

# What the training page plots, from each succeeded job's metrics.
CURVES = ("reward_mean", "loss", "logprob_mismatch_mean")


class Sources(Protocol):
    """What the admin service reads: the settings, the store, and what each feature knows now."""

    @property
    def settings(self) -> Settings: ...
    @property
    def store(self) -> Store: ...
    @property
    def registry(self) -> PolicyRegistry: ...
    @property
    def router(self) -> Router: ...
    @property
    def scheduler(self) -> JobScheduler: ...
    @property
    def publisher(self) -> Publisher: ...
    @property
    def canary(self) -> Canary: ...
    @property
    def judging(self) -> JudgeService: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def token_texts(self) -> TokenTexts: ...
    @property
    def handover(self) -> HandoverCoordinator | None: ...
    @property
    def disk(self) -> DiskWatch | None: ...


async def overview(services: Sources, policy: str | None = None) -> dict[str, Any]:
    """Traffic, data, training and serving at a glance: of every policy, or of ``policy`` alone."""
    store = services.store
    traffic = await store.reads.traffic()
    jobs = await store.jobs.counts(policy)
    last_step = await store.jobs.last(JobState.SUCCEEDED, policy)
    running = await store.jobs.last(JobState.RUNNING, policy)
    total, rewarded = traffic["trajectories"], traffic["rewarded"]
    policies = [p for p in await store.policies.all() if policy is None or p["name"] == policy]
    summaries = [await _policy_summary(services, p) for p in policies]
    return {
        "object": "overview",
        "policy": policy,
        "requests_per_minute": {
            "last_minute": traffic["calls_last_minute"],
            "last_5_minutes": round(traffic["calls_last_5_minutes"] / 5, 1),
        },
        "trajectories": {"total": total, "rewarded": rewarded, "open": total - rewarded},
        "groups_ready": sum(p["groups_ready"] for p in summaries),
        "policies": summaries,
        "loaded_versions": sorted({f"{p['policy']}@{v}" for p in summaries for v in p["loaded_versions"]}),
        "jobs": {state.value: jobs.get(state.value, 0) for state in JobState},
        "last_step": _job(last_step) if last_step else None,
        "running_job": _job(running) if running else None,
        "gpu_handover": await _gpu_handover(services),
        "upstreams": await _upstreams(services),
        "paused": [p["training"] for p in summaries if p["training"]["paused"]],
        # The one policy in view (named, or the only one there is): its training state and trial; None with several.
        "training": summaries[0]["training"] if len(summaries) == 1 else None,
        "trial": summaries[0]["trial"] if len(summaries) == 1 else None,
        "awaiting_review": sum(p["awaiting_review"] for p in summaries),
        "reviewed_by_people": [p["policy"] for p in summaries if p["reward_source"] == "human"],
        "groups_unrewarded": sum(p["groups_unrewarded"] for p in summaries),
        "disk": _disk(services),
    }


async def _policy_summary(services: Sources, row: dict[str, Any]) -> dict[str, Any]:
    """One policy on the overview: its alias, the versions loaded here, ready groups, training state, its running
    canary trial and what awaits a person's score."""
    name = str(row["name"])
    served = services.registry.get(name) if name in services.registry else None
    return {
        "policy": name,
        "state": row["state"],
        "base_model": row["base_model"],
        "active_version": int(row["active_version"]),
        "loaded_versions": sorted(served.loaded_versions) if served is not None else [],
        "updated_at": row["updated_at"],
        "groups_ready": len(await services.scheduler.ready_groups(name)),
        "groups_unrewarded": await services.store.reward_timeouts.unrewarded(name),
        "training": await training_state(services, name),
        "trial": await services.store.trials.running(name),  # its canary trial running, if any
        "awaiting_review": await services.store.reads.review_count(name),
        "reward_source": served.settings.reward_source if served is not None else None,
    }


def _disk(services: Sources) -> dict[str, Any] | None:
    """Bytes per part and free space, as last measured (every minute); calls the store could not record."""
    usage = services.disk.latest if services.disk is not None else None
    return None if usage is None else {**usage.view(), "capture_failures": dict(services.metrics.failed_captures)}


async def training_state(services: Sources, policy: str) -> dict[str, Any]:
    """Whether ``policy`` trains; when the regression guard paused it, why, and the version it rolled back."""
    state = await services.store.guards.training(policy)
    settings = services.registry.get(policy).settings if policy in services.registry else None
    return {
        "object": "training",
        "policy": policy,
        **state,
        "paused": state["training"] == TrainingState.PAUSED,
        "served": settings is not None,
        "regression_guard": settings.regression_guard if settings else services.settings.regression_guard,
        "reward_timeout_s": settings.reward_timeout_s if settings else services.settings.reward_timeout_s,
    }


async def resume_training(services: Sources, policy: str) -> dict[str, Any]:
    """Resume ``policy``'s training after the regression guard paused it (a no-op when it was not paused)."""
    await resume(services.store, policy)
    return await training_state(services, policy)


async def refuse_while_paused(services: Sources, policy: str) -> None:
    """'Train now' while the guard paused training is a 409 that says why and how to resume."""
    if reason := await services.scheduler.paused(policy):
        raise Conflict(f"Training of {policy} is paused: {reason}. Resume it first (POST /admin/training/resume"
                       f"?policy={policy}, or the dashboard's Resume training button).",
                       code="training_paused")  # fmt: skip


async def _gpu_handover(services: Sources) -> dict[str, Any] | None:
    """With --share-gpu: the hand-over under way (a step asked for or holds the GPU), or vLLM not awake."""
    if not services.settings.share_gpu:
        return None
    not_awake = services.handover.not_awake if services.handover is not None else None
    pending = await services.store.jobs.pending_gpu_requests()
    if not pending and not_awake is None:
        return None
    job = pending[0] if pending else None
    return {
        "job_id": job["id"] if job else None,
        "policy": job["policy"] if job else None,
        "gpu_state": job["gpu_state"] if job else None,  # requested: vLLM is being paused; granted: it sleeps
        "since": (job["gpu_granted_at"] or job["gpu_requested_at"]) if job else None,
        "vllm_not_awake": not_awake,
    }


async def _upstreams(services: Sources) -> list[dict[str, Any]]:
    """Each vLLM server as the router sees it (in rotation, calls in flight, versions), and its /health now."""

    async def one(server: Server) -> dict[str, Any]:
        try:
            latency = await server.upstream.health()
        except ProxyError as exc:
            return {**server.view(), "error": exc.message}
        return {**server.view(), "latency_ms": round(latency, 1), "error": server.problem}

    return list(await asyncio.gather(*(one(server) for server in services.router.servers)))


async def list_trajectories(services: Sources, **filters: Any) -> dict[str, Any]:
    return await _data.list_trajectories(services.store, **filters)


async def trajectory_detail(services: Sources, trajectory_id: str) -> dict[str, Any]:
    """A trajectory (with every reward it got), its calls with each completion token's text."""
    trajectory = await _data.get_trajectory(services.store, trajectory_id)
    calls = trajectory["calls"]
    every_id = [token_id for call in calls for token_id in call["completion_token_ids"]]
    texts = await services.token_texts.texts(services.registry.base_model or "", every_id) if every_id else []
    previous: list[Any] = []
    start = 0
    for call in calls:
        end = start + len(call["completion_token_ids"])
        call["completion_token_texts"], start = texts[start:end], end
        messages = call_messages(call["endpoint"], call["request"])
        if messages is not None:
            # Only what the agent added since the previous call; the rest is already shown above it.
            same_start = common_prefix(messages, previous, same=same_message) == len(previous)
            call["new_messages"] = messages[len(previous) :] if same_start else messages
            reply = call_reply(call["endpoint"], call.get("response"))
            previous = [*messages, reply] if reply else list(messages)
        else:
            call["new_messages"] = []
            previous = []
    return trajectory


async def list_groups(services: Sources, **filters: Any) -> dict[str, Any]:
    return await _data.list_groups(services.store, min_group_size=services.settings.min_group_size,
                                   min_group_sizes=min_group_sizes(services.registry), **filters)  # fmt: skip


def min_group_sizes(registry: PolicyRegistry) -> dict[str, int]:
    """Each served policy's least size of a group that trains (its own, or the server's)."""
    return {served.name: served.settings.min_group_size for served in registry}


async def group_detail(services: Sources, group_id: str) -> dict[str, Any]:
    """A group's members side by side: rewards, advantages as the trainer computes them, answers,
    and the judge's latest scores and explanations when it judged the group."""
    record = await services.store.reads.group(group_id)
    if record is None:
        raise NotFound(f"No group with id '{group_id}'.", param="group_id", code="group_not_found")
    group, members, last_replies = record.group, record.members, record.last_replies
    rewards = [m["reward"] for m in members]
    centered, scaled = group_advantages(rewards)
    judgements = (await services.judging.list_judgements(group_id=group_id, state=None, limit=20))["data"]
    judged = next((j for j in judgements if j["state"] == "ok"), None)
    verdicts = {s["trajectory_id"]: s for s in judged["scores"]} if judged else {}
    rows = []
    for member, adv_c, adv_s in zip(members, centered, scaled, strict=True):
        answer = last_replies.get(member["id"])
        verdict = verdicts.get(member["id"], {})
        rows.append(
            {
                **trajectory_view(member),
                "advantage": adv_s,
                "advantage_centered": adv_c,
                "final_answer": (answer or {}).get("content"),
                "judge_score": verdict.get("score"),
                "judge_explanation": verdict.get("explanation"),
            }
        )
    return {
        "object": "group",
        **{name: group[name] for name in ("id", "policy", "state", "job_id", "created_at")},
        "members": rows,
        "judgements": judgements,
    }


def group_advantages(rewards: list[float | None]) -> tuple[list[float | None], list[float | None]]:
    """Reward minus the group mean, and that over the population std: the trainer's two variants.

    None until every member is rewarded; 0.0 for a group whose rewards do not vary (the
    trainer drops those: they carry no signal). The math is ``tracetrain_core.group_advantages``, the trainer's.
    """
    values = [r for r in rewards if r is not None]
    if not rewards or len(values) < len(rewards):
        return [None] * len(rewards), [None] * len(rewards)
    one_group = [0] * len(values)
    centered: list[float | None] = [*advantages_of(values, one_group, scale=False).advantages]
    scaled: list[float | None] = [*advantages_of(values, one_group, scale=True).advantages]
    return centered, scaled


async def list_jobs(services: Sources, limit: int, policy: str | None = None) -> dict[str, Any]:
    """Training jobs (of every policy, or of ``policy``), newest first, with their metrics and progress."""
    return {"object": "list", "data": [_job(r) for r in await services.store.jobs.newest(limit, policy)]}


def curves(jobs: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(version, value) per succeeded step for each plotted metric, oldest first."""
    steps = sorted((j for j in jobs if j["state"] == "succeeded" and j["version"] is not None),
                   key=lambda j: j["version"])  # fmt: skip
    out: dict[str, list[tuple[int, float]]] = {}
    for name in CURVES:
        out[name] = [
            (int(j["version"]), float(j["metrics"][name]))
            for j in steps
            if isinstance(j["metrics"].get(name), int | float) and math.isfinite(j["metrics"][name])
        ]
    return out


async def list_adapters(services: Sources, policy: str) -> dict[str, Any]:
    """``policy``'s adapter versions on disk, which are loaded, and which one serves it."""
    rows = await services.store.adapters.of_policy(policy)
    served = services.registry.get(policy) if policy in services.registry else None
    active = served.active_version if served else await services.store.policies.active_version(policy)
    return {
        "object": "list",
        "policy": policy,
        "served": served is not None,
        "active_version": active or 0,
        "loaded_versions": sorted(served.loaded_versions) if served else [],
        "data": [{"object": "adapter", **{f: r[f] for f in ADAPTER_FIELDS}} for r in rows],
    }


def _job(row: dict[str, Any]) -> dict[str, Any]:
    return {"object": "training_job", **{f: row[f] for f in JOB_FIELDS}}
