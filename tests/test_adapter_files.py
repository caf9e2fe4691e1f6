"""Adapters without a shared filesystem: the trainer's files in the store, served by the proxy, fetched by vLLM.

The store round trip runs on SQLite, and on PostgreSQL when TRACETRAIN_TEST_POSTGRES_URL names a
database it may wipe. The resolver (``tracetrain_vllm``) downloads from a real proxy over loopback;
the publisher asks the fake vLLM for ``policy@N`` by name, and the fake plays vLLM's resolver hook
with that same resolver. The real vLLM version of this is in tests/test_integration_vllm.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, serve_in_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from store import AdapterFile, Store
from tracetrain_vllm._adapter_fetch import AdapterFetcher, AdapterFetchError

ADAPTER_KEY = "adapter-key-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
API_KEY = "inference-key-0123456789abcdef"
WEIGHTS = bytes(range(256)) * 64  # binary, with every byte value, 16 KiB
FILES = [
    AdapterFile("adapter_config.json", json.dumps({"peft_type": "LORA", "r": 8}).encode()),
    AdapterFile("adapter_model.safetensors", WEIGHTS),
    AdapterFile("metrics.json", b"{}"),
]


def wait_for(condition: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def record(database_url: str, version: int, files: list[AdapterFile], path: str = "/elsewhere/adapters") -> None:
    """What the trainer does on its own machine: record the adapter and its files (nothing on this disk)."""

    async def run() -> None:
        store = await Store.open(database_url, capture=False)
        try:
            await store.adapters.record("agent", version, f"{path}/{version}", None, {}, files)
        finally:
            await store.close()

    asyncio.run(run())


# ---------------------------------------------------------------- the store


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    else:
        url = os.environ.get("TRACETRAIN_TEST_POSTGRES_URL", "")
        if not url:
            pytest.skip("set TRACETRAIN_TEST_POSTGRES_URL to run the store on PostgreSQL (.ci/postgres.sh starts one)")
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public;")
        await conn.close()
    opened = await Store.open(url, capture=False)
    yield opened
    await opened.close()


async def test_an_adapters_files_come_back_byte_for_byte_with_their_digests(store: Store) -> None:
    await store.adapters.record("agent", 1, "/trainer/adapters/agent/1", None, {"loss": 0.5}, FILES)
    manifest = await store.adapter_files.manifest("agent", 1)
    assert manifest is not None
    assert [(f.name, f.size, f.sha256) for f in manifest] == sorted(
        (f.name, len(f.data), hashlib.sha256(f.data).hexdigest()) for f in FILES
    )
    weights = await store.adapter_files.read("agent", 1, "adapter_model.safetensors")
    assert weights is not None and weights.data == WEIGHTS
    assert await store.adapter_files.read("agent", 1, "optimizer.pt") is None
    assert await store.adapter_files.has_files("agent", 1)
    assert (await store.adapters.get("agent", 1) or {})["state"] == "trained"


async def test_an_adapter_recorded_without_files_has_an_empty_manifest_and_an_unknown_one_none(store: Store) -> None:
    await store.adapters.record("agent", 1, "/data/adapters/agent/1", None, {})
    assert await store.adapter_files.manifest("agent", 1) == []
    assert not await store.adapter_files.has_files("agent", 1)
    assert await store.adapter_files.manifest("agent", 2) is None
    assert await store.adapter_files.manifest("other", 1) is None


async def test_files_and_adapter_are_recorded_together_or_not_at_all(store: Store) -> None:
    twice = [*FILES, AdapterFile("metrics.json", b"[]")]
    with pytest.raises(ValueError, match="appears twice"):
        await store.adapters.record("agent", 1, "/trainer/adapters/agent/1", None, {}, twice)
    assert await store.adapters.get("agent", 1) is None
    assert await store.adapter_files.manifest("agent", 1) is None


def test_a_file_name_with_a_directory_part_is_refused() -> None:
    for bad in ("../x", "a/b", ".hidden", "", "x" * 201):
        with pytest.raises(ValueError, match="plain file name"):
            AdapterFile(bad, b"")


# ---------------------------------------------------------------- the endpoint


@pytest.fixture
def keyed_proxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(adapter_keys=ADAPTER_KEY, admin_token=ADMIN_TOKEN, api_keys=API_KEY)


def get(proxy: RunningProxy, path: str, key: str | None = ADAPTER_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{proxy.url}{path}", headers=headers)


def test_the_manifest_and_each_file_are_served_to_an_adapter_key_or_the_admin_token(keyed_proxy: RunningProxy) -> None:
    record(keyed_proxy.settings.resolved_database_url, 3, FILES)
    for key in (ADAPTER_KEY, ADMIN_TOKEN):
        manifest = get(keyed_proxy, "/v1/adapters/agent/3", key)
        assert manifest.status_code == 200
        body = manifest.json()
        assert (body["object"], body["id"], body["version"]) == ("adapter", "agent@3", 3)
        assert {f["name"]: f["size"] for f in body["files"]} == {f.name: len(f.data) for f in FILES}
    weights = get(keyed_proxy, "/v1/adapters/agent/3/files/adapter_model.safetensors")
    assert weights.status_code == 200 and weights.content == WEIGHTS
    assert weights.headers["content-type"] == "application/octet-stream"
    assert weights.headers["x-content-sha256"] == hashlib.sha256(WEIGHTS).hexdigest()


def test_adapter_files_refuse_no_key_a_wrong_key_and_an_inference_key(keyed_proxy: RunningProxy) -> None:
    record(keyed_proxy.settings.resolved_database_url, 1, FILES)
    for key in (None, "not-the-adapter-key-0123456789", API_KEY):
        for path in ("/v1/adapters/agent/1", "/v1/adapters/agent/1/files/adapter_config.json"):
            refused = get(keyed_proxy, path, key)
            assert refused.status_code == 401, (key, path)
            assert refused.json()["error"]["type"] == "authentication_error"
    # The adapter key opens nothing else.
    assert get(keyed_proxy, "/admin/adapters").status_code == 401
    assert get(keyed_proxy, "/v1/trajectories").status_code == 401


def test_without_adapter_keys_the_admin_token_alone_reads_adapters(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy(admin_token=ADMIN_TOKEN)
    record(proxy.settings.resolved_database_url, 1, FILES)
    assert get(proxy, "/v1/adapters/agent/1", ADMIN_TOKEN).status_code == 200
    assert get(proxy, "/v1/adapters/agent/1", None).status_code == 401


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/v1/adapters/agent/seven", "version"),
        ("/v1/adapters/agent/-1", "version"),
        (f"/v1/adapters/agent/{2**31}", "version"),
        ("/v1/adapters/ag%20ent/1", "policy"),
        ("/v1/adapters/agent/1/files/.hidden", "name"),
        ("/v1/adapters/agent/1/files/a%00b", "name"),
    ],
)
def test_bad_path_values_are_a_400_naming_the_parameter(keyed_proxy: RunningProxy, path: str, param: str) -> None:
    answer = get(keyed_proxy, path)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_a_name_with_an_encoded_slash_matches_no_route(keyed_proxy: RunningProxy) -> None:
    answer = get(keyed_proxy, "/v1/adapters/agent/1/files/..%2Fadmin-token")
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"


def test_a_missing_version_or_file_is_a_404_in_openais_shape(keyed_proxy: RunningProxy) -> None:
    database = keyed_proxy.settings.resolved_database_url
    record(database, 1, FILES)
    record(database, 2, [])  # recorded before the store kept files
    expectations = {
        "/v1/adapters/agent/9": ("adapter_not_found", "version"),
        "/v1/adapters/other/1": ("adapter_not_found", "version"),
        "/v1/adapters/agent/2": ("adapter_files_not_found", "version"),
        "/v1/adapters/agent/1/files/optimizer.pt": ("adapter_file_not_found", "name"),
        "/v1/adapters/agent/9/files/adapter_config.json": ("adapter_file_not_found", "name"),
    }
    for path, (code, param) in expectations.items():
        answer = get(keyed_proxy, path)
        assert answer.status_code == 404, path
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"], error["param"]) == ("not_found_error", code, param), path


# ---------------------------------------------------------------- the resolver's download


def fetcher(proxy: RunningProxy, tmp_path: Path, key: str | None = ADAPTER_KEY) -> AdapterFetcher:
    return AdapterFetcher(proxy.url, key, tmp_path / "cache", attempts=2)


async def test_the_resolver_downloads_a_version_once_into_its_cache(keyed_proxy: RunningProxy, tmp_path: Path) -> None:
    await asyncio.to_thread(record, keyed_proxy.settings.resolved_database_url, 4, FILES)
    first = await fetcher(keyed_proxy, tmp_path).fetch("agent", 4)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == {f.name: f.data for f in FILES}
    assert first.parent == tmp_path / "cache" / "agent"
    modified = (first / "adapter_model.safetensors").stat().st_mtime_ns
    again = await fetcher(keyed_proxy, tmp_path).fetch("agent", 4)
    assert again == first and (again / "adapter_model.safetensors").stat().st_mtime_ns == modified
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temporary directory left


async def test_new_bytes_under_an_old_name_get_a_new_cache_directory(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path
) -> None:
    """A store reset that trains agent@1 again must not be served the old agent@1 from the cache."""
    cached = []
    for run, weights in enumerate((b"first run", b"second run")):
        proxy = start_proxy(adapter_keys=ADAPTER_KEY, database_url=f"sqlite+aiosqlite:///{tmp_path / f'{run}.db'}")
        files = [FILES[0], AdapterFile("adapter_model.safetensors", weights)]
        await asyncio.to_thread(record, proxy.settings.resolved_database_url, 1, files)
        cached.append(await fetcher(proxy, tmp_path).fetch("agent", 1))
    assert cached[0] != cached[1]
    assert [(p / "adapter_model.safetensors").read_bytes() for p in cached] == [b"first run", b"second run"]


async def test_the_resolver_says_why_it_fetched_nothing(keyed_proxy: RunningProxy, tmp_path: Path) -> None:
    with pytest.raises(AdapterFetchError, match="answered 404") as missing:
        await fetcher(keyed_proxy, tmp_path).fetch("agent", 5)
    assert missing.value.missing
    with pytest.raises(AdapterFetchError, match=r"answered 401.*Invalid adapter key") as refused:
        await fetcher(keyed_proxy, tmp_path, key="wrong-key-0123456789abcdef").fetch("agent", 5)
    assert not refused.value.missing
    with pytest.raises(AdapterFetchError, match="could not be reached"):
        await AdapterFetcher("http://127.0.0.1:9", None, tmp_path, attempts=1).fetch("agent", 5)
    with pytest.raises(ValueError, match="not an adapter version"):
        await fetcher(keyed_proxy, tmp_path).fetch("../agent", 1)


def _lying_proxy(manifest: dict[str, Any], content: bytes, failures: list[int]) -> Starlette:
    """A server that answers the manifest, then files with ``content`` after failing ``failures`` first."""

    async def get_manifest(request: Request) -> Response:
        return JSONResponse(manifest)

    async def get_file(request: Request) -> Response:
        if failures:
            return JSONResponse({"error": {"message": "busy"}}, status_code=failures.pop(0))
        return Response(content)

    return Starlette(routes=[Route("/v1/adapters/agent/1", get_manifest),
                             Route("/v1/adapters/agent/1/files/{name}", get_file)])  # fmt: skip


def _manifest_for(name: str, data: bytes) -> dict[str, Any]:
    return {"files": [{"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]}


async def test_a_file_that_does_not_match_its_digest_is_refused_and_nothing_is_cached(tmp_path: Path) -> None:
    app = _lying_proxy(_manifest_for("adapter_config.json", b"{}"), b"{tampered}", [])
    with serve_in_thread(app) as url, pytest.raises(AdapterFetchError, match="does not match its sha256"):
        await AdapterFetcher(url, None, tmp_path).fetch("agent", 1)
    assert list((tmp_path / "agent").iterdir()) == []


async def test_a_manifest_naming_a_path_outside_the_cache_is_refused(tmp_path: Path) -> None:
    app = _lying_proxy(_manifest_for("../../escape.json", b"{}"), b"{}", [])
    with serve_in_thread(app) as url, pytest.raises(AdapterFetchError, match="no plain file name"):
        await AdapterFetcher(url, None, tmp_path / "cache").fetch("agent", 1)
    assert not (tmp_path / "escape.json").exists()


async def test_a_busy_proxy_is_asked_again_and_a_refusal_is_not(tmp_path: Path) -> None:
    app = _lying_proxy(_manifest_for("adapter_config.json", b"{}"), b"{}", [503, 502])
    with serve_in_thread(app) as url:
        path = await AdapterFetcher(url, None, tmp_path, attempts=3).fetch("agent", 1)
    assert (path / "adapter_config.json").read_bytes() == b"{}"
    app = _lying_proxy(_manifest_for("adapter_config.json", b"{}"), b"{}", [403, 403])
    with serve_in_thread(app) as url, pytest.raises(AdapterFetchError, match="answered 403"):
        await AdapterFetcher(url, None, tmp_path / "other", attempts=3).fetch("agent", 1)


async def test_vllms_resolver_answers_only_policy_versions(keyed_proxy: RunningProxy, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="the resolver subclasses vLLM's LoRAResolver")
    from tracetrain_vllm._resolver import ProxyAdapterResolver, fetcher_from_env

    await asyncio.to_thread(record, keyed_proxy.settings.resolved_database_url, 2, FILES)
    env = {"TRACETRAIN_ADAPTERS_URL": f"{keyed_proxy.url}/v1", "TRACETRAIN_ADAPTERS_KEY": ADAPTER_KEY,
           "VLLM_CACHE_ROOT": str(tmp_path)}  # fmt: skip
    configured = fetcher_from_env(env)
    assert configured is not None and configured.url == keyed_proxy.url
    assert configured.cache_dir == tmp_path / "tracetrain-adapters" and ADAPTER_KEY not in repr(configured)
    resolver = ProxyAdapterResolver(configured)
    found = await resolver.resolve_lora("tiny", "agent@2")
    assert found is not None and found.lora_name == "agent@2"
    assert (Path(found.lora_path) / "adapter_model.safetensors").read_bytes() == WEIGHTS
    for not_ours in ("agent", "agent@0", "agent@x", "tiny", "agent@2@3", "agent@9"):
        assert await resolver.resolve_lora("tiny", not_ours) is None, not_ours
    assert fetcher_from_env({}) is None
    with pytest.raises(ValueError, match="http"):
        fetcher_from_env({"TRACETRAIN_ADAPTERS_URL": "proxy:8100"})


# ---------------------------------------------------------------- publishing by name


def fake_resolver(fake: FakeVLLM, proxy_url: str, cache: Path, key: str | None = ADAPTER_KEY) -> None:
    """Plays vLLM's resolver hook with tracetrain's own download (the real one runs inside vLLM)."""
    fetch = AdapterFetcher(proxy_url, key, cache)

    async def resolve(name: str) -> str | None:
        policy, _, version = name.partition("@")
        try:
            return str(await fetch.fetch(policy, int(version)))
        except (AdapterFetchError, ValueError):
            return None

    fake.resolve_lora = resolve


def adapters(proxy: RunningProxy) -> dict[str, Any]:
    return httpx.get(f"{proxy.url}/admin/adapters", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).json()


def test_an_adapter_on_no_disk_here_is_fetched_by_vllm_before_the_flip(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, tmp_path: Path
) -> None:
    proxy = start_proxy(adapter_keys=ADAPTER_KEY, admin_token=ADMIN_TOKEN)  # delivery "auto"
    fake_resolver(fake, proxy.url, tmp_path / "vllm-cache")
    record(proxy.settings.resolved_database_url, 1, FILES, path=str(tmp_path / "trainer-machine"))
    wait_for(lambda: adapters(proxy)["active_version"] == 1)
    assert Path(fake.loras["agent@1"]).parent == tmp_path / "vllm-cache" / "agent"
    assert (Path(fake.loras["agent@1"]) / "adapter_model.safetensors").read_bytes() == WEIGHTS
    answer = proxy.client().chat.completions.with_raw_response.create(
        model="agent", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.headers["x-policy-version"] == "1" and fake.requests[-1]["model"] == "agent@1"


def test_a_vllm_without_the_resolver_fails_the_publish_and_says_what_to_set(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, tmp_path: Path
) -> None:
    proxy = start_proxy(adapter_keys=ADAPTER_KEY, admin_token=ADMIN_TOKEN, adapter_delivery="resolver")
    record(proxy.settings.resolved_database_url, 1, FILES, path=str(tmp_path))
    failed = wait_for(lambda: [a for a in adapters(proxy)["data"] if a["state"] == "failed"])
    assert "does not exist" in failed[0]["error"] and "TRACETRAIN_ADAPTERS_URL" in failed[0]["error"]
    assert adapters(proxy)["active_version"] == 0 and fake.loras == {}


def test_delivery_path_sends_the_directory_even_when_the_files_are_in_the_store(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, tmp_path: Path
) -> None:
    proxy = start_proxy(admin_token=ADMIN_TOKEN, adapter_delivery="path")
    record(proxy.settings.resolved_database_url, 1, FILES, path=str(tmp_path / "shared"))
    wait_for(lambda: adapters(proxy)["active_version"] == 1)
    assert fake.loras == {"agent@1": str(tmp_path / "shared" / "1")}


def test_one_box_auto_delivery_still_loads_by_path(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, tmp_path: Path
) -> None:
    proxy = start_proxy(admin_token=ADMIN_TOKEN)
    (tmp_path / "data" / "adapters" / "agent" / "1").mkdir(parents=True)
    record(proxy.settings.resolved_database_url, 1, FILES, path=str(tmp_path / "data" / "adapters" / "agent"))
    wait_for(lambda: adapters(proxy)["active_version"] == 1)
    assert fake.loras == {"agent@1": str(tmp_path / "data" / "adapters" / "agent" / "1")}


def test_a_rollback_to_a_version_only_in_the_store_is_fetched_again(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, tmp_path: Path
) -> None:
    proxy = start_proxy(adapter_keys=ADAPTER_KEY, admin_token=ADMIN_TOKEN, keep_versions=1, unload_grace_s=0)
    fake_resolver(fake, proxy.url, tmp_path / "vllm-cache")
    for version in (1, 2):
        record(proxy.settings.resolved_database_url, version, FILES, path=str(tmp_path / "trainer-machine"))
        wait_for(lambda v=version: adapters(proxy)["active_version"] == v)
    wait_for(lambda: "agent@1" not in fake.loras)  # outside the window of one
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    rolled = httpx.post(f"{proxy.url}/admin/adapters/1/activate", headers=headers)
    assert rolled.status_code == 200 and rolled.json()["active_version"] == 1 and "agent@1" in fake.loras
    record(proxy.settings.resolved_database_url, 7, [], path=str(tmp_path / "trainer-machine"))
    wait_for(lambda: [a for a in adapters(proxy)["data"] if a["version"] == 7 and a["state"] == "failed"])
    refused = httpx.post(f"{proxy.url}/admin/adapters/7/activate", headers=headers)
    assert refused.status_code == 404 and "on disk or in the store" in refused.json()["error"]["message"]


# ---------------------------------------------------------------- tracetrain serve


@pytest.mark.parametrize(
    ("delivery", "train", "by_name"),
    [("auto", True, False), ("auto", False, True), ("path", False, False), ("resolver", True, True)],
)
def test_serve_points_vllms_resolver_at_itself_only_when_adapters_may_go_by_name(
    tmp_path: Path, delivery: str, train: bool, by_name: bool
) -> None:
    from proxy import Settings
    from tracetrain_cli._serve_command import _adapters_by_name, _with_adapter_resolver
    from tracetrain_cli._vllm_process import VLLMLaunch

    settings = Settings(data_dir=tmp_path, adapter_delivery=delivery, port=8100, admin_token=ADMIN_TOKEN)
    launch = VLLMLaunch(model="m", port=8101, data_dir=tmp_path)
    assert _adapters_by_name(settings, train=train) is by_name
    assert "TRACETRAIN_ADAPTERS_URL" not in launch.env({})
    settings, launch = _with_adapter_resolver(settings, launch)
    env = launch.env({})
    key = env["TRACETRAIN_ADAPTERS_KEY"]
    assert env["TRACETRAIN_ADAPTERS_URL"] == "http://127.0.0.1:8100"
    # A key made for this run, that reads adapters only: never the admin token.
    assert [k.get_secret_value() for k in settings.adapter_keys] == [key] and key != ADMIN_TOKEN and len(key) >= 32
    assert key not in repr(launch)
    configured = Settings(data_dir=tmp_path, adapter_keys=ADAPTER_KEY, host="0.0.0.0", api_keys=API_KEY)
    _, launch = _with_adapter_resolver(configured, VLLMLaunch(model="m", port=8101, data_dir=tmp_path))
    assert launch.env({})["TRACETRAIN_ADAPTERS_KEY"] == ADAPTER_KEY
    assert launch.env({})["TRACETRAIN_ADAPTERS_URL"] == "http://127.0.0.1:8100"
