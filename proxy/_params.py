"""What routes declare: the bounded parameter types they share, and bodies documented but not parsed.

A path or query value is validated like a body: a bad one is answered 400 in OpenAI's
shape, ``param`` naming it (``proxy._app``'s validation handler). The bounds are the
store's: integers stop at ``MAX_INT`` (Postgres INTEGER; SQLite raises OverflowError
past 2**63 - 1 and Python's ``int()`` refuses 4,300 digits), ids are what the gateway
accepts as an id (so no trajectory or group can have another, and no NUL byte reaches
Postgres), times are finite.

``Id`` and ``Version`` carry their bounds in a pydantic ``Field``, so one alias serves as a
path parameter, as a query filter (``Id | None``) and in a wire model.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import Field, TypeAdapter

from store import FILE_NAME_PATTERN, POLICY_NAME_PATTERN

MAX_INT = 2**31 - 1
ID_PATTERN = r"^[A-Za-z0-9_.:\-]{1,200}$"
# What a next_cursor is made of: a row's pk, or "created_at|group id" (created_at as repr(float)).
_CURSOR_PATTERN = r"^[A-Za-z0-9_.:|+\-]{1,256}$"

Id = Annotated[str, Field(pattern=ID_PATTERN)]
Version = Annotated[int, Field(ge=0, le=MAX_INT)]
TrialId = Annotated[int, Field(ge=1, le=MAX_INT)]  # a canary trial (store.Trials)
# A policy's name (proxy.Settings.policies) and a file of one of its adapters (store.FILE_NAME_PATTERN).
PolicyName = Annotated[str, Field(pattern=POLICY_NAME_PATTERN)]
FileName = Annotated[str, Field(pattern=FILE_NAME_PATTERN)]
Limit = Annotated[int, Query(ge=1, le=1000, description="Items per page.")]
Cursor = Annotated[str | None, Query(pattern=_CURSOR_PATTERN, description="The next_cursor of the previous page.")]
UnixTime = Annotated[float | None, Query(allow_inf_nan=False, description="Unix seconds.")]
# The store's states as filters (tests/test_openapi_fuzz.py checks they match store.GROUP_VIEW_STATES
# and store.JUDGEMENT_STATES): a Literal, so the OpenAPI document lists them.
GroupViewState = Literal["open", "ready", "training", "trained", "failed", "unrewarded"]
JudgementStateName = Literal["ok", "failed"]


def json_body(shape: Any, examples: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` documenting a JSON body that the route reads itself (raw bytes, one parse).

    ``shape`` is a model or a union of models; their ``$defs`` are inlined, since a
    ``#/$defs/...`` reference would point into the OpenAPI document, not the schema.
    """
    schema = TypeAdapter(shape).json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    content = {"schema": inline(schema), "examples": {name: {"value": value} for name, value in examples.items()}}
    return {"requestBody": {"required": True, "content": {"application/json": content}}}
