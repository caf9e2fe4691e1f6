"""What translating one call costs: tracetrain's Responses and Messages translators against LiteLLM's.

Each call on ``/v1/responses`` or ``/v1/messages`` is turned into a chat completion for vLLM and
its answer turned back (proxy.gateway.dialects). LiteLLM ships both translations
(``LiteLLMCompletionResponsesConfig`` for the Responses API, ``LiteLLMAnthropicMessagesAdapter``
for Anthropic's Messages): this times both sides, request and response, on the same agent turn
(instructions/system, a user message, a tool call and its result, one function tool; a reply with
text and a tool call), in one process, one after the other, and prints microseconds per call and
the ratio. Run: ``python bench/api_translation.py`` (with the project's .venv; LiteLLM installed).
"""

from __future__ import annotations

import os
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else LiteLLM fetches a price map at import
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_BODY: dict[str, Any] = {
    "model": "agent",
    "instructions": "You are a weather assistant. Answer in one sentence.",
    "input": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"},
        {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "The weather.", "parameters": SCHEMA}],
    "max_output_tokens": 256,
    "temperature": 0.7,
}
MESSAGES_BODY: dict[str, Any] = {
    "model": "agent",
    "max_tokens": 256,
    "system": "You are a weather assistant. Answer in one sentence.",
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 24 C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ],
    "tools": [{"name": "get_weather", "description": "The weather.", "input_schema": SCHEMA}],
    "temperature": 0.7,
}
CHAT_RESPONSE: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1_700_000_000,
    "model": "agent@3",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Let me check tomorrow's forecast.",
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 120, "completion_tokens": 24, "total_tokens": 144},
}


def per_call_us(fn: Callable[[], object], number: int = 2000, repeat: int = 7) -> float:
    """The median over ``repeat`` runs of ``number`` calls, in microseconds per call."""
    fn()  # first call outside the timing (imports, caches)
    return statistics.median(t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=repeat))


def ours() -> dict[str, Callable[[], object]]:
    from proxy.gateway._call import Call
    from proxy.gateway._capture import Asked
    from proxy.gateway._keying import Conversation, Key
    from proxy.gateway._policies import Route
    from proxy.gateway._served import Served
    from proxy.gateway.dialects import MESSAGES, RESPONSES

    served = Served()

    def call(body: dict[str, Any]) -> Call:
        asked = Asked(token_ids=True, logprobs=False, usage_chunk=True)
        route, key = Route("agent", 3, "base"), Key("t", "g", "header", None)
        return Call("chat.completions", body, route, key, Conversation("agent", None), asked, 0.0, 0.0, None, served)

    responses_call, messages_call = call(RESPONSES_BODY), call(MESSAGES_BODY)

    return {
        "responses: request -> chat": lambda: RESPONSES.to_chat(RESPONSES_BODY, served),
        "responses: chat -> response": lambda: RESPONSES.from_chat(CHAT_RESPONSE, responses_call),
        "messages: request -> chat": lambda: MESSAGES.to_chat(MESSAGES_BODY, served),
        "messages: chat -> response": lambda: MESSAGES.from_chat(CHAT_RESPONSE, messages_call),
    }


def litellms() -> dict[str, Callable[[], object]]:
    from litellm.llms.anthropic.experimental_pass_through.adapters.transformation import (
        LiteLLMAnthropicMessagesAdapter,
    )
    from litellm.responses.litellm_completion_transformation.transformation import (
        LiteLLMCompletionResponsesConfig as Responses,
    )
    from litellm.types.utils import ModelResponse

    params = {k: v for k, v in RESPONSES_BODY.items() if k not in ("model", "input")}
    adapter = LiteLLMAnthropicMessagesAdapter()
    return {
        "responses: request -> chat": lambda: Responses.transform_responses_api_request_to_chat_completion_request(
            "openai/agent", RESPONSES_BODY["input"], params, custom_llm_provider="openai"
        ),
        "responses: chat -> response": lambda: Responses.transform_chat_completion_response_to_responses_api_response(
            RESPONSES_BODY["input"], params, ModelResponse(**CHAT_RESPONSE)
        ),
        "messages: request -> chat": lambda: adapter.translate_anthropic_to_openai(MESSAGES_BODY),  # type: ignore[arg-type]
        "messages: chat -> response": lambda: adapter.translate_openai_response_to_anthropic(
            ModelResponse(**CHAT_RESPONSE)
        ),
    }


def main() -> None:
    mine, theirs = ours(), litellms()
    print(f"{'translation':30} {'tracetrain us':>14} {'litellm us':>11} {'litellm/tracetrain':>19}")
    for name, fn in mine.items():
        a, b = per_call_us(fn), per_call_us(theirs[name])
        print(f"{name:30} {a:14.1f} {b:11.1f} {b / a:18.1f}x")


if __name__ == "__main__":
    main()
