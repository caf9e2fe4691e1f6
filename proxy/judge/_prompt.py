"""The group judge: an LLM scores every trajectory of a group from 0 to 1, relative to the others.

After OpenPipe ART's RULER: ranking attempts at the same task against each other is
easier for a model than grading one in isolation, and GRPO only needs relative
rewards anyway (advantages are reward minus the group mean). So the user need not
write a reward function.

The prompt (``build_prompt``):

- Each trajectory becomes a list of chat messages: its calls in order, each call's
  request messages plus its reply, where a call that extends the previous one (the
  usual agent loop) adds only what is new. Message contents longer than
  ``MAX_MESSAGE_CHARS`` keep their start and end.
- The messages every trajectory starts with (the system prompt, the task, often the
  first tool results) are sent once, in ``<context>``; then each trajectory's own
  continuation in ``<trajectory id="t1">``. The ids are short labels, not trajectory ids,
  so the judge sees nothing that could leak an order or a hint, and the same content
  always makes the same prompt (the cache depends on that).
- The rubric says what "better" means; ``DEFAULT_RUBRIC`` suits generic agent tasks.

The answer is JSON ``{"scores": [{"id", "explanation", "score"}]}``. It is requested as a
JSON schema through litellm's ``response_format`` when the provider takes that parameter
(vLLM then constrains decoding to it, ids included), and it is always validated with
pydantic (``parse_scores``): every id exactly once, no other id, a finite score in
[0, 1]. Explanations come before scores so the model reasons before it commits.

Asking the model (retries included) is ``proxy.judge._client``; writing the scores to the
store is ``proxy.judge._service``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from tracetrain_core import call_messages as request_messages
from tracetrain_core import call_reply, common_prefix, first_choice

DEFAULT_RUBRIC = """\
- A trajectory that achieves the task's goal scores clearly higher than one that does not.
- Between two that achieve it, the one that gets there more directly (fewer wasted steps, \
no needless tool calls, no detours) scores higher.
- Partial progress earns partial credit: a trajectory that gets closer to the goal scores \
higher than one that gets less far.
- Follow the instructions of the task exactly (format, length, constraints): a violated \
instruction costs credit even when the content is right.
- Make score differences proportional to quality differences: nearly equal trajectories get \
nearly equal scores, a much better one a much higher score. Use the whole range from 0 to 1."""

MAX_MESSAGE_CHARS = 8000  # per message content, in the prompt; the middle is elided beyond
MAX_EXPLANATION_CHARS = 1000  # longer explanations are cut, not rejected
_PROMPT_VERSION = 1  # part of the cache key: bump when the prompt's wording changes

_SYSTEM = """\
You are a careful, impartial judge of an AI agent's work. You are shown several \
trajectories: independent attempts by the same agent at the same task. They share the \
context shown first, then each continues in its own way. Score every trajectory from 0 \
to 1 relative to the others, following the rubric.

Rubric:
{rubric}

Answer with only a JSON object, no other text: {{"scores": [{{"id": "<trajectory id>", \
"explanation": "<one or two sentences on why>", "score": <number from 0 to 1>}}, ...]}}, \
with exactly one entry for each of these trajectory ids: {ids}."""


# ---------------------------------------------------------------- the prompt


@dataclass(frozen=True, slots=True)
class TrajectoryText:
    """A trajectory as the judge reads it: its messages, oldest first."""

    trajectory_id: str
    messages: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class JudgePrompt:
    """What is sent to the judge model, and the labels it must score."""

    messages: list[dict[str, Any]]
    labels: list[str]  # "t1", "t2", ... in the order of the trajectories given
    trajectory_ids: list[str]  # the trajectory each label stands for
    shared: int  # messages sent once, as the context

    def response_format(self) -> dict[str, Any]:
        """The JSON schema of the answer; the ids are an enum, so constrained decoding gets them right."""
        item = {
            "type": "object",
            "properties": {
                "id": {"type": "string", "enum": self.labels},
                "explanation": {"type": "string"},
                "score": {"type": "number"},
            },
            "required": ["id", "explanation", "score"],
            "additionalProperties": False,
        }
        schema = {
            "type": "object",
            "properties": {"scores": {"type": "array", "items": item}},
            "required": ["scores"],
            "additionalProperties": False,
        }
        return {"type": "json_schema", "json_schema": {"name": "group_scores", "schema": schema, "strict": True}}

    def cache_key(self, model: str) -> str:
        """Hash of everything that decides the answer: the model, the prompt (rubric included), the format."""
        content = {"v": _PROMPT_VERSION, "model": model, "messages": self.messages, "format": self.response_format()}
        return hashlib.sha256(orjson.dumps(content, option=orjson.OPT_SORT_KEYS)).hexdigest()


def call_messages(
    endpoint: str, request: dict[str, Any], response: dict[str, Any] | None, error: str | None
) -> list[dict[str, Any]]:
    """One captured call as chat messages: the request's messages (or prompt), then the reply.

    A failed call (``error`` set: vLLM's error, a broken stream, a client gone mid-stream) shows as failed,
    even when its record keeps what was sampled before the failure: the judge must not score half an answer
    as a whole one.
    """
    sent = request_messages(endpoint, request)  # chat, Responses and Messages calls alike
    if sent is not None:
        messages = [_message(m) for m in sent]
    else:
        messages = [{"role": "user", "content": _content(request.get("prompt"))}]
    first, reply = first_choice(response), call_reply(endpoint, response)
    if error is not None:
        messages.append({"role": "assistant", "content": f"[the call failed: {error}]"})
    elif reply is not None:
        messages.append(_message(reply))
    elif first is not None:
        messages.append({"role": "assistant", "content": _content(first.get("text"))})
    else:
        messages.append({"role": "assistant", "content": f"[the call failed: {error or 'no reply'}]"})
    return messages


def trajectory_messages(calls: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A trajectory's calls (each from ``call_messages``) as one conversation.

    A call whose messages start with everything so far (the usual agent loop) adds what
    is new; a call that starts over (a new context) is appended whole.
    """
    merged: list[dict[str, Any]] = []
    for messages in calls:
        if messages[: len(merged)] == merged:
            merged = list(messages)
        else:
            merged += messages
    return merged


def build_prompt(trajectories: Sequence[TrajectoryText], rubric: str) -> JudgePrompt:
    """The judge's messages: the shared prefix once, then each trajectory's continuation."""
    if not trajectories:
        raise ValueError("a group to judge has at least one trajectory")
    labels = [f"t{i + 1}" for i in range(len(trajectories))]
    shared = common_prefix(*(t.messages for t in trajectories))
    parts = []
    if shared:
        parts.append("<context>\n" + _render(trajectories[0].messages[:shared]) + "\n</context>")
        parts.append("Each trajectory continues the context above:")
    else:
        parts.append("The trajectories share no context.")
    for label, t in zip(labels, trajectories, strict=True):
        rest = t.messages[shared:]
        body = _render(rest) if rest else "(nothing beyond the shared context)"
        parts.append(f'<trajectory id="{label}">\n{body}\n</trajectory>')
    ids = ", ".join(labels)
    messages = [
        {"role": "system", "content": _SYSTEM.format(rubric=rubric.strip(), ids=ids)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]
    return JudgePrompt(messages, labels, [t.trajectory_id for t in trajectories], shared)


def _render(messages: Sequence[dict[str, Any]]) -> str:
    return "\n".join(orjson.dumps(m).decode() for m in messages)


def _message(raw: dict[str, Any]) -> dict[str, Any]:
    """The parts of a chat message that matter to a judge, in a stable shape."""
    out: dict[str, Any] = {"role": str(raw.get("role") or "assistant")}
    for key in ("name", "tool_call_id"):
        if raw.get(key):
            out[key] = str(raw[key])
    out["content"] = _content(raw.get("content"))
    if raw.get("reasoning_content") or raw.get("reasoning"):
        out["reasoning"] = _content(raw.get("reasoning_content") or raw.get("reasoning"))
    calls = raw.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [
            {"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
            for c in calls
            if isinstance(c, dict)
        ]
    return out


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: text kept, the rest named
        text = "".join(
            p.get("text", "") if isinstance(p, dict) and p.get("type") == "text" else f"[{_part_type(p)}]"
            for p in content
        )
    else:
        text = content if isinstance(content, str) else orjson.dumps(content).decode()
    if len(text) > MAX_MESSAGE_CHARS:
        keep = MAX_MESSAGE_CHARS // 2
        text = f"{text[:keep]}\n[... {len(text) - 2 * keep} characters elided ...]\n{text[-keep:]}"
    return text


def _part_type(part: Any) -> str:
    return str(part.get("type", "part")) if isinstance(part, dict) else "part"


# ---------------------------------------------------------------- the answer


class Score(BaseModel):
    """One trajectory's verdict, as the judge model must write it."""

    model_config = ConfigDict(extra="ignore")

    id: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
    explanation: str = ""
    score: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    scores: list[Score]


class InvalidJudgement(ValueError):
    """The judge model's answer cannot be used; the message says why, for the model and the log."""


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_scores(content: str | None, labels: Sequence[str]) -> list[Score]:
    """Validate an answer: JSON of the right shape, every label exactly once, nothing else.

    Returns the scores in ``labels`` order, explanations cut to ``MAX_EXPLANATION_CHARS``.
    """
    text = (content or "").strip()
    if fenced := _FENCE.match(text):  # small models wrap JSON in a code fence despite the instructions
        text = fenced.group(1)
    if not text:
        raise InvalidJudgement("the answer was empty")
    try:
        answer = _Answer.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the answer"
        raise InvalidJudgement(f"{where}: {first['msg']}") from exc
    # The ids named back are ours only: whatever else the answer holds is never repeated (it is recorded).
    unknown = len({score.id for score in answer.scores} - set(labels))
    if unknown:
        raise InvalidJudgement(f"{unknown} unknown id{'s' if unknown > 1 else ''}: score only {', '.join(labels)}")
    by_id: dict[str, Score] = {}
    for score in answer.scores:
        if score.id in by_id:
            raise InvalidJudgement(f"the id {score.id} was scored more than once")
        by_id[score.id] = score
    missing = [label for label in labels if label not in by_id]
    if missing:
        raise InvalidJudgement(f"no score for {', '.join(missing)}")
    return [
        by_id[label].model_copy(update={"explanation": by_id[label].explanation.strip()[:MAX_EXPLANATION_CHARS]})
        for label in labels
    ]
