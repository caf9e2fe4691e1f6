"""Raw HTTP at concurrency 1: the answer check, and the time to a streamed response's first byte."""

from __future__ import annotations

import json
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

from .servers import HOST, Server

PROMPT = "Write one short sentence about proxies, trajectories and rewards for this benchmark."
TTFB_WARMUP = 20  # probes sent, and not timed, before the measured ones


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    first_byte_ms: float  # from sending the request to receiving the body's first byte
    body: bytes


class Connection:
    """One keep-alive HTTP/1.1 connection that notes when a response's first body byte arrived."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection((HOST, port), timeout=30)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = b""
        self._received_ns = 0  # when the unread bytes arrived: all came with the last recv

    def close(self) -> None:
        self._sock.close()

    def _recv(self) -> None:
        data = self._sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self._buffer += data
        self._received_ns = time.perf_counter_ns()

    def _until(self, marker: bytes) -> bytes:
        while (end := self._buffer.find(marker)) < 0:
            self._recv()
        found, self._buffer = self._buffer[:end], self._buffer[end + len(marker) :]
        return found

    def _take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._recv()
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def _next_byte_arrival_ns(self) -> int:
        if not self._buffer:
            self._recv()
        return self._received_ns

    def exchange(self, request: bytes) -> Reply:
        """Send one request and read its whole response (chunked or sized)."""
        start_ns = time.perf_counter_ns()
        self._sock.sendall(request)
        head = self._until(b"\r\n\r\n").split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in head[1:])}
        first_ns, parts = 0, []
        if headers.get(b"transfer-encoding") == b"chunked":
            while (size := int(self._until(b"\r\n").split(b";")[0], 16)) > 0:
                first_ns = first_ns or self._next_byte_arrival_ns()
                parts.append(self._take(size + 2)[:-2])
            self._until(b"\r\n")
        else:
            length = int(headers.get(b"content-length", b"0"))
            first_ns = self._next_byte_arrival_ns() if length else time.perf_counter_ns()
            parts.append(self._take(length))
        return Reply(int(head[0].split(b" ", 2)[1]), (first_ns - start_ns) / 1e6, b"".join(parts))


# Per API the server speaks: its path, its body's maximum-tokens field, and what ends a stream / fills a reply
# (16 tokens cut the fake's echo: a Responses stream then ends "incomplete").
_API = {
    "chat": ("/v1/chat/completions", "max_tokens", b"data: [DONE]", b'"choices"'),
    "responses": ("/v1/responses", "max_output_tokens", b"event: response.incomplete", b'"output"'),
    "messages": ("/v1/messages", "max_tokens", b"event: message_stop", b'"content"'),
}


def chat_request(server: Server, trajectory_id: str, stream: bool) -> bytes:
    """The call ``chat.lua`` sends (a chat completion, or the same question in ``server.api``), as raw HTTP/1.1."""
    path, max_tokens = _API[server.api][:2]
    question: dict[str, Any] = {"input": PROMPT} if server.api == "responses" else {
        "messages": [{"role": "user", "content": PROMPT}]
    }  # fmt: skip
    body: dict[str, Any] = {"model": server.model, **question, max_tokens: 16}
    if stream:
        body["stream"] = True
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{server.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nX-Trajectory-Id: {trajectory_id}\r\n\r\n"
    )
    return head.encode() + data


def check_answers(server: Server, tag: str) -> int:
    """A plain and a streamed call must answer 200 with the fake's echo; returns the calls made."""
    conn = Connection(server.port)
    try:
        for i, stream in enumerate((False, True)):
            reply = conn.exchange(chat_request(server, f"{tag}-{i}", stream))
            ends_stream, fills_reply = _API[server.api][2:]
            complete = ends_stream in reply.body if stream else fills_reply in reply.body
            if reply.status != 200 or b"echo" not in reply.body or not complete:
                raise SystemExit(f"{server.name} answered {reply.status}: {reply.body[:500]!r}")
    finally:
        conn.close()
    return 2


@dataclass(frozen=True, slots=True)
class Ttfb:
    n: int
    p50_ms: float
    p99_ms: float


def measure_ttfb(server: Server, requests: int, tag: str) -> Ttfb:
    """Streamed requests one after the other on one keep-alive connection: ms to the first body byte."""
    conn = Connection(server.port)
    times = []
    try:
        for i in range(TTFB_WARMUP + requests):
            reply = conn.exchange(chat_request(server, f"{tag}-{i}", stream=True))
            if reply.status != 200:
                raise RuntimeError(f"TTFB probe to {server.name} answered {reply.status}: {reply.body[:300]!r}")
            if i >= TTFB_WARMUP:
                times.append(reply.first_byte_ms)
    finally:
        conn.close()
    cuts = statistics.quantiles(times, n=100, method="inclusive")
    return Ttfb(len(times), cuts[49], cuts[98])
