"""The demo's tool task (``tracetrain demo --task lookup``): look a booking up with a function tool, then answer.

Success: the final reply holds a JSON object naming the hotel that ``find_hotel`` returns for the traveller's
destination.

A scenario is one travel request; the agent is given one function tool, ``find_hotel(city)``, which
returns the hotel booked in that city (or that nothing is booked there), and its instructions in the
system turn. An episode takes at least two calls: the model calls the tool, the agent runs it and
sends the result back, the model answers.

    system     You look up the hotel booked for a traveller. Call find_hotel with the city the traveller
               goes to, then reply with only JSON: {"hotel": "<hotel name>"}
    user       Ana is flying from Lima to Oslo on Friday.
    assistant  <tool_call>{"name": "find_hotel", "arguments": {"city": "Oslo"}}</tool_call>
    tool       {"city": "Oslo", "hotel": "Hotel Silver Harbour"}
    assistant  {"hotel": "Hotel Silver Harbour"}

Hotel names are made from the city by a fixed hash, so no answer can be known without the tool, and
held-out requests name only cities (origins and destinations) no training request names. The reward
gives partial credit for each step on the way, since GRPO learns only from differences in a group:

    0.1  called find_hotel (a call vLLM's parser read)      +0.2  ...with the destination
    0.2  the final reply holds a JSON object with a "hotel" string (prose around it is allowed: the
         skill taught here is the lookup, and the city task already teaches a bare JSON reply)
    0.1  the booked hotel's name appears in the final reply
    1.0  success (the line above)

With call rewards (``tracetrain demo --call-rewards``), each model call that called find_hotel also gets its own
reward (``call_reward``): 1 when it named the destination, else 0; the trajectory's reward stays as above.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracetrain_demo.task import CITIES, Scenario, normal, split_requests

TEMPLATE = Path(__file__).with_name("tool_template.jinja")
TOOL_NAME = "find_hotel"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "The hotel booked for the traveller in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city, e.g. Paris"}},
                "required": ["city"],
            },
        },
    }
]
_REQUESTS = (
    "{n} is flying from {a} to {b} on {d}.",
    "{n} takes the train from {a} to {b} on {d}.",
    "{n} lives in {a} and has a conference in {b} on {d}.",
    "Travel request: {n}, {d}. Departure: {a}. Destination: {b}.",
)
# The task's wording, the same for every request (training and held-out). In the system turn, with the request
# alone as the user turn, SmolLM2-135M passed the destination to the tool in 23-24% of its first calls against
# 12-14% with the same ask after the request in the user turn (4 x 32 training requests each, T 0.7).
INSTRUCTIONS = (
    "You look up the hotel booked for a traveller. Call find_hotel with the city the traveller goes to, "
    'then reply with only JSON: {"hotel": "<hotel name>"}'
)
_FIRST = ("Silver", "Grand", "Blue", "Royal", "Old", "North", "Golden", "Green", "Little", "Red", "White", "Iron")
_SECOND = ("Harbour", "Garden", "Tower", "Bridge", "Lantern", "Crown", "Meadow", "Anchor", "Castle", "River")

SPLIT_SEED = 20261126  # the split's own: not the city task's


@dataclass(frozen=True, slots=True)
class Score:
    reward: float
    success: bool
    called_tool: bool
    called_destination: bool
    valid_json: bool

    def metrics(self) -> dict[str, float]:
        return {"success": float(self.success), "called_tool": float(self.called_tool),
                "called_destination": float(self.called_destination), "valid_json": float(self.valid_json)}  # fmt: skip


def hotel_in(city: str) -> str:
    """The hotel booked in ``city``: a fixed hash of its name, so it cannot be guessed."""
    digest = hashlib.sha256(normal(city).encode()).digest()
    return f"Hotel {_FIRST[digest[0] % len(_FIRST)]} {_SECOND[digest[1] % len(_SECOND)]}"


def find_hotel(city: object) -> dict[str, str]:
    """The tool: what the agent sends back for a call ``find_hotel(city=...)``."""
    if not isinstance(city, str) or normal(city) not in _KNOWN:
        return {"error": f"no booking found in {city!r}"}
    return {"city": _KNOWN[normal(city)], "hotel": hotel_in(city)}


_KNOWN = {normal(c): c for c in CITIES}


@functools.cache
def scenarios() -> tuple[list[Scenario], list[Scenario]]:
    """(train, held_out): held-out requests name only cities no training request names; a prompt is the request."""
    return split_requests(_REQUESTS, "", seed=SPLIT_SEED, sep="")


@functools.cache
def by_prompt() -> dict[str, Scenario]:
    train, held_out = scenarios()
    return {s.prompt: s for s in train + held_out}


def json_hotel(reply: str) -> str | None:
    """The "hotel" of the first JSON object in the reply that has a "hotel" string (prose around it allowed)."""
    decoder = json.JSONDecoder()
    start = reply.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(reply, start)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("hotel"), str):
            return str(value["hotel"])
        start = reply.find("{", start + 1)
    return None


def score(scenario: Scenario, tool_cities: list[object], reply: str) -> Score:
    """``tool_cities``: the ``city`` argument of each find_hotel call the model made, in order."""
    booked = hotel_in(scenario.destination)
    hotel = json_hotel(reply)
    called = bool(tool_cities)
    to_destination = call_reward(scenario, tool_cities) == 1.0
    valid = hotel is not None
    success = valid and normal(hotel or "") == normal(booked)
    mentions = f" {normal(booked)} " in f" {normal(reply)} "
    reward = 1.0 if success else 0.1 * called + 0.2 * to_destination + 0.2 * valid + 0.1 * mentions
    return Score(round(reward, 6), success, called, to_destination, valid)


def call_reward(scenario: Scenario, cities: list[object]) -> float | None:
    """One model call's own reward from the ``city`` of each find_hotel call it made: 1.0 when one named the
    destination, 0.0 when none did, None when it made none (an answer: the trajectory's reward judges it)."""
    if not cities:
        return None
    return float(any(isinstance(c, str) and normal(c) == normal(scenario.destination) for c in cities))


def tool_cities(messages: list[dict[str, Any]]) -> list[object]:
    """The city of each find_hotel call in a conversation's assistant turns (unparseable arguments: None)."""
    cities: list[object] = []
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            if function.get("name") != TOOL_NAME:
                continue
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except ValueError:
                arguments = {}
            cities.append(arguments.get("city") if isinstance(arguments, dict) else None)
    return cities
