"""Evaluations posted by whoever measured a version (``POST /admin/evaluations``), recorded in the store.

A version's scores on what it was not trained on (the demo's held-out success, a user's benchmark).
The proxy only checks and records them; the trainer worker logs them into its run (``--log-to``)
at that version's step, so they sit beside the training curves in TensorBoard, W&B or MLflow.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from proxy._params import MAX_INT, Version
from proxy.data._wire import MAX_METRICS, MetricName, Score
from proxy.errors import NotFound, store_errors
from store import Store


class EvaluationPost(BaseModel):
    """``{"version": 3, "scores": {"held_out_success": 0.62}, "samples": 200}``."""

    model_config = ConfigDict(extra="forbid")

    version: Version
    scores: dict[MetricName, Score] = Field(min_length=1, max_length=MAX_METRICS)
    samples: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None  # how many attempts the scores stand for


async def record_evaluation(store: Store, policy: str, post: EvaluationPost) -> dict[str, Any]:
    """Record the scores of ``policy@version`` (0: the base model); a version never trained is a 404."""
    with store_errors():
        if post.version != 0 and await store.adapters.get(policy, post.version) is None:
            raise NotFound(f"No version {policy}@{post.version} was trained.", param="version")
        rows = await store.evaluations.record(policy, post.version, post.scores, samples=post.samples)
    return {"object": "list", "data": [{"object": "evaluation", **row} for row in rows]}
