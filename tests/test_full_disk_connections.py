"""A full disk never costs a call its connection: every request is answered in its API's shape, the connection is
kept for the next call, and the log tells the full disk once.

What ``bench/chaos.py`` found: a reward posted as the disk filled was recorded, then the training job it made due
could not be (the database's own "database or disk is full", from a query no store method translated); the proxy
answered 500, logged two tracebacks, and closed the connection the client had been told to keep. The client's
next call, sent down it at once, met a reset (``ReadError``, no status): an ordinary call lost for another's error.
Here the same failure is made on purpose (the job's statement raises what SQLite raises on a full disk), and the
two requests go down one raw keep-alive connection, as the client's pool sends them.
"""

from __future__ import annotations

import logging
import socket
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from conftest import RunningProxy
from sqlalchemy.exc import OperationalError

from store import FULL_DISK

TASK = [{"role": "user", "content": "Name a colour."}]


def disk_full(*_args: Any, **_kwargs: Any) -> Any:
    raise OperationalError("UPDATE groups", {}, sqlite3.OperationalError("database or disk is full"))


@pytest.fixture(autouse=True)
def no_episode_under_way() -> Iterator[None]:
    """The process's account of the disk (``store.FULL_DISK``) starts each test with no full disk under way."""
    FULL_DISK.succeeded()
    yield
    FULL_DISK.succeeded()


class Connection:
    """One kept-alive HTTP/1.1 connection to the proxy: requests sent down it one after the other."""

    def __init__(self, proxy: RunningProxy) -> None:
        host, port = proxy.url.removeprefix("http://").split(":")
        self._sock = socket.create_connection((host, int(port)), timeout=30)
        self._buffer = b""

    def close(self) -> None:
        self._sock.close()

    def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        """(status, headers, parsed body); raises ``ConnectionError`` when the server closed or reset the connection."""
        content = orjson.dumps(body)
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._sock.sendall(head.encode() + f"Content-Length: {len(content)}\r\n\r\n".encode() + content)
        while b"\r\n\r\n" not in self._buffer:
            self._read()
        raw_head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = raw_head.decode().split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        length = int(fields["content-length"])
        while len(self._buffer) < length:
            self._read()
        answer, self._buffer = self._buffer[:length], self._buffer[length:]
        return int(status_line.split()[1]), fields, orjson.loads(answer)

    def _read(self) -> None:
        data = self._sock.recv(65536)  # a reset raises ConnectionResetError
        if not data:
            raise ConnectionError("the server closed the connection")
        self._buffer += data


@pytest.fixture
def connection(proxy_one_step: RunningProxy) -> Iterator[Connection]:
    opened = Connection(proxy_one_step)
    yield opened
    opened.close()


@pytest.fixture
def proxy_one_step(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    """A proxy whose policy trains on each rewarded group: one reward makes a job due."""
    return start_proxy(batch_groups=1, min_group_size=1)


def disk_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "disk is full" in r.getMessage()]


def test_a_reward_whose_job_the_full_disk_refuses_is_answered_and_the_next_call_down_its_connection_too(
    proxy_one_step: RunningProxy, connection: Connection, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO)
    status, _, _ = connection.post("/v1/chat/completions", {"model": "agent", "messages": TASK},
                                   {"X-Trajectory-Id": "t-1", "X-Group-Id": "g-1"})  # fmt: skip
    assert status == 200
    monkeypatch.setattr("store._jobs.move", disk_full)  # the job's statement finds the disk full

    status, _, answer = connection.post("/v1/rewards", {"trajectory_id": "t-1", "reward": 1.0})
    assert status == 200, answer  # the reward is recorded: its job is made by the next reward once space is freed
    assert answer["data"][0]["reward"] == 1.0

    status, _, answer = connection.post("/v1/chat/completions", {"model": "agent", "messages": TASK})
    assert status == 200 and answer["choices"][0]["message"]["content"]
    assert proxy_one_step.rows("SELECT reward FROM trajectories WHERE id = 't-1'")[0]["reward"] == 1.0
    assert proxy_one_step.rows("SELECT count(*) AS n FROM training_jobs")[0]["n"] == 0

    monkeypatch.undo()  # space freed: the next reward of the policy makes the job of every ready group
    connection.post("/v1/chat/completions", {"model": "agent", "messages": TASK}, {"X-Group-Id": "g-2"})
    status, _, _ = connection.post("/v1/rewards", {"trajectory_id": "t-2", "reward": 0.0})
    assert len(disk_warnings(caplog)) == 1
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_a_query_that_finds_the_disk_full_is_a_503_in_the_api_shape_on_a_kept_connection(
    proxy_one_step: RunningProxy, connection: Connection, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Any route: the database's own error, untranslated by the store, is the store's 503, never a crash."""
    monkeypatch.setattr("store._store.Store.group_policy", disk_full)
    body = {"model": "agent", "max_tokens": 16, "messages": TASK}
    status, _, answer = connection.post("/v1/messages", body, {"X-Group-Id": "g-new"})
    assert status == 503 and answer["type"] == "error" and "disk is full" in answer["error"]["message"]
    status, _, answer = connection.post("/v1/chat/completions", {"model": "agent", "messages": TASK})
    assert status == 200
    assert len(disk_warnings(caplog)) == 1 and not [r for r in caplog.records if r.exc_info]


def test_an_unexpected_error_tells_the_client_the_connection_ends(
    proxy_one_step: RunningProxy, connection: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server ends the connection after an error it did not expect: the 500 says so, so that the client's
    pool opens another for its next call instead of sending it down a closed one."""

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr("store._store.Store.group_policy", broken)
    status, headers, answer = connection.post("/v1/chat/completions", {"model": "agent", "messages": TASK},
                                              {"X-Group-Id": "g-new"})  # fmt: skip
    assert status == 500 and answer["error"]["type"] == "server_error"
    assert headers["connection"] == "close"
