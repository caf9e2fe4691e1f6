"""The files of adapter versions, kept in the store for vLLM servers that cannot see the trainer's disk.

    trainer: Adapters.record(..., files=...)  --one transaction-->  adapters row + adapter_files rows
    proxy:   AdapterFiles.manifest / .read  -->  GET /v1/adapters/{policy}/{version}[/files/{name}]
    vLLM:    tracetrain_vllm's resolver downloads them, checks each sha256, loads the directory

An adapter recorded without files (before migration 0004) has a manifest of no files: it
can only be loaded from its path.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store._tables import adapter_files as F
from store._tables import adapters as A

# A plain file name: no directory part, no "." or "..", nothing a shell or a URL would mangle.
FILE_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$"
_FILE_NAME = re.compile(FILE_NAME_PATTERN)


@dataclass(frozen=True, slots=True)
class AdapterFile:
    """One file of an adapter directory, as the trainer wrote it."""

    name: str
    data: bytes

    def __post_init__(self) -> None:
        if not _FILE_NAME.match(self.name):
            raise ValueError(f"an adapter file name must be a plain file name, got {self.name!r}")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True, slots=True)
class FileEntry:
    """What the manifest says of one stored file."""

    name: str
    size: int
    sha256: str


async def write_files(conn: AsyncConnection, policy: str, version: int, files: Sequence[AdapterFile]) -> None:
    """Insert ``files`` in the caller's transaction (the one that records the adapter)."""
    if not files:
        return
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"adapter {policy}@{version}: a file name appears twice in {names}")
    now = time.time()
    await conn.execute(
        F.insert(),
        [{"policy": policy, "version": version, "name": f.name, "size": len(f.data), "sha256": f.sha256,
          "data": f.data, "created_at": now} for f in files],
    )  # fmt: skip


class AdapterFiles:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def manifest(self, policy: str, version: int) -> list[FileEntry] | None:
        """The stored files of ``policy@version`` by name; None when no such adapter was recorded."""
        async with self._engine.connect() as conn:
            known = (await conn.execute(select(A.c.pk).where(A.c.policy == policy, A.c.version == version))).first()
            if known is None:
                return None
            rows = await conn.execute(
                select(F.c.name, F.c.size, F.c.sha256)
                .where(F.c.policy == policy, F.c.version == version)
                .order_by(F.c.name)
            )
            return [FileEntry(str(name), int(size), str(digest)) for name, size, digest in rows.all()]

    async def read(self, policy: str, version: int, name: str) -> AdapterFile | None:
        """One stored file; None when there is none of that name."""
        async with self._engine.connect() as conn:
            data = (
                await conn.execute(
                    select(F.c.data).where(F.c.policy == policy, F.c.version == version, F.c.name == name)
                )
            ).scalar()
        return None if data is None else AdapterFile(name, bytes(data))

    async def has_files(self, policy: str, version: int) -> bool:
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(F.c.pk).where(F.c.policy == policy, F.c.version == version))).first()
        return row is not None
