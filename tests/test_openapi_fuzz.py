"""Bad input never reaches a 500: schemathesis over the app's own OpenAPI, admin routes included.

The real app runs on loopback in front of the fake vLLM, with keys of every class configured
and a little real traffic in its store so that detail routes find something. Each generated
request carries one credential, drawn per case: none, an inference key, a reward key, a key
bound to one policy, or the admin token (every operation meets each of them: the last test
checks). Every answer must be below 500, and every 4xx must be OpenAI's error shape
(Anthropic's on /v1/messages: ``{"type": "error", "error": {"type", "message"}}``).
Numbers at the ends of what JSON carries (integers past 2**63, 1e308) are sent by hand to
every numeric field and parameter the schema declares, since a generator seldom draws them.
The generation routes (chat, completions, /v1/responses, /v1/messages, count_tokens) are in it.
The dashboard's pages and the keying prefixes (/t/{id}/v1/...) are not in the schema, so they
get hostile values by hand.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import hypothesis
import openai
import pytest
import schemathesis
from conftest import RunningProxy
from fake_vllm import FakeVLLM, serve_in_thread
from fastapi.routing import APIRoute
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig

from proxy import Settings, create_app
from proxy._throttle import LoginThrottle

# The last test reads what the generated cases met (MET): under make test's xdist, they all run on one worker.
pytestmark = pytest.mark.xdist_group("openapi_fuzz")

ADMIN = "admin-" + "f" * 30
BEARER = {"Authorization": f"Bearer {ADMIN}"}
API_KEY = "inference-" + "i" * 30
REWARD_KEY = "reward-" + "r" * 30
POLICY_KEY = "policy-" + "p" * 30  # bound to the policy "agent"
# Each credential class, as the Authorization header it sends.
CREDENTIALS: dict[str, dict[str, str]] = {
    "none": {},
    "inference": {"Authorization": f"Bearer {API_KEY}"},
    "reward": {"Authorization": f"Bearer {REWARD_KEY}"},
    "policy": {"Authorization": f"Bearer {POLICY_KEY}"},
    "admin": BEARER,
}
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
KEYS: dict[str, Any] = {
    "admin_token": ADMIN, "api_keys": (API_KEY,), "reward_keys": (REWARD_KEY,), "policy_keys": (("agent", POLICY_KEY),)
}  # fmt: skip
APP = create_app(Settings(**KEYS))
OPENAPI = APP.openapi()
schema = schemathesis.openapi.from_dict(with_seeded_examples(OPENAPI))
# The other credentials get generated cases only: the coverage phase's boundary values (most of the cases) are the
# admin token's, which reaches every route's validation; the others are mostly refused at the door.
at_the_door = schemathesis.openapi.from_dict(
    with_seeded_examples(OPENAPI),
    config=SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}, "examples": {"enabled": False}}}),
)


class _NoThrottle(LoginThrottle):
    """Wrong credentials are most of what the fuzzer sends: throttled, the admin token's cases would all be 429s
    and reach no route (the throttle has its own tests)."""

    def __init__(self) -> None:
        super().__init__(burst=2**31)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    """The proxy with keys of every class and one ready group of two rewarded trajectories."""
    with ExitStack() as stack, pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy._credentials.LoginThrottle", _NoThrottle)
        fake = FakeVLLM(emit_eos=True)
        upstream = stack.enter_context(serve_in_thread(fake.app))
        data: Path = tmp_path_factory.mktemp("fuzz")
        settings = Settings(upstream=f"{upstream}/v1", data_dir=data, **KEYS)
        proxy = RunningProxy(stack.enter_context(serve_in_thread(create_app(settings))), settings, stack)
        for trajectory, reward in (("fuzz-a", 1.0), ("fuzz-b", 0.0)):
            headers = {"X-Group-Id": GROUP, "X-Trajectory-Id": trajectory}
            client = openai.OpenAI(base_url=proxy.v1, api_key=API_KEY, max_retries=0, default_headers=headers)
            client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "2+2?"}])
            client.close()
            response = httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": trajectory, "reward": reward},
                                  headers=CREDENTIALS["reward"])  # fmt: skip
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


# What the generated cases met, per operation: the credential classes (checked at the end) and how many cases.
MET: dict[str, Counter[str]] = defaultdict(Counter)
SPENT: Counter[str] = Counter()  # seconds in the calls, per operation


def fuzz(case: schemathesis.Case, credential: str, proxy: RunningProxy) -> None:
    operation = f"{case.operation.method.upper()} {case.operation.path}"  # the case's own method may be another
    MET[operation][credential] += 1
    started = time.perf_counter()
    try:
        case.call_and_validate(base_url=proxy.url, headers=CREDENTIALS[credential], timeout=60,
                               checks=[not_a_server_error, errors_are_openai_shaped])  # fmt: skip
    finally:
        SPENT[operation] += time.perf_counter() - started


@schema.parametrize()
@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
def test_no_generated_request_with_the_admin_token_is_answered_with_a_server_error(
    case: schemathesis.Case, seeded: RunningProxy
) -> None:
    fuzz(case, "admin", seeded)


# Fewer cases each: most are refused at the door, and the admin token's cases above explore the bodies.
@at_the_door.parametrize()
@pytest.mark.parametrize("credential", sorted(set(CREDENTIALS) - {"admin"}))
@hypothesis.settings(max_examples=5, deadline=None, derandomize=True)
def test_no_generated_request_with_another_credential_is_answered_with_a_server_error(
    case: schemathesis.Case, credential: str, seeded: RunningProxy
) -> None:
    fuzz(case, credential, seeded)


def test_every_operation_met_every_credential() -> None:
    """Runs after the generated cases (pytest keeps the file's order); prints how many there were."""
    if not MET:
        pytest.skip("the generated cases did not run")
    operations = {f"{method.upper()} {path}" for path, item in OPENAPI["paths"].items() for method in item}
    assert set(MET) == operations
    missed = {op: sorted(set(CREDENTIALS) - set(met)) for op, met in MET.items() if set(met) != set(CREDENTIALS)}
    assert not missed, missed
    slowest = ", ".join(f"{op} {s:.1f} s" for op, s in SPENT.most_common(3))
    per_credential = {c: sum(met[c] for met in MET.values()) for c in CREDENTIALS}
    print(f"\ncases per credential: {per_credential}")
    print(f"\n{sum(sum(met.values()) for met in MET.values())} generated cases over {len(MET)} operations "
          f"in {sum(SPENT.values()):.1f} s of calls; slowest: {slowest}")  # fmt: skip


# -- numbers at the ends of what JSON carries, in every numeric field and parameter ----------------------------------

HUGE_INT = 79717771397495269223366349815808
EXTREMES: tuple[float, ...] = (HUGE_INT, -HUGE_INT, 2**63, 1e308, -1e308, 1.7976931348623157e308, 5e-324)


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = OPENAPI["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def _alternatives(node: dict[str, Any]) -> list[dict[str, Any]]:
    node = _resolve(node)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in node:
            return [alt for sub in node[key] for alt in _alternatives(sub)]
    return [node]


def numeric_paths(node: dict[str, Any], at: tuple[str | int, ...] = (), depth: int = 0) -> Iterator[tuple[Any, ...]]:
    """Where a number may sit in a body of this schema: a path of keys and list indexes."""
    if depth > 6:
        return
    for alt in _alternatives(node):
        kind = alt.get("type")
        if kind in ("integer", "number"):
            yield at
        elif kind == "object" or "properties" in alt:
            for name, sub in alt.get("properties", {}).items():
                yield from numeric_paths(sub, (*at, name), depth + 1)
            if isinstance(alt.get("additionalProperties"), dict):
                yield from numeric_paths(alt["additionalProperties"], (*at, "m"), depth + 1)
        elif kind == "array" and isinstance(alt.get("items"), dict):
            yield from numeric_paths(alt["items"], (*at, 0), depth + 1)


def minimal(node: dict[str, Any], name: str = "", depth: int = 0) -> Any:
    """A small value of this schema (the required fields only), seeded ids where a field names one."""
    alt = _alternatives(node)[0]
    if "enum" in alt:
        return alt["enum"][0]
    kind = alt.get("type")
    if kind == "object" or "properties" in alt:
        required = alt.get("required", []) if depth < 6 else []
        return {key: minimal(alt["properties"][key], key, depth + 1) for key in required if key in alt["properties"]}
    if kind == "array":
        return [minimal(alt["items"], name, depth + 1)] if isinstance(alt.get("items"), dict) else []
    return {"integer": 1, "number": 0.5, "boolean": False}.get(str(kind), SEEDED.get(name, "x"))


def planted(body: Any, at: tuple[Any, ...], value: float) -> Any:
    """``body`` with ``value`` at ``at``, the containers on the way made as needed."""
    if not at:
        return value
    key, rest = at[0], at[1:]
    if isinstance(key, int):
        items = list(body) if isinstance(body, list) and body else [{}]
        return [planted(items[0], rest, value)]
    out = dict(body) if isinstance(body, dict) else {}
    out[key] = planted(out.get(key), rest, value)
    return out


# Path values that exist: a policy's settings then reach the store when the number passes.
EXISTING = {**SEEDED, "name": "agent", "policy": "agent"}


def extreme_requests() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(method, path, request arguments) with one extreme number each, for every numeric field and parameter."""
    for path, item in OPENAPI["paths"].items():
        for method, operation in item.items():
            params = [p for p in operation.get("parameters", []) if p["in"] in ("path", "query")]
            base_path = {p["name"]: EXISTING.get(p["name"], "x") for p in params if p["in"] == "path"}
            content = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            body_schema = content.get("schema")
            examples = [e["value"] for e in content.get("examples", {}).values()]
            base_body = examples[0] if examples else (minimal(body_schema) if body_schema else None)
            for value in EXTREMES:
                for p in params:
                    if not any(alt.get("type") in ("integer", "number") for alt in _alternatives(p["schema"])):
                        continue
                    where = {**base_path, **({p["name"]: value} if p["in"] == "path" else {})}
                    query = {p["name"]: value} if p["in"] == "query" else {}
                    url = path.format(**{k: quote(str(v), safe="") for k, v in where.items()})
                    yield method, url, {"params": query, "json": base_body}
                if body_schema is not None:
                    for at in numeric_paths(body_schema):
                        url = path.format(**{k: quote(str(v), safe="") for k, v in base_path.items()})
                        yield method, url, {"json": planted(base_body, at, value)}


def test_no_extreme_number_in_any_field_or_parameter_is_answered_with_a_server_error(seeded: RunningProxy) -> None:
    failures, sent = [], 0
    with httpx.Client(base_url=seeded.url, timeout=30) as client:
        for method, url, arguments in extreme_requests():
            if arguments.get("json") is None:
                arguments.pop("json", None)
            else:  # orjson would refuse 2**64 and more; the standard library writes any integer
                arguments["content"] = json.dumps(arguments.pop("json"))
            for credential in ("admin", "inference", "reward", "policy"):
                sent += 1
                try:
                    response = client.request(method, url, headers={**CREDENTIALS[credential],
                                              "Content-Type": "application/json"}, **arguments)  # fmt: skip
                except httpx.TransportError as exc:  # the server dropped the connection
                    failures.append(f"{method} {url} {str(arguments)[:200]}: {type(exc).__name__}")
                    break
                if response.status_code >= 500:
                    failures.append(f"{method} {url} {str(arguments)[:200]}: {response.status_code} {response.text}")
                if response.status_code not in (401, 403):
                    break  # this credential reaches the route: the others would be refused before the number
        # Whatever was accepted is read back by the pages that sum and square it.
        for url in ("/v1/groups", "/v1/trajectories", "/admin/groups", f"/admin/groups/{GROUP}", "/admin/ui/groups",
                    "/admin/policies", "/admin/policies/agent"):  # fmt: skip
            response = client.get(url, headers=CREDENTIALS["reward"] if url.startswith("/v1") else BEARER)
            if response.status_code >= 500:
                failures.append(f"GET {url} afterwards: {response.status_code} {response.text}")
    assert sent > 200
    assert not failures, "\n".join(failures[:30])
    print(f"\n{sent} requests with extreme numbers")


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
