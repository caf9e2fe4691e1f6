"""vLLM's LoRA resolver for tracetrain: ``policy@N`` that vLLM does not hold is fetched from a proxy.

vLLM asks its registered resolvers when a request names a model it does not serve
(``OpenAIServingModels.resolve_lora``, with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), then
loads what they return. This one answers names of the form ``policy@N`` (N >= 1): it
downloads the files the trainer recorded in the store from the proxy
(``tracetrain_vllm._adapter_fetch``) into a local cache and returns a ``LoRARequest`` for
that directory. The proxy's publisher triggers it with ``POST /tokenize`` (see
``proxy.gateway.upstream._client.Upstream.resolve_lora``), so every vLLM holds a version before
the alias flips. Other names are left to other resolvers (None).

Configured from the environment of the vLLM process (``register`` in ``tracetrain_vllm``):

    TRACETRAIN_ADAPTERS_URL     the proxy's root URL, e.g. http://proxy:8100 (unset: no resolver)
    TRACETRAIN_ADAPTERS_KEY     an adapter key of that proxy (--adapter-key), or its admin token
    TRACETRAIN_ADAPTERS_CACHE   where downloads go (default $VLLM_CACHE_ROOT/tracetrain-adapters,
                                else ~/.cache/vllm/tracetrain-adapters)
    TRACETRAIN_ADAPTERS_KEEP    versions of a policy the cache keeps, the newest (default 3, as the
                                proxy's --keep-versions); older downloads are deleted after each fetch
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

from tracetrain_vllm._adapter_fetch import AdapterFetcher, AdapterFetchError

RESOLVER_NAME = "tracetrain"
_VERSIONED = re.compile(r"^(?P<policy>[A-Za-z0-9_.\-]{1,200})@(?P<version>[1-9][0-9]{0,9})$")
_logger = logging.getLogger("vllm.tracetrain_vllm")


class ProxyAdapterResolver(LoRAResolver):
    def __init__(self, fetcher: AdapterFetcher) -> None:
        self.fetcher = fetcher

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """The request for ``lora_name`` fetched into the cache; None when it is not ours or not found."""
        named = _VERSIONED.match(lora_name)
        if named is None:
            return None
        try:
            path = await self.fetcher.fetch(named["policy"], int(named["version"]))
        except AdapterFetchError as exc:
            # vLLM answers 404 for None: the reason is here, in vLLM's log.
            _logger.warning("tracetrain resolver: %s not fetched: %s", lora_name, exc)
            return None
        _logger.info("tracetrain resolver: %s fetched from %s into %s", lora_name, self.fetcher.url, path)
        # vLLM replaces lora_int_id with its own counter before loading.
        return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=str(path), base_model_name=base_model_name)


def fetcher_from_env(env: dict[str, str] | None = None) -> AdapterFetcher | None:
    """The fetcher TRACETRAIN_ADAPTERS_* describe; None when TRACETRAIN_ADAPTERS_URL is unset."""
    env = dict(os.environ) if env is None else env
    url = env.get("TRACETRAIN_ADAPTERS_URL", "").strip()
    if not url:
        return None
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"TRACETRAIN_ADAPTERS_URL must be an http(s) URL such as http://proxy:8100, got {url!r}")
    cache = env.get("TRACETRAIN_ADAPTERS_CACHE") or os.path.join(
        env.get("VLLM_CACHE_ROOT") or os.path.expanduser("~/.cache/vllm"), "tracetrain-adapters"
    )
    key = env.get("TRACETRAIN_ADAPTERS_KEY") or None
    keep = env.get("TRACETRAIN_ADAPTERS_KEEP", "3").strip()
    if not keep.isdecimal() or int(keep) < 1:
        raise ValueError(f"TRACETRAIN_ADAPTERS_KEEP must be a whole number of versions, 1 or more, got {keep!r}")
    return AdapterFetcher(url.removesuffix("/v1").rstrip("/"), key, Path(cache), keep=int(keep))


def register_resolver() -> bool:
    """Register the resolver with vLLM when TRACETRAIN_ADAPTERS_URL is set; True when it is registered."""
    if RESOLVER_NAME in LoRAResolverRegistry.get_supported_resolvers():
        return True
    fetcher = fetcher_from_env()
    if fetcher is None:
        return False
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, ProxyAdapterResolver(fetcher))
    _logger.info("tracetrain resolver: policy@N is fetched from %s into %s", fetcher.url, fetcher.cache_dir)
    return True
