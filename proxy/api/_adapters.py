"""``GET /v1/adapters/{policy}/{version}`` and its files: what vLLM's tracetrain resolver downloads.

Read with an adapter key (``--adapter-key``, what each vLLM server holds) or the admin token.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Response

from proxy._params import FileName, PolicyName, Version
from proxy.api._deps import ServicesDep, require_adapter_reader
from proxy.training import _adapter_files as _files

router = APIRouter(dependencies=[Depends(require_adapter_reader)], tags=["adapters"])


@router.get("/v1/adapters/{policy}/{version}")
async def adapter_manifest(policy: PolicyName, version: Version, services: ServicesDep) -> dict[str, Any]:
    """The files of `policy@version` the trainer recorded: name, size and sha256 of each."""
    return await _files.manifest(services.store, policy, version)


@router.get(
    "/v1/adapters/{policy}/{version}/files/{name}",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes."}},
)
async def adapter_file(policy: PolicyName, version: Version, name: FileName, services: ServicesDep) -> Response:
    """One file of `policy@version`, byte for byte; its sha256 is in the `X-Content-SHA256` header."""
    found = await _files.read_file(services.store, policy, version, name)
    headers = {"X-Content-SHA256": found.sha256, "Cache-Control": "no-store"}
    return Response(found.data, media_type="application/octet-stream", headers=headers)
