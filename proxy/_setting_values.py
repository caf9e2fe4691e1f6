"""How the settings' list values are read: comma-separated text (an environment variable), or a sequence
(flags, keyword arguments); ``NAME=VALUE`` items as pairs; each item checked with the flag it came from.

Pure functions, for ``proxy._settings``' validators: a value that is not what it should be raises a
``ValueError`` whose message names the flag and says what is expected.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import Any

from store import POLICY_NAME_PATTERN, redact


def items(value: object) -> object:
    """``"a, b,,c"`` -> ``("a", "b", "c")``; a sequence's text items split alike (a repeated flag, each given
    ``a,b``); anything else as it is."""
    if isinstance(value, str):
        return _split(value)
    if isinstance(value, tuple | list):
        return tuple(part for item in value for part in (_split(item) if isinstance(item, str) else (item,)))
    return value


def _split(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def pairs(values: object, pair: Callable[[str], tuple[str, Any]]) -> object:
    """Each text item made a pair by ``pair`` (which raises ``ValueError`` for a malformed one); pairs as they are."""
    values = items(values)
    if not isinstance(values, tuple | list):
        return values
    return tuple(pair(item) if isinstance(item, str) else item for item in values)


def policy_key_pair(item: str) -> tuple[str, str]:
    """``NAME=KEY`` -> (name, key)."""
    name, sep, key = item.partition("=")
    if not sep or not key:
        raise ValueError("a policy key is NAME=KEY (the policy's name, '=', then the key)")
    return name.strip(), key.strip()


def judge_pair(item: str) -> tuple[str, str | None]:
    """``MODEL`` or ``MODEL=BASE_URL`` -> (model, URL or None)."""
    model, sep, url = item.partition("=")
    if not model.strip() or (sep and not url.strip()):
        raise ValueError("a judge is MODEL or MODEL=BASE_URL (a litellm model name, then its server's URL)")
    return model.strip(), url.strip() or None


def alias_pair(item: str) -> tuple[str, str]:
    """``NAME=POLICY`` -> (name, policy)."""
    name, sep, policy = item.rpartition("=")
    if not sep or not name.strip() or not policy.strip():
        raise ValueError("a model alias is NAME=POLICY (the model name an agent asks for, '=', a policy)")
    return name.strip(), policy.strip()


def aliases(values: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """``--model-alias``: each name once, each policy a valid name."""
    names = [name for name, _ in values]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"--model-alias names {', '.join(twice)} twice")
    for name, policy in values:
        if not re.fullmatch(POLICY_NAME_PATTERN, policy):
            raise ValueError(f"--model-alias {name}={policy[:100]}: {policy[:100]!r} is not a policy name")
        if len(name) > 200:
            raise ValueError("--model-alias: a model name is at most 200 characters")
    return values


def proxy_addresses(values: tuple[str, ...]) -> tuple[str, ...]:
    """``--forwarded-allow-ips``: addresses or networks, or ``*``."""
    for value in values:
        if value != "*":
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError:
                raise ValueError(f"--forwarded-allow-ips: {value[:100]!r} is not an address or a network") from None
    return values


def policy_names(values: tuple[str, ...]) -> tuple[str, ...]:
    """``--policy``: valid names, each once."""
    for name in values:
        if not re.fullmatch(POLICY_NAME_PATTERN, name):
            raise ValueError(
                f"policy name {name!r}: 1-100 letters, digits, '_', '.' or '-', beginning with a letter or digit"
            )
    if len(set(values)) != len(values):
        raise ValueError(f"a policy is named twice: {', '.join(values)}")
    return values


def judge_urls(values: tuple[tuple[str, str | None], ...]) -> tuple[tuple[str, str | None], ...]:
    """``--judge``: http(s) base URLs, each model once."""
    for model, url in values:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"--judge {model}=...: the base URL must be http(s), got {redact(url)!r}")
    if len({model for model, _ in values}) != len(values):
        raise ValueError("a judge model is named twice in --judge")
    return values


def upstream_urls(values: tuple[str, ...]) -> tuple[str, ...]:
    """``--upstream``: http(s) URLs without a trailing slash, each once (passwords never shown)."""
    urls = []
    for value in values:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http(s) URL such as http://127.0.0.1:8000/v1, got {redact(value)!r}")
        urls.append(value.rstrip("/"))
    if len(set(urls)) != len(urls):
        raise ValueError(f"an upstream is named twice: {redact(', '.join(urls))}")
    return tuple(urls)
