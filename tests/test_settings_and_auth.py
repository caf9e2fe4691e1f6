"""Settings validation and the key rules for inference and rewards."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from proxy import Settings

KEY = "k-" + "a" * 30
REWARD_KEY = "r-" + "b" * 30


def test_non_loopback_bind_without_keys_refuses_to_start() -> None:
    with pytest.raises(ValidationError, match=r"refusing to listen on 0\.0\.0\.0"):
        Settings(host="0.0.0.0")
    assert Settings(host="0.0.0.0", api_keys=KEY).host == "0.0.0.0"


@pytest.mark.parametrize("secret", ["changeme", "short", "secret"])
def test_placeholder_secrets_are_rejected(secret: str) -> None:
    with pytest.raises(ValidationError, match="placeholder"):
        Settings(api_keys=secret)


def test_keys_come_from_the_environment_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACETRAIN_API_KEYS", f"{KEY}, {REWARD_KEY}")
    assert [k.get_secret_value() for k in Settings().api_keys] == [KEY, REWARD_KEY]


def test_secrets_never_show_in_repr() -> None:
    settings = Settings(api_keys=KEY, reward_keys=REWARD_KEY)
    assert KEY not in repr(settings) and REWARD_KEY not in str(settings.model_dump())


def test_inference_needs_a_key_when_keys_are_set(start_proxy) -> None:
    proxy = start_proxy(api_keys=KEY)
    body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
    missing = httpx.post(f"{proxy.v1}/chat/completions", json=body)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(f"{proxy.v1}/chat/completions", json=body, headers={"Authorization": "Bearer " + "x" * 32})
    assert wrong.status_code == 401 and KEY not in wrong.text
    ok = httpx.post(f"{proxy.v1}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_reward_keys_are_separate_from_inference_keys(start_proxy) -> None:
    proxy = start_proxy(api_keys=KEY, reward_keys=REWARD_KEY)
    headers = {"Authorization": f"Bearer {KEY}", "X-Trajectory-Id": "t1"}
    httpx.post(
        f"{proxy.v1}/chat/completions",
        headers=headers,
        json={"model": "agent", "messages": [{"role": "user", "content": "hi"}]},
    ).raise_for_status()
    body = {"trajectory_id": "t1", "reward": 1.0}
    as_agent = httpx.post(f"{proxy.v1}/rewards", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert as_agent.status_code == 401
    as_rewarder = httpx.post(f"{proxy.v1}/rewards", json=body, headers={"Authorization": f"Bearer {REWARD_KEY}"})
    assert as_rewarder.status_code == 200
    listing = httpx.get(f"{proxy.v1}/trajectories", headers={"Authorization": f"Bearer {REWARD_KEY}"})
    assert listing.status_code == 200
