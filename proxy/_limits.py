"""How deep a request body may nest: checked when its JSON is parsed, before anything is generated.

orjson reads JSON nested up to 1024 levels but writes at most 254, and a call's record keeps the
client's body (``calls.request``), inside whatever wraps it again (an export line, a Langfuse
span). A body nested deeper than ``MAX_JSON_DEPTH`` is refused with a 400 in its API's own shape,
so no call is generated that could not be recorded. Real bodies nest a few dozen levels at most
(a tool's JSON schema inside ``tools[].function.parameters``).

The check costs nothing for most bodies: JSON cannot nest deeper than it has brackets, and
counting them runs at memory speed. Only a body with more brackets than the limit is measured,
by orjson itself: wrapped in ``254 - MAX_JSON_DEPTH`` lists, it is written only if it nests no
deeper than the limit.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import InvalidRequest

MAX_JSON_DEPTH = 128
_ORJSON_MAX_DEPTH = 254  # the most levels orjson.dumps writes
_WRAP = _ORJSON_MAX_DEPTH - MAX_JSON_DEPTH


def check_nesting(raw: bytes, body: Any) -> None:
    """Raise ``InvalidRequest`` when ``body`` (parsed from ``raw``) nests deeper than ``MAX_JSON_DEPTH`` levels."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_JSON_DEPTH:
        return
    wrapped = body
    for _ in range(_WRAP):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        raise InvalidRequest(
            f"The request body nests JSON deeper than {MAX_JSON_DEPTH} levels, the most the proxy accepts.",
            code="json_too_deep",
        ) from None
