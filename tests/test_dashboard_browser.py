"""The dashboard in a real browser (headless Chromium through Playwright): log in, read a
trajectory's shaded tokens, roll back an adapter, and a captured payload that does not run.

CI installs Debian's ``chromium``; elsewhere the test is skipped when Chromium or Playwright
is missing, and fails instead under ``CI=true`` so a broken install cannot pass unnoticed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply
from test_admin import ADMIN, BEARER, PAYLOAD, attempt
from test_publishing import record_trained_adapter, wait_for

CHROMIUM = os.environ.get("TRACETRAIN_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("playwright (pip install playwright)")
    if not shutil.which(CHROMIUM):
        missing.append(f"Chromium at {CHROMIUM} (apt-get install -y chromium)")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"browser tests need {' and '.join(missing)}")
        pytest.skip(f"browser tests need {' and '.join(missing)}")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page that records console errors, uncaught errors and dialogs (an alert would be one)."""
    context = browser.new_context()
    page = context.new_page()
    page.problems = []
    page.on("console", lambda m: page.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
    page.on("dialog", lambda d: (page.problems.append(f"dialog: {d.message}"), d.dismiss()))
    yield page
    context.close()


def active_version(proxy: RunningProxy) -> int:
    return int(httpx.get(f"{proxy.url}/admin/adapters", headers=BEARER).json()["active_version"])


def test_an_operator_logs_in_reads_the_tokens_and_rolls_back(
    start_proxy, fake: FakeVLLM, page: Any, tmp_path: Path
) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    fake.script(Reply(content="The capital of Peru is Lima."))
    attempt(proxy, "Capital of Peru?", "peru-1", reward=1.0)
    record_trained_adapter(proxy, 1, tmp_path)
    wait_for(lambda: active_version(proxy) == 1)

    page.goto(f"{proxy.url}/admin/ui/login?next=/admin/ui/trajectories")
    page.fill("#token", "not-the-token-at-all")
    page.click("button[type=submit]")
    assert "not the admin token" in page.inner_text("[role=alert]")
    page.problems.clear()  # the refused login answered 401, which Chromium logs as a failed resource
    page.fill("#token", ADMIN)
    page.click("button[type=submit]")
    page.wait_for_url("**/admin/ui/trajectories")
    assert "Now serving" not in page.content()

    page.click("text=peru-1")
    page.wait_for_url("**/admin/ui/trajectories/peru-1")
    tokens = page.locator(".tokens span")
    ids = httpx.get(f"{proxy.url}/admin/trajectories/peru-1", headers=BEARER).json()["calls"][0]
    assert tokens.count() == len(ids["completion_token_ids"]) > 0
    assert "".join(tokens.all_inner_texts()) == "The capital of Peru is Lima.<|im_end|>"  # vLLM keeps the EOS id
    first = tokens.first
    assert first.get_attribute("title").startswith(f"id {ids['completion_token_ids'][0]} · logprob ")
    assert first.get_attribute("class").startswith("lp")
    shaded = first.evaluate("e => getComputedStyle(e).backgroundColor")
    assert shaded  # the stylesheet applied (a CSP-blocked sheet would leave every class unstyled)
    heading = page.locator("h1").evaluate("e => getComputedStyle(e).fontSize")
    assert heading == "20px"

    page.click("text=Adapters")
    page.wait_for_url("**/admin/ui/adapters")
    page.click("text=Roll back to @0")
    page.wait_for_url(lambda url: url.endswith("/admin/ui/adapters?notice=activated&version=0"))
    assert "Now serving agent@0." in page.inner_text("[role=status]")
    assert active_version(proxy) == 0
    page.click("text=Activate @1")
    page.wait_for_url(lambda url: url.endswith("version=1"))
    assert active_version(proxy) == 1
    assert page.problems == []


def test_a_captured_script_payload_does_not_run(start_proxy, fake: FakeVLLM, page: Any) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    fake.script(Reply(content=PAYLOAD))
    attempt(proxy, PAYLOAD, "xss", reward=0.5)
    page.goto(f"{proxy.url}/admin/ui/login?next=/admin/ui/trajectories/xss")
    page.fill("#token", ADMIN)
    page.click("button[type=submit]")
    page.wait_for_url("**/admin/ui/trajectories/xss")
    for path in ("/admin/ui/trajectories/xss", "/admin/ui/trajectories", "/admin/ui/groups", "/admin"):
        page.goto(f"{proxy.url}{path}")
        assert page.evaluate("() => window.__pwned") is None, path
        assert page.locator("main script, main img").count() == 0, path
    page.goto(f"{proxy.url}/admin/ui/trajectories/xss")
    assert PAYLOAD in page.inner_text(".message.user pre")  # shown as the text it is
    assert PAYLOAD in "".join(page.locator(".tokens span").all_inner_texts())
    assert page.problems == []


def test_a_reviewer_scores_trajectories_from_the_keyboard(start_proxy, fake: FakeVLLM, page: Any) -> None:
    proxy = start_proxy(admin_token=ADMIN, reward_source="human")
    for i in range(1, 5):
        fake.script(Reply(content=f"Answer {i}."))
        attempt(proxy, f"Question {i}?", f"r{i}")

    def scored(trajectory_id: str) -> tuple[Any, ...]:
        t = httpx.get(f"{proxy.url}/admin/trajectories/{trajectory_id}", headers=BEARER).json()
        return t["reward"], t["reward_source"], t["reward_note"]

    page.goto(f"{proxy.url}/admin/ui/login?next=/admin/ui/review")
    page.fill("#token", ADMIN)
    page.click("button[type=submit]")
    page.wait_for_url("**/admin/ui/review")
    assert "4" in page.inner_text("#review-total")
    page.click("#review-start")
    page.wait_for_url("**/admin/ui/trajectories/r1")
    keys = page.inner_text("#review-keys")
    assert "0\u20139" in keys and "Enter" in keys and "j / k" in keys  # the shortcuts are written on the page

    page.keyboard.press("7")
    assert page.input_value("#score") == "0.7"
    page.keyboard.press("n")  # a note
    page.keyboard.type("close, but wordy")
    page.keyboard.press("Escape")
    page.keyboard.press("Enter")  # saved; the next trajectory awaiting a score opens
    page.wait_for_url("**/admin/ui/trajectories/r2?notice=scored")
    assert scored("r1") == (0.7, "human", "close, but wordy")

    page.keyboard.press("j")  # skip r2 for now
    page.wait_for_url("**/admin/ui/trajectories/r3")
    page.keyboard.press("k")  # back to it
    page.wait_for_url("**/admin/ui/trajectories/r2")
    page.keyboard.press("=")
    page.keyboard.press("Enter")
    page.wait_for_url("**/admin/ui/trajectories/r3?notice=scored")
    page.keyboard.press("0")
    page.keyboard.press("Enter")
    page.wait_for_url("**/admin/ui/trajectories/r4?notice=scored")
    assert [scored(t)[:2] for t in ("r2", "r3", "r4")] == [(1.0, "human"), (0.0, "human"), (None, None)]
    assert "Score saved" in page.inner_text("[role=status]")
    assert page.problems == []  # the review script ran under the page's policy, and nothing else tried to
