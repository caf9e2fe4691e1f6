"""The demo's task: name a country's capital, then give it as JSON; checked by code.

A scenario is one country. The conversation the agent holds with the model:

    user       What is the capital of Peru?
    assistant  The capital of Peru is Lima.
    user       Now give only your answer as JSON: {"answer": "<city>"}
    assistant  {"answer": "Lima"}
   (user       That was not valid JSON. ...      only if the agent's check failed
    assistant  {"answer": "Lima"})

SmolLM2-135M knows many capitals when asked plainly (about half, sampled at T=0.7) but
rarely carries its answer into the JSON it is asked for (about 5% end right): that is
the skill GRPO has to find. The reward gives partial credit, because GRPO learns only
from differences within a group:

    0.2  the right capital appears somewhere in the final reply, even outside JSON
    0.4  the final reply is a JSON object with an "answer" key
    1.0  ...and the answer is the right capital

A final reply that needed the retry turn earns 0.8 of that. An episode *succeeds* when
its final reply is valid JSON with the right capital. The countries are split once, by
a fixed seed, into the ones the agent trains on and held-out ones only ever measured.
"""

from __future__ import annotations

import functools
import json
import random
import unicodedata
from dataclasses import dataclass

# (country, capital, other accepted spellings)
_CAPITALS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Afghanistan", "Kabul", ()), ("Albania", "Tirana", ("Tirane",)), ("Algeria", "Algiers", ()),
    ("Argentina", "Buenos Aires", ()), ("Armenia", "Yerevan", ()), ("Australia", "Canberra", ()),
    ("Austria", "Vienna", ("Wien",)), ("Azerbaijan", "Baku", ()), ("Bangladesh", "Dhaka", ("Dacca",)),
    ("Belarus", "Minsk", ()), ("Belgium", "Brussels", ("Bruxelles",)), ("Bolivia", "Sucre", ("La Paz",)),
    ("Brazil", "Brasilia", ()), ("Bulgaria", "Sofia", ()), ("Cambodia", "Phnom Penh", ()),
    ("Canada", "Ottawa", ()), ("Chile", "Santiago", ()), ("China", "Beijing", ("Peking",)),
    ("Colombia", "Bogota", ()), ("Croatia", "Zagreb", ()), ("Cuba", "Havana", ("La Habana",)),
    ("Czech Republic", "Prague", ("Praha",)), ("Denmark", "Copenhagen", ()), ("Ecuador", "Quito", ()),
    ("Egypt", "Cairo", ()), ("Estonia", "Tallinn", ()), ("Ethiopia", "Addis Ababa", ()),
    ("Finland", "Helsinki", ()), ("France", "Paris", ()), ("Georgia", "Tbilisi", ()),
    ("Germany", "Berlin", ()), ("Ghana", "Accra", ()), ("Greece", "Athens", ()),
    ("Hungary", "Budapest", ()), ("Iceland", "Reykjavik", ()), ("India", "New Delhi", ("Delhi",)),
    ("Indonesia", "Jakarta", ()), ("Iran", "Tehran", ("Teheran",)), ("Iraq", "Baghdad", ()),
    ("Ireland", "Dublin", ()), ("Israel", "Jerusalem", ()), ("Italy", "Rome", ("Roma",)),
    ("Jamaica", "Kingston", ()), ("Japan", "Tokyo", ()), ("Jordan", "Amman", ()),
    ("Kazakhstan", "Astana", ()), ("Kenya", "Nairobi", ()), ("Latvia", "Riga", ()),
    ("Lebanon", "Beirut", ()), ("Libya", "Tripoli", ()), ("Lithuania", "Vilnius", ()),
    ("Madagascar", "Antananarivo", ()), ("Malaysia", "Kuala Lumpur", ()), ("Mexico", "Mexico City", ()),
    ("Mongolia", "Ulaanbaatar", ("Ulan Bator",)), ("Morocco", "Rabat", ()), ("Nepal", "Kathmandu", ()),
    ("Netherlands", "Amsterdam", ()), ("New Zealand", "Wellington", ()), ("Nigeria", "Abuja", ()),
    ("North Korea", "Pyongyang", ()), ("Norway", "Oslo", ()), ("Pakistan", "Islamabad", ()),
    ("Peru", "Lima", ()), ("Philippines", "Manila", ()), ("Poland", "Warsaw", ("Warszawa",)),
    ("Portugal", "Lisbon", ("Lisboa",)), ("Qatar", "Doha", ()), ("Romania", "Bucharest", ()),
    ("Russia", "Moscow", ()), ("Saudi Arabia", "Riyadh", ()), ("Senegal", "Dakar", ()),
    ("Serbia", "Belgrade", ()), ("Singapore", "Singapore", ()), ("Slovakia", "Bratislava", ()),
    ("Slovenia", "Ljubljana", ()), ("South Africa", "Pretoria", ("Cape Town",)), ("South Korea", "Seoul", ()),
    ("Spain", "Madrid", ()), ("Sri Lanka", "Sri Jayawardenepura Kotte", ("Colombo", "Kotte")),
    ("Sudan", "Khartoum", ()), ("Sweden", "Stockholm", ()), ("Switzerland", "Bern", ("Berne",)),
    ("Syria", "Damascus", ()), ("Taiwan", "Taipei", ()), ("Tanzania", "Dodoma", ()),
    ("Thailand", "Bangkok", ()), ("Tunisia", "Tunis", ()), ("Turkey", "Ankara", ()),
    ("Uganda", "Kampala", ()), ("Ukraine", "Kyiv", ("Kiev",)), ("United Kingdom", "London", ()),
    ("United States", "Washington, D.C.", ("Washington", "Washington DC", "Washington D.C.")),
    ("Uruguay", "Montevideo", ()), ("Uzbekistan", "Tashkent", ()), ("Venezuela", "Caracas", ()),
    ("Vietnam", "Hanoi", ()), ("Zambia", "Lusaka", ()), ("Zimbabwe", "Harare", ()),
)  # fmt: skip

HELD_OUT_COUNT = 24
SPLIT_SEED = 20261122

QUESTION = "What is the capital of {country}?"
FORMAT = 'Now give only your answer as JSON: {"answer": "<city>"}'
RETRY = 'That was not valid JSON. Reply with only the JSON object {"answer": "<city>"}.'
MAX_TURNS = 3  # the question, the JSON, one retry


@dataclass(frozen=True, slots=True)
class Scenario:
    country: str
    capital: str
    accepted: tuple[str, ...]  # the capital and its other spellings

    @property
    def question(self) -> str:
        return QUESTION.format(country=self.country)


@dataclass(frozen=True, slots=True)
class Score:
    reward: float
    success: bool  # valid JSON with the right capital
    valid_json: bool
    mentions_capital: bool
    turns: int  # the model's replies, the free answer included

    def metrics(self) -> dict[str, float]:
        return {"success": float(self.success), "valid_json": float(self.valid_json),
                "mentions_capital": float(self.mentions_capital), "turns": float(self.turns)}  # fmt: skip


def scenarios() -> tuple[list[Scenario], list[Scenario]]:
    """(train, held_out): a fixed split of the countries."""
    everything = [Scenario(country, capital, (capital, *other)) for country, capital, other in _CAPITALS]
    random.Random(SPLIT_SEED).shuffle(everything)
    return everything[HELD_OUT_COUNT:], everything[:HELD_OUT_COUNT]


@functools.cache  # read-only; scored once per attempt by the reward service and the demo
def by_country() -> dict[str, Scenario]:
    train, held_out = scenarios()
    return {s.country: s for s in train + held_out}


def country_of(question: str) -> str | None:
    """The country a question asks about (the reward service reads it from the first user turn)."""
    prefix, _, rest = question.partition("What is the capital of ")
    country, sep, _ = rest.partition("?")
    return country if sep and not prefix else None


def json_answer(reply: str) -> str | None:
    """The "answer" of a reply that is exactly one JSON object (code fences allowed); else None."""
    text = reply.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("answer"), str):
        return None
    return str(value["answer"])


def score(scenario: Scenario, final_reply: str, turns: int) -> Score:
    accepted = {_normal(name) for name in scenario.accepted}
    answer = json_answer(final_reply)
    valid = answer is not None
    correct = valid and _normal(answer or "") in accepted
    words = f" {_normal(final_reply)} "
    mentions = any(f" {name} " in words for name in accepted)
    reward = 1.0 if correct else 0.4 if valid else 0.2 if mentions else 0.0
    if turns > 2:
        reward *= 0.8
    return Score(reward, correct, valid, mentions, turns)


def _normal(text: str) -> str:
    """Lower case, no accents, no punctuation, single spaces: "Bogotá" == "bogota"."""
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    words = "".join(c if c.isalnum() else " " for c in plain.lower()).split()
    return " ".join(words)
