"""The demo's task: read a travel request, say which city needs a hotel, as JSON; checked by code.

A scenario is one request: a traveller, where they leave from, where they go, when.
The agent's call:

    user       Hi, this is Ana. I'm flying from Lima to Oslo on Friday and need a hotel there.

               Which city does Ana need a hotel in? Reply with only JSON: {"city": "<city>"}
    assistant  {"city": "Oslo"}

Everything needed is in the request, so the task is a skill, not knowledge: SmolLM2-135M
names the right city in prose about half the time (sampled at T=0.7), but answers with
exactly one JSON object naming it about 6% of the time (it adds prose after the JSON,
echoes the template, or names the city it leaves from): that is what GRPO has to teach,
and what the agent's parser needs. One call per attempt keeps the demo's minutes for
learning: on two CPU cores vLLM samples ~100 tokens/s, and every token counts.
The reward gives partial credit, because GRPO learns only from differences within a group:

    0.2  the destination appears somewhere in the final reply, even outside JSON
    0.4  the final reply is exactly one JSON object with a "city" string
    1.0  ...and the city is the destination

An attempt *succeeds* when its reply is valid JSON naming the destination. The cities are split once, by a fixed
seed: held-out requests only ever name held-out cities, so no held-out request, and no
city in one, is ever trained on.
"""

from __future__ import annotations

import functools
import json
import random
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

CITIES = (
    "Accra", "Adelaide", "Amman", "Amsterdam", "Ankara", "Antwerp", "Athens", "Atlanta", "Auckland", "Austin",
    "Baku", "Bangkok", "Barcelona", "Basel", "Beirut", "Belfast", "Belgrade", "Bergen", "Berlin", "Bilbao",
    "Bologna", "Bordeaux", "Boston", "Bremen", "Brisbane", "Bristol", "Brussels", "Budapest", "Cairo", "Calgary",
    "Cardiff", "Chicago", "Cologne", "Copenhagen", "Cork", "Dakar", "Dallas", "Delhi", "Denver", "Doha", "Dresden",
    "Dublin", "Durban", "Edinburgh", "Florence", "Geneva", "Genoa", "Glasgow", "Granada", "Hamburg", "Hanoi",
    "Havana", "Helsinki", "Houston", "Istanbul", "Jakarta", "Kyoto", "Lagos", "Leeds", "Leipzig", "Lima",
    "Lisbon", "Liverpool", "London", "Lyon", "Madrid", "Malaga", "Manila", "Marseille", "Melbourne", "Miami",
    "Milan", "Montreal", "Mumbai", "Munich", "Nairobi", "Nantes", "Naples", "Nice", "Osaka", "Oslo", "Ottawa",
    "Oxford", "Palermo", "Paris", "Perth", "Porto", "Prague", "Quito", "Riga", "Rome", "Rotterdam", "Santiago",
    "Seattle", "Seoul", "Seville", "Sofia", "Stockholm", "Sydney", "Tallinn", "Tokyo", "Toronto", "Toulouse",
    "Turin", "Valencia", "Vancouver", "Venice", "Vienna", "Vilnius", "Warsaw", "York", "Zagreb", "Zurich",
)  # fmt: skip
NAMES = (
    "Ana", "Tom", "Priya", "Jonas", "Mei", "Omar", "Lena", "Carlos", "Sara", "Ivan", "Aisha", "Ben", "Yuki",
    "Marta", "Kofi", "Elena", "Raj", "Nora", "Diego", "Hana", "Luca", "Zoe", "Amir", "Ines",
)  # fmt: skip
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday", "3 May", "the 14th",
         "next week", "June 2", "the weekend")  # fmt: skip
# {n} travels from {a} to {b} on {d}; the destination is not always the second city named.
_REQUESTS = (
    "Hi, this is {n}. I'm flying from {a} to {b} on {d} and need a hotel there.",
    "{n} here. On {d} I take the train to {b}; I leave {a} in the morning. Can you find me a room?",
    "Please book a hotel for {n} in {b}. {n} arrives on {d} from {a}.",
    "{n} lives in {a} and has a conference in {b} on {d}.",
    "Travel request: {n}, {d}. Departure: {a}. Destination: {b}. Hotel needed at the destination.",
    "{n} is driving to {b} on {d} and stays two nights; the trip starts in {a}.",
)
QUESTION = 'Which city does {n} need a hotel in? Reply with only JSON: {{"city": "<city>"}}'

HELD_OUT_CITIES = 30
TRAIN_SCENARIOS = 400
HELD_OUT_SCENARIOS = 100
SPLIT_SEED = 20261124


@dataclass(frozen=True, slots=True)
class Scenario:
    traveller: str
    origin: str
    destination: str
    prompt: str  # the first user message: the request and the question


@dataclass(frozen=True, slots=True)
class Score:
    reward: float
    success: bool  # valid JSON naming the destination
    valid_json: bool
    mentions_destination: bool

    def metrics(self) -> dict[str, float]:
        return {"success": float(self.success), "valid_json": float(self.valid_json),
                "mentions_destination": float(self.mentions_destination)}  # fmt: skip


@functools.cache
def scenarios() -> tuple[list[Scenario], list[Scenario]]:
    """(train, held_out): fixed sets of requests; held-out ones name only cities no training request names."""
    return split_requests(_REQUESTS, QUESTION, seed=SPLIT_SEED, sep="\n\n")


def split_requests(
    templates: Sequence[str], question: str, *, seed: int, sep: str
) -> tuple[list[Scenario], list[Scenario]]:
    """(train, held_out) requests from ``templates`` and ``question``, joined by ``sep``: held-out ones name
    only cities no training request names (every task built on these cities splits them this way)."""
    rng = random.Random(seed)
    cities = list(CITIES)
    rng.shuffle(cities)
    held_out_cities, train_cities = cities[:HELD_OUT_CITIES], cities[HELD_OUT_CITIES:]
    train = _requests(rng, train_cities, TRAIN_SCENARIOS, templates, question, sep)
    return train, _requests(rng, held_out_cities, HELD_OUT_SCENARIOS, templates, question, sep)


def _requests(
    rng: random.Random, cities: list[str], count: int, templates: Sequence[str], question: str, sep: str
) -> list[Scenario]:
    made: dict[str, Scenario] = {}
    while len(made) < count:
        origin, destination = rng.sample(cities, 2)
        name = rng.choice(NAMES)
        request = rng.choice(templates).format(n=name, a=origin, b=destination, d=rng.choice(DAYS))
        prompt = f"{request}{sep}{question.format(n=name)}"
        made.setdefault(prompt, Scenario(name, origin, destination, prompt))
    return list(made.values())


@functools.cache  # read-only; scored once per attempt by the reward service and the demo
def by_prompt() -> dict[str, Scenario]:
    train, held_out = scenarios()
    return {s.prompt: s for s in train + held_out}


def json_city(reply: str) -> str | None:
    """The "city" of a reply that is exactly one JSON object (code fences allowed); else None."""
    text = reply.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("city"), str):
        return None
    return str(value["city"])


def score(scenario: Scenario, reply: str) -> Score:
    city = json_city(reply)
    valid = city is not None
    correct = valid and normal(city or "") == normal(scenario.destination)
    mentions = f" {normal(scenario.destination)} " in f" {normal(reply)} "
    reward = 1.0 if correct else 0.4 if valid else 0.2 if mentions else 0.0
    return Score(reward, correct, valid, mentions)


def normal(text: str) -> str:
    """Lower case, no accents, no punctuation, single spaces: "Málaga" == "malaga"."""
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    words = "".join(c if c.isalnum() else " " for c in plain.lower()).split()
    return " ".join(words)
