"""Responses API calls read back as conversations: the dashboard, the judge, export, the SFT path, Langfuse.

Every reader goes through one function (``tracetrain_core.call_messages`` / ``call_reply`` / ``call_tools``),
so a call made through ``/v1/responses`` shows as the chat messages vLLM was sent.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, ToolCall

from proxy.judge._prompt import call_messages as judge_messages
from proxy.observability._genai import call_attributes
from proxy.observability._langfuse_wire import generation_attributes
from store import CallWrite
from tracetrain_cli._main import main
from trainer._sft import read_export, sft_examples

INSTRUCTIONS = "Answer in one sentence."
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture
def looped(start_proxy: Callable[..., RunningProxy], fake: FakeVLLM) -> RunningProxy:
    """One rewarded trajectory, "resp": a function tool loop through the Responses API."""
    proxy = start_proxy()
    client = proxy.client(default_headers={"X-Trajectory-Id": "resp", "X-Group-Id": "g1"})
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]), Reply(content="It is sunny."))
    items: list = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(model="agent", instructions=INSTRUCTIONS, input=items, tools=[TOOL])
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": first.output[0].call_id, "output": "sunny"})
    client.responses.create(model="agent", instructions=INSTRUCTIONS, input=items, tools=[TOOL])
    assert httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "resp", "reward": 1.0}).status_code == 200
    return proxy


def conversation(fake: FakeVLLM) -> list[dict]:
    """What vLLM was sent last, plus the reply it gave."""
    return [*fake.requests[-1]["messages"], {"role": "assistant", "content": "It is sunny."}]


def test_export_and_sft_read_responses_calls_as_chat_conversations(
    looped: RunningProxy, fake: FakeVLLM, tmp_path: Path
) -> None:
    out = tmp_path / "export.jsonl"
    assert main(["export", "--data-dir", str(looped.settings.data_dir), "--output", str(out)]) == 0
    [row] = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    expected = conversation(fake)
    assert [m["content"] for m in row["messages"]] == [m.get("content") for m in expected]
    assert row["messages"][2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert orjson.loads(row["tools"]) == [CHAT_TOOL]
    assert [c["endpoint"] for c in row["calls"]] == ["responses", "responses"]
    examples = sft_examples(read_export(out)).rows
    assert len(examples) == 2
    assert examples[1]["completion"] == [{"role": "assistant", "content": "It is sunny."}]
    assert [m["role"] for m in examples[1]["prompt"]] == ["system", "user", "assistant", "tool"]


def test_the_dashboard_and_the_admin_api_show_the_messages_and_the_answer(looped: RunningProxy) -> None:
    page = httpx.get(f"{looped.url}/admin/ui/trajectories/resp")
    assert page.status_code == 200
    for text in ("Weather in Paris?", "get_weather", "sunny", INSTRUCTIONS):  # the answer: token by token
        assert text in page.text, text
    detail = httpx.get(f"{looped.url}/admin/trajectories/resp").json()
    new = [[m["role"] for m in call["new_messages"]] for call in detail["calls"]]
    assert new == [["system", "user"], ["tool"]], "each call shows only what the agent added"
    group = httpx.get(f"{looped.url}/admin/groups/g1").json()
    assert [row["final_answer"] for row in group["members"]] == ["It is sunny."]


def test_the_judge_and_the_exporters_read_the_translated_conversation(looped: RunningProxy, fake: FakeVLLM) -> None:
    [_, call] = httpx.get(f"{looped.v1}/trajectories/resp").json()["calls"]
    judged = judge_messages("responses", call["request"], call["response"], None)
    assert [m["role"] for m in judged] == ["system", "user", "assistant", "tool", "assistant"]
    assert judged[-1]["content"] == "It is sunny."
    row = {k: call[k] for k in ("id", "endpoint", "model", "served_model", "stream", "request", "response",
                                "finish_reason", "prompt_tokens", "completion_tokens", "status_code", "error",
                                "latency_ms", "ttft_ms", "started_at")}  # fmt: skip
    write = CallWrite(row, "resp", "g1", "agent", "header", None, None, row["started_at"], 0)
    attributes = generation_attributes(write)
    otel = call_attributes(write, content=True)  # what an OpenTelemetry collector reads
    roles = [m["role"] for m in orjson.loads(str(otel["gen_ai.input.messages"]))]
    assert roles == [m["role"] for m in fake.requests[-1]["messages"]]
    sunny = {"type": "text", "content": "It is sunny."}
    assert orjson.loads(str(otel["gen_ai.output.messages"]))[0]["parts"] == [sunny]
    assert orjson.loads(str(attributes["langfuse.observation.input"])) == fake.requests[-1]["messages"]
    reply = {"role": "assistant", "content": "It is sunny."}
    assert orjson.loads(str(attributes["langfuse.observation.output"])) == reply
    assert "input" not in orjson.loads(str(attributes["langfuse.observation.model.parameters"]))
