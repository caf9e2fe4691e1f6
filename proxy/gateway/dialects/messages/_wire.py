"""Request models for Anthropic's Messages API: validation only, never re-serialization.

As for the OpenAI endpoints (``_wire``), models allow extra fields: Claude Code sends many the
proxy has no use for (``thinking``, ``context_management``, ``cache_control`` on blocks,
``metadata.user_id``...), and they are kept in the record as sent. Fields follow the order of
Anthropic's API reference; only those the translation reads, or worth a clear early error, are
declared. Content blocks are a union tagged by ``type``; a block of a type the proxy does not read
(a newer API version's) validates as ``OtherBlock`` and becomes a placeholder the model reads
(``tracetrain_core``), as do images for a model that reads text only and binary documents.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

# Bounds what reaches vLLM as an integer (orjson writes no integer past 64 bits; vLLM wants 32).
_INT32 = 2**31 - 1


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Open):
    type: Literal["text"]
    text: str


class ImageBlock(_Open):
    type: Literal["image"]
    source: dict[str, Any] | None = None


class DocumentBlock(_Open):
    type: Literal["document"]
    source: dict[str, Any] | None = None


class OtherBlock(_Open):
    """A block of a type the proxy does not read: a placeholder in what the model reads."""

    type: str


class ToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: Any = None  # an object; what the proxy reported back (a parser may emit other JSON) is accepted too


def _block_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None  # no type: "Unable to extract tag", a 400
    return kind if kind in _KNOWN else "other"


_KNOWN = frozenset({"text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking"})

ToolResultPart = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")]
    | Annotated[DocumentBlock, Tag("document")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_type),
]  # fmt: skip


class ToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Open):
    type: Literal["thinking"]
    thinking: str
    signature: str  # the proxy's, on a block it answered: checked when the block comes back


class RedactedThinkingBlock(_Open):
    type: Literal["redacted_thinking"]


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")]
    | Annotated[DocumentBlock, Tag("document")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_type),
]  # fmt: skip


class MessageParam(_Open):
    # "system": a system message mid-conversation (Claude Code sends them: beta mid-conversation-system-2026-04-07).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Open):
    # Anthropic's server tools (web search, code execution...) carry a dated type: left out, with a note to the
    # model (tracetrain_core); custom ones none or "custom".
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
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # vLLM's reasoning_effort
    format: OutputFormat | None = None


class ThinkingEnabled(_Open):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024, le=_INT32)  # Anthropic's floor


class ThinkingDisabled(_Open):
    type: Literal["disabled"]


class ThinkingAdaptive(_Open):
    type: Literal["adaptive"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class CountTokensRequest(_Open):
    """``POST /v1/messages/count_tokens``: what a call would render, without sampling settings."""

    messages: list[MessageParam] = Field(min_length=1)
    model: str = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    thinking: Thinking | None = None
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
