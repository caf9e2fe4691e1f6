"""Bad input and a failing upstream: OpenAI-shaped errors, and the proxy stays up."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

MESSAGES = [{"role": "user", "content": "hi"}]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    return error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_invalid_json_is_a_400(proxy: RunningProxy) -> None:
    response = httpx.post(f"{proxy.v1}/chat/completions", content=b'{"model": "agent", "messages": [')
    assert assert_openai_error(response, 400)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "agent"}, "messages"),
        ({"model": "agent", "messages": []}, "messages"),
        ({"model": "agent", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "agent", "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"model": "agent", "messages": MESSAGES, "n": 2**40}, "n"),  # the fake would make 2**40 choices
        ({"messages": MESSAGES}, "model"),
    ],
)
def test_invalid_fields_name_the_parameter(proxy: RunningProxy, body: dict, param: str) -> None:
    response = httpx.post(f"{proxy.v1}/chat/completions", json=body)
    assert assert_openai_error(response, 400)["param"] == param


@pytest.mark.parametrize("prompt", [[2**63], [[1, 2**31]], [-1]])
def test_a_prompt_token_id_beyond_what_a_record_holds_is_a_400(proxy: RunningProxy, prompt: list) -> None:
    response = httpx.post(f"{proxy.v1}/completions", json={"model": "agent", "prompt": prompt, "max_tokens": 4})
    assert assert_openai_error(response, 400)["param"].startswith("prompt")


def test_body_that_is_not_an_object_is_a_400(proxy: RunningProxy) -> None:
    assert_openai_error(httpx.post(f"{proxy.v1}/completions", json=[1, 2]), 400)


def test_unknown_model_is_a_404_with_what_exists(proxy: RunningProxy) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        proxy.client().chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    assert "agent" in info.value.message


def test_unloaded_version_is_a_404(proxy: RunningProxy) -> None:
    response = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent@7", "messages": MESSAGES})
    assert "agent@0" in assert_openai_error(response, 404)["message"]


def test_pinned_version_zero_is_the_base_model(proxy: RunningProxy, fake: FakeVLLM) -> None:
    completion = proxy.client().chat.completions.create(model="agent@0", messages=MESSAGES)
    assert completion.model == "agent@0"
    assert fake.requests[-1]["model"] == fake.base_model


def test_models_lists_the_policy_and_its_versions(proxy: RunningProxy) -> None:
    ids = [m.id for m in proxy.client().models.list().data]
    assert ids == ["agent", "agent@0"]


def test_upstream_error_status_and_body_pass_through(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(status=400, error_message="This model's maximum context length is 2048 tokens."))
    response = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": MESSAGES})
    error = assert_openai_error(response, 400)
    assert "maximum context length" in error["message"]
    rows = proxy.rows("SELECT status_code, error FROM calls")
    assert rows[0]["status_code"] == 400 and "maximum context length" in rows[0]["error"]
    assert response.headers["x-trajectory-id"]


def test_upstream_down_is_a_502_and_the_proxy_stays_up(start_proxy, fake: FakeVLLM) -> None:
    proxy = start_proxy(upstream=f"http://127.0.0.1:{free_port()}/v1", served_model="base")
    for stream in (False, True):
        body = {"model": "agent", "messages": MESSAGES, "stream": stream}
        error = assert_openai_error(httpx.post(f"{proxy.v1}/chat/completions", json=body), 502)
        assert error["code"] == "upstream_unreachable" and "vLLM" in error["message"]
    assert httpx.get(f"{proxy.url}/healthz").status_code == 200
    assert_openai_error(httpx.get(f"{proxy.url}/readyz"), 502)
    assert len(proxy.rows("SELECT pk FROM calls")) == 2  # the failed calls are on record


def test_upstream_down_before_its_model_is_known_is_a_502(start_proxy, fake: FakeVLLM) -> None:
    proxy = start_proxy(upstream=f"http://127.0.0.1:{free_port()}/v1")
    response = httpx.get(f"{proxy.v1}/models")
    assert response.status_code == 200  # listable even while vLLM starts
    error = assert_openai_error(
        httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": MESSAGES}), 502
    )
    assert error["type"] == "upstream_error"


def test_slow_upstream_is_a_504(start_proxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="late", delay_s=2.0))
    proxy = start_proxy(upstream_timeout_s=0.3)
    error = assert_openai_error(
        httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": MESSAGES}), 504
    )
    assert error["code"] == "upstream_timeout"


def test_unknown_route_is_an_openai_404(proxy: RunningProxy) -> None:
    assert_openai_error(httpx.get(f"{proxy.v1}/embeddingz"), 404)


def test_health_and_readiness(proxy: RunningProxy, fake: FakeVLLM) -> None:
    assert httpx.get(f"{proxy.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{proxy.url}/readyz").json()["base_model"] == fake.base_model


# -- path and query parameters are validated like bodies -------------------------------------------

HUGE = str(10**30)


@pytest.mark.parametrize(
    ("method", "path", "param"),
    [
        ("GET", f"/admin/trajectories?version={HUGE}", "version"),
        ("GET", "/admin/trajectories?version=-1", "version"),
        ("GET", f"/admin/jobs?limit={HUGE}", "limit"),
        ("GET", "/v1/trajectories?limit=-1", "limit"),
        ("GET", f"/v1/trajectories?after={HUGE}", "after"),
        ("GET", f"/admin/trajectories?after={'9' * 5000}", "after"),
        ("GET", "/admin/trajectories?after=%C2%B2", "after"),  # "²" is a digit to str.isdigit, not to int()
        ("GET", "/v1/groups?after=%00", "after"),
        ("GET", "/admin/trajectories?created_after=nan", "created_after"),
        ("GET", "/admin/trajectories?created_before=inf", "created_before"),
        ("GET", "/admin/trajectories?created_after=1e400", "created_after"),
        ("GET", "/v1/groups?state=cooking", "state"),
        ("GET", "/admin/judgements?state=cooking", "state"),
        ("GET", "/v1/trajectories?group_id=g%00", "group_id"),
        ("GET", "/admin/groups?policy=", "policy"),
        ("GET", "/v1/trajectories/t%00", "trajectory_id"),
        ("GET", f"/admin/groups/{'g' * 5000}", "group_id"),
        ("POST", "/admin/groups/g%00/judge", "group_id"),
        ("POST", f"/admin/adapters/{HUGE}/activate", "version"),
        ("POST", "/admin/adapters/-1/activate", "version"),
    ],
)
def test_bad_path_and_query_values_are_a_400_naming_the_parameter(
    proxy: RunningProxy, method: str, path: str, param: str
) -> None:
    error = assert_openai_error(httpx.request(method, f"{proxy.url}{path}"), 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


@pytest.mark.parametrize("model", ["agent@²", f"agent@{'9' * 5000}", f"agent@{HUGE}"])
def test_a_pinned_version_that_is_no_number_we_serve_is_a_404(proxy: RunningProxy, model: str) -> None:
    response = httpx.post(f"{proxy.v1}/chat/completions", json={"model": model, "messages": MESSAGES})
    assert assert_openai_error(response, 404)["code"] == "model_not_found"


def test_a_reward_for_an_id_with_a_nul_byte_is_a_400(proxy: RunningProxy) -> None:
    response = httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "t\x00", "reward": 1.0})
    assert assert_openai_error(response, 400)["param"] == "trajectory_id"


def test_a_wrong_method_is_an_openai_405(proxy: RunningProxy) -> None:
    response = httpx.delete(f"{proxy.v1}/models")
    assert assert_openai_error(response, 405)["type"] == "invalid_request_error"
    assert response.headers["allow"] == "GET"
