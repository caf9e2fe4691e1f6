"""The Responses API's objects as OpenAI shapes them: a response, its output items, its usage."""

from __future__ import annotations

import random
from typing import Any

from proxy.gateway.dialects._dialect import usage_detail


def new_id(prefix: str) -> str:
    """An opaque id (``resp_...``, ``msg_...``, ``fc_...``): unique, not secret, so not from ``os.urandom`` (~5 us)."""
    return f"{prefix}_{random.getrandbits(128):032x}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The model's thinking, as OpenAI's Responses API shapes an open-weight model's (``reasoning_text``)."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "encrypted_content": None,
            "status": status}  # fmt: skip


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """The response's ``status`` and ``incomplete_details`` for a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return ("completed", None) if finish_reason is not None else ("in_progress", None)


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's usage as the Responses API's: cached prompt tokens (``--enable-prompt-tokens-details``) and
    thinking tokens (with a ``--reasoning-parser``) in their details, where vLLM reports them."""
    if not usage:
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": usage_detail(usage, "prompt_tokens_details", "cached_tokens")},
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": usage_detail(usage, "completion_tokens_details", "reasoning_tokens")
        },
        "total_tokens": prompt + completion,
    }


def response_object(
    body: dict[str, Any], model: str, response_id: str, created_at: int, output: list[dict[str, Any]],
    status: str, incomplete: dict[str, str] | None, usage: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """A ``response`` object: what was sampled, and the request's settings echoed as OpenAI echoes them."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }
