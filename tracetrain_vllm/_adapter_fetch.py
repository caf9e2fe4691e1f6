"""Downloading one adapter version from a tracetrain proxy into a local cache directory.

    GET {url}/v1/adapters/{policy}/{version}               -> {"files": [{"name", "size", "sha256"}]}
    GET {url}/v1/adapters/{policy}/{version}/files/{name}  -> the bytes, checked against the manifest

The files land in a hidden directory beside the final one, which is renamed into place when
every file is checked: a reader never sees half an adapter. The final directory is named by
the manifest's digest, ``<cache>/<policy>/<version>-<digest>``: a cached copy is reused only
while the proxy serves the same bytes (a store reset that trains ``agent@1`` again gets a new
directory, never the old weights under the same name).

Plain httpx, no vLLM: ``tracetrain_vllm._resolver`` wraps this as vLLM's ``LoRAResolver``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

# What the proxy accepts as a file name (store.FILE_NAME_PATTERN); anything else in a manifest is refused.
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_POLICY = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
REQUIRED = "adapter_config.json"


class AdapterFetchError(Exception):
    """The adapter could not be fetched; ``missing`` when the proxy says it has no such version."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True, slots=True)
class AdapterFetcher:
    """Fetches ``policy@version`` from the proxy at ``url`` (its root, e.g. ``http://proxy:8100``)."""

    url: str
    key: str | None
    cache_dir: Path
    timeout_s: float = 120.0
    attempts: int = 3
    keep: int = 3  # versions of a policy kept in the cache: the newest, and always the one just fetched

    async def fetch(self, policy: str, version: int) -> Path:
        """The local directory holding ``policy@version``, downloaded unless already cached.

        Raises ``AdapterFetchError`` (``missing`` on a 404), ``ValueError`` for a bad name.
        """
        if not _POLICY.match(policy) or version < 1:
            raise ValueError(f"not an adapter version: {policy}@{version}")
        try:
            path = await self._fetch(policy, version)
        except httpx.HTTPStatusError as exc:
            status = exc.response.status_code
            raise AdapterFetchError(
                f"{self.url} answered {status} for {policy}@{version}: {_message(exc.response)}", missing=status == 404
            ) from exc
        except httpx.HTTPError as exc:
            raise AdapterFetchError(f"{self.url} could not be reached for {policy}@{version}: {exc!r}") from exc
        prune_cache(self.cache_dir / policy, self.keep, path)
        return path

    async def _fetch(self, policy: str, version: int) -> Path:
        headers = {"authorization": f"Bearer {self.key}"} if self.key else {}
        base = f"{self.url.rstrip('/')}/v1/adapters/{policy}/{version}"
        async with httpx.AsyncClient(headers=headers, timeout=self.timeout_s) as client:
            files = _checked_manifest((await self._get(client, base)).json(), f"{policy}@{version}")
            digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
            final = self.cache_dir / policy / f"{version}-{digest}"
            if final.is_dir():
                return final
            work = final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
            work.mkdir(parents=True)
            try:
                for entry in files:
                    data = (await self._get(client, f"{base}/files/{entry['name']}")).content
                    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                        raise AdapterFetchError(f"{policy}@{version}: {entry['name']} does not match its sha256")
                    (work / entry["name"]).write_bytes(data)
                try:
                    work.rename(final)
                except OSError:
                    if not final.is_dir():  # unless another process put the same bytes in place first
                        raise
            finally:
                shutil.rmtree(work, ignore_errors=True)
        return final

    async def _get(self, client: httpx.AsyncClient, url: str) -> httpx.Response:
        """GET, retried with back-off on connection errors, 429 and 5xx; other statuses raise at once."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=0.5, max=5),
            retry=retry_if_exception(_transient),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                response = await client.get(url)
                response.raise_for_status()
                return response
        raise AssertionError("tenacity re-raises the last error")

    def __repr__(self) -> str:  # the key never shows in a log line
        return f"AdapterFetcher(url={self.url!r}, cache_dir={str(self.cache_dir)!r})"


def prune_cache(policy_dir: Path, keep: int, fetched: Path) -> None:
    """Delete the downloads of all but the newest ``keep`` versions in ``policy_dir`` (never ``fetched``).

    vLLM holds a loaded adapter's weights in memory; the proxy keeps loaded at most its window
    of versions, the same number, so a deleted download is never needed to serve.
    """
    versions: dict[int, list[Path]] = {}
    for entry in policy_dir.iterdir():
        number = entry.name.partition("-")[0]
        if entry.is_dir() and number.isdecimal():
            versions.setdefault(int(number), []).append(entry)
    for version in sorted(versions)[:-keep]:
        for entry in versions[version]:
            if entry != fetched:
                shutil.rmtree(entry, ignore_errors=True)


def _checked_manifest(body: Any, what: str) -> list[dict[str, Any]]:
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files, list) or not files:
        raise AdapterFetchError(f"{what}: the proxy's manifest lists no files")
    checked = []
    for entry in files:
        name, size, digest = (entry.get(k) if isinstance(entry, dict) else None for k in ("name", "size", "sha256"))
        if not (isinstance(name, str) and _FILE_NAME.match(name)):
            raise AdapterFetchError(f"{what}: the manifest names a file {name!r} that is no plain file name")
        if not (isinstance(size, int) and size >= 0 and isinstance(digest, str) and _SHA256.match(digest)):
            raise AdapterFetchError(f"{what}: the manifest's entry for {name} has no valid size and sha256")
        checked.append({"name": name, "size": size, "sha256": digest})
    if REQUIRED not in {e["name"] for e in checked}:
        raise AdapterFetchError(f"{what}: the manifest has no {REQUIRED}")
    return checked


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, httpx.TransportError)


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
