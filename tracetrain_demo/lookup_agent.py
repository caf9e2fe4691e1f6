"""The tool task's agent: the openai SDK's plain tool loop, knowing nothing of tracetrain.

It sends the task's instructions (a system message) and the request with the ``find_hotel`` function
tool, the first call with ``tool_choice``
"required" (the agent's first step is a lookup: vLLM then constrains the output to a well-formed
call, and the model still chooses the arguments), later ones "auto"; while the model answers with tool
calls, it runs each (``lookup.find_hotel``), appends the result as a ``tool`` message and asks
again, up to ``max_calls`` calls; the first answer without a tool call is the reply. Every call
carries the attempt's trajectory and group headers, so one attempt is one trajectory of several
calls, and the proxy merges them into one training sample where each prompt extends the last.
"""

from __future__ import annotations

import json
from typing import Any, cast

import openai

from tracetrain_demo.lookup import INSTRUCTIONS, TOOL_NAME, TOOLS, find_hotel, tool_cities
from tracetrain_demo.task import Scenario

MAX_CALLS = 3


def attempt(client: openai.OpenAI, model: str, scenario: Scenario, trajectory_id: str, group_id: str,
            *, temperature: float, max_tokens: int, max_calls: int = MAX_CALLS) -> dict[str, object]:  # fmt: skip
    """One attempt: tool calls answered until the model replies without one (or ``max_calls`` calls)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": scenario.prompt}]  # fmt: skip
    headers = {"X-Trajectory-Id": trajectory_id, "X-Group-Id": group_id}
    reply, served_by, calls = "", "", 0
    while calls < max_calls:
        completion = client.chat.completions.create(
            model=model, messages=cast(Any, messages), tools=cast(Any, TOOLS), temperature=temperature,
            tool_choice="required" if calls == 0 else "auto", max_tokens=max_tokens, extra_headers=headers,
        )  # fmt: skip
        calls += 1
        message, served_by = completion.choices[0].message, completion.model
        if not message.tool_calls:
            reply = message.content or ""
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(_run(call))})
    return {"trajectory_id": trajectory_id, "group_id": group_id, "prompt": scenario.prompt, "reply": reply,
            "served_by": served_by, "calls": calls, "tool_cities": tool_cities(messages)}  # fmt: skip


def _run(call: Any) -> dict[str, str]:
    function = getattr(call, "function", None)
    if function is None or function.name != TOOL_NAME:
        return {"error": f"no tool named {getattr(function, 'name', None)!r}; the tool is {TOOL_NAME}"}
    try:
        arguments = json.loads(function.arguments or "{}")
    except ValueError:
        return {"error": "the arguments are not JSON"}
    return find_hotel(arguments.get("city") if isinstance(arguments, dict) else None)
