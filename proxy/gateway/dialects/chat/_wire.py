"""Request models of chat completions and (legacy) text completions: validation only, never re-serialization.

Models allow extra fields so a parameter a newer client sends passes through to vLLM
untouched (the proxy forwards the client's own JSON, not these objects). Fields
follow the order of OpenAI's API reference; only fields the proxy reads or that are
worth a clear early error are declared.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# OpenAI's own limit on choices per request; without one, n=2**40 reaches vLLM as a request.
MAX_N = 128
# Completions: the prompts of one request (a list of texts or of token id lists), times n, choices in all: as many
# as MAX_N allows one prompt, so a list of 10^5 prompts is not 10^5 generations.
MAX_PROMPTS = MAX_N
# A prompt's token id: the record keeps ids as 32-bit integers (store._compact), and no vocabulary comes near that.
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


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
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's extension: the client itself wants token ids back.
    return_token_ids: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _bounded_prompts(cls, prompt: Any) -> Any:
        if _prompts(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {_prompts(prompt)}")
        return prompt

    @field_validator("n")
    @classmethod
    def _bounded_completions(cls, n: int | None, info: ValidationInfo) -> int | None:
        prompts = _prompts(info.data.get("prompt"))
        if n is not None and prompts * n > MAX_PROMPTS:
            raise ValueError(
                f"{prompts} prompts with n={n} ask for {prompts * n} completions; at most {MAX_PROMPTS} per request"
            )
        return n


def _prompts(prompt: Any) -> int:
    """How many prompts ``prompt`` holds: a text or a list of token ids is one; a list of either, one each."""
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)
