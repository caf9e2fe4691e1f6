"""``--model-alias NAME=POLICY``: an agent's own model names (gpt-4o-mini, Claude Code's claude-sonnet-4-5 and its
haiku calls) reach a policy unmodified, on every API, through the real clients; the record keeps the name asked
for; an unknown name's 404 says how to map it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from claude_code import needs_claude, run_claude
from fake_vllm import FakeVLLM, Reply

from proxy import Settings

KEY = "sk-tracetrain-alias-key-0123456789"
# Claude Code's own defaults when nothing maps them: its main model and its small, fast one.
CLAUDE_MODELS = ("claude-sonnet-4-5", "claude-haiku-4-5")


def _asked(proxy: Any) -> list[str]:
    return [json.loads(r["request"])["model"] for r in proxy.rows("SELECT request FROM calls ORDER BY started_at")]


def test_an_alias_reaches_its_policy_on_every_api_and_the_record_keeps_the_name_asked_for(
    start_proxy: Any, fake: FakeVLLM
) -> None:
    proxy = start_proxy(policies=("agent", "support"), model_aliases=("gpt-4o-mini=support", "*=agent"))
    fake.script(*[Reply(content="ok")] * 5)
    client = proxy.client()
    chat = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "ok" and chat.model == "support@0"
    completion = client.completions.create(model="gpt-4o-mini", prompt="hi", max_tokens=4)
    assert completion.model == "support@0"
    response = client.responses.create(model="o4-mini", input="hi")  # any other name: '*' takes it
    assert response.output_text == "ok" and response.model == "agent@0"
    with anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0) as claude:
        message = claude.messages.create(model=CLAUDE_MODELS[0], max_tokens=16,
                                         messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert message.content[0].text == "ok" and message.model == "agent@0"  # type: ignore[union-attr]
    assert client.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}]).model == (
        "support@0"
    )  # a policy's own name is still its own, '*' or not
    assert _asked(proxy) == ["gpt-4o-mini", "gpt-4o-mini", "o4-mini", CLAUDE_MODELS[0], "support"]
    rows = proxy.rows("SELECT t.policy FROM calls c JOIN trajectories t ON t.id = c.trajectory_id "
                      "ORDER BY c.started_at")  # fmt: skip
    assert [r["policy"] for r in rows] == ["support", "support", "agent", "agent", "support"]
    listed = {m.id for m in client.models.list()}
    assert {"agent", "support", "gpt-4o-mini"} <= listed and "*" not in listed


def test_an_unknown_model_is_a_404_that_names_the_flag(start_proxy: Any, fake: FakeVLLM) -> None:
    proxy = start_proxy()
    with pytest.raises(openai.NotFoundError) as refused:
        proxy.client().chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    message = refused.value.body["message"]  # type: ignore[index]
    assert "--model-alias 'gpt-4o-mini=agent'" in message and "'*=agent'" in message
    with (
        anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0) as claude,
        pytest.raises(anthropic.NotFoundError, match="--model-alias"),
    ):
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    aliased = start_proxy(model_aliases=("gpt-4o-mini=retired",), data_dir=proxy.settings.data_dir.parent / "b")
    answer = httpx.post(f"{aliased.v1}/chat/completions",
                        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert answer.status_code == 404
    assert "an alias (--model-alias) of the policy 'retired'" in answer.json()["error"]["message"]


async def test_the_agents_sdk_asks_for_its_own_model_and_reaches_the_policy(
    start_proxy: Any, fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is in the test extra")
    proxy = start_proxy(model_aliases=("gpt-4.1=agent",))
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    fake.script(Reply(content="Bonjour."))
    try:
        run = await agents.Runner.run(agents.Agent(name="greeter", instructions="Greet.", model="gpt-4.1"), "Hi")
    finally:
        await client.close()
    assert run.final_output == "Bonjour."
    assert _asked(proxy) == ["gpt-4.1"]


@needs_claude
def test_claude_code_with_its_default_model_names_reaches_the_policy(
    start_proxy: Any, fake: FakeVLLM, tmp_path: Path
) -> None:
    from claude_code import claude_env

    proxy = start_proxy(api_keys=KEY, model_aliases=("*=agent",))
    fake.reply_for = lambda body: Reply(content="Paris.")
    env = claude_env(proxy.url, KEY, tmp_path / "home")
    for name in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                 "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL"):  # fmt: skip
        env.pop(name)  # Claude Code asks for its own models, unmodified
    assert "Paris." in run_claude("What is the capital of France?", env, tmp_path)
    asked = set(_asked(proxy))
    assert asked and all(name.startswith("claude-") for name in asked), asked


def test_aliases_are_checked_when_the_settings_are_built(tmp_path: Path) -> None:
    assert Settings(data_dir=tmp_path, model_aliases="a=agent, b=agent").model_aliases == (("a", "agent"),
                                                                                          ("b", "agent"))  # fmt: skip
    for bad, said in (("gpt-4o-mini", "NAME=POLICY"), ("a=agent,a=other", "names a twice"),
                      ("a=not a policy!", "is not a policy name")):  # fmt: skip
        with pytest.raises(ValueError, match=said):
            Settings(data_dir=tmp_path, model_aliases=bad)
