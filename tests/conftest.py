"""Shared fixtures: a fake vLLM and the real proxy, each served over loopback HTTP."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from fake_vllm import FakeVLLM, serve_in_thread

from proxy import Settings, create_app


@dataclass
class RunningProxy:
    """A proxy served by uvicorn in a thread; ``stop()`` shuts it down (the store drains first)."""

    url: str
    settings: Settings
    _stack: ExitStack = field(repr=False)

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    @property
    def db_path(self) -> Path:
        return self.settings.data_dir / "tracetrain.db"

    def stop(self) -> None:
        self._stack.close()

    def client(self, base_url: str | None = None, **kwargs: Any) -> openai.OpenAI:
        """A real OpenAI client aimed at the proxy; closed when the proxy stops."""
        client = openai.OpenAI(base_url=base_url or self.v1, api_key="unused", max_retries=0, **kwargs)
        self._stack.callback(client.close)
        return client

    def async_client(self, base_url: str | None = None, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=base_url or self.v1, api_key="unused", max_retries=0, **kwargs)

    def rows(self, sql: str, *params: Any) -> list[sqlite3.Row]:
        """Read the store's SQLite file directly, as another process would."""
        with sqlite3.connect(self.db_path) as conn:
            conn.row_factory = sqlite3.Row
            return list(conn.execute(sql, params))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with its BPE tokenizer and ChatML template, built once per session."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    fake = FakeVLLM(emit_eos=True)  # like vLLM: a natural stop ends token_ids with <|im_end|>
    with serve_in_thread(fake.app) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture
def start_proxy(tmp_path: Path, fake: FakeVLLM) -> Iterator[Callable[..., RunningProxy]]:
    started: list[RunningProxy] = []

    def start(**overrides: Any) -> RunningProxy:
        options: dict[str, Any] = {"upstream": f"{fake.url}/v1", "data_dir": tmp_path / "data"}  # type: ignore[attr-defined]
        settings = Settings(**{**options, **overrides})
        stack = ExitStack()
        url = stack.enter_context(serve_in_thread(create_app(settings)))
        running = RunningProxy(url, settings, stack)
        started.append(running)
        return running

    yield start
    for running in reversed(started):
        running.stop()


@pytest.fixture
def proxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy()
