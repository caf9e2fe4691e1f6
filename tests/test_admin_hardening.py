"""Admin credentials under abuse: malformed ones are a 4xx, guessing is throttled, sessions end on the server, and a
policy's name is never a path that leaves its directory."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from test_admin import ADMIN, BEARER, csrf_of, login

from proxy import Settings


def test_malformed_credentials_are_refused_never_a_server_error(start_proxy) -> None:
    """A cookie or header of bytes that are not ASCII failed hmac.compare_digest on str: a 500 and a traceback."""
    proxy = start_proxy(admin_token=ADMIN)
    odd = "\u00e9t\u00e9.\u00fc\u00f1\u00ee.c\u00f6\u00f6kie"
    for cookie in (odd, "1.2.\u00e9", "\u00e9\u00e9.x.y"):
        headers = {"Cookie": f"tracetrain_admin={cookie}".encode()}
        response = httpx.get(f"{proxy.url}/admin/overview", headers=headers)  # type: ignore[arg-type]
        assert response.status_code == 401, cookie
        page = httpx.get(f"{proxy.url}/admin", headers=headers)  # type: ignore[arg-type]
        assert page.status_code == 401, cookie
    bearer = httpx.get(f"{proxy.url}/admin/overview", headers={"Authorization": "Bearer t\u00f6ken".encode("latin-1")})
    assert bearer.status_code == 401
    with login(proxy) as client:
        odd_csrf = client.post("/admin/train", headers={"X-CSRF-Token": "\u00e9".encode("latin-1")})
        assert odd_csrf.status_code == 403
        form = client.post("/admin/ui/logout", data={"csrf_token": "\u00e9\u00e8"})
        assert form.status_code == 403
    assert httpx.post(f"{proxy.url}/admin/ui/login", data={"token": "t\u00f6ken\u2603"}).status_code == 401


def test_wrong_log_ins_are_throttled_and_the_right_token_is_still_admitted(start_proxy) -> None:
    """Every client behind a reverse proxy has one address: a throttle that refused the right token there would
    let anyone who reaches the admin API lock its owner out."""
    proxy = start_proxy(admin_token=ADMIN)
    statuses = [httpx.post(f"{proxy.url}/admin/ui/login", data={"token": f"guess-{i}"}).status_code for i in range(8)]
    assert statuses[:5] == [401] * 5 and statuses[5:] == [429] * 3
    wrong = httpx.post(f"{proxy.url}/admin/ui/login", data={"token": "guess-9"})
    assert wrong.status_code == 429 and 1 <= int(wrong.headers["Retry-After"]) <= 60
    assert "set-cookie" not in wrong.headers
    api = httpx.get(f"{proxy.url}/admin/overview", headers={"Authorization": "Bearer guess-10"})
    assert api.status_code == 429 and api.json()["error"]["type"] == "rate_limit_error" and api.headers["Retry-After"]
    # The right token, from the same address, right away: admitted, by the form and by the API.
    right = httpx.post(f"{proxy.url}/admin/ui/login", data={"token": ADMIN})
    assert right.status_code == 303 and "tracetrain_admin=" in right.headers["set-cookie"]
    assert httpx.get(f"{proxy.url}/admin/overview", headers=BEARER).status_code == 200


def test_logout_revokes_the_session_on_the_server(start_proxy) -> None:
    """Deleting the browser's cookie is not enough: a copy of it (a stolen one) must stop working too."""
    proxy = start_proxy(admin_token=ADMIN)
    with login(proxy) as client:
        copied = client.cookies["tracetrain_admin"]
        assert httpx.get(f"{proxy.url}/admin/overview", cookies={"tracetrain_admin": copied}).status_code == 200
        client.post("/admin/ui/logout", data={"csrf_token": csrf_of(client.get("/admin").text)})
    assert httpx.get(f"{proxy.url}/admin/overview", cookies={"tracetrain_admin": copied}).status_code == 401
    with login(proxy) as again:  # logging in again works
        assert again.get("/admin/overview").status_code == 200


def test_every_session_can_be_revoked_at_once(start_proxy) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    cookies = []
    for _ in range(2):
        with login(proxy) as client:
            cookies.append(client.cookies["tracetrain_admin"])
    assert httpx.post(f"{proxy.url}/admin/sessions/revoke", headers=BEARER).json() == {"revoked": "all sessions"}
    for cookie in cookies:
        assert httpx.get(f"{proxy.url}/admin/overview", cookies={"tracetrain_admin": cookie}).status_code == 401
    with login(proxy) as client:  # a session made after the revocation is fine, even within the same second
        assert client.get("/admin/overview").status_code == 200
    openapi = httpx.get(f"{proxy.url}/openapi.json").json()
    assert "/admin/sessions/revoke" in openapi["paths"]


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "-flag", "_x", "a/b", "", "a" * 101])
def test_a_policy_name_must_start_with_a_letter_or_digit(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trainer writes DATA_DIR/adapters/<policy>/: '..' would write beside DATA_DIR."""
    from trainer.__main__ import parse_args

    with pytest.raises(ValidationError):
        Settings(data_dir=tmp_path, policy=name)
    with pytest.raises(SystemExit) as refused:
        parse_args(["--database-url", "sqlite+aiosqlite:///x.db", "--data-dir", str(tmp_path),
                    "--base-model", str(tmp_path), "--policy", name])  # fmt: skip
    assert refused.value.code == 2 and "policy" in capsys.readouterr().err


def test_ordinary_policy_names_are_accepted(tmp_path: Path) -> None:
    from trainer.__main__ import parse_args

    for name in ("agent", "Agent-2", "team.coder_v3", "7b"):
        assert Settings(data_dir=tmp_path, policy=name).policy == name
        args = parse_args(["--database-url", "sqlite+aiosqlite:///x.db", "--data-dir", str(tmp_path),
                           "--base-model", str(tmp_path), "--policy", name])  # fmt: skip
        assert args.policy == [name]
