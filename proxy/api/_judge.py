"""The judge's admin API: judge a group now, and the judgements with their scores or failures."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from proxy._params import Id, JudgementStateName, Limit
from proxy.api._deps import ServicesDep, require_admin

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])


@router.post("/groups/{group_id}/judge")
async def judge_group(group_id: Id, services: ServicesDep) -> dict[str, Any]:
    """Ask the judge to score the group's trajectories now.

    Returns the judgement: `state` "ok" with a score and explanation per trajectory, or
    "failed" with the reason (nothing else was written). An unchanged group is answered
    from the cache. With `--reward-source judge` the scores become the rewards; otherwise
    they are recorded beside the external ones.
    """
    return await services.judging.judge_group(group_id)


@router.get("/judgements")
async def list_judgements(
    services: ServicesDep,
    group_id: Id | None = None,
    state: JudgementStateName | None = None,
    limit: Limit = 50,
) -> dict[str, Any]:
    """Judgements, newest first: scores and explanations, or why the judge failed."""
    return await services.judging.list_judgements(group_id=group_id, state=state, limit=limit)
