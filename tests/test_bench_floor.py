"""bench/_proxy/floor.py's relays pass vLLM's answers through as they are: what they cost is a floor only if so."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from fake_vllm import FakeVLLM, serve_in_thread

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from _host import free_port, wait_http  # noqa: E402  (bench/ is not a package)

# What bench/wrk/chat.lua's "chat-as-proxied" sends: a chat body with the capture flags the proxy adds.
_BODY = {"model": "fake/base-model", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 8,
         "return_token_ids": True, "logprobs": True}  # fmt: skip


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serve_in_thread(FakeVLLM().app) as url:
        yield url


@pytest.fixture(scope="module", params=["pipe", "asgi"])
def relay(request: pytest.FixtureRequest, upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port, log = free_port(), tmp_path_factory.mktemp("floor") / f"{request.param}.log"
    argv = [sys.executable, "bench/_proxy/floor.py", request.param, "--upstream", upstream.removeprefix("http://"),
            "--port", str(port)]  # fmt: skip
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, log, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _without_ids(answer: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


def test_a_relay_passes_an_answer_and_a_stream_through_unchanged(relay: str, upstream: str) -> None:
    with httpx.Client(timeout=30) as http:
        direct = http.post(f"{upstream}/v1/chat/completions", json=_BODY).json()
        relayed = http.post(f"{relay}/v1/chat/completions", json=_BODY)
        assert relayed.status_code == 200 and _without_ids(relayed.json()) == _without_ids(direct)
        assert relayed.json()["choices"][0]["token_ids"]  # the capture's fields came through
        for _ in range(2):  # the relay's kept connection serves the next call
            events = http.post(f"{relay}/v1/chat/completions", json={**_BODY, "stream": True}).text.split("\n\n")
            chunks = [orjson.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
            assert events[-2:] == ["data: [DONE]", ""] and all("token_ids" in c["choices"][0] for c in chunks[1:])
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert text == direct["choices"][0]["message"]["content"]
