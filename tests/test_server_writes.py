"""`tracetrain serve`'s HTTP server writes each answer in as few socket writes as it can: every write is a system
call, on the proxy's one core, for every call."""

from __future__ import annotations

import asyncio.selector_events
import contextlib
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM, Reply
from test_slow_clients import served, settings

from proxy.gateway._relay import RelayResponse
from tracetrain_cli._http_server import TimedHttpToolsProtocol

_Transport = asyncio.selector_events._SelectorSocketTransport


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write of the proxy's HTTP server to its clients' sockets, in order."""
    written: list[bytes] = []
    lock = threading.Lock()
    write = _Transport.write

    def recorded(self: _Transport, data: bytes) -> None:
        if isinstance(self._protocol, TimedHttpToolsProtocol):
            with lock:
                written.append(bytes(data))
        write(self, data)

    monkeypatch.setattr(_Transport, "write", recorded)
    return written


def test_a_non_streamed_answer_leaves_in_one_write(fake: FakeVLLM, tmp_path: Path, writes: list[bytes]) -> None:
    with served(settings(fake, tmp_path)) as (host, port):
        body = {"model": "agent", "messages": [{"role": "user", "content": "Name a colour."}]}
        reply = httpx.post(f"http://{host}:{port}/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 200
    assert len(writes) == 1, writes  # the status line, the headers and the body together
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(reply.content)


def test_a_streams_closing_events_and_the_end_of_its_body_leave_in_one_write(
    fake: FakeVLLM, tmp_path: Path, writes: list[bytes]
) -> None:
    with served(settings(fake, tmp_path)) as (host, port):
        body = {"model": "agent", "messages": [{"role": "user", "content": "Name a colour."}], "stream": True}
        with httpx.stream("POST", f"http://{host}:{port}/v1/chat/completions", json=body, timeout=10) as reply:
            events = b"".join(reply.iter_bytes())
    assert reply.status_code == 200 and events.endswith(b"data: [DONE]\n\n")
    assert writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), writes[-3:]  # no write of its own for the end
    assert b"0\r\n\r\n" not in writes


def test_a_stream_learns_its_client_hung_up_from_the_connection(
    fake: FakeVLLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served by `tracetrain serve`'s server, a stream is told of a hang-up by the connection (``HANG_UP``), with no
    task of its own listening on ``receive()``: its record keeps what was sampled, vLLM is hung up on too, and the
    stream ends without an error."""
    listeners: list[object] = []
    create_task = asyncio.BaseEventLoop.create_task

    def counted(self: asyncio.BaseEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        if getattr(coro, "__qualname__", "").endswith("_stream_until_hang_up.<locals>.listen"):
            listeners.append(coro)
        return create_task(self, coro, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "create_task", counted)
    raised: list[BaseException] = []  # what the stream's response let out (uvicorn would log it as the app's crash)
    streaming = RelayResponse._stream_until_hang_up

    async def watched(self: RelayResponse, *args: Any) -> None:
        try:
            await streaming(self, *args)
        except BaseException as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(RelayResponse, "_stream_until_hang_up", watched)
    fake.token_delay_s = 0.1
    fake.script(Reply(content=" ".join(f"w{i}" for i in range(40))))  # 4 s of tokens
    with served(settings(fake, tmp_path)) as (host, port):
        body = {"model": "agent", "messages": [{"role": "user", "content": "Count."}], "stream": True}
        with httpx.stream("POST", f"http://{host}:{port}/v1/chat/completions", json=body, timeout=10) as reply:
            for line in reply.iter_lines():
                if "w2" in line:
                    break  # hang up
        deadline = time.monotonic() + 3  # well before the stream's 4 s end
        rows: list[Any] = []
        while time.monotonic() < deadline and not (fake.disconnected_streams and rows):
            time.sleep(0.05)
            with contextlib.closing(sqlite3.connect(tmp_path / "data" / "tracetrain.db")) as db:
                rows = db.execute("SELECT status_code, error FROM calls").fetchall()
    assert fake.disconnected_streams == 1  # the proxy hung up on vLLM as soon as its client left
    assert rows == [(499, "the client disconnected mid-stream")]
    assert listeners == [] and raised == []
