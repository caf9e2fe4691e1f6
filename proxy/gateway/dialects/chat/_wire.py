"""Request models of chat completions and (legacy) text completions: validation only, never re-serialization.

Models allow extra fields so a parameter a newer client sends passes through to vLLM
untouched (the proxy forwards the client's own JSON, not these objects). Fields
follow the order of OpenAI's API reference; only fields the proxy reads or that are
worth a clear early error are declared.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's own limit on choices per request; without one, n=2**40 reaches vLLM as a request.
MAX_N = 128


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Open):
    include_usage: bool | None = None


class ChatCompletionRequest(_Open):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str = Field(min_length=1)
    logprobs: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    # vLLM's extension: the client itself wants token ids back.
    return_token_ids: bool | None = None


class CompletionRequest(_Open):
    model: str = Field(min_length=1)
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's extension: the client itself wants token ids back.
    return_token_ids: bool | None = None
