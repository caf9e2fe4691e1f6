"""The Codex CLI (``codex exec``, offline, configured only by its config file) through the proxy, on the fake vLLM.

Codex speaks the Responses API, streamed, with its long developer prompt and its function tools. A
tool loop (the model runs ``cat note.txt`` with Codex's ``exec_command``, then answers) must be one
trajectory of token-exact calls whose prompts extend each other, so the trainer merges them.
Skipped with the reason when ``codex`` is not installed (.ci/run installs it).
"""

from __future__ import annotations

from pathlib import Path

import httpx
from codex_cli import needs_codex, run_codex
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, ToolCall

pytestmark = needs_codex


def test_a_codex_tool_loop_is_one_trajectory_of_token_exact_calls(
    proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text("the answer is 42\n")
    fake.script(Reply(tool_calls=[ToolCall("exec_command", '{"cmd": "cat note.txt"}')]), Reply(content="It says 42."))
    out = run_codex("What does note.txt say?", proxy.v1, tmp_path / "home", work)
    assert "It says 42." in out
    [trajectory] = httpx.get(f"{proxy.v1}/trajectories").json()["data"]
    calls = httpx.get(f"{proxy.v1}/trajectories/{trajectory['id']}").json()["calls"]
    assert [(c["endpoint"], c["stream"], c["status_code"]) for c in calls] == [("responses", True, 200)] * 2
    first_sent, second_sent = fake.requests[-2:]
    assert (
        second_sent["messages"][-1]["role"] == "tool" and "the answer is 42" in second_sent["messages"][-1]["content"]
    )
    assert second_sent["messages"][-2]["tool_calls"][0]["function"]["name"] == "exec_command"
    for call, sent in zip(calls, (first_sent, second_sent), strict=True):
        assert call["prompt_token_ids"] == fake.tokenize(fake.render_chat(sent["messages"], sent["tools"]))
        assert len(call["completion_token_ids"]) == len(call["logprobs"]) > 0
    first, second = calls
    merged = first["prompt_token_ids"] + first["completion_token_ids"]
    assert second["prompt_token_ids"][: len(merged)] == merged, "the second prompt extends the first call"
    assert calls[1]["response"]["output"][0]["content"][0]["text"] == "It says 42."
