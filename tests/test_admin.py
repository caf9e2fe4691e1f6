"""The admin API and the dashboard over real HTTP: who gets in, what they see, what they can change."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, ToolCall
from fake_vllm_text import detokenize
from test_publishing import adapters, record_trained_adapter, wait_for

from proxy import Settings, create_app
from proxy.admin._service import group_advantages

ADMIN = "admin-" + "z" * 30
KEY = "key-" + "k" * 30
BEARER = {"Authorization": f"Bearer {ADMIN}"}
PAYLOAD = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


def attempt(proxy: RunningProxy, task: str, trajectory_id: str, reward: float | None = None, **headers: str) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": trajectory_id, **headers})
    client.chat.completions.create(model="agent", messages=[{"role": "user", "content": task}])
    if reward is not None:
        httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": trajectory_id, "reward": reward}).raise_for_status()


@contextmanager
def login(proxy: RunningProxy, token: str = ADMIN) -> Iterator[httpx.Client]:
    """A browser-like client that logged in through the form."""
    with httpx.Client(base_url=proxy.url) as client:
        response = client.post("/admin/ui/login", data={"token": token, "next": "/admin/ui/adapters"})
        assert response.status_code == 303, response.text
        yield client


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert match, "the page carries no CSRF token"
    return match.group(1)


def admin_routes(tmp_path: Path) -> list[tuple[str, str]]:
    """Every (method, path) under /admin, path parameters filled in."""
    app = create_app(Settings(data_dir=tmp_path / "routes"))
    found = []
    for route in app.routes:
        path = getattr(route, "path", "")
        if not path.startswith("/admin"):
            continue
        for method in sorted(getattr(route, "methods", set()) - {"HEAD"}):
            filled = re.sub(r"\{(\w+)\}", lambda m: "1" if m.group(1) in ("version", "trial_id") else "x", path)
            found.append((method, filled))
    return found


# -- who gets in -------------------------------------------------------------------------------


def test_every_admin_page_and_endpoint_answers_401_without_credentials(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    routes = admin_routes(tmp_path)
    assert ("GET", "/admin") in routes and ("GET", "/admin/ui/trajectories/x") in routes
    assert ("POST", "/admin/ui/adapters/1/activate") in routes and ("GET", "/admin/overview") in routes
    for method, path in routes:
        response = httpx.request(method, f"{proxy.url}{path}")
        if path == "/admin/ui/login":
            assert response.status_code == (200 if method == "GET" else 401), (method, path)
            continue
        assert response.status_code == 401, (method, path, response.status_code)
        if response.headers["content-type"].startswith("application/json"):
            assert response.json()["error"]["type"] == "authentication_error"
        else:
            assert 'name="token"' in response.text  # the page offers the login form


def test_the_admin_token_admits_and_anything_else_is_refused(start_proxy) -> None:
    proxy = start_proxy(admin_token=ADMIN, api_keys=KEY)
    assert httpx.get(f"{proxy.url}/admin/overview", headers=BEARER).status_code == 200
    for wrong in (KEY, ADMIN + "x", ADMIN[:-1]):
        response = httpx.get(f"{proxy.url}/admin/overview", headers={"Authorization": f"Bearer {wrong}"})
        assert response.status_code == 401 and response.json()["error"]["message"] == "Invalid admin token."
    page = httpx.get(f"{proxy.url}/admin", headers=BEARER)
    assert page.status_code == 200 and "Overview" in page.text


def test_beyond_loopback_without_an_admin_token_nothing_admin_is_open(start_proxy) -> None:
    proxy = start_proxy(host="0.0.0.0", api_keys=KEY)
    response = httpx.get(f"{proxy.url}/admin/adapters")
    assert response.status_code == 403 and "TRACETRAIN_ADMIN_TOKEN" in response.json()["error"]["message"]
    assert httpx.get(f"{proxy.url}/admin").status_code == 403


def test_login_sets_an_httponly_samesite_cookie_that_is_not_the_token(start_proxy) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    response = httpx.post(f"{proxy.url}/admin/ui/login", data={"token": ADMIN, "next": "/admin/ui/training"})
    assert response.status_code == 303 and response.headers["location"] == "/admin/ui/training"
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin" in cookie
    assert ADMIN not in cookie
    with login(proxy) as client:
        assert client.get("/admin/ui/training").status_code == 200
        assert client.get("/admin/overview").status_code == 200  # the JSON API accepts the session too


def test_a_wrong_login_is_refused_and_next_never_leaves_the_dashboard(start_proxy) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    wrong = httpx.post(f"{proxy.url}/admin/ui/login", data={"token": "nope"})
    assert wrong.status_code == 401 and "not the admin token" in wrong.text and "set-cookie" not in wrong.headers
    for target in ("https://evil.example/", "//evil.example/admin", "/v1/models"):
        response = httpx.post(f"{proxy.url}/admin/ui/login", data={"token": ADMIN, "next": target})
        assert response.headers["location"] == "/admin"


def test_a_forged_or_expired_session_cookie_is_refused(start_proxy) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    with login(proxy) as client:
        good = client.cookies["tracetrain_admin"]
    expires, nonce, signature = good.split(".")
    for forged in (f"{int(expires) + 10}.{nonce}.{signature}", f"{expires}.{nonce}x.{signature}", "1.2.3", "garbage"):
        response = httpx.get(f"{proxy.url}/admin/overview", cookies={"tracetrain_admin": forged})
        assert response.status_code == 401, forged


def test_actions_through_a_session_need_its_csrf_token(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    record_trained_adapter(proxy, 1, tmp_path)
    wait_for(lambda: httpx.get(f"{proxy.url}/admin/adapters", headers=BEARER).json()["active_version"] == 1)
    with login(proxy) as client:
        page = client.get("/admin/ui/adapters")
        token = csrf_of(page.text)
        assert client.post("/admin/ui/adapters/0/activate").status_code == 403
        assert client.post("/admin/ui/adapters/0/activate", data={"csrf_token": "0" * 64}).status_code == 403
        assert client.post("/admin/train").status_code == 403  # the JSON API wants X-CSRF-Token with a cookie
        done = client.post("/admin/ui/adapters/0/activate", data={"csrf_token": token})
        assert done.status_code == 303 and done.headers["location"].endswith("notice=activated&version=0")
        assert "Now serving agent@0." in client.get(done.headers["location"]).text
        assert client.get("/admin/adapters").json()["active_version"] == 0
        again = client.post("/admin/adapters/1/activate", headers={"X-CSRF-Token": token})
        assert again.json()["active_version"] == 1


def test_cross_site_requests_change_nothing_even_without_a_token(proxy: RunningProxy) -> None:
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
        response = httpx.post(f"{proxy.url}/admin/adapters/0/activate", headers=headers)
        assert response.status_code == 403, headers
        assert httpx.post(f"{proxy.url}/admin/ui/train", headers=headers).status_code == 403
    same_site = httpx.post(f"{proxy.url}/admin/adapters/0/activate", headers={"Origin": proxy.url})
    assert same_site.status_code == 200


def test_logout_ends_the_browser_session(start_proxy) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    with login(proxy) as client:
        token = csrf_of(client.get("/admin").text)
        out = client.post("/admin/ui/logout", data={"csrf_token": token})
        assert out.status_code == 303 and 'tracetrain_admin=""' in out.headers["set-cookie"]
        assert client.get("/admin").status_code == 401


# -- what the pages show ----------------------------------------------------------------------


def test_captured_markup_is_shown_as_text_under_a_policy_that_runs_no_script(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    fake.script(Reply(content=PAYLOAD))
    attempt(proxy, PAYLOAD, "xss")
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "xss", "reward": 1.0}).raise_for_status()
    for path in ("/admin/ui/trajectories/xss", "/admin/ui/trajectories", "/admin/ui/groups"):
        page = httpx.get(f"{proxy.url}{path}")
        assert page.status_code == 200
        assert "<script>window" not in page.text and "<img src=x" not in page.text, path
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "unsafe-inline" not in csp
        scripts = re.findall(r"<script>(.*?)</script>", page.text, re.S)
        if path == "/admin/ui/trajectories/xss":  # the review shortcuts, and no other script, allowed by their hash
            digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
            assert len(scripts) == 1 and csp.endswith(f"script-src 'sha256-{digest}'"), csp
        else:
            assert scripts == [] and "script-src" not in csp
        assert page.headers["x-frame-options"] == "DENY"
    detail = httpx.get(f"{proxy.url}/admin/ui/trajectories/xss").text
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in detail  # the user's message, as text


def test_a_trajectory_shows_each_completion_token_with_its_text_and_logprob(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    fake.script(Reply(content="Paris is the capital"))
    attempt(proxy, "Capital of France?", "t1")
    detail = httpx.get(f"{proxy.url}/admin/trajectories/t1").json()
    call = detail["calls"][0]
    ids, texts = call["completion_token_ids"], call["completion_token_texts"]
    assert ids and texts == [detokenize([token_id]) for token_id in ids]
    assert call["new_messages"] == [{"role": "user", "content": "Capital of France?"}]
    page = httpx.get(f"{proxy.url}/admin/ui/trajectories/t1").text
    spans = re.findall(r'<span class="lp(\d)" title="id (\d+) · logprob (-?[\d.]+)', page)
    assert [int(token_id) for _, token_id, _ in spans] == ids
    for (shade, _, logprob), expected in zip(spans, call["logprobs"], strict=True):
        assert float(logprob) == pytest.approx(expected, abs=1e-3)
        assert 0 <= int(shade) <= 9
    asked = fake.detokenized
    httpx.get(f"{proxy.url}/admin/trajectories/t1").raise_for_status()
    assert fake.detokenized == asked  # token texts are asked for once


def test_a_later_call_shows_only_what_the_agent_added(proxy: RunningProxy, fake: FakeVLLM) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": "multi"})
    first = [{"role": "user", "content": "Capital of Peru?"}]
    reply = client.chat.completions.create(model="agent", messages=first).choices[0].message
    follow = [*first, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "As JSON?"}]
    client.chat.completions.create(model="agent", messages=follow)
    calls = httpx.get(f"{proxy.url}/admin/trajectories/multi").json()["calls"]
    assert [c["new_messages"] for c in calls] == [first, [{"role": "user", "content": "As JSON?"}]]


def test_a_trajectory_page_shows_tool_calls_and_their_results(proxy: RunningProxy, fake: FakeVLLM) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]), Reply(content="Sunny in Paris."))
    client = proxy.client(default_headers={"X-Trajectory-Id": "tools"})
    first = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat.completions.create(model="agent", messages=first, tools=tools).choices[0].message
    call_id = reply.tool_calls[0].id
    result = {"role": "tool", "tool_call_id": call_id, "content": "18 C, clear"}
    client.chat.completions.create(
        model="agent", messages=[*first, reply.model_dump(exclude_none=True), result], tools=tools
    )
    page = httpx.get(f"{proxy.url}/admin/ui/trajectories/tools").text
    assert "→ get_weather({&#34;city&#34;: &#34;Paris&#34;})" in page
    assert f"result of <code>{call_id}</code>" in page and "18 C, clear" in page
    assert page.index("get_weather(") < page.index("18 C, clear") < page.index("Sunny")


def test_a_group_shows_members_with_rewards_and_advantages(proxy: RunningProxy) -> None:
    for i, reward in enumerate((0.0, 1.0)):
        attempt(proxy, "task A", f"m{i}", reward=reward, **{"X-Group-Id": "g1"})
    group = httpx.get(f"{proxy.url}/admin/groups/g1").json()
    assert [(m["id"], m["reward"], m["advantage"]) for m in group["members"]] == [("m0", 0.0, -1.0), ("m1", 1.0, 1.0)]
    assert all(m["final_answer"] for m in group["members"])
    page = httpx.get(f"{proxy.url}/admin/ui/groups/g1").text
    assert "-1.000" in page and "+1.000" in page
    missing = httpx.get(f"{proxy.url}/admin/groups/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "group_not_found"
    assert httpx.get(f"{proxy.url}/admin/ui/groups/nope").status_code == 404


def test_judge_now_from_a_group_page_shows_scores_explanations_and_failures(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    from test_judge import fake_judge

    fake.script(Reply(content="Paris."), Reply(content="Lyon."))
    attempt(proxy, "Capital of France?", "j1", reward=0.0, **{"X-Group-Id": "jg"})
    attempt(proxy, "Capital of France?", "j2", reward=1.0, **{"X-Group-Id": "jg"})
    token = csrf_of(httpx.get(f"{proxy.url}/admin/ui/groups/jg").text)
    # The first judgement imports litellm (seconds on a busy machine): more than httpx's default 5 s timeout.
    failed = httpx.post(f"{proxy.url}/admin/ui/groups/jg/judge", data={"csrf_token": token}, timeout=60)
    assert failed.status_code == 303 and failed.headers["location"].endswith("notice=judge_failed")
    page = httpx.get(f"{proxy.url}{failed.headers['location']}").text
    assert "could not score" in page and ">failed<" in page and "no valid answer after 3 attempts" in page
    fake_judge(fake)
    judged = httpx.post(f"{proxy.url}/admin/ui/groups/jg/judge", data={"csrf_token": token})
    assert judged.headers["location"].endswith("notice=judged")
    group = httpx.get(f"{proxy.url}/admin/groups/jg").json()
    assert [(m["id"], m["reward"], m["judge_score"]) for m in group["members"]] == [("j1", 0.0, 1.0), ("j2", 1.0, 0.0)]
    assert [j["state"] for j in group["judgements"]] == ["ok", "failed"]
    assert "Checked the capital." in httpx.get(f"{proxy.url}/admin/ui/groups/jg").text
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert metric(metrics, 'tracetrain_rewards_total{policy="agent",source="judge"}') == 2


def test_group_advantages_are_the_trainers_centered_and_scaled_ones() -> None:
    # Mean 0.5; population variance (0.09 + 0.25 + 0.01 + 0.01) / 4 = 0.09, so std 0.3.
    centered, scaled = group_advantages([0.2, 1.0, 0.4, 0.4])
    assert centered == pytest.approx([-0.3, 0.5, -0.1, -0.1])
    assert scaled == pytest.approx([-1.0, 5 / 3, -1 / 3, -1 / 3])
    assert group_advantages([0.5, 0.5]) == ([0.0, 0.0], [0.0, 0.0])  # no signal: the trainer drops the group
    assert group_advantages([1.0, None]) == ([None, None], [None, None])


def test_trajectories_filter_by_reward_version_and_time_and_page(proxy: RunningProxy) -> None:
    for i in range(5):
        attempt(proxy, f"task {i}", f"f{i}", reward=1.0 if i % 2 else None)
    listing = httpx.get(f"{proxy.url}/admin/trajectories", params={"rewarded": True}).json()
    assert [t["id"] for t in listing["data"]] == ["f3", "f1"]
    assert httpx.get(f"{proxy.url}/admin/trajectories", params={"version": 1}).json()["data"] == []
    assert len(httpx.get(f"{proxy.url}/admin/trajectories", params={"version": 0}).json()["data"]) == 5
    future = httpx.get(f"{proxy.url}/admin/trajectories", params={"created_after": 4e9}).json()
    assert future["data"] == []
    first = httpx.get(f"{proxy.url}/admin/trajectories", params={"limit": 2}).json()
    second = httpx.get(f"{proxy.url}/admin/trajectories", params={"limit": 2, "after": first["next_cursor"]}).json()
    assert [t["id"] for t in first["data"] + second["data"]] == ["f4", "f3", "f2", "f1"]
    page = httpx.get(f"{proxy.url}/admin/ui/trajectories", params={"rewarded": "false", "since": "1h"}).text
    assert ">f4<" in page and ">f2<" in page and ">f3<" not in page
    assert "Older" not in httpx.get(f"{proxy.url}/admin/ui/trajectories").text  # five fit on one page
    bad = httpx.get(f"{proxy.url}/admin/ui/trajectories", params={"after": "nonsense"})
    assert bad.status_code == 400 and "next_cursor" in bad.text


@pytest.mark.parametrize(
    ("path", "params", "param"),
    [
        ("/admin/ui/trajectories", {"version": str(10**30)}, "version"),
        ("/admin/ui/trajectories", {"group_id": "g\x00"}, "group_id"),
        ("/admin/ui/groups", {"after": "\x00"}, "after"),
        ("/admin/ui/trajectories/t%00", {}, "trajectory_id"),
    ],
)
def test_a_bad_value_in_a_page_url_is_an_error_page_naming_it(
    start_proxy, path: str, params: dict[str, str], param: str
) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    response = httpx.get(f"{proxy.url}{path}", params=params, headers=BEARER)
    assert response.status_code == 400 and response.headers["content-type"].startswith("text/html")
    assert f"Invalid value for &#39;{param}&#39;" in response.text


def test_an_empty_filter_in_the_form_is_no_filter(proxy: RunningProxy) -> None:
    attempt(proxy, "task", "e1")
    page = httpx.get(f"{proxy.url}/admin/ui/trajectories", params={"policy": "", "version": "", "group_id": ""})
    assert page.status_code == 200 and ">e1<" in page.text


def test_the_overview_counts_traffic_data_and_serving(proxy: RunningProxy, fake: FakeVLLM) -> None:
    attempt(proxy, "task A", "o1", reward=1.0, **{"X-Group-Id": "og"})
    attempt(proxy, "task A", "o2", reward=0.0, **{"X-Group-Id": "og"})
    attempt(proxy, "task B", "o3")
    overview = httpx.get(f"{proxy.url}/admin/overview").json()
    assert overview["requests_per_minute"]["last_minute"] == 3
    assert overview["trajectories"] == {"total": 3, "rewarded": 2, "open": 1}
    assert overview["groups_ready"] == 1
    assert overview["policies"][0]["policy"] == "agent" and overview["policies"][0]["active_version"] == 0
    assert [(u["url"], u["healthy"], u["in_flight"]) for u in overview["upstreams"]] == [(f"{fake.url}/v1", True, 0)]  # type: ignore[attr-defined]
    assert overview["last_step"] is None and overview["jobs"]["queued"] == 0


def test_the_overview_says_when_vllm_is_down(start_proxy) -> None:
    proxy = start_proxy(upstream="http://127.0.0.1:9/v1", served_model="base")
    (upstream,) = httpx.get(f"{proxy.url}/admin/overview").json()["upstreams"]
    assert upstream["healthy"] is False and upstream["error"]
    assert "down" in httpx.get(f"{proxy.url}/admin").text


def test_the_training_page_charts_reward_and_loss_per_step(proxy: RunningProxy, tmp_path: Path) -> None:
    for job, (reward, loss) in enumerate([(0.2, 0.5), (0.4, 0.3), (0.7, 0.1)], start=1):
        proxy.rows(
            "INSERT INTO training_jobs (policy, state, group_ids, version, metrics, progress, created_at, finished_at)"
            " VALUES ('agent', 'succeeded', '[]', ?, ?, 1.0, 0, 0)",
            job, f'{{"reward_mean": {reward}, "loss": {loss}}}',
        )  # fmt: skip
    proxy.rows(
        "INSERT INTO training_jobs (policy, state, group_ids, metrics, progress, created_at, started_at)"
        " VALUES ('agent', 'running', '[]', '{}', 0.6, 0, 0)"
    )
    page = httpx.get(f"{proxy.url}/admin/ui/training").text
    charts = re.findall(r'<svg class="chart".*?</svg>', page, re.S)
    assert len(charts) == 2
    for chart, values in zip(charts, (["0.2", "0.4", "0.7"], ["0.5", "0.3", "0.1"]), strict=True):
        assert re.findall(r"<title>version \d+: ([\d.]+)</title>", chart) == values
        assert len(re.findall(r"<circle", chart)) == 3
    assert '<progress max="1" value="0.6">' in page


def test_the_training_page_shows_each_steps_logprob_mismatch_and_a_skipped_step(proxy: RunningProxy) -> None:
    steps = [{"logprob_mismatch_mean": 0.00012, "logprob_mismatch_max": 0.004, "log_ratio_clamped": 0},
             {"logprob_mismatch_mean": 0.031, "logprob_mismatch_max": 21.5, "log_ratio_clamped": 1,
              "step_skipped": True}]  # fmt: skip
    for version, metrics in enumerate(steps, start=1):
        proxy.rows(
            "INSERT INTO training_jobs (policy, state, group_ids, version, metrics, progress, created_at, finished_at)"
            " VALUES ('agent', 'succeeded', '[]', ?, ?, 1.0, 0, 0)",
            version, json.dumps(metrics),
        )  # fmt: skip
    page = httpx.get(f"{proxy.url}/admin/ui/training").text
    charts = re.findall(r'<svg class="chart".*?</svg>', page, re.S)
    assert re.findall(r"<title>version \d+: ([\d.]+)</title>", charts[-1]) == ["0.00012", "0.031"]
    assert ">0.00012</td>" in page and ">0.031</td>" in page and "1 tokens clamped" in page
    assert "step skipped: the gradient was not finite" in page


def test_the_training_page_shows_each_steps_turns_and_why_calls_split(proxy: RunningProxy) -> None:
    metrics = {"calls_per_trajectory": 3.0, "samples_per_trajectory": 3.0, "samples_merged": 0,
               "samples_split_rerendered": 16, "samples_split_not_extended": 0, "trained_tokens": 900,
               "samples_completion_tokens": 1000, "trained_token_share": 0.9, "samples_tokens": 5000,
               "samples_call_tokens": 5000, "logprob_mismatch_mean": 0.05, "logprob_mismatch_max": 0.6,
               "logprob_mismatch_on_policy": 0.048, "sampler_correction": "tis", "log_ratio_clamped": 0,
               "tokens": 5000, "forwarded_tokens": 1800, "loss_tokens": 900,
               "forwarded_per_sampled_token": 2.0}  # fmt: skip
    proxy.rows(
        "INSERT INTO training_jobs (policy, state, group_ids, version, metrics, progress, created_at, finished_at)"
        " VALUES ('agent', 'succeeded', '[]', 1, ?, 1.0, 0, 0)",
        json.dumps(metrics),
    )  # fmt: skip
    page = httpx.get(f"{proxy.url}/admin/ui/training").text
    assert ">3 → 3</td>" in page and "16 split because the prompt re-rendered the previous turn" in page
    assert ">90%</td>" in page and "900 tokens trained of 1000 sampled" in page
    assert "on-policy samples only 0.048; sampler correction tis" in page
    assert ">2</td>" in page and "1800 tokens forwarded for 900 sampled; each sample alone would forward 5000" in page


def test_train_now_from_the_adapters_page(proxy: RunningProxy) -> None:
    page = httpx.get(f"{proxy.url}/admin/ui/adapters").text
    token = csrf_of(page)
    nothing = httpx.post(f"{proxy.url}/admin/ui/train", data={"csrf_token": token})
    assert nothing.status_code == 400 and "No group is ready" in nothing.text
    attempt(proxy, "task A", "n1", reward=0.0, **{"X-Group-Id": "ng"})
    attempt(proxy, "task A", "n2", reward=1.0, **{"X-Group-Id": "ng"})
    queued = httpx.post(f"{proxy.url}/admin/ui/train", data={"csrf_token": token})
    assert queued.status_code == 303 and "notice=queued" in queued.headers["location"]
    assert httpx.get(f"{proxy.url}/admin/jobs").json()["data"][0]["group_ids"] == ["ng"]


def test_every_page_has_its_json_twin_documented_in_openapi(proxy: RunningProxy) -> None:
    paths = httpx.get(f"{proxy.url}/openapi.json").json()["paths"]
    for path in ("/admin/overview", "/admin/trajectories", "/admin/trajectories/{trajectory_id}", "/admin/groups",
                 "/admin/groups/{group_id}", "/admin/jobs", "/admin/adapters", "/admin/train",
                 "/admin/adapters/{version}/activate"):  # fmt: skip
        assert path in paths, path
        assert all(op.get("description") for op in paths[path].values()), path
    assert not any(p.startswith("/admin/ui") for p in paths)


# -- /metrics ---------------------------------------------------------------------------------


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([\d.e+-]+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def test_metrics_count_requests_tokens_captures_rewards_and_training(proxy: RunningProxy, tmp_path: Path) -> None:
    attempt(proxy, "task A", "p1", reward=1.0)
    attempt(proxy, "task A", "p2")
    question = [{"role": "user", "content": "x"}]
    bad = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "nope", "messages": question})
    assert bad.status_code == 404
    record_trained_adapter(proxy, 1, tmp_path)
    wait_for(lambda: adapters(proxy)["active_version"] == 1)
    response = httpx.get(f"{proxy.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert metric(text, 'tracetrain_requests_total{endpoint="chat.completions",policy="agent",status="200"}') == 2
    assert metric(text, 'tracetrain_request_latency_seconds_count{endpoint="chat.completions"}') == 2
    assert metric(text, 'tracetrain_tokens_total{kind="completion",policy="agent"}') > 0
    assert metric(text, 'tracetrain_captured_calls_total{policy="agent"}') == 2
    assert metric(text, 'tracetrain_rewards_total{policy="agent",source="service"}') == 1
    assert metric(text, 'tracetrain_policy_active_version{policy="agent"}') == 1
    assert metric(text, 'tracetrain_training_steps{policy="agent"}') == 1
    assert metric(text, 'tracetrain_versions_loaded{policy="agent"}') == 2
