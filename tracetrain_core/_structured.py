"""The grammar vLLM samples a chat request under: its structured-output specification, derived as vLLM 0.32 does.

A request constrains its output three ways, and every API reaches vLLM as chat (the Responses API's
``text.format`` and Anthropic's ``output_config.format`` become ``response_format``; their forced tool
choices a named or ``"required"`` ``tool_choice``):

- ``tool_choice`` ``"required"`` or a named function, with tools: vLLM's tool-call parser builds a
  structural tag (``vllm.tool_parsers.structural_tag_registry``; Hermes, ``serve``'s default parser): each
  call is ``<tool_call>`` + ``{"name": "NAME", "arguments": `` + the arguments + ``}`` + ``</tool_call>``,
  with or without the newlines, the arguments any JSON unless the tool is ``strict`` (then its parameters'
  schema); one call or more for ``"required"`` (one when ``parallel_tool_calls`` is false), one for a
  named tool. It wins over ``response_format``.
- ``response_format`` ``json_schema`` -> ``{"json": schema}``, ``json_object`` -> ``{"json_object": true}``.
- ``structured_outputs`` (vLLM's own field), which ``response_format`` overrides.

The result is vLLM's ``StructuredOutputsParams`` as a JSON object (one kind among ``json``, ``json_object``,
``regex``, ``grammar``, ``structural_tag``), which the trainer compiles with xgrammar as vLLM's backend does.
A constraint this module cannot derive exactly (a strict tool under ``tool_choice`` "auto", a structural-tag
``response_format``) is ``{"unsupported": why}``: recorded, so training counts and shows it rather than
train that call as if it were free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# What the spec records besides the grammar: how it was derived, so a reader knows what it assumed.
TOOL_PARSER = "hermes"
_KINDS = ("json", "json_object", "regex", "grammar", "structural_tag", "choice")


def structured_outputs(chat: Mapping[str, Any]) -> dict[str, Any] | None:
    """The structured-output specification vLLM samples the chat request ``chat`` under; None: unconstrained.

    >>> structured_outputs({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}})
    {'json': {}}
    >>> structured_outputs({"messages": []}) is None
    True
    """
    tools = [t for t in chat.get("tools") or () if isinstance(t, Mapping) and t.get("type") == "function"]
    choice = chat.get("tool_choice")
    if tools and (choice == "required" or isinstance(choice, Mapping)):
        return _tool_tag(tools, choice, chat.get("parallel_tool_calls"))
    if tools and choice in (None, "auto") and any(_strict(t) for t in tools):
        return {"unsupported": "tool_choice auto with a strict tool"}
    spec = _own(chat.get("structured_outputs"))
    response_format = chat.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") not in (None, "text"):
        kind = response_format.get("type")
        if kind == "json_object":
            spec = {"json_object": True}
        elif kind == "json_schema" and isinstance(schema := response_format.get("json_schema"), Mapping):
            spec = {"json": schema.get("schema", {})}
        else:
            spec = {"unsupported": f"response_format {kind}"}
    return spec


def _own(value: Any) -> dict[str, Any] | None:
    """A client's own ``structured_outputs``: the grammar fields vLLM compiles (its options left out)."""
    if not isinstance(value, Mapping):
        return None
    kinds = {k: value[k] for k in _KINDS if value.get(k) not in (None, False)}
    if len(kinds) != 1 or "choice" in kinds:  # vLLM turns a choice into a grammar of its own
        return {"unsupported": "structured_outputs " + ", ".join(kinds)} if kinds else None
    return kinds


def _strict(tool: Mapping[str, Any]) -> bool:
    function = tool.get("function")
    return isinstance(function, Mapping) and function.get("strict") is True


def _tool_tag(tools: list[Mapping[str, Any]], choice: Any, parallel: Any) -> dict[str, Any] | None:
    """The Hermes structural tag of a forced tool choice (vLLM's ``_hermes_style_structural_tag``)."""
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        tools = [t for t in tools if (t.get("function") or {}).get("name") == name]
        if not tools:  # vLLM refuses the call: nothing was sampled
            return None
    tags = []
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters")
        schema: Any = (parameters if parameters is not None else True) if _strict(tool) else True
        content = {"type": "json_schema", "json_schema": schema, "style": "json", "any_order": False,
                   "max_whitespace_cnt": None, "excludes": []}  # fmt: skip
        prefix = '{"name": "' + str(function.get("name")) + '", "arguments": '
        tags += [
            {"type": "tag", "begin": "<tool_call>\n" + prefix, "content": content, "end": "}\n</tool_call>"},
            {"type": "tag", "begin": "<tool_call>" + prefix, "content": content, "end": "}</tool_call>"},
        ]
    once = isinstance(choice, Mapping) or parallel is False
    tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags, "separator": "",
                                                "at_least_one": True, "stop_after_first": once}}  # fmt: skip
    return {"structural_tag": json.dumps(tag), "tool_parser": TOOL_PARSER}
