"""The front door over real HTTP: browsers and foreign hosts with no keys, body size and depth, prompt lists,
who reads /metrics and the docs."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM

KEY = "key-" + "k" * 30
ADMIN = "admin-" + "z" * 30
REWARD_KEY = "reward-" + "r" * 30
CHAT = {"model": "agent", "messages": [{"role": "user", "content": "Name a colour."}]}
MESSAGES = {"model": "agent", "max_tokens": 16, "messages": [{"role": "user", "content": "Name a colour."}]}
CROSS_SITE: list[dict[str, str]] = [
    {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"},
    {"Origin": "https://evil.example"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},  # another port of localhost is the same site, but not this server
    {"Origin": "null"},
]


def nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = {"a": value}
    return value


def post(proxy: RunningProxy, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{proxy.url}{path}", content=httpx.Request("POST", "/", json=body).content, headers=headers)


# -- browsers and foreign hosts, with no keys ---------------------------------------------------------


@pytest.mark.parametrize("headers", CROSS_SITE)
def test_a_cross_site_browser_request_reaches_no_route_without_keys(
    proxy: RunningProxy, fake: FakeVLLM, headers: dict[str, str]
) -> None:
    chat = post(proxy, "/v1/chat/completions", CHAT, **headers)
    assert chat.status_code == 403 and chat.json()["error"]["type"] == "permission_error"
    messages = post(proxy, "/v1/messages", MESSAGES, **headers)
    assert messages.status_code == 403 and messages.json()["type"] == "error"  # Anthropic's shape there
    assert messages.json()["error"]["type"] == "permission_error"
    rewards = post(proxy, "/v1/rewards", {"trajectory_id": "t", "reward": 1.0}, **headers)
    assert rewards.status_code == 403
    assert httpx.get(f"{proxy.v1}/trajectories", headers=headers).status_code == 403
    assert fake.requests == []  # nothing was generated
    assert proxy.rows("SELECT * FROM calls") == [] and proxy.rows("SELECT * FROM rewards") == []


def test_a_foreign_host_reads_nothing_without_keys(proxy: RunningProxy) -> None:
    """DNS rebinding: a name the attacker owns, pointed at 127.0.0.1, arrives as the Host header."""
    assert post(proxy, "/v1/chat/completions", CHAT).status_code == 200
    for host in ("evil.example", "evil.example:8100", "127.0.0.1.evil.example", "localhost.evil.example"):
        response = httpx.get(f"{proxy.v1}/trajectories", headers={"Host": host})
        assert response.status_code == 403, host
        assert "Host" in response.json()["error"]["message"]
    port = proxy.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"127.0.0.2:{port}", "app.localhost", "LOCALHOST"):
        assert httpx.get(f"{proxy.v1}/trajectories", headers={"Host": host}).status_code == 200, host


def test_same_origin_pages_tools_and_followed_links_still_pass(proxy: RunningProxy) -> None:
    assert post(proxy, "/v1/chat/completions", CHAT).status_code == 200  # SDKs send neither header
    same = post(proxy, "/v1/chat/completions", CHAT, Origin=proxy.url, **{"Sec-Fetch-Site": "same-origin"})
    assert same.status_code == 200
    link = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
    assert httpx.get(f"{proxy.url}/admin", headers=link).status_code == 200  # a link followed changes nothing
    assert post(proxy, "/v1/rewards", {"trajectory_id": "t", "reward": 1.0}, **link).status_code == 403


def test_with_keys_a_request_that_holds_one_is_not_taken_for_a_browsers(start_proxy) -> None:
    proxy = start_proxy(api_keys=KEY)
    headers = {"Authorization": f"Bearer {KEY}", "Origin": "https://app.example", "Host": "proxy.example"}
    assert post(proxy, "/v1/chat/completions", CHAT, **headers).status_code == 200
    assert post(proxy, "/v1/chat/completions", CHAT, Origin="https://evil.example").status_code == 401


def test_refusals_at_the_door_are_counted(proxy: RunningProxy) -> None:
    post(proxy, "/v1/chat/completions", CHAT, Origin="https://evil.example")
    httpx.get(f"{proxy.v1}/models", headers={"Host": "evil.example"})
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'tracetrain_refused_requests_total{reason="cross_site"} 1.0' in metrics
    assert 'tracetrain_refused_requests_total{reason="foreign_host"} 1.0' in metrics


# -- bodies ---------------------------------------------------------------------------------------


def raw_exchange(proxy: RunningProxy, head: bytes, body: bytes = b"") -> bytes:
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_body_over_the_cap_is_a_413_before_it_is_read(start_proxy, fake: FakeVLLM) -> None:
    """The default is 32 MB: a 40 MB body is refused from its Content-Length, and its connection closed."""
    proxy = start_proxy()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 40000000\r\n\r\n"
    )
    answer = raw_exchange(proxy, head, b'{"model": "agent", ')  # the rest never comes: the answer does not wait for it
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer and b"connection: close" in answer
    messages = raw_exchange(proxy, head.replace(b"/chat/completions", b"/messages"))
    assert messages.startswith(b"HTTP/1.1 413") and b'"type":"request_too_large"' in messages
    assert fake.requests == []


def test_a_chunked_body_is_cut_off_at_the_cap(start_proxy, fake: FakeVLLM) -> None:
    proxy = start_proxy(max_body_mb=0.01)  # 10,000 bytes

    def chunks(size: int) -> Any:
        yield b'{"model": "agent", "messages": [{"role": "user", "content": "'
        yield b"x" * size
        yield b'"}]}'

    small = httpx.post(f"{proxy.v1}/chat/completions", content=chunks(100))  # a generator: sent chunked
    assert small.status_code == 200
    large = httpx.post(f"{proxy.v1}/chat/completions", content=chunks(20_000))
    assert large.status_code == 413 and large.json()["error"]["code"] == "request_too_large"
    assert len(fake.requests) == 1


def test_a_body_nested_deeper_than_the_limit_is_a_400_before_anything_is_generated(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    """orjson reads 1024 levels and writes 254: a Messages body nested 300 deep in its metadata was generated,
    then failed its record (and every record in its batch)."""
    deep_messages = post(proxy, "/v1/messages", {**MESSAGES, "metadata": nested(300)})
    assert deep_messages.status_code == 400 and deep_messages.json()["type"] == "error"
    assert deep_messages.json()["error"]["type"] == "invalid_request_error"
    assert "deeper than 128" in deep_messages.json()["error"]["message"]
    deep_chat = post(proxy, "/v1/chat/completions", {**CHAT, "user": nested(200)})
    assert deep_chat.status_code == 400 and deep_chat.json()["error"]["code"] == "json_too_deep"
    deep_responses = post(proxy, "/v1/responses", {"model": "agent", "input": "hi", "metadata": nested(129)})
    assert deep_responses.status_code == 400
    assert fake.requests == [] and proxy.rows("SELECT * FROM calls") == []
    within = post(proxy, "/v1/chat/completions", {**CHAT, "user_data": nested(120)})
    assert within.status_code == 200  # generous: real bodies nest a few dozen levels


def test_a_completions_prompt_list_is_capped(proxy: RunningProxy, fake: FakeVLLM) -> None:
    many = post(proxy, "/v1/completions", {"model": "agent", "prompt": ["2+2="] * 129})
    assert many.status_code == 400 and many.json()["error"]["param"] == "prompt"
    times_n = post(proxy, "/v1/completions", {"model": "agent", "prompt": ["2+2="] * 4, "n": 40})
    assert times_n.status_code == 400 and times_n.json()["error"]["param"] == "n"
    ids = post(proxy, "/v1/completions", {"model": "agent", "prompt": list(range(1, 500)), "max_tokens": 2})
    assert ids.status_code == 200  # a list of token ids is one prompt
    assert len(fake.requests) == 1


# -- metrics and docs ------------------------------------------------------------------------------


def test_metrics_and_docs_can_require_credentials(start_proxy) -> None:
    open_proxy = start_proxy()
    assert httpx.get(f"{open_proxy.url}/metrics").status_code == 200  # open by default, like /healthz
    proxy = start_proxy(admin_token=ADMIN, reward_keys=REWARD_KEY, protect_metrics_and_docs=True)
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
        refused = httpx.get(f"{proxy.url}{path}")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error", path
        wrong = httpx.get(f"{proxy.url}{path}", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, path
        for token in (ADMIN, REWARD_KEY):
            assert httpx.get(f"{proxy.url}{path}", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert httpx.get(f"{proxy.url}/healthz").status_code == 200
