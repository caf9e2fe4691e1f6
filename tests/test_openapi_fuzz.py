"""Bad input never reaches a 500: schemathesis over the app's own OpenAPI, admin routes included.

The real app runs on loopback in front of the fake vLLM, with a little real traffic in
its store so that detail routes find something. Every generated request carries the
admin token; every answer must be below 500, and every 4xx must be OpenAI's error shape
(Anthropic's on /v1/messages: ``{"type": "error", "error": {"type", "message"}}``).
The generation routes (chat, completions, /v1/responses, /v1/messages, count_tokens) are in it.
The dashboard's pages and the keying prefixes (/t/{id}/v1/...) are not in the schema, so they
get hostile values by hand.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import hypothesis
import pytest
import schemathesis
from conftest import RunningProxy
from fake_vllm import FakeVLLM, serve_in_thread
from fastapi.routing import APIRoute
from schemathesis.checks import not_a_server_error

from proxy import Settings, create_app

ADMIN = "admin-" + "f" * 30
BEARER = {"Authorization": f"Bearer {ADMIN}"}
GROUP = "fuzz-group"

# What the seeded store holds, offered as examples so that detail routes also find something.
SEEDED = {"trajectory_id": "fuzz-a", "group_id": GROUP, "version": 0}


def with_seeded_examples(openapi: dict[str, Any]) -> dict[str, Any]:
    openapi = copy.deepcopy(openapi)
    for operation in (op for path in openapi["paths"].values() for op in path.values()):
        for parameter in operation.get("parameters", []):
            if parameter["in"] == "path" and parameter["name"] in SEEDED:
                parameter["example"] = SEEDED[parameter["name"]]
    return openapi


# Built when the module is collected (no lifespan runs), so that pytest names one test per
# operation; the first test checks that the running proxy serves this very document at
# /openapi.json. (schemathesis.pytest.from_fixture, which would load it from the running
# proxy, fails on pytest 9.2: it sets Function._nodeid, which pytest no longer has.)
APP = create_app(Settings(admin_token=ADMIN))
OPENAPI = APP.openapi()
schema = schemathesis.openapi.from_dict(with_seeded_examples(OPENAPI))


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    """The proxy with an admin token and one ready group of two rewarded trajectories."""
    with ExitStack() as stack:
        fake = FakeVLLM(emit_eos=True)
        upstream = stack.enter_context(serve_in_thread(fake.app))
        data: Path = tmp_path_factory.mktemp("fuzz")
        settings = Settings(upstream=f"{upstream}/v1", data_dir=data, admin_token=ADMIN)
        proxy = RunningProxy(stack.enter_context(serve_in_thread(create_app(settings))), settings, stack)
        for trajectory, reward in (("fuzz-a", 1.0), ("fuzz-b", 0.0)):
            client = proxy.client(default_headers={"X-Group-Id": GROUP, "X-Trajectory-Id": trajectory})
            client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "2+2?"}])
            response = httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": trajectory, "reward": reward})
            response.raise_for_status()
        yield proxy


@schemathesis.check
def errors_are_openai_shaped(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool:
    """Every 4xx is ``{"error": {"message", "type", "param", "code"}}`` with a message (Anthropic's on its API)."""
    if not 400 <= response.status_code < 500:
        return True
    body = response.json()
    if case.path.startswith("/v1/messages") and case.method.upper() == "POST":  # others: the app's 405
        assert isinstance(body, dict) and body.get("type") == "error", response.text
        assert isinstance(body["error"]["type"], str) and body["error"]["message"], response.text
        return True
    assert isinstance(body, dict) and set(body) == {"error"}, response.text
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, response.text
    assert isinstance(error["message"], str) and error["message"], response.text
    return True


def test_the_translated_apis_are_fuzzed() -> None:
    assert {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens"} <= set(OPENAPI["paths"])
    for path in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        assert OPENAPI["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"], path


def test_the_fuzzed_schema_is_the_one_the_proxy_serves(seeded: RunningProxy) -> None:
    assert httpx.get(f"{seeded.url}/openapi.json").json() == OPENAPI


@schema.parametrize()
@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
def test_no_generated_request_is_answered_with_a_server_error(case: schemathesis.Case, seeded: RunningProxy) -> None:
    case.call_and_validate(base_url=seeded.url, headers=BEARER, checks=[not_a_server_error, errors_are_openai_shaped])


# -- what the schema leaves out: the dashboard's pages and the keying path prefixes -------------------

HOSTILE = [str(10**30), "-1", "", "nan", "\x00", "²", "x" * 5000, "9" * 5000]
# Every query parameter a page reads from request.query_params.
PAGE_QUERY = ("policy", "group_id", "rewarded", "version", "since", "after", "state", "notice", "job", "next")
UNLISTED_ROUTES = sorted(
    (method, route.path)
    for route in APP.routes
    if isinstance(route, APIRoute) and not route.include_in_schema
    for method in route.methods
)


@pytest.mark.parametrize(("method", "path"), UNLISTED_ROUTES, ids=[f"{m} {p}" for m, p in UNLISTED_ROUTES])
def test_no_hostile_value_in_an_unlisted_route_url_is_answered_with_a_server_error(
    seeded: RunningProxy, method: str, path: str
) -> None:
    failures = []
    with httpx.Client(base_url=seeded.url, headers=BEARER) as client:
        for value in HOSTILE:
            url = re.sub(r"\{\w+\}", quote(value, safe=""), path)
            page = method == "GET" and path.startswith("/admin")
            for params in [{name: value} for name in PAGE_QUERY] if page else [{}]:
                try:
                    status = client.request(method, url, params=params).status_code
                except httpx.TransportError as exc:  # the server dropped the connection
                    status = type(exc).__name__
                if not isinstance(status, int) or status >= 500:
                    failures.append(f"{method} {url[:60]} {str(params)[:60]}: {status}")
    assert not failures, "\n".join(failures)


def test_the_state_filters_are_the_stores_states() -> None:
    import typing

    import store
    from proxy._params import GroupViewState, JudgementStateName

    assert typing.get_args(GroupViewState) == store.GROUP_VIEW_STATES
    assert typing.get_args(JudgementStateName) == store.JUDGEMENT_STATES
