"""Request models for Anthropic's Messages API: validation only, never re-serialization.

As for the OpenAI endpoints (``_wire``), models allow extra fields: Claude Code sends many the
proxy has no use for (``thinking``, ``context_management``, ``cache_control`` on blocks,
``metadata.user_id``...), and they are kept in the record as sent. Fields follow the order of
Anthropic's API reference; only those the translation reads, or worth a clear early error, are
declared. Content blocks are a union tagged by ``type``: an unknown type is a 400 naming the types
the proxy reads; images and documents validate here and are refused by the translation, which
says why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Bounds what reaches vLLM as an integer (orjson writes no integer past 64 bits; vLLM wants 32).
_INT32 = 2**31 - 1


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Open):
    type: Literal["text"]
    text: str


class ImageBlock(_Open):
    type: Literal["image"]


class DocumentBlock(_Open):
    type: Literal["document"]


class ToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: Any = None  # an object; what the proxy reported back (a parser may emit other JSON) is accepted too


ToolResultPart = Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]


class ToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Open):
    type: Literal["thinking"]


class RedactedThinkingBlock(_Open):
    type: Literal["redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(_Open):
    # "system": a system message mid-conversation (Claude Code sends them: beta mid-conversation-system-2026-04-07).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Open):
    # Anthropic's server tools (web search, code execution...) carry a dated type; custom ones none or "custom".
    type: str | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1)
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Open):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Open):
    # ``effort`` is Claude's thinking budget: the policy has none, so it is kept in the record only.
    format: OutputFormat | None = None


class CountTokensRequest(_Open):
    """``POST /v1/messages/count_tokens``: what a call would render, without sampling settings."""

    messages: list[MessageParam] = Field(min_length=1)
    model: str = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, le=_INT32)
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_k: int | None = Field(default=None, ge=0, le=_INT32)
    top_p: float | None = Field(default=None, gt=0, le=1)
