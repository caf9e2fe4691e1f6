"""The data API's service: rewards, trajectories and groups, read from the store."""

from __future__ import annotations

import re
from typing import Any

import orjson
from pydantic import ValidationError
from sqlalchemy import and_, case, func, or_, select

from proxy._params import MAX_INT
from proxy.data._wire import RewardBatch, RewardPost, call_view, group_view, reward_view, trajectory_view
from proxy.errors import InvalidRequest, TrajectoryNotFound
from store._store import C, G, R, RewardIn, Store, T

GROUP_STATES = ("open", "ready", "training", "trained", "failed")
# ASCII digits, few enough for int() and the store: str.isdigit() also takes "²".
_PK_CURSOR = re.compile(r"[0-9]{1,10}")


async def post_rewards(store: Store, raw: bytes) -> dict[str, Any]:
    """Validate a single or batch reward post completely, then record it atomically."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON ({exc}).") from exc
    try:
        if isinstance(body, dict) and "rewards" in body:
            items = RewardBatch.model_validate(body).rewards
        else:
            items = [RewardPost.model_validate(body)]
    except ValidationError as exc:
        hint = "A reward is a finite JSON number; metrics map names to finite numbers. Nothing was recorded."
        raise InvalidRequest.from_validation(exc.errors(), hint) from exc
    rows = await store.add_rewards(RewardIn(r.trajectory_id, r.reward, dict(r.metrics)) for r in items)
    return {"object": "list", "data": [reward_view(row) for row in rows]}


def _page(rows: list[Any], limit: int, cursor_of: Any) -> tuple[list[Any], bool, str | None]:
    has_more = len(rows) > limit
    rows = rows[:limit]
    return rows, has_more, (cursor_of(rows[-1]) if has_more and rows else None)


async def list_trajectories(
    store: Store,
    *,
    group_id: str | None,
    policy: str | None,
    rewarded: bool | None,
    limit: int,
    after: str | None,
    version: int | None = None,
    created_after: float | None = None,
    created_before: float | None = None,
) -> dict[str, Any]:
    query = select(T).order_by(T.c.pk.desc()).limit(limit + 1)
    if version is not None:
        query = query.where(T.c.last_version == version)
    if created_after is not None:
        query = query.where(T.c.created_at >= created_after)
    if created_before is not None:
        query = query.where(T.c.created_at < created_before)
    if group_id is not None:
        query = query.where(T.c.group_id == group_id)
    if policy is not None:
        query = query.where(T.c.policy == policy)
    if rewarded is not None:
        query = query.where(T.c.reward.is_not(None) if rewarded else T.c.reward.is_(None))
    if after is not None:
        if not _PK_CURSOR.fullmatch(after) or int(after) > MAX_INT:
            raise InvalidRequest("'after' must be a cursor returned as next_cursor.", param="after")
        query = query.where(T.c.pk < int(after))
    async with store.engine.connect() as conn:
        rows = list((await conn.execute(query)).all())
    rows, has_more, cursor = _page(rows, limit, lambda row: str(row.pk))
    return {"object": "list", "data": [trajectory_view(r) for r in rows], "has_more": has_more, "next_cursor": cursor}


async def get_trajectory(store: Store, trajectory_id: str) -> dict[str, Any]:
    async with store.engine.connect() as conn:
        row = (await conn.execute(select(T).where(T.c.id == trajectory_id))).first()
        if row is None:
            raise TrajectoryNotFound(f"No trajectory with id '{trajectory_id}'.", param="trajectory_id")
        calls = (
            await conn.execute(select(C).where(C.c.trajectory_id == trajectory_id).order_by(C.c.started_at, C.c.pk))
        ).all()
        # Every reward it got, oldest first: posted ones and the judge's, each with its source and explanation.
        rewards = (await conn.execute(select(R).where(R.c.trajectory_id == trajectory_id).order_by(R.c.pk))).all()
    return {
        **trajectory_view(row),
        "rewards": [reward_view(dict(r._mapping)) for r in rewards],
        "calls": [call_view(c) for c in calls],
    }


async def list_groups(
    store: Store, *, min_group_size: int, policy: str | None, state: str | None, limit: int, after: str | None
) -> dict[str, Any]:
    size = func.count(T.c.pk)
    n_rewarded = func.count(T.c.reward)
    ready = and_(G.c.state == "open", size >= min_group_size, n_rewarded == size)
    query = (
        select(
            G.c.id,
            G.c.policy,
            G.c.created_at,
            G.c.state,
            size.label("size"),
            n_rewarded.label("n_rewarded"),
            func.avg(T.c.reward).label("reward_mean"),
            func.avg(T.c.reward * T.c.reward).label("reward_sq_mean"),
            case((ready, "ready"), else_=G.c.state).label("view_state"),
        )
        .select_from(G.outerjoin(T, T.c.group_id == G.c.id))
        .group_by(G.c.id, G.c.policy, G.c.created_at, G.c.state)
        .order_by(G.c.created_at.desc(), G.c.id.desc())
        .limit(limit + 1)
    )
    if policy is not None:
        query = query.where(G.c.policy == policy)
    if state is not None:
        if state not in GROUP_STATES:
            raise InvalidRequest(f"'state' must be one of {', '.join(GROUP_STATES)}.", param="state")
        if state == "ready":
            query = query.having(ready)
        elif state == "open":
            query = query.where(G.c.state == "open").having(~ready)
        else:
            query = query.where(G.c.state == state)
    if after is not None:
        created, _, group = after.partition("|")
        try:
            created_at = float(created)
        except ValueError as exc:
            raise InvalidRequest("'after' must be a cursor returned as next_cursor.", param="after") from exc
        query = query.where(or_(G.c.created_at < created_at, and_(G.c.created_at == created_at, G.c.id < group)))
    async with store.engine.connect() as conn:
        rows = list((await conn.execute(query)).all())
    rows, has_more, cursor = _page(rows, limit, lambda row: f"{row.created_at!r}|{row.id}")
    return {
        "object": "list",
        "data": [group_view(r, r.view_state) for r in rows],
        "has_more": has_more,
        "next_cursor": cursor,
    }
