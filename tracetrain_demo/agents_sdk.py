"""The demo's Agents SDK task (``tracetrain demo --task agents-sdk``): the tool task, its agent the OpenAI Agents SDK.

The agent (``tracetrain_demo.agents_sdk_agent``) is the SDK with its defaults: an ``Agent`` with
``INSTRUCTIONS``, the ``find_hotel`` function tool (``@function_tool``) and ``model="agent"``, run by
``Runner.run``, which speaks the Responses API (``POST /v1/responses``) to whatever OPENAI_BASE_URL
names. The proxy captures each model call token for token, as it does chat; one attempt is one
trajectory of two calls or more that merge into one training sample where each prompt extends
the last. What the SDK sends:

    instructions   You look up the hotel booked for a traveller. Call find_hotel ...    (the system turn)
    input          Ana is flying from Lima to Oslo on Friday.                          (the user turn)
    output         function_call find_hotel {"city": "Oslo"}            the SDK runs the tool and asks again:
    input          ..., function_call, function_call_output {"city": "Oslo", "hotel": "Hotel Silver Harbour"}
    output         message {"hotel": "Hotel Silver Harbour"}                          (Runner's final_output)

The instructions, the requests, the tool and the checker are the tool task's (``tracetrain_demo.lookup``:
the same split, held-out requests naming only cities no training request names, the same partial credit);
what differs is the agent and the API it speaks. The first call asks for a tool
(``ModelSettings(tool_choice="required")``; the SDK's ``reset_tool_choice`` lets the model answer
once the tool ran), as the tool task's agent does: unconstrained, SmolLM2-135M never writes a call.

This module reads what the proxy captured (a Responses request and response) without the SDK:
the reward service scores trajectories with it.
"""

from __future__ import annotations

import json
from typing import Any

from tracetrain_demo import lookup
from tracetrain_demo.task import Scenario

INSTRUCTIONS = lookup.INSTRUCTIONS  # the tool task's system turn, as the Agent's instructions
MAX_TURNS = 3  # model calls per attempt, as the tool task's agent (lookup_agent.MAX_CALLS)
scenarios = lookup.scenarios
by_prompt = lookup.by_prompt


def find_hotel(city: str) -> str:
    """The hotel booked for the traveller in a city.

    Args:
        city: the city, e.g. Paris
    """
    return json.dumps(lookup.find_hotel(city))


def score_call(request: dict[str, Any], response: dict[str, Any] | None) -> lookup.Score:
    """Score an attempt from its last captured Responses call: the request's input, the response's output."""
    items = _input(request)
    scenario = _scenario(items)
    output = list((response or {}).get("output") or [])
    cities = [_city(item) for item in [*items, *output] if _is_call(item)]
    reply = "" if any(_is_call(item) for item in output) else _text(output)
    return lookup.score(scenario, cities, reply)


def call_reward(request: dict[str, Any], response: dict[str, Any] | None) -> float | None:
    """One captured Responses call's own reward (``lookup.call_reward``) from the find_hotel calls it output."""
    output = list((response or {}).get("output") or [])
    return lookup.call_reward(_scenario(_input(request)), [_city(item) for item in output if _is_call(item)])


def _input(request: dict[str, Any]) -> list[Any]:
    items = request.get("input")
    return items if isinstance(items, list) else [{"role": "user", "content": items}]


def _scenario(items: list[Any]) -> Scenario:
    for item in items:
        if isinstance(item, dict) and item.get("role") == "user" and item.get("type", "message") == "message":
            prompt = _content_text(item.get("content"))
            if prompt in by_prompt():
                return by_prompt()[prompt]
            break
    raise ValueError("the call's input does not start with one of the task's requests")


def _is_call(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "function_call" and item.get("name") == lookup.TOOL_NAME


def _city(call: dict[str, Any]) -> object:
    try:
        arguments = json.loads(call.get("arguments") or "{}")
    except ValueError:
        return None
    return arguments.get("city") if isinstance(arguments, dict) else None


def _text(output: list[Any]) -> str:
    """The text of the output's messages (what ``Runner.run``'s ``final_output`` is)."""
    return "".join(_content_text(item.get("content")) for item in output
                   if isinstance(item, dict) and item.get("type") == "message")  # fmt: skip


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "".join(str(p.get("text") or "") for p in parts
                   if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text"))  # fmt: skip
