"""The hostile and broken calls, one function per class, each saying what the proxy should answer.

Refused at the front door: a body nested too deep, a body too large, a browser's cross-site request,
a foreign ``Host`` (DNS rebinding), a completions prompt list too long, malformed or guessed admin
credentials. Accepted but heavy: a call carrying 2 MB that vLLM never renders (compact capture's
memory). Broken: an engine failure inside a stream (and outside one), an upstream that drops the
connection mid-stream, a client that hangs up mid-stream; each must be recorded as failed, never
trained on. Slow: connections that send half their headers (``Slowloris``, held apart).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from .calls import APIS, Outcome, call
from .fake import DROP, ENGINE_ERROR

Hostile = Callable[[httpx.AsyncClient, str, str], Awaitable[Outcome]]
STREAMED = ("chat", "responses", "messages")


def _nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = {"k": value}
    return value


def _refused(outcome: Outcome, *statuses: int) -> Outcome:
    outcome.expected = outcome.status in statuses
    return outcome


async def _raw(client: httpx.AsyncClient, kind: str, method: str, path: str, **kwargs: Any) -> Outcome:
    outcome = Outcome(kind, "-", False, "", time.monotonic())
    try:
        response = await client.request(method, path, **kwargs)
        outcome.status, outcome.error = response.status_code, response.text[:200]
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.ended = time.monotonic()
    return outcome


async def deep_json(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """Nested 300 deep: orjson reads it, could not write its record (and failed every record of its batch)."""
    field = "metadata" if api in ("messages", "responses") else "user_data"
    return _refused(await call(client, "deep-json", api, task, stream=False, **{field: _nested(300)}), 400)


async def oversized_body(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """Says 40 MB, sends 64 KB: refused from its Content-Length (413), before the rest would be read."""
    head = b'{"model": "agent", "messages": [{"role": "user", "content": "' + b"x" * 65536
    headers = {"Content-Length": "40000000", "Content-Type": "application/json"}
    outcome = Outcome("oversized-body", "chat", False, "", time.monotonic())
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection(client.base_url.host, client.base_url.port)
            request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            request += b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n" + head
            writer.write(request)
            answer = await reader.read(4096)
            writer.close()
        outcome.status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    except (OSError, TimeoutError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.ended = time.monotonic()
    return _refused(outcome, 413)


async def cross_site(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """A web page's text/plain POST (no CORS preflight) to a key-less proxy: a chat call, or a reward."""
    headers = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"}
    if random.random() < 0.5:
        return _refused(await _raw(client, "cross-site", "POST", "/v1/rewards", headers=headers,
                                   content=b'{"trajectory_id": "x", "reward": 1}'), 403)  # fmt: skip
    content = b'{"model": "agent", "messages": [{"role": "user", "content": "%s"}]}' % task.encode()
    return _refused(await _raw(client, "cross-site", "POST", "/v1/chat/completions", headers=headers,
                               content=content), 403)  # fmt: skip


async def dns_rebinding(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """A name the attacker owns, resolved to 127.0.0.1: the browser sends it as Host."""
    return _refused(await _raw(client, "dns-rebinding", "GET", "/v1/trajectories", headers={"Host": "evil.example"}),
                    403)  # fmt: skip


async def prompt_list(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """10,000 prompts in one completions call (n is capped; the list was not)."""
    return _refused(await call(client, "prompt-list", "completions", task, stream=False, prompt=[task] * 10_000), 400)


async def admin_credentials(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """A cookie that is not ASCII (a 500 with a traceback before), or a guessed admin token (then 429s)."""
    if random.random() < 0.5:
        headers = {"Cookie": "tracetrain_admin=\u00e9t\u00e9.\u00fc.c".encode()}
        return _refused(await _raw(client, "admin-credentials", "GET", "/admin/overview", headers=headers), 401)
    guess = {"Authorization": f"Bearer guess-{random.random()}"}
    return _refused(await _raw(client, "admin-credentials", "GET", "/admin/overview", headers=guess), 401, 429)


async def memory_hog(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """A valid call carrying a 2 MB field vLLM never renders: answered and recorded; compact capture's memory of
    it is bounded in bytes."""
    message = {"role": "user", "content": task, "attachment": "z" * 2_000_000}
    outcome = await call(client, "memory-hog", "chat", task, stream=False, messages=[message])
    outcome.expected = outcome.whole
    return outcome


async def engine_error(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """vLLM's engine fails on the call: inside the stream, or as a 500."""
    stream = random.random() < 0.75
    outcome = await call(client, "engine-error", api, f"{task} {ENGINE_ERROR}", stream=stream)
    outcome.expected = not outcome.whole  # the client must see the failure
    return outcome


async def upstream_drop(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """vLLM's connection drops after the first token."""
    outcome = await call(client, "upstream-drop", api, f"{task} {DROP}", stream=True)
    outcome.expected = not outcome.whole
    return outcome


async def client_disconnect(client: httpx.AsyncClient, task: str, api: str) -> Outcome:
    """The client hangs up after the first event: the call is recorded as cut short (499)."""
    longer = {"max_output_tokens": 400} if api == "responses" else {"max_tokens": 400}
    text = f"{task} " + "and then some more words " * 40  # echoed back: a stream long enough to be cut
    outcome = await call(client, "client-disconnect", api, text, stream=True, cut_after_first_event=True, **longer)
    outcome.expected = True
    return outcome


# Each class with its weight in the hostile stream (memory hogs are sent apart, early: bench/chaos.py).
CLASSES: dict[str, tuple[Hostile, float]] = {
    "deep-json": (deep_json, 1.0),
    "oversized-body": (oversized_body, 0.5),
    "cross-site": (cross_site, 1.0),
    "dns-rebinding": (dns_rebinding, 1.0),
    "prompt-list": (prompt_list, 0.5),
    "admin-credentials": (admin_credentials, 0.5),
    "engine-error": (engine_error, 1.5),
    "upstream-drop": (upstream_drop, 1.0),
    "client-disconnect": (client_disconnect, 1.5),
}
# The classes whose calls are broken: what the store must never hold as a whole call.
BROKEN = frozenset({"engine-error", "upstream-drop", "client-disconnect"})


def pick() -> tuple[str, Hostile, str]:
    names = list(CLASSES)
    name = random.choices(names, weights=[CLASSES[n][1] for n in names])[0]
    api = random.choice(STREAMED if name in BROKEN else APIS)
    return name, CLASSES[name][0], api


class Slowloris:
    """``n`` connections that each send half a request's headers and nothing more, opened again once closed."""

    def __init__(self, host: str, port: int, n: int = 20) -> None:
        self._address = (host, port)
        self._n = n
        self.closed = 0  # connections the server closed
        self.longest_s = 0.0  # the longest any of them stayed open

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._one(stop) for _ in range(self._n)))

    async def _one(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            opened = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(*self._address)
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
                waiting = asyncio.ensure_future(reader.read())
                stopping = asyncio.ensure_future(stop.wait())
                await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if waiting.done():
                    self.closed += 1
                    self.longest_s = max(self.longest_s, time.monotonic() - opened)
                else:
                    waiting.cancel()
                    self.longest_s = max(self.longest_s, time.monotonic() - opened)
                writer.close()
            except OSError:
                await asyncio.sleep(0.5)  # the proxy is down or refusing: try again
