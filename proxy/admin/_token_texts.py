"""The text of single tokens, for showing a completion token by token.

The proxy has no tokenizer (it never loads the model), and the store keeps token ids,
not strings. vLLM's ``/detokenize`` knows them; each distinct id is asked once and the
answer kept. A byte-level BPE token that holds part of a UTF-8 character decodes to
U+FFFD on its own: the dashboard shows that as is, the token id beside it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from proxy.errors import ProxyError
from proxy.gateway.upstream import Upstream

log = logging.getLogger("tracetrain.proxy")

_MAX_CACHED = 200_000
_CONCURRENCY = 16


class TokenTexts:
    """id -> text, asked of the upstream on a miss; None where it cannot say."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self._texts: dict[int, str] = {}

    async def texts(self, model: str, token_ids: Sequence[int]) -> list[str | None]:
        missing = sorted(set(token_ids) - self._texts.keys())
        if missing:
            await self._fetch(model, missing)
        return [self._texts.get(token_id) for token_id in token_ids]

    async def _fetch(self, model: str, token_ids: list[int]) -> None:
        gate = asyncio.Semaphore(_CONCURRENCY)

        async def one(token_id: int) -> None:
            async with gate:
                self._texts[token_id] = await self._upstream.detokenize(model, [token_id])

        results = await asyncio.gather(*(one(t) for t in token_ids), return_exceptions=True)
        if failed := [r for r in results if isinstance(r, ProxyError)]:
            log.warning("could not detokenize %d token ids: %s", len(failed), failed[0].message)
        if unexpected := [r for r in results if isinstance(r, BaseException) and not isinstance(r, ProxyError)]:
            raise unexpected[0]
        if len(self._texts) > _MAX_CACHED:  # a vocabulary is far smaller; only a model change gets here
            self._texts.clear()
