"""The city task's agent: one plain OpenAI call per attempt, the reply what the app would parse.

Its own module, like ``lookup_agent``, so that ``tasks`` can name each task's attempt while
``agent`` (the program that runs the rounds) imports ``tasks``: no cycle between them.
"""

from __future__ import annotations

from typing import Any

import openai

from tracetrain_demo.task import Scenario

# ``--structured``: the answer the task asks for, as a JSON schema vLLM samples under (structured outputs).
CITY_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "hotel_city", "strict": True, "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False,
    }},
}  # fmt: skip


def attempt(client: openai.OpenAI, model: str, scenario: Scenario, trajectory_id: str, group_id: str,
            *, temperature: float, max_tokens: int, response_format: dict[str, Any] | None = None,
            ) -> dict[str, object]:  # fmt: skip
    """One attempt: one call (constrained to ``response_format`` if given); the reply is what the app would parse."""
    extra: dict[str, Any] = {"response_format": response_format} if response_format is not None else {}
    completion = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": scenario.prompt}], temperature=temperature,
        max_tokens=max_tokens, extra_headers={"X-Trajectory-Id": trajectory_id, "X-Group-Id": group_id}, **extra,
    )  # fmt: skip
    return {"trajectory_id": trajectory_id, "group_id": group_id, "prompt": scenario.prompt,
            "reply": completion.choices[0].message.content or "", "served_by": completion.model}  # fmt: skip
