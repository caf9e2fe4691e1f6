"""A URL's password shows nowhere: not in /metrics labels, /readyz, 502 bodies, logs, stored errors, exports, the
dashboard, the settings' repr, or a child's command line."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, serve_in_thread

from proxy import Settings
from store import redact

PASSWORD = "s3cret-pw-4711"


def with_password(url: str) -> str:
    return url.replace("http://", f"http://agent:{PASSWORD}@", 1)


def test_the_redaction_hides_every_urls_password_and_nothing_else() -> None:
    assert (
        redact(f"at http://agent:{PASSWORD}@vllm:8000/v1 (ConnectError)")
        == "at http://agent:***@vllm:8000/v1 (ConnectError)"
    )
    assert redact("postgresql+asyncpg://tracetrain:p@ss@db:5432/tt") == "postgresql+asyncpg://tracetrain:***@db:5432/tt"
    assert redact("https://sk-token@judge.example/v1") == "https://***@judge.example/v1"
    kept = "http://vllm:8000/v1/models?user=a@b.example and mail me at ops@example.com"
    assert redact(kept) == kept


def test_an_upstreams_password_is_shown_nowhere(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    vllm = FakeVLLM(emit_eos=True)
    with serve_in_thread(vllm.app) as url:
        proxy = start_proxy(upstream=with_password(f"{url}/v1"), admin_token="admin-" + "z" * 30)
        client = proxy.client(default_headers={"X-Trajectory-Id": "before"})
        client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "Hi"}])
        shown = [
            httpx.get(f"{proxy.url}/metrics").text,
            httpx.get(f"{proxy.url}/readyz").text,
            httpx.get(f"{proxy.url}/admin/overview", headers={"Authorization": f"Bearer admin-{'z' * 30}"}).text,
            httpx.get(f"{proxy.url}/admin", headers={"Authorization": f"Bearer admin-{'z' * 30}"}).text,
            repr(proxy.settings),
            str(proxy.settings),
        ]
        assert "agent:***@127.0.0.1" in shown[0]  # the server is still named, its password hidden
    # vLLM is gone: the next call's 502 names the upstream, and is recorded
    down = httpx.post(f"{proxy.v1}/chat/completions", headers={"X-Trajectory-Id": "after"},
                      json={"model": "agent", "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert down.status_code == 502 and "agent:***@127.0.0.1" in down.json()["error"]["message"]
    shown += [down.text, httpx.get(f"{proxy.url}/readyz").text, httpx.get(f"{proxy.url}/metrics").text]
    shown += [row["error"] or "" for row in proxy.rows("SELECT error FROM calls")]
    shown += [httpx.get(f"{proxy.v1}/trajectories/after").text]
    shown += [record.getMessage() + str(record.exc_info or "") for record in caplog.records]
    assert any("agent:***@" in text for text in [*shown[-3:], down.text])
    leaks = [text[:200] for text in shown if PASSWORD in text]
    assert leaks == []


def test_an_error_stored_before_redaction_is_redacted_when_read_and_exported(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, tmp_path: Path
) -> None:
    from tracetrain_cli._main import main

    proxy = start_proxy()
    proxy.client(default_headers={"X-Trajectory-Id": "old"}).chat.completions.create(
        model="agent", messages=[{"role": "user", "content": "Hi"}]
    )
    with sqlite3.connect(proxy.db_path) as conn:  # as an older release stored it
        conn.execute("UPDATE calls SET error = ?", (f"cannot reach the upstream at {with_password('http://vllm')}",))
    assert PASSWORD not in httpx.get(f"{proxy.v1}/trajectories/old").text
    out = tmp_path / "export.jsonl"
    assert main(["export", "--data-dir", str(proxy.settings.data_dir), "--format", "jsonl", "--output", str(out)]) == 0
    assert PASSWORD not in out.read_text()


def test_the_database_password_never_reaches_a_childs_command_line(tmp_path: Path) -> None:
    """A process's argv is readable by every user of the machine (ps): the trainer gets the URL in its environment."""
    from tracetrain_cli._serve import ServePlan, _trainer_env, trainer_argv

    url = f"postgresql+asyncpg://tracetrain:{PASSWORD}@db:5432/tracetrain"
    settings = Settings(data_dir=tmp_path, database_url=url)
    argv = trainer_argv(settings, tmp_path, "cpu", [])
    assert not any(PASSWORD in arg for arg in argv)
    env = _trainer_env(ServePlan(settings=settings, vllm=None, trainer_argv=argv))
    assert env["TRACETRAIN_DATABASE_URL"] == url
    assert PASSWORD not in repr(settings)


async def test_langfuses_and_the_judges_urls_are_redacted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from proxy.observability import start_exporters
    from proxy.observability._export_process import langfuse_receiver

    caplog.set_level(logging.INFO)
    settings = Settings(data_dir=tmp_path, langfuse=True, langfuse_public_key="pk-lf-1234",
                        langfuse_secret_key="sk-lf-" + "s" * 20, langfuse_base_url=with_password("http://127.0.0.1:9"),
                        judge_api_base=with_password("http://judge.internal/v1"))  # fmt: skip
    exporters = start_exporters(settings)
    assert exporters is not None and exporters.scores is not None
    try:
        scores = exporters.scores  # Langfuse's scores, posted from the proxy's process
        assert PASSWORD not in repr(scores) and PASSWORD not in caplog.text and "agent:***@127.0.0.1" in caplog.text
        assert PASSWORD not in str(scores._client.base_url)  # what httpx logs with each request
        # The spans, sent from the export process: the keys authenticate, the URL carries no password.
        assert PASSWORD not in langfuse_receiver(scores.config).endpoint
    finally:
        await exporters.aclose()
    assert PASSWORD not in repr(settings) and "agent:***@judge.internal" in repr(settings)
