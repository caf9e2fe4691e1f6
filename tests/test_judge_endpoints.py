"""Where the judge's requests go is the operator's to say: the admin API picks among the judges configured.

Every test runs a listener on loopback that counts what reaches it, as a host inside the network would: the
admin API must not be able to aim the judge (and the provider key it carries) at it, and what such a host
answers is never echoed in a judgement's error.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import serve_in_thread
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from test_judge import attempt

from proxy import Settings

PROVIDER_KEY = "sk-test-" + "p" * 40
BODY = "INTERNAL-PAGE-3f9a: rows of a host nobody should read"


class Listener:
    """A loopback HTTP server that records every request and answers what ``answer`` says."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answer: Callable[[], Response] = lambda: PlainTextResponse(BODY, status_code=500)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        self.requests.append({"path": request.url.path, "headers": dict(request.headers),
                              "body": (await request.body()).decode()})  # fmt: skip
        await self.answer()(scope, receive, send)


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Listener, str]]:
    monkeypatch.setenv("OPENAI_API_KEY", PROVIDER_KEY)
    monkeypatch.setenv("DISABLE_AIOHTTP_TRANSPORT", "True")
    app = Listener()
    with serve_in_thread(app) as url:
        yield app, f"{url}/v1"


def patch_policy(proxy: RunningProxy, config: dict[str, Any]) -> httpx.Response:
    return httpx.patch(f"{proxy.url}/admin/policies/agent", json={"config": config})


def test_the_admin_api_cannot_aim_the_judge_at_a_url(start_proxy, listener: tuple[Listener, str]) -> None:
    app, url = listener
    proxy = start_proxy()
    for config in ({"judge_model": "openai/gpt-4o-mini", "judge_api_base": url}, {"judge_api_base": url},
                   {"judge_model": "openai/gpt-4o-mini"}):  # fmt: skip
        refused = patch_policy(proxy, config)
        assert refused.status_code == 400, config
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].startswith("config.judge_"), config
    added = httpx.post(f"{proxy.url}/admin/policies", json={"name": "other", "config": {"judge_model": "openai/x"}})
    assert added.status_code == 400 and added.json()["error"]["param"] == "config.judge_model"
    group = attempt(proxy, "a")
    attempt(proxy, "b")
    judged = httpx.post(f"{proxy.url}/admin/groups/{group}/judge", timeout=60).json()
    assert judged["model"].startswith("hosted_vllm/")  # the server's own judge: the base model upstream
    assert app.requests == []


def test_a_policy_picks_a_judge_the_operator_configured(start_proxy, listener: tuple[Listener, str]) -> None:
    app, url = listener
    proxy = start_proxy(judges=(f"openai/gpt-4o-mini={url}", "anthropic/claude-x"))
    chosen = patch_policy(proxy, {"judge_model": "openai/gpt-4o-mini"})
    assert chosen.status_code == 200 and chosen.json()["settings"]["judge_model"] == "openai/gpt-4o-mini"
    assert "judge_api_base" not in chosen.json()["settings"]
    group = attempt(proxy, "a")
    attempt(proxy, "b")
    failed = httpx.post(f"{proxy.url}/admin/groups/{group}/judge", timeout=60).json()
    assert len(app.requests) >= 1 and app.requests[0]["path"] == "/v1/chat/completions"
    # The far end's answer is classified, never echoed: it could be any host's page.
    assert failed["state"] == "failed" and "HTTP 500" in failed["error"] and BODY not in failed["error"]
    assert "INTERNAL-PAGE" not in httpx.get(f"{proxy.url}/admin/judgements").text


def test_a_judges_answer_that_is_not_json_is_not_echoed(start_proxy, listener: tuple[Listener, str]) -> None:
    app, url = listener
    app.answer = lambda: PlainTextResponse(BODY, status_code=200)
    proxy = start_proxy(judge_model="openai/gpt-4o-mini", judge_api_base=url, judge_max_attempts=1)
    group = attempt(proxy, "a")
    attempt(proxy, "b")
    failed = httpx.post(f"{proxy.url}/admin/groups/{group}/judge", timeout=60).json()
    assert len(app.requests) == 1 and failed["state"] == "failed"
    assert BODY not in failed["error"] and "INTERNAL-PAGE" not in failed["error"], failed["error"]
    assert "not valid JSON" in failed["error"]


def test_a_refused_connection_is_named_as_such(start_proxy, listener: tuple[Listener, str]) -> None:
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: a connection to it is refused
        proxy = start_proxy(judge_model="openai/gpt-4o-mini", judge_api_base=f"http://127.0.0.1:{port}/v1",
                            judge_max_attempts=1)  # fmt: skip
        group = attempt(proxy, "a")
        attempt(proxy, "b")
        failed = httpx.post(f"{proxy.url}/admin/groups/{group}/judge", timeout=60).json()
    assert failed["state"] == "failed" and "connection refused" in failed["error"], failed["error"]


def test_a_stored_judge_the_server_no_longer_configures_is_not_asked(
    start_proxy, listener: tuple[Listener, str]
) -> None:
    app, url = listener
    first = start_proxy(judges=(f"openai/gpt-4o-mini={url}",))
    assert patch_policy(first, {"judge_model": "openai/gpt-4o-mini"}).status_code == 200
    group = attempt(first, "a")
    attempt(first, "b")
    first.stop()
    proxy = start_proxy()  # the same store, without that judge
    failed = httpx.post(f"{proxy.url}/admin/groups/{group}/judge", timeout=60).json()
    assert failed["state"] == "failed" and "not one this server is configured with" in failed["error"]
    assert app.requests == []


def test_a_policy_config_file_may_name_only_a_configured_judge(tmp_path) -> None:
    with pytest.raises(ValueError, match="not one this server is configured with"):
        Settings(data_dir=tmp_path, policy_configs={"agent": {"judge_model": "openai/gpt-4o-mini"}})
    with pytest.raises(ValueError, match="judge_api_base"):
        Settings(data_dir=tmp_path, policy_configs={"agent": {"judge_api_base": "http://127.0.0.1:9/v1"}})
    ok = Settings(data_dir=tmp_path, judges=("openai/gpt-4o-mini",),
                  policy_configs={"agent": {"judge_model": "openai/gpt-4o-mini"}})  # fmt: skip
    assert ok.judge_endpoints == {"openai/gpt-4o-mini": None}


def test_serve_flags_name_the_judges_and_their_urls() -> None:
    from tracetrain_cli._serve_command import settings_from
    from tracetrain_cli._serve_flags import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--judge-model", "openai/gpt-4o-mini", "--judge-api-base", "https://gw/v1",
                              "--judge", "anthropic/claude-x",
                              "--judge", "hosted_vllm/big=http://10.0.0.5:8000/v1"])  # fmt: skip
    settings = settings_from(args)
    assert settings.judge_endpoints == {"openai/gpt-4o-mini": "https://gw/v1", "anthropic/claude-x": None,
                                        "hosted_vllm/big": "http://10.0.0.5:8000/v1"}  # fmt: skip
    with pytest.raises(SystemExit):
        settings_from(parser.parse_args(["serve", "--judge", "m=ftp://x"]))
