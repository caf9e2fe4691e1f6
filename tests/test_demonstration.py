"""A person's demonstration: the answer they wanted, given with their score, kept with the trajectory, shown,
exported by ``tracetrain export`` and trained on by ``tracetrain sft``.

A real proxy over loopback HTTP, the fake vLLM as its upstream, the real OpenAI client as the agent.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

from tracetrain_cli._export import ExportFilter, export_trajectories
from trainer._sft import read_export, sft_examples

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WANTED = "The capital of France is Paris."


def feedback(proxy: RunningProxy, trajectory_id: str, body: Any) -> httpx.Response:
    return httpx.post(f"{proxy.url}/admin/trajectories/{trajectory_id}/feedback", json=body)


def test_a_demonstration_is_kept_shown_exported_and_an_sft_example(
    proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path
) -> None:
    fake.script(Reply(content="Lyon, I think."), Reply(content="Paris."))
    proxy.client(default_headers={"X-Trajectory-Id": "wrong"}).chat.completions.create(model="agent", messages=QUESTION)
    proxy.client(default_headers={"X-Trajectory-Id": "right"}).chat.completions.create(model="agent", messages=QUESTION)

    given = feedback(proxy, "wrong", {"score": 0.0, "note": "wrong city", "demonstration": f"  {WANTED}\n"})
    assert given.status_code == 200, given.text
    feedback(proxy, "right", {"score": 1.0}).raise_for_status()

    wrong = httpx.get(f"{proxy.v1}/trajectories/wrong").json()
    assert (wrong["reward"], wrong["demonstration"]) == (0.0, WANTED)
    assert httpx.get(f"{proxy.v1}/trajectories/right").json()["demonstration"] is None
    page = httpx.get(f"{proxy.url}/admin/ui/trajectories/wrong").text
    assert 'id="shown-demonstration"' in page and WANTED in page and 'name="demonstration"' in page

    out = tmp_path / "data.jsonl"
    asyncio.run(export_trajectories(proxy.settings.resolved_database_url, out, "jsonl", ExportFilter()))
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert rows["wrong"]["demonstration"] == WANTED and rows["right"]["demonstration"] is None

    # A demonstration is an example whatever the trajectory's reward, in place of the agent's own answer.
    examples = sft_examples(read_export(out, min_reward=0.5))
    assert examples.trajectories == 2
    completions = sorted(e["completion"][0]["content"] for e in examples.rows)
    assert completions == sorted([WANTED, "Paris."])
    demo = next(e for e in examples.rows if e["completion"][0]["content"] == WANTED)
    assert demo["prompt"][-1]["content"] == QUESTION[0]["content"]

    # A second score without one takes it back, as it takes the note back.
    feedback(proxy, "wrong", {"score": 0.2}).raise_for_status()
    assert httpx.get(f"{proxy.v1}/trajectories/wrong").json()["demonstration"] is None


def test_a_demonstration_is_text_of_bounded_length(proxy: RunningProxy) -> None:
    proxy.client(default_headers={"X-Trajectory-Id": "t1"}).chat.completions.create(model="agent", messages=QUESTION)
    for bad in (42, "x" * 100_001):
        refused = feedback(proxy, "t1", {"score": 0.5, "demonstration": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "demonstration"
    assert httpx.get(f"{proxy.v1}/trajectories/t1").json()["rewards"] == []


def test_the_review_form_takes_a_demonstration(proxy: RunningProxy) -> None:
    proxy.client(default_headers={"X-Trajectory-Id": "t1"}).chat.completions.create(model="agent", messages=QUESTION)
    with httpx.Client(base_url=proxy.url) as browser:
        page = browser.get("/admin/ui/trajectories/t1").text
        csrf = page.split('name="csrf_token" value="')[1].split('"')[0]
        sent = browser.post("/admin/ui/trajectories/t1/feedback",
                            data={"score": "0.3", "note": "", "demonstration": WANTED, "csrf_token": csrf})  # fmt: skip
        assert sent.status_code == 303, sent.text
    assert httpx.get(f"{proxy.v1}/trajectories/t1").json()["demonstration"] == WANTED
