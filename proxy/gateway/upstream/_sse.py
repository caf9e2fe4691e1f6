"""Server-sent events, parsed from byte chunks as the WHATWG HTML standard says.

https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation:
lines end with CRLF, LF or CR (a CRLF split across two chunks is one line end); one
leading byte-order mark is ignored; a line starting with ``:`` is a comment; ``data:``
lines accumulate, joined with LF; a blank line dispatches the event, unless no data came;
``event:`` names the event's type, ``id:`` sets the last event id (never with a NUL),
``retry:`` the reconnection time (digits only); other fields are ignored; an event not
ended by a blank line when the stream ends is dropped. One space after the colon is
removed.

Hand-written rather than taken from httpx-sse (0.4.3): its public API reads an
``httpx.Response``, and the proxy's upstream stream is its own (``_http1``); its decoders are private
and work on decoded text, which costs a UTF-8 decode of every chunk on the hot path; and it
neither skips the byte-order mark nor drops an event that carries no data. Data stays bytes
here (the relay hands it to ``orjson``; UTF-8 never has CR or LF inside a character, so
splitting bytes is safe), and a chunk without CR takes one ``split``.
"""

from __future__ import annotations

from dataclasses import dataclass

_BOM = b"\xef\xbb\xbf"


@dataclass(slots=True)  # not frozen: a frozen dataclass is built through object.__setattr__, 3x slower per event
class ServerSentEvent:
    data: bytes
    event: str = "message"
    id: str = ""  # the last event id when it was dispatched


class SSEDecoder:
    """Feed byte chunks in arrival order; each call returns the events they completed."""

    def __init__(self) -> None:
        self._tail = b""  # an unfinished line
        self._at_start = True  # a byte-order mark may still come
        self._skip_lf = False  # the last chunk ended in CR: a LF starting the next one ends no line
        self._data: list[bytes] = []
        self._event = ""
        self.last_event_id = ""
        self.retry_ms: int | None = None

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        if not chunk:
            return []
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        buffer = self._tail + chunk if self._tail else chunk
        if self._at_start:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                self._tail = buffer  # too short to tell yet
                return []
            self._at_start = False
            buffer = buffer.removeprefix(_BOM)
        if b"\r" in buffer:
            self._skip_lf = buffer.endswith(b"\r")
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, self._tail = buffer.split(b"\n")
        events: list[ServerSentEvent] = []
        for line in lines:
            if line:
                self._field(line)
            elif self._data:
                events.append(ServerSentEvent(b"\n".join(self._data), self._event or "message", self.last_event_id))
                self._data, self._event = [], ""
            else:
                self._event = ""
        return events

    def _field(self, line: bytes) -> None:
        if line[0] == 0x3A:  # ":" a comment
            return
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
        elif name == b"id":
            if b"\0" not in value:
                self.last_event_id = value.decode("utf-8", "replace")
        elif name == b"retry" and value.isdigit():
            self.retry_ms = int(value)
