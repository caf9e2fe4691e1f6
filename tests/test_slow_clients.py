"""`tracetrain serve`'s HTTP server against slow and greedy clients: half-sent headers and bodies are cut off, huge
headers refused, connections bounded, and ordinary calls answered meanwhile."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fake_vllm import FakeVLLM, Reply

from proxy import Settings, create_app
from tracetrain_cli._http_server import server_config


@contextmanager
def served(settings: Settings, loop: str = "asyncio") -> Iterator[tuple[str, int]]:
    """The proxy as `tracetrain serve` serves it (its uvicorn configuration; `serve` runs uvloop), on an ephemeral
    port."""
    server = uvicorn.Server(server_config(create_app(settings), settings, log_level="warning", loop=loop))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30  # a loaded machine starts it slowly; a broken one fails at once
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.01)
    try:
        yield "127.0.0.1", server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def settings(fake: FakeVLLM, tmp_path: Path, **overrides: Any) -> Settings:
    return Settings(upstream=f"{fake.url}/v1", data_dir=tmp_path / "data", port=0, **overrides)  # type: ignore[attr-defined]


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within ``within_s``."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


def chat(address: tuple[str, int]) -> httpx.Response:
    body = {"model": "agent", "messages": [{"role": "user", "content": "Name a colour."}]}
    return httpx.post(f"http://{address[0]}:{address[1]}/v1/chat/completions", json=body, timeout=10)


def test_connections_that_send_half_their_headers_are_closed_and_others_are_served(
    fake: FakeVLLM, tmp_path: Path
) -> None:
    """Slowloris: twenty connections that never finish their headers would otherwise stay open for good."""
    with served(settings(fake, tmp_path, header_timeout_s=1.0)) as address:
        slow = []
        for _ in range(20):
            sock = socket.create_connection(address)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: app")
            slow.append(sock)
        idle = socket.create_connection(address)  # connects and sends nothing at all
        assert chat(address).status_code == 200  # served while they wait
        started = time.monotonic()
        assert all(closed_by_server(sock, within_s=3.0) for sock in [*slow, idle])
        assert time.monotonic() - started < 3.0
        for sock in [*slow, idle]:
            sock.close()
        assert chat(address).status_code == 200


def test_a_kept_alive_connection_gets_the_same_deadline_for_its_next_request(fake: FakeVLLM, tmp_path: Path) -> None:
    with served(settings(fake, tmp_path, header_timeout_s=1.0)) as address, socket.create_connection(address) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.")  # the next request, half sent
        assert closed_by_server(sock, within_s=3.0)


def test_a_body_that_does_not_arrive_in_time_is_cut_off(fake: FakeVLLM, tmp_path: Path) -> None:
    with served(settings(fake, tmp_path, body_timeout_s=1.0)) as address, socket.create_connection(address) as sock:
        sock.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 200\r\n\r\n{"mod')
        assert closed_by_server(sock, within_s=3.0)
        assert fake.requests == []
        assert chat(address).status_code == 200  # the proxy is fine


def test_a_slow_but_steady_call_within_the_deadlines_is_served(fake: FakeVLLM, tmp_path: Path) -> None:
    body = b'{"model": "agent", "messages": [{"role": "user", "content": "Hi"}]}'
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(body)
    limits = settings(fake, tmp_path, header_timeout_s=2.0, body_timeout_s=2.0)
    with served(limits) as address, socket.create_connection(address) as sock:
        for part in (head[:20], head[20:], body[:10], body[10:]):
            sock.sendall(part)
            time.sleep(0.3)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_headers_past_64_kib_are_refused_and_the_client_reads_the_answer(
    fake: FakeVLLM, tmp_path: Path, loop: str
) -> None:
    # A client that goes on sending its headers (a MB of them) after the server answered: the server reads and
    # drops the rest before it closes, so the client's sends succeed and it reads the 431, then the end.
    with served(settings(fake, tmp_path), loop) as address, socket.create_connection(address) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for i in range(1000):
            sock.sendall(b"X-Filler-%d: %s\r\n" % (i, b"x" * 1000))
        sock.settimeout(5)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 431") and answer.endswith(b"The request's headers are too large.")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_body_past_the_cap_is_refused_and_the_client_reads_the_answer(
    fake: FakeVLLM, tmp_path: Path, loop: str
) -> None:
    # The app answers 413 from the Content-Length before reading the body; a client that sends the whole body
    # anyway (as most do before they read) must still read the answer, not a reset, on a fresh connection
    # and on a kept-alive one.
    body = b"x" * 48_000_000  # past the kernel's buffers on loopback (32 + 4 MB): sent whole if the server reads it
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(body)
    with served(settings(fake, tmp_path, max_body_mb=1.0), loop) as address:
        for kept_alive in (False, True):
            with socket.create_connection(address) as sock:
                if kept_alive:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    healthz = b""
                    while not healthz.endswith(b"}"):  # its JSON, whole
                        healthz += sock.recv(4096)
                    assert healthz.startswith(b"HTTP/1.1 200")
                sock.sendall(head)
                for at in range(0, len(body), 65536):
                    sock.sendall(body[at : at + 65536])
                sock.settimeout(5)
                answer = b""
                while chunk := sock.recv(4096):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer[:200]
        assert fake.requests == [] and chat(address).status_code == 200
        # httpx, as an agent's SDK sends it: the whole body first, then the answer.
        large = httpx.post(f"http://{address[0]}:{address[1]}/v1/chat/completions", content=body, timeout=10)
        assert large.status_code == 413 and large.json()["error"]["code"] == "request_too_large"


_NODE_POSTS = """
const body = JSON.stringify({model: "agent", messages: [{role: "user", content: "x".repeat(40_000_000)}]});
(async () => {
  const seen = [];
  for (let i = 0; i < 5; i++) {
    try { const r = await fetch(process.argv[1], {method: "POST", body}); seen.push(String(r.status)); await r.text(); }
    catch (e) { seen.push(e.cause ? String(e.cause.code || e.cause.message) : e.message); }
  }
  console.log(JSON.stringify(seen));
})();
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js (.ci/run installs it with npm)")
def test_nodes_fetch_reads_the_413_for_a_body_past_the_cap(fake: FakeVLLM, tmp_path: Path) -> None:
    # Node's fetch (undici: the TypeScript SDKs' and Claude Code's HTTP client) fails the request when its write
    # is reset, where httpx goes on to read the answer: on `serve`'s loop it saw ECONNRESET in 9 posts of 10
    # before the lingering close.
    with served(settings(fake, tmp_path, max_body_mb=1.0), "uvloop") as (host, port):
        node = subprocess.run(["node", "-e", _NODE_POSTS, f"http://{host}:{port}/v1/chat/completions"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert json.loads(node.stdout) == ["413"] * 5, node.stdout + node.stderr


def test_past_the_connection_limit_a_request_is_answered_503(fake: FakeVLLM, tmp_path: Path) -> None:
    fake.script(*[Reply("slow", delay_s=3.0)] * 2)
    with served(settings(fake, tmp_path, max_connections=2)) as address:
        answers: list[int] = []
        threads = [threading.Thread(target=lambda: answers.append(chat(address).status_code)) for _ in range(2)]
        for thread in threads:
            thread.start()
        # Both calls reached vLLM, so both connections are open (they hold them for 3 s): not a guess by sleeping.
        deadline = time.monotonic() + 30
        while len(fake.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert chat(address).status_code == 503
        for thread in threads:
            thread.join()
        assert answers == [200, 200]
