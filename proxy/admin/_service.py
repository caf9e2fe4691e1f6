"""The admin service: what the dashboard shows, read from the store.

Every page of the dashboard renders one of these results, and the admin JSON API
returns the same result, so whatever an operator sees can also be scripted.
"""

from __future__ import annotations

import math
import time
from typing import Any

from sqlalchemy import func, select

from proxy.data import _service as _data
from proxy.data._wire import trajectory_view
from proxy._deps import Services
from proxy.errors import NotFound, ProxyError
from store import _advantages
from store._conversation import common_prefix, reply_message, same_message
from store._store import A, C, G, J, P, T

_JOB_FIELDS = ("id", "policy", "state", "group_ids", "version", "metrics", "progress", "error", "worker",
               "created_at", "started_at", "finished_at")  # fmt: skip
_ADAPTER_FIELDS = ("policy", "version", "path", "job_id", "state", "error", "metrics", "created_at", "published_at")
# What the training page plots, from each succeeded job's metrics.
CURVES = ("reward_mean", "loss")


async def overview(services: Services) -> dict[str, Any]:
    """Traffic, data, training and serving at a glance."""
    now = time.time()
    async with services.store.engine.connect() as conn:
        last_minute = (await conn.execute(select(func.count()).where(C.c.started_at >= now - 60))).scalar_one()
        last_5 = (await conn.execute(select(func.count()).where(C.c.started_at >= now - 300))).scalar_one()
        total, rewarded = (await conn.execute(select(func.count(T.c.pk), func.count(T.c.reward)))).one()
        policies = (await conn.execute(select(P).order_by(P.c.name))).all()
        jobs: dict[str, int] = dict((await conn.execute(select(J.c.state, func.count()).group_by(J.c.state))).all())
        last_step = (
            await conn.execute(select(J).where(J.c.state == "succeeded").order_by(J.c.finished_at.desc()).limit(1))
        ).first()
        running = (await conn.execute(select(J).where(J.c.state == "running").order_by(J.c.id).limit(1))).first()
    return {
        "object": "overview",
        "requests_per_minute": {"last_minute": int(last_minute), "last_5_minutes": round(int(last_5) / 5, 1)},
        "trajectories": {"total": int(total), "rewarded": int(rewarded), "open": int(total) - int(rewarded)},
        "groups_ready": len(await services.scheduler.ready_groups()),
        "policies": [
            {
                "policy": row.name,
                "base_model": row.base_model,
                "active_version": row.active_version,
                "updated_at": row.updated_at,
            }
            for row in policies
        ],
        "loaded_versions": sorted(services.registry.loaded_versions),
        "jobs": {state: int(jobs.get(state, 0)) for state in ("queued", "running", "succeeded", "failed")},
        "last_step": _job(last_step) if last_step else None,
        "running_job": _job(running) if running else None,
        "upstream": await _upstream_health(services),
    }


async def _upstream_health(services: Services) -> dict[str, Any]:
    try:
        latency = await services.upstream.health()
    except ProxyError as exc:
        return {"url": services.upstream.base_url, "healthy": False, "error": exc.message}
    return {"url": services.upstream.base_url, "healthy": True, "latency_ms": round(latency, 1)}


async def list_trajectories(services: Services, **filters: Any) -> dict[str, Any]:
    return await _data.list_trajectories(services.store, **filters)


async def trajectory_detail(services: Services, trajectory_id: str) -> dict[str, Any]:
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
        messages = call["request"].get("messages")
        if isinstance(messages, list):
            # Only what the agent added since the previous call; the rest is already shown above it.
            same_start = common_prefix(messages, previous, same=same_message) == len(previous)
            call["new_messages"] = messages[len(previous) :] if same_start else messages
            reply = reply_message(call.get("response"))
            previous = [*messages, reply] if reply else list(messages)
        else:
            call["new_messages"] = []
            previous = []
    return trajectory


async def list_groups(services: Services, **filters: Any) -> dict[str, Any]:
    return await _data.list_groups(services.store, min_group_size=services.settings.min_group_size, **filters)


async def group_detail(services: Services, group_id: str) -> dict[str, Any]:
    """A group's members side by side: rewards, advantages as the trainer computes them, answers,
    and the judge's latest scores and explanations when it judged the group."""
    async with services.store.engine.connect() as conn:
        group = (await conn.execute(select(G).where(G.c.id == group_id))).first()
        if group is None:
            raise NotFound(f"No group with id '{group_id}'.", param="group_id", code="group_not_found")
        members = (await conn.execute(select(T).where(T.c.group_id == group_id).order_by(T.c.created_at))).all()
        last_calls = {
            row.trajectory_id: row.response
            for row in (
                await conn.execute(
                    select(C.c.trajectory_id, C.c.response, C.c.started_at)
                    .where(C.c.group_id == group_id)
                    .order_by(C.c.started_at, C.c.pk)
                )
            ).all()
        }  # the last call of each trajectory wins
    rewards = [m.reward for m in members]
    centered, scaled = group_advantages(rewards)
    judgements = (await services.judging.list_judgements(group_id=group_id, state=None, limit=20))["data"]
    judged = next((j for j in judgements if j["state"] == "ok"), None)
    verdicts = {s["trajectory_id"]: s for s in judged["scores"]} if judged else {}
    rows = []
    for member, adv_c, adv_s in zip(members, centered, scaled, strict=True):
        answer = reply_message(last_calls.get(member.id))
        verdict = verdicts.get(member.id, {})
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
        "id": group.id,
        "policy": group.policy,
        "state": group.state,
        "job_id": group.job_id,
        "created_at": group.created_at,
        "members": rows,
        "judgements": judgements,
    }


def group_advantages(rewards: list[float | None]) -> tuple[list[float | None], list[float | None]]:
    """Reward minus the group mean, and that over the population std: the trainer's two variants.

    None until every member is rewarded; 0.0 for a group whose rewards do not vary (the
    trainer drops those: they carry no signal). The math is ``store._advantages``, the trainer's.
    """
    values = [r for r in rewards if r is not None]
    if not rewards or len(values) < len(rewards):
        return [None] * len(rewards), [None] * len(rewards)
    one_group = [0] * len(values)
    centered: list[float | None] = [*_advantages.group_advantages(values, one_group, scale=False).advantages]
    scaled: list[float | None] = [*_advantages.group_advantages(values, one_group, scale=True).advantages]
    return centered, scaled


async def list_jobs(services: Services, limit: int) -> dict[str, Any]:
    """Training jobs, newest first, with their metrics and progress."""
    async with services.store.engine.connect() as conn:
        rows = (await conn.execute(select(J).order_by(J.c.id.desc()).limit(limit))).all()
    return {"object": "list", "data": [_job(r) for r in rows]}


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


async def list_adapters(services: Services) -> dict[str, Any]:
    """Adapter versions on disk, which are loaded, and which one serves the policy."""
    registry = services.registry
    async with services.store.engine.connect() as conn:
        rows = (await conn.execute(select(A).where(A.c.policy == registry.policy).order_by(A.c.version))).all()
    return {
        "object": "list",
        "policy": registry.policy,
        "active_version": registry.active_version,
        "loaded_versions": sorted(registry.loaded_versions),
        "data": [{"object": "adapter", **{f: r._mapping[f] for f in _ADAPTER_FIELDS}} for r in rows],
    }


def _job(row: Any) -> dict[str, Any]:
    return {"object": "training_job", **{f: row._mapping[f] for f in _JOB_FIELDS}}
