"""The files of adapter versions, read from the store for vLLM servers that cannot see the trainer's disk.

The worker records each adapter's files in the store (``store._adapter_files``); vLLM's
tracetrain resolver (``tracetrain_vllm``) reads the manifest, then each file, and checks
its sha256. Nothing here touches the disk: a proxy on any machine serves any version.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import NotFound
from store import AdapterFile, Store


async def manifest(store: Store, policy: str, version: int) -> dict[str, Any]:
    """``{"object": "adapter", "id": "agent@3", ..., "files": [{"name", "size", "sha256"}]}``; 404 when none."""
    files = await store.adapter_files.manifest(policy, version)
    if files is None:
        raise NotFound(f"No adapter {policy}@{version} was recorded.", param="version", code="adapter_not_found")
    if not files:
        raise NotFound(
            f"Adapter {policy}@{version} has no files in the store (it was recorded before tracetrain kept them "
            "there); only a vLLM that sees its directory can load it.",
            param="version",
            code="adapter_files_not_found",
        )
    return {
        "object": "adapter",
        "id": f"{policy}@{version}",
        "policy": policy,
        "version": version,
        "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in files],
    }


async def read_file(store: Store, policy: str, version: int, name: str) -> AdapterFile:
    found = await store.adapter_files.read(policy, version, name)
    if found is None:
        raise NotFound(f"Adapter {policy}@{version} has no file {name!r}.", param="name", code="adapter_file_not_found")
    return found
