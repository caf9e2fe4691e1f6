"""The log-in throttle: every comparison with the admin token counts a wrong one, and the client's address is
the connection's peer unless the operator names the reverse proxy that forwards for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM
from test_slow_clients import served

from proxy import Settings
from tracetrain_cli._http_server import server_config

ADMIN = "admin-" + "t" * 30
ADAPTER_KEY = "adapter-" + "a" * 30
REWARD_KEY = "reward-" + "r" * 30


def statuses(url: str, n: int, headers: Callable[[int], dict[str, str]]) -> list[int]:
    return [httpx.get(url, headers=headers(i)).status_code for i in range(n)]


def guess(i: int) -> dict[str, str]:
    return {"Authorization": f"Bearer guess-{i:04d}-{'g' * 20}"}


def test_wrong_tokens_for_adapter_files_are_throttled(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy(admin_token=ADMIN, adapter_keys=ADAPTER_KEY)
    url = f"{proxy.url}/v1/adapters/agent/1"
    assert statuses(url, 7, guess) == [401] * 5 + [429] * 2
    # The same address's next guess at the admin API is throttled too: one count per address.
    assert httpx.get(f"{proxy.url}/admin/overview", headers=guess(99)).status_code == 429
    # The right credentials are still admitted (404: no such version, past the check).
    assert httpx.get(url, headers={"Authorization": f"Bearer {ADAPTER_KEY}"}).status_code == 404
    assert httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 404


def test_wrong_tokens_for_protected_metrics_are_throttled(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy(admin_token=ADMIN, reward_keys=REWARD_KEY, protect_metrics_and_docs=True)
    url = f"{proxy.url}/metrics"
    assert statuses(url, 7, guess) == [401] * 5 + [429] * 2
    refused = httpx.get(url, headers=guess(7))
    assert refused.json()["error"]["type"] == "rate_limit_error" and int(refused.headers["Retry-After"]) >= 1
    # The door's count is the app's: the next guess at the admin API is throttled as well.
    assert httpx.get(f"{proxy.url}/admin/overview", headers=guess(99)).status_code == 429
    assert httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert httpx.get(url, headers={"Authorization": f"Bearer {REWARD_KEY}"}).status_code == 200


@contextmanager
def served_as_serve_does(settings: Settings) -> Iterator[str]:
    """The proxy under the uvicorn configuration ``tracetrain serve`` builds (``server_config``), in a thread."""
    with served(settings) as (host, port):
        yield f"http://{host}:{port}"


def from_client(address: str, i: int) -> dict[str, str]:
    return {**guess(i), "X-Forwarded-For": address}


@pytest.fixture
def settings_for(tmp_path: Path, fake: FakeVLLM) -> Callable[..., Settings]:
    def build(**overrides: Any) -> Settings:
        return Settings(upstream=f"{fake.url}/v1", data_dir=tmp_path / "data", admin_token=ADMIN, port=0, **overrides)  # type: ignore[attr-defined]

    return build


def test_x_forwarded_for_is_ignored_by_default_even_from_loopback(settings_for: Callable[..., Settings]) -> None:
    with served_as_serve_does(settings_for()) as url:
        # Each guess claims another client: the throttle counts the connection's address all the same.
        got = statuses(f"{url}/admin/overview", 6, lambda i: from_client(f"203.0.113.{i + 1}", i))
        assert got == [401] * 5 + [429]
        assert httpx.get(f"{url}/admin/overview", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_x_forwarded_for_names_the_client_when_it_comes_from_a_named_proxy(
    settings_for: Callable[..., Settings],
) -> None:
    with served_as_serve_does(settings_for(forwarded_allow_ips="127.0.0.0/8")) as url:
        overview = f"{url}/admin/overview"
        assert statuses(overview, 6, lambda i: from_client("203.0.113.7", i)) == [401] * 5 + [429]
        # Another client behind the same proxy is not slowed by the first one's guesses.
        assert httpx.get(overview, headers=from_client("203.0.113.8", 0)).status_code == 401
        right = {"Authorization": f"Bearer {ADMIN}", "X-Forwarded-For": "203.0.113.7"}
        assert httpx.get(overview, headers=right).status_code == 200


def test_forwarded_allow_ips_must_be_addresses_or_networks(tmp_path: Path) -> None:
    assert Settings(data_dir=tmp_path, forwarded_allow_ips="10.0.0.1, 172.28.0.0/16").forwarded_allow_ips == (
        "10.0.0.1",
        "172.28.0.0/16",
    )
    with pytest.raises(ValueError, match="not an address or a network"):
        Settings(data_dir=tmp_path, forwarded_allow_ips="nginx")


def test_serve_builds_uvicorn_without_proxy_headers_unless_proxies_are_named(tmp_path: Path) -> None:
    plain = server_config(object(), Settings(data_dir=tmp_path))
    assert plain.proxy_headers is False
    named = server_config(object(), Settings(data_dir=tmp_path, forwarded_allow_ips="172.28.0.0/16"))
    assert named.proxy_headers is True and named.forwarded_allow_ips == ["172.28.0.0/16"]
