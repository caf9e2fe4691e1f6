"""The generation calls' HTTP/1.1 client (proxy.gateway.upstream._http1), on asyncio's loop and on uvloop's.

Against the fake vLLM (uvicorn, like vLLM) for what vLLM sends, and against raw loopback servers
for what a well-behaved server may do and a broken one might: close a kept connection, say
``Connection: close``, end a body with the connection, stall, or answer something that is not HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
import uvloop

from proxy.gateway.upstream._http1 import ConnectFailed, Http1Pool, TransportError
from tests.fake_vllm import FakeVLLM, Reply

BODY = orjson.dumps({"model": "fake/base-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
Run = Callable[[Awaitable[Any]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a coroutine to its end on a new event loop of the parameter's kind."""
    if request.param == "uvloop":  # `tracetrain serve` runs on uvloop, whose transports are no asyncio.Transport
        return uvloop.run  # type: ignore[no-any-return]
    return asyncio.run


async def _whole(pool: Http1Pool, path: str = "/chat/completions", body: bytes = BODY) -> tuple[int, bytes]:
    response = await pool.post(path, body)
    try:
        return response.status, await response.read()
    finally:
        response.release()


def test_answers_from_vllm_are_read_whole_and_the_connection_kept(run: Run, fake: FakeVLLM) -> None:
    fake.script(Reply(content="one two three"), Reply(content="four five"), Reply(content="six"))

    async def main() -> None:
        pool = Http1Pool(f"{fake.url}/v1", timeout_s=10)  # type: ignore[attr-defined]
        try:
            status, content = await _whole(pool)  # Content-Length
            assert status == 200 and orjson.loads(content)["choices"][0]["message"]["content"] == "one two three"
            stream = orjson.loads(BODY) | {"stream": True}
            response = await pool.post("/chat/completions", orjson.dumps(stream))  # chunked
            chunks = []
            while chunk := await response.next_chunk():
                chunks.append(chunk)
            response.release()
            events = b"".join(chunks).split(b"\n\n")
            assert response.status == 200 and events[-2] == b"data: [DONE]" and b"four" in b"".join(chunks)
            status, content = await _whole(pool, "/nothing-here")
            assert status == 404 and content  # an error status is read whole too
            status, _ = await _whole(pool)
            assert status == 200
            assert len(pool._open) == 1 and len(pool._idle) == 1  # four exchanges, one connection
        finally:
            pool.close()

    run(main())


def test_a_stream_released_early_closes_its_connection_so_vllm_stops(run: Run, fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.05
    fake.script(Reply(content=" ".join(f"w{i}" for i in range(40))))

    async def main() -> None:
        pool = Http1Pool(f"{fake.url}/v1", timeout_s=10)  # type: ignore[attr-defined]
        response = await pool.post("/chat/completions", orjson.dumps(orjson.loads(BODY) | {"stream": True}))
        received = b""
        while b"w2" not in received:
            chunk = await response.next_chunk()
            assert chunk, "the stream ended before w2"
            received += chunk
        response.release()
        assert not pool._open and not pool._idle
        for _ in range(100):
            if fake.disconnected_streams:
                break
            await asyncio.sleep(0.05)
        pool.close()

    run(main())
    assert fake.disconnected_streams == 1


class _Server:
    """A loopback server that answers each request on a connection with the next of ``answers``.

    An answer is raw bytes; ``None`` closes the connection instead of answering; a connection
    with no answers left is closed once its next request arrived.
    """

    def __init__(self, *answers: bytes | None, after_answer: str = "keep") -> None:
        self.answers = list(answers)
        self.after_answer = after_answer  # "keep", or "close" the connection after each answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0) if self.answers else None
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if self.after_answer == "close":
                    break
        except asyncio.IncompleteReadError:
            self.closed_by_client += 1
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()


def _ok(body: bytes = b'{"ok":true}', *headers: bytes) -> bytes:
    extra = b"".join(header + b"\r\n" for header in headers)
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def test_the_request_names_the_prefix_host_and_length(run: Run) -> None:
    server = _Server(_ok())

    async def main() -> None:
        async with server as url:
            pool = Http1Pool(url, timeout_s=5)
            assert await _whole(pool, "/completions", b'{"a":1}') == (200, b'{"ok":true}')
            pool.close()

    run(main())
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/completions HTTP/1.1" and body == b'{"a":1}'
    assert {b"content-type: application/json", b"content-length: 7"} <= {line.lower() for line in lines}
    assert any(line.startswith(b"Host: 127.0.0.1:") for line in lines)


def test_a_kept_connection_closed_by_the_server_is_replaced(run: Run) -> None:
    """uvicorn closes idle kept connections (vLLM: after 5 s); the next call must not fail for it."""
    server = _Server(_ok(), _ok(b'{"second":1}'), after_answer="close")

    async def main() -> None:
        async with server as url:
            pool = Http1Pool(url, timeout_s=5)
            assert (await _whole(pool))[0] == 200
            await asyncio.sleep(0.05)  # the close arrives while the connection is idle
            assert await _whole(pool) == (200, b'{"second":1}')
            pool.close()

    run(main())
    assert server.connections == 2


def test_a_request_racing_the_servers_close_is_sent_again_on_a_new_connection(run: Run) -> None:
    # The server reads the second request and closes without a byte of answer: what a server
    # closing an idle connection the moment the request arrives looks like to the client.
    server = _Server(_ok(), None, _ok(b'{"again":1}'))

    async def main() -> None:
        async with server as url:
            pool = Http1Pool(url, timeout_s=5)
            assert (await _whole(pool))[0] == 200
            assert await _whole(pool) == (200, b'{"again":1}')
            pool.close()

    run(main())
    assert server.connections == 2 and len(server.requests) == 3


def test_a_new_connection_closed_before_answering_is_an_error(run: Run) -> None:
    server = _Server(None)

    async def main() -> None:
        async with server as url:
            pool = Http1Pool(url, timeout_s=5)
            with pytest.raises(TransportError, match="closed the connection before answering"):
                await _whole(pool)
            pool.close()

    run(main())


def test_connection_close_and_a_body_ended_by_the_connection(run: Run) -> None:
    closing = _ok(b'{"a":1}', b"Connection: close")
    until_eof = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b'{"b":2}'
    server = _Server(closing, until_eof, after_answer="close")

    async def main() -> None:
        async with server as url:
            pool = Http1Pool(url, timeout_s=5)
            assert await _whole(pool) == (200, b'{"a":1}')
            assert not pool._idle  # "Connection: close": never kept
            assert await _whole(pool) == (200, b'{"b":2}')
            pool.close()

    run(main())
    assert server.connections == 2


def test_a_server_that_stalls_times_out_and_its_connection_is_dropped(run: Run) -> None:
    stalled = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10

    async def main() -> None:
        async with _Server(stalled) as url:
            pool = Http1Pool(url, timeout_s=0.2)
            response = await pool.post("/chat/completions", BODY)
            with pytest.raises(TimeoutError):
                await response.read()
            response.release()
            assert not pool._open
        async with _Server(b"") as url:  # reads the request, never answers
            pool = Http1Pool(url, timeout_s=0.2)
            with pytest.raises(TimeoutError):
                await pool.post("/chat/completions", BODY)
            pool.close()

    run(main())


def test_an_answer_that_is_not_http_and_a_refused_connection(run: Run) -> None:
    async def main() -> None:
        async with _Server(b"SSH-2.0-OpenSSH_9.6\r\n\r\n") as url:
            pool = Http1Pool(url, timeout_s=5)
            with pytest.raises(TransportError, match="not valid HTTP"):
                await _whole(pool)
            assert not pool._open
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
            await _whole(Http1Pool(f"http://127.0.0.1:{port}/v1", timeout_s=5))

    run(main())


def test_a_large_body_is_read_whole_through_the_read_pause(run: Run) -> None:
    big = orjson.dumps({"text": "x" * 3_000_000})  # past the high-water mark: reading pauses and resumes
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"".join(
            b"%x\r\n%s\r\n" % (len(part), part) for part in (big[i : i + 65536] for i in range(0, len(big), 65536))
        )
        + b"0\r\n\r\n"
    )

    async def main() -> None:
        async with _Server(_ok(big), chunked) as url:
            pool = Http1Pool(url, timeout_s=5)
            response = await pool.post("/chat/completions", BODY)
            await asyncio.sleep(0.2)  # the whole answer arrives before it is read
            assert await response.read() == big
            response.release()
            assert await _whole(pool) == (200, big)
            assert len(pool._open) == 1
            pool.close()

    run(main())


def test_basic_auth_in_the_url_and_a_bad_url() -> None:
    pool = Http1Pool("http://user:p%40ss@vllm.internal:8000/v1", timeout_s=5)
    assert b"Host: vllm.internal:8000\r\n" in pool._head
    assert b"Authorization: Basic dXNlcjpwQHNz\r\n" in pool._head  # user:p@ss
    with pytest.raises(ValueError, match="http"):
        Http1Pool("ftp://vllm.internal/v1", timeout_s=5)
