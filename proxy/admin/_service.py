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
from proxy.training import Canary, HandoverCoordinator, JobScheduler
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


async def overview(services: Sources) -> dict[str, Any]:
    """Traffic, data, training and serving at a glance."""
    store = services.store
    traffic = await store.reads.traffic()
    jobs = await store.jobs.counts()
    last_step = await store.jobs.last(JobState.SUCCEEDED)
    running = await store.jobs.last(JobState.RUNNING)
    total, rewarded = traffic["trajectories"], traffic["rewarded"]
    return {
        "object": "overview",
        "requests_per_minute": {
            "last_minute": traffic["calls_last_minute"],
            "last_5_minutes": round(traffic["calls_last_5_minutes"] / 5, 1),
        },
        "trajectories": {"total": total, "rewarded": rewarded, "open": total - rewarded},
        "groups_ready": len(await services.scheduler.ready_groups()),
        "policies": [
            {
                "policy": p["name"],
                "base_model": p["base_model"],
                "active_version": p["active_version"],
                "updated_at": p["updated_at"],
            }
            for p in await store.policies.all()
        ],
        "loaded_versions": sorted(services.registry.loaded_versions),
        "jobs": {state.value: jobs.get(state.value, 0) for state in JobState},
        "last_step": _job(last_step) if last_step else None,
        "running_job": _job(running) if running else None,
        "gpu_handover": await _gpu_handover(services),
        "upstreams": await _upstreams(services),
        "training": await training_state(services),
        "trial": await store.trials.running(services.settings.policy),
        "awaiting_review": await store.reads.review_count(services.settings.policy),
        "reward_source": services.settings.reward_source,
        "groups_unrewarded": await store.reward_timeouts.unrewarded(services.settings.policy),
        "disk": _disk(services),
    }


def _disk(services: Sources) -> dict[str, Any] | None:
    """Bytes per part and free space, as last measured (every minute); calls the store could not record."""
    usage = services.disk.latest if services.disk is not None else None
    return None if usage is None else {**usage.view(), "capture_failures": dict(services.metrics.failed_captures)}


async def training_state(services: Sources) -> dict[str, Any]:
    """Whether the policy trains; when the regression guard paused it, why, and the version it rolled back."""
    policy = services.settings.policy
    state = await services.store.guards.training(policy)
    return {
        "object": "training",
        "policy": policy,
        **state,
        "paused": state["training"] == TrainingState.PAUSED,
        "regression_guard": services.settings.regression_guard,
        "reward_timeout_s": services.settings.reward_timeout_s,
    }


async def resume_training(services: Sources) -> dict[str, Any]:
    """Resume the policy's training after the regression guard paused it (a no-op when it was not paused)."""
    await resume(services.store, services.settings.policy)
    return await training_state(services)


async def refuse_while_paused(services: Sources) -> None:
    """'Train now' while the guard paused training is a 409 that says why and how to resume."""
    if reason := await services.scheduler.paused():
        raise Conflict(f"Training is paused: {reason}. Resume it first (POST /admin/training/resume, or the "
                       "dashboard's Resume training button).", code="training_paused")  # fmt: skip


async def _gpu_handover(services: Sources) -> dict[str, Any] | None:
    """With --share-gpu: the hand-over under way (a step asked for or holds the GPU), or vLLM not awake."""
    if not services.settings.share_gpu:
        return None
    not_awake = services.handover.not_awake if services.handover is not None else None
    pending = await services.store.jobs.pending_gpu_requests(services.settings.policy)
    if not pending and not_awake is None:
        return None
    job = pending[0] if pending else None
    return {
        "job_id": job["id"] if job else None,
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
    return await _data.list_groups(services.store, min_group_size=services.settings.min_group_size, **filters)


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


async def list_jobs(services: Sources, limit: int) -> dict[str, Any]:
    """Training jobs, newest first, with their metrics and progress."""
    return {"object": "list", "data": [_job(r) for r in await services.store.jobs.newest(limit)]}


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


async def list_adapters(services: Sources) -> dict[str, Any]:
    """Adapter versions on disk, which are loaded, and which one serves the policy."""
    registry = services.registry
    rows = await services.store.adapters.of_policy(registry.policy)
    return {
        "object": "list",
        "policy": registry.policy,
        "active_version": registry.active_version,
        "loaded_versions": sorted(registry.loaded_versions),
        "data": [{"object": "adapter", **{f: r[f] for f in ADAPTER_FIELDS}} for r in rows],
    }


def _job(row: dict[str, Any]) -> dict[str, Any]:
    return {"object": "training_job", **{f: row[f] for f in JOB_FIELDS}}
