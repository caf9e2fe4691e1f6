"""The Agents SDK task's agent: an OpenAI Agents SDK program that knows nothing of tracetrain.

The SDK with its defaults: ``Agent(model="agent")`` goes through the default provider, the Responses
API, on the SDK's default client (``set_default_openai_client``), an ``AsyncOpenAI`` made from
OPENAI_BASE_URL and OPENAI_API_KEY. The SDK's tracing is turned off (it would export every run to
OpenAI's servers). Each attempt is one ``Runner.run``; its trajectory and group travel as headers in the
run's ``ModelSettings(extra_headers=...)``, the way an app sets per-run headers. A round's attempts run
at once on one event loop and one client (``tracetrain_demo.agent`` gathers them and closes the client).
"""

from __future__ import annotations

import functools
from typing import Any

import agents
import openai

from tracetrain_demo import lookup
from tracetrain_demo.agents_sdk import INSTRUCTIONS, MAX_TURNS, find_hotel
from tracetrain_demo.task import Scenario


@functools.cache
def concierge() -> agents.Agent[Any]:
    """The agent: its instructions, its one tool, and a first call that must use it."""
    agents.set_tracing_disabled(True)
    return agents.Agent(
        name="concierge",
        instructions=INSTRUCTIONS,
        tools=[agents.function_tool(find_hotel)],
        model="agent",
        # The first call asks for a tool; reset_tool_choice (the SDK's default) lets the next one answer.
        model_settings=agents.ModelSettings(tool_choice="required"),
    )


async def attempt(client: openai.AsyncOpenAI, model: str, scenario: Scenario, trajectory_id: str, group_id: str,
                  *, temperature: float, max_tokens: int) -> dict[str, object]:  # fmt: skip
    """One attempt: ``Runner.run`` on the request; what the app would parse is its ``final_output``."""
    agents.set_default_openai_client(client, use_for_tracing=False)
    agent = concierge().clone(model=model)
    headers = {"X-Trajectory-Id": trajectory_id, "X-Group-Id": group_id}
    settings = agents.ModelSettings(temperature=temperature, max_tokens=max_tokens, extra_headers=headers)
    reply, calls, items = "", 0, []
    try:
        result = await agents.Runner.run(agent, scenario.prompt, max_turns=MAX_TURNS,
                                         run_config=agents.RunConfig(model_settings=settings))  # fmt: skip
        reply, calls, items = str(result.final_output or ""), len(result.raw_responses), result.new_items
    except agents.AgentsException as exc:  # calls past MAX_TURNS, a tool the agent lacks: an attempt with no reply
        if exc.run_data is not None:
            calls, items = len(exc.run_data.raw_responses), exc.run_data.new_items
    calls_made = [item.raw_item for item in items if isinstance(item, agents.ToolCallItem)]
    cities = lookup.tool_cities([{"tool_calls": [{"function": {"name": getattr(c, "name", None),
                                                               "arguments": getattr(c, "arguments", None)}}
                                                 for c in calls_made]}])  # fmt: skip
    # No "served_by": the SDK keeps no response's model (the demo reads each attempt's version from the proxy).
    return {"trajectory_id": trajectory_id, "group_id": group_id, "prompt": scenario.prompt, "reply": reply,
            "calls": calls, "tool_cities": cities}  # fmt: skip
