"""Token-in/token-out capture: what the proxy adds upstream, keeps, and strips.

The proxy asks vLLM for the truth (``return_token_ids`` and sampling ``logprobs``)
on every call, keeps the prompt ids, the completion ids and the logprob of every
sampled token, and removes from the client's response whatever the client did not
ask for, so an agent sees the same bytes it would get from vLLM directly.

vLLM's placement (0.32): chat responses carry ``prompt_token_ids`` at the top level
(streams: the first chunk only) and ``token_ids`` per choice (streams: per delta);
completions carry both per choice. Logprobs are ``choices[i].logprobs.content[j].logprob``
for chat and ``choices[i].logprobs.token_logprobs[j]`` for completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tracetrain_core import structured_outputs

Endpoint = Literal["chat.completions", "completions"]


@dataclass(frozen=True, slots=True)
class Asked:
    """What the client itself asked for, so the proxy's additions can be removed again."""

    token_ids: bool
    logprobs: bool
    usage_chunk: bool


@dataclass(slots=True)
class ChoiceCapture:
    """One sampled choice, as vLLM produced it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""  # message content (chat) or completion text
    reasoning: str = ""  # a chat answer's thinking, with vLLM's --reasoning-parser (its ids are in token_ids)
    role: str = "assistant"
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # completions carry the prompt per choice

    def message(self) -> dict[str, Any]:
        """The assistant message as a client would send it back in its next request."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text or None}
        if self.reasoning:
            msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


@dataclass(slots=True)
class Capture:
    """Everything the record keeps about a response, whatever its transport."""

    endpoint: Endpoint
    prompt_token_ids: list[int] = field(default_factory=list)
    choices: dict[int, ChoiceCapture] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    response_id: str | None = None
    created: int | None = None
    model: str | None = None

    def choice(self, index: int) -> ChoiceCapture:
        found = self.choices.get(index)
        if found is None:
            found = self.choices[index] = ChoiceCapture()
        return found

    @property
    def first(self) -> ChoiceCapture:
        return self.choices[min(self.choices)] if self.choices else ChoiceCapture()

    def prompt_ids(self) -> list[int]:
        if self.prompt_token_ids:
            return self.prompt_token_ids
        return self.first.prompt_token_ids or []

    def as_response(self) -> dict[str, Any]:
        """A non-streamed response equivalent to what was captured (for the record)."""
        chat = self.endpoint == "chat.completions"
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            if chat:
                choices.append({"index": index, "message": c.message(), "finish_reason": c.finish_reason})
            else:
                choices.append({"index": index, "text": c.text, "finish_reason": c.finish_reason})
        return {
            "id": self.response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage,
        }


def constrain(body: dict[str, Any]) -> dict[str, Any] | None:
    """The grammar vLLM will sample the chat request ``body`` under (``tracetrain_core.structured_outputs``), or
    None. A ``response_format`` is sent as that very specification (vLLM's ``structured_outputs``, in place of
    the ``response_format`` it would derive it from), so what the call records is what vLLM compiles; a forced
    tool choice's grammar is vLLM's tool parser's to build, and recorded as that parser builds it."""
    spec = structured_outputs(body)
    if spec is not None and ("json" in spec or "json_object" in spec) and "structured_outputs" not in body:
        body["structured_outputs"] = spec
        body.pop("response_format", None)
    return spec


def prepare_upstream_body(body: dict[str, Any], endpoint: Endpoint, served_model: str) -> tuple[dict[str, Any], Asked]:
    """The request to send upstream, and what the client asked for itself."""
    out = dict(body)
    out["model"] = served_model
    out["return_token_ids"] = True
    if endpoint == "chat.completions":
        asked_logprobs = bool(body.get("logprobs"))
        out["logprobs"] = True
    else:
        asked_logprobs = body.get("logprobs") is not None
        if not asked_logprobs:
            out["logprobs"] = 0  # the sampled token's logprob, no alternatives
    asked_usage = False
    if body.get("stream"):
        options = dict(body.get("stream_options") or {})
        asked_usage = bool(options.get("include_usage"))
        options["include_usage"] = True
        out["stream_options"] = options
    return out, Asked(token_ids=bool(body.get("return_token_ids")), logprobs=asked_logprobs, usage_chunk=asked_usage)


def _logprob_values(endpoint: Endpoint, logprobs: Any) -> list[float]:
    if not isinstance(logprobs, dict):
        return []
    if endpoint == "chat.completions":
        return [float(item["logprob"]) for item in logprobs.get("content") or ()]
    return [float(x) for x in logprobs.get("token_logprobs") or () if x is not None]


def capture_response(data: dict[str, Any], endpoint: Endpoint) -> Capture:
    """Read ids, logprobs and the reply out of a non-streamed vLLM response."""
    cap = Capture(endpoint, response_id=data.get("id"), created=data.get("created"), model=data.get("model"))
    cap.prompt_token_ids = list(data.get("prompt_token_ids") or ())
    cap.usage = data.get("usage")
    for raw in data.get("choices") or ():
        c = cap.choice(int(raw.get("index", 0)))
        c.token_ids = list(raw.get("token_ids") or ())
        c.logprobs = _logprob_values(endpoint, raw.get("logprobs"))
        c.finish_reason = raw.get("finish_reason")
        if endpoint == "chat.completions":
            message = raw.get("message") or {}
            c.role = message.get("role") or "assistant"
            c.text = message.get("content") or ""
            c.reasoning = message.get("reasoning") or ""
            c.tool_calls = list(message.get("tool_calls") or ())
        else:
            c.text = raw.get("text") or ""
            c.prompt_token_ids = raw.get("prompt_token_ids")
    return cap


def strip_response(data: dict[str, Any], asked: Asked, model: str) -> dict[str, Any]:
    """Remove, in place, what the proxy added and the client did not ask for.

    ``model`` becomes the version that served the call (``agent@3``), the way OpenAI
    answers ``gpt-4o`` with the dated snapshot that served it.
    """
    if "model" in data:
        data["model"] = model
    # vLLM leaves unrequested token fields present as null; so does the proxy.
    if not asked.token_ids and "prompt_token_ids" in data:
        data["prompt_token_ids"] = None
    for choice in data.get("choices") or ():
        if not asked.token_ids:
            for name in ("token_ids", "prompt_token_ids"):
                if name in choice:
                    choice[name] = None
        if not asked.logprobs:
            choice["logprobs"] = None
    return data


def without_token_fields(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a response without ids and logprobs (those live in their own columns)."""
    out = {k: v for k, v in data.items() if k != "prompt_token_ids"}
    out["choices"] = [
        {k: v for k, v in choice.items() if k not in ("token_ids", "prompt_token_ids", "logprobs")}
        for choice in data.get("choices") or ()
    ]
    return out


class StreamCapture:
    """Reassembles a streamed response chunk by chunk while the chunks are forwarded."""

    def __init__(self, endpoint: Endpoint, asked: Asked, model: str) -> None:
        self.capture = Capture(endpoint)
        self._asked = asked
        self._model = model

    def add(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """Record a chunk; return it as the client should see it, or None to drop it."""
        cap = self.capture
        chat = cap.endpoint == "chat.completions"
        if cap.response_id is None:
            cap.response_id, cap.created, cap.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        prompt_ids = chunk.get("prompt_token_ids")
        if prompt_ids:
            cap.prompt_token_ids = list(prompt_ids)
        if chunk.get("usage"):
            cap.usage = chunk["usage"]
        choices = chunk.get("choices") or ()
        for raw in choices:
            c = cap.choice(int(raw.get("index", 0)))
            c.token_ids.extend(raw.get("token_ids") or ())
            c.logprobs.extend(_logprob_values(cap.endpoint, raw.get("logprobs")))
            if raw.get("finish_reason") is not None:
                c.finish_reason = raw["finish_reason"]
            if chat:
                _add_delta(c, raw.get("delta") or {})
            else:
                c.text += raw.get("text") or ""
                if raw.get("prompt_token_ids"):
                    c.prompt_token_ids = list(raw["prompt_token_ids"])
        if not choices and chunk.get("usage") and not self._asked.usage_chunk:
            return None  # the usage-only chunk the proxy asked for
        if not self._asked.usage_chunk and "usage" in chunk:
            chunk["usage"] = None
        return strip_response(chunk, self._asked, self._model)


def _add_delta(c: ChoiceCapture, delta: dict[str, Any]) -> None:
    if delta.get("role"):
        c.role = delta["role"]
    if delta.get("content"):
        c.text += delta["content"]
    if delta.get("reasoning"):
        c.reasoning += delta["reasoning"]
    for part in delta.get("tool_calls") or ():
        index = int(part.get("index", 0))
        while len(c.tool_calls) <= index:
            c.tool_calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call = c.tool_calls[index]
        if part.get("id"):
            call["id"] = part["id"]
        function = part.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]
