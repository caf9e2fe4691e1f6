"""The upstream OpenAI-compatible server (vLLM): generation over a lean HTTP/1.1 pool, the rest over httpx.

The two calls on every agent's path (``post`` and ``open_stream``) go through
``proxy.gateway.upstream._http1``'s kept connections: measured (docs/BENCHMARKS.md, issue 14), httpx +
httpcore + anyio cost the proxy 55-65% of its time under load, and aiohttp after them ~29%
and 470-670 µs per exchange where a kept connection takes 290-440. The control endpoints
(adapters, models, health, pause and sleep) are rare and stay on httpx, whose
``MockTransport`` tests may pass to ``create_app``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import httpx
import orjson

from proxy.errors import UpstreamError, UpstreamHTTPError, UpstreamNotReady
from proxy.gateway.upstream._errors import upstream_errors, upstream_http_error
from proxy.gateway.upstream._http1 import Exchange, Http1Pool, TransportError
from store import redact, without_userinfo

_JSON = {"content-type": "application/json"}
# How long a stream's end (the chunked body's last chunk) may take after its last event.
_FINISH_S = 1.0
# vLLM's PauseMode: "wait" lets what runs finish; "abort" (its default) ends it; "keep" freezes it.
PauseMode = Literal["abort", "wait", "keep"]


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole upstream answer."""

    status_code: int
    content: bytes


class UpstreamStream:
    """An upstream response whose body is still arriving; ``close`` it however it ends."""

    def __init__(self, response: Exchange) -> None:
        self._response = response

    async def next_chunk(self) -> bytes:
        """The body's next bytes as they arrive (b"" at its end); a broken connection raises ``UpstreamError``."""
        try:
            return await self._response.next_chunk()
        except (TransportError, TimeoutError) as exc:
            raise UpstreamError(f"the upstream stream broke: {exc!r}") from exc

    async def finish(self) -> None:
        """After the last event: read the body's end, so its connection is kept for the next call."""
        await self._response.finish(_FINISH_S)

    def close(self) -> None:
        """Give the connection back; with unread bytes left (the client hung up) it closes, so vLLM stops generating."""
        self._response.release()


class Upstream:
    """One server: ``generation`` carries the calls on the agents' path, ``clients`` the rest.

    ``timeout_s`` bounds each wait for the server's bytes (not a whole stream: a long generation
    that keeps sending is never cut off).
    """

    def __init__(self, base_url: str, clients: Sequence[httpx.AsyncClient], *, timeout_s: float) -> None:
        self.base_url = base_url  # as configured: the generation pool sends its user-info as a header itself
        self.name = redact(base_url)  # what logs, labels and messages show: the URL without its password
        # The control calls go through httpx, which logs and quotes the URLs it requests: theirs carry no
        # user-info, its password goes as a basic auth header.
        url = urlsplit(base_url)
        self._url = without_userinfo(base_url)
        self._auth = (
            httpx.BasicAuth(unquote(url.username), unquote(url.password or "")) if url.username else httpx.Auth()
        )
        self._clients = list(clients)
        self._next = itertools.cycle(self._clients)
        self._generation = Http1Pool(base_url, timeout_s=timeout_s)

    def close(self) -> None:
        """Close the generation calls' connections."""
        self._generation.close()

    @property
    def _client(self) -> httpx.AsyncClient:
        return next(self._next)

    async def post(self, path: str, body: bytes) -> Reply:
        """POST and read the whole answer (any status)."""
        async with upstream_errors(self.base_url):
            response = await self._generation.post(path, body)
            try:
                return Reply(response.status, await response.read())
            finally:
                response.release()

    async def open_stream(self, path: str, body: bytes) -> UpstreamStream:
        """POST and return once the status line and headers arrived; the caller closes it.

        An error status is read whole and raised (``proxy.errors.upstream_http_error``).
        """
        async with upstream_errors(self.base_url):
            response = await self._generation.post(path, body)
            if response.status != 200:
                try:
                    content = await response.read()
                finally:
                    response.release()
                raise upstream_http_error(response.status, content)
        return UpstreamStream(response)

    async def load_lora(self, name: str, path: str) -> None:
        """vLLM's runtime LoRA loading (needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."""
        await self._lora("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def resolve_lora(self, name: str) -> None:
        """Make vLLM load ``name`` through its LoRA resolvers (tracetrain_vllm's fetches it from the proxy).

        vLLM 0.32's ``/v1/load_lora_adapter`` takes a path and never asks a resolver; a request
        for a model it does not hold does, and loads what the resolver returns before it
        answers. ``POST /tokenize`` is the cheapest such request: no sampling, no KV cache.
        It answers 200 once the adapter is loaded, 404 when no resolver knows the name,
        400 when one found it but the engine could not load it.
        """
        body = orjson.dumps({"model": name, "prompt": "resolve", "add_special_tokens": False})
        async with upstream_errors(self.base_url):
            response = await self._client.post(
                self.root_url + "/tokenize", content=body, headers=_JSON, auth=self._auth
            )
        if response.status_code != 200:
            raise UpstreamHTTPError(response.status_code, response.content)

    async def count_prompt_tokens(self, chat: dict[str, Any]) -> int:
        """vLLM's ``POST /tokenize`` of a chat request's ``messages`` (and ``tools``), rendered for generation."""
        body = orjson.dumps({**chat, "add_generation_prompt": True})
        async with upstream_errors(self.base_url):
            response = await self._client.post(
                self.root_url + "/tokenize", content=body, headers=_JSON, auth=self._auth
            )
        if response.status_code != 200:
            raise UpstreamHTTPError(response.status_code, response.content)
        return int(response.json()["count"])

    async def unload_lora(self, name: str) -> None:
        await self._lora("/unload_lora_adapter", {"lora_name": name})

    async def _lora(self, path: str, body: dict[str, str]) -> None:
        async with upstream_errors(self.base_url):
            response = await self._client.post(
                self._url + path, content=orjson.dumps(body), headers=_JSON, auth=self._auth
            )
        if response.status_code != 200:
            raise UpstreamHTTPError(response.status_code, response.content)

    async def models(self) -> list[dict[str, Any]]:
        """The upstream's ``/v1/models`` entries (the base model and loaded adapters)."""
        async with upstream_errors(self.base_url):
            response = await self._client.get(self._url + "/models", timeout=5.0, auth=self._auth)
        if response.status_code != 200:
            raise UpstreamHTTPError(response.status_code, response.content)
        return list(orjson.loads(response.content).get("data") or [])

    @property
    def root_url(self) -> str:
        """The server's root, where vLLM serves /health and /detokenize (base_url without /v1 and user-info)."""
        return self._url.removesuffix("/v1")

    async def health(self) -> float:
        """Milliseconds vLLM took to answer ``/health``; raises when it does not answer 200."""
        started = time.perf_counter()
        async with upstream_errors(self.base_url):
            response = await self._client.get(self.root_url + "/health", timeout=3.0, auth=self._auth)
        if response.status_code != 200:
            raise UpstreamHTTPError(response.status_code, response.content)
        return (time.perf_counter() - started) * 1000

    async def prometheus(self) -> bytes:
        """vLLM's ``GET /metrics`` (Prometheus text), at the server's root."""
        async with upstream_errors(self.base_url):
            response = await self._client.get(self.root_url + "/metrics", timeout=5.0, auth=self._auth)
        if response.status_code != 200:
            raise UpstreamHTTPError(response.status_code, response.content)
        return response.content

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        """vLLM's ``POST /detokenize``: the text of ``token_ids`` under ``model``'s tokenizer."""
        body = orjson.dumps({"model": model, "tokens": token_ids})
        async with upstream_errors(self.base_url):
            response = await self._client.post(
                self.root_url + "/detokenize", content=body, headers=_JSON, timeout=5.0, auth=self._auth
            )
        if response.status_code != 200:
            raise UpstreamHTTPError(response.status_code, response.content)
        return str(orjson.loads(response.content)["prompt"])

    async def base_model(self) -> str:
        """The base model the upstream serves: the first model of /v1/models that is no adapter."""
        for model in await self.models():
            if not model.get("parent"):
                return str(model["id"])
        raise UpstreamNotReady(f"the upstream at {self.name} lists no base model")

    # -- a GPU hand-over (vLLM started with VLLM_SERVER_DEV_MODE=1; see proxy.training._handover) --

    async def pause(self, mode: PauseMode = "wait") -> None:
        """``POST /pause``: vLLM schedules nothing new; with "wait" it answers once what runs has finished."""
        await self._control("POST", "/pause", {"mode": mode})

    async def sleep(self, level: int = 1, mode: PauseMode = "wait") -> None:
        """``POST /sleep``: level 1 moves the weights to host memory and drops the KV cache (a no-op on a CPU)."""
        await self._control("POST", "/sleep", {"level": level, "mode": mode})

    async def wake_up(self) -> bool:
        """``POST /wake_up``: True when vLLM says it is fully awake (it then schedules again, too)."""
        return (await self._control("POST", "/wake_up")).get("status") == "awake"

    async def resume(self) -> None:
        """``POST /resume``: schedule requests again."""
        await self._control("POST", "/resume")

    async def is_sleeping(self) -> bool:
        """``GET /is_sleeping``: true while asleep, and while merely paused."""
        return bool((await self._control("GET", "/is_sleeping", timeout=5.0))["is_sleeping"])

    async def is_paused(self) -> bool:
        return bool((await self._control("GET", "/is_paused", timeout=5.0))["is_paused"])

    async def _control(
        self, method: str, path: str, params: dict[str, str | int] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """One call to vLLM's development endpoints (at the server's root); its JSON answer."""
        async with upstream_errors(self.base_url):
            response = await self._client.request(
                method, self.root_url + path, params=params, auth=self._auth,
                timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
            )  # fmt: skip
        if response.status_code != 200:
            raise UpstreamHTTPError(response.status_code, response.content)
        answer = orjson.loads(response.content)
        if not isinstance(answer, dict):
            raise UpstreamHTTPError(502, response.content)
        return answer
