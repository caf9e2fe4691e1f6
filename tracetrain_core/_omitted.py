"""What the policy cannot use, said in words it reads: the placeholders that stand for omitted content.

An agent's call never fails for carrying something the served model cannot take: an image for a
text-only model, a PDF, a block of a newer API, a tool only OpenAI or Anthropic hosts. Each is left out
of what vLLM renders and replaced by a short note in the text, so the model knows something was there,
and every reader (the dashboard, export, SFT, the judge) sees the same note, since each derives the
conversation with these functions from the body the record keeps:

    [image omitted: image/png, 12 kB; this model reads text only]
    [document omitted: application/pdf, 120 kB; this model reads text only]
    [tools omitted: web_search (hosted by the API's vendor); this server runs function tools only]

Pure Python (stdlib only).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

TEXT_ONLY = "this model reads text only"


def human_size(size: int) -> str:
    """``12 kB``, ``1.4 MB``: a size as people read it (decimal units)."""
    value, unit = float(size), "B"
    for bigger in ("kB", "MB", "GB"):
        if value < 1000:
            break
        value, unit = value / 1000, bigger
    return f"{value:.0f} {unit}" if unit == "B" or value >= 10 else f"{value:.1f} {unit}"


def base64_size(data: Any) -> int | None:
    """How many bytes a base64 text decodes to (without decoding it); None when it is not text."""
    if not isinstance(data, str):
        return None
    text: str = data.strip()
    return max(len(text) * 3 // 4 - text[-2:].count("="), 0)


def data_url_parts(url: Any) -> tuple[str | None, int | None]:
    """A ``data:`` URL's media type and size in bytes; (None, None) for any other URL."""
    if not isinstance(url, str) or not url.startswith("data:"):
        return None, None
    header, _, data = url[5:].partition(",")
    media_type = header.split(";", 1)[0] or None
    return media_type, base64_size(data) if header.endswith(";base64") else len(data)


def omitted(kind: str, what: str | None = None, size: int | None = None, why: str = TEXT_ONLY) -> str:
    """``[image omitted: image/png, 12 kB; this model reads text only]``."""
    details = ", ".join(d for d in (what, human_size(size) if size is not None else None) if d)
    return f"[{kind} omitted{': ' + details if details else ''}; {why}]"


def tools_note(names: Sequence[str]) -> str | None:
    """The note for tools the proxy does not serve (hosted by the API's vendor); None when there are none."""
    if not names:
        return None
    return omitted("tools", ", ".join(names), why="this server runs function tools only")


def add_note(messages: list[dict[str, Any]], note: str | None) -> None:
    """Put ``note`` at the end of the leading system message (made when there is none), in place.

    Appended to the system prompt rather than sent as a message of its own: many chat templates take
    one system message, at the start.
    """
    if note is None:
        return
    first = messages[0] if messages else None
    if first is not None and first.get("role") == "system" and isinstance(first.get("content"), str):
        first["content"] = f"{first['content']}\n\n{note}" if first["content"] else note
    else:
        messages.insert(0, {"role": "system", "content": note})


def dropped_tools(tools: Any, served_types: Collection[str | None]) -> list[str]:
    """The tools of ``tools`` whose ``type`` is not in ``served_types`` (hosted by the API's vendor), by name
    (else by type): what the proxy leaves out of what vLLM is sent."""
    names: list[str] = []
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, Mapping) and tool.get("type") not in served_types:
            label = tool.get("name") if isinstance(tool.get("name"), str) else tool.get("type")
            names.append(str(label)[:100])
    return names
