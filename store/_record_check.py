"""A call's record checked and encoded before it joins a group commit: one bad record fails alone.

The group-commit writer (``store._writer``) writes every call that finished while its last commit
ran in one transaction. A record that cannot be written (JSON that orjson reads but cannot write:
it writes at most 254 levels of nesting, and reads 1024) would fail the whole transaction, so every
call beside it. So the record is encoded here, on the caller's side, before it is queued:
its JSON columns become ``Encoded`` text, which ``store._engine.dumps`` writes as it is (nothing is
encoded twice), and a record that cannot be encoded raises ``RecordRefused`` for its call alone.

Text columns are made storable too: the error a call ended with is redacted (``store._redact``: an
upstream's URL may carry a password) and NUL characters, which PostgreSQL's text refuses, become
U+FFFD.
"""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import JSON

from store._errors import RecordRefused
from store._redact import redact
from store._tables import calls as C

CALL_JSON_COLUMNS = tuple(c.name for c in C.columns if isinstance(c.type, JSON))


class Encoded(str):
    """A JSON column's value already encoded (and so known to be writable): ``dumps`` passes it through."""

    __slots__ = ()


def checked_call(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` (a calls row) with its JSON columns encoded and its text made storable; ``RecordRefused`` if it
    cannot be written. ``row`` itself is left as it is."""
    checked = dict(row)
    for name in CALL_JSON_COLUMNS:
        value = checked.get(name)
        if value is None or type(value) is Encoded:
            continue  # None stays None: written as JSON null, as before
        try:
            checked[name] = Encoded(orjson.dumps(value).decode())
        except orjson.JSONEncodeError as exc:
            raise RecordRefused(f"the call's {name} cannot be stored ({exc})") from exc
    error = checked.get("error")
    if error is not None:
        checked["error"] = redact(str(error))
    for name, value in checked.items():
        if type(value) is str and "\x00" in value:
            checked[name] = value.replace("\x00", "\ufffd")
    return checked
