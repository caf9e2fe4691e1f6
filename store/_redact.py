"""The one redaction of secrets in URLs: what every log line, label, error body and stored text goes through.

A URL may carry credentials in its user-info part: ``http://user:password@vllm:8000/v1`` (an upstream
behind basic auth), ``postgresql+asyncpg://tracetrain:password@db/tracetrain`` (the database), a judge's
or Langfuse's base URL. ``redact`` replaces the password (or a user name given alone, which is often a
token) with ``***`` wherever such a URL appears in a text, so a message that quotes a URL can be shown,
logged or stored as it is::

    >>> redact("cannot reach the upstream at http://me:s3cret@vllm:8000/v1 (ConnectError)")
    'cannot reach the upstream at http://me:***@vllm:8000/v1 (ConnectError)'
    >>> redact("https://sk-live-123@judge.example/v1")
    'https://***@judge.example/v1'

It lives in the store, the lowest package, so that the proxy, the trainer, the command line and the
store itself redact alike. ``without_userinfo`` drops the part altogether, for a client that sends the
credentials as a header instead.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

# scheme://userinfo@ : the user-info runs to the last "@" before the host's end (a "/", "?", "#" or a blank),
# so a password holding an unescaped "@" is hidden whole.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/?#\s]*)@")
HIDDEN = "***"


def _hide(match: re.Match[str]) -> str:
    user, colon, _password = match["userinfo"].partition(":")
    kept = f"{user}:{HIDDEN}" if colon else HIDDEN  # a user name alone is often the secret itself
    return f"{match['scheme']}{kept}@"


def redact(text: str) -> str:
    """``text`` with the user-info password of every URL in it replaced by ``***`` (see the module docstring)."""
    if "@" not in text:  # the common case, a URL without credentials: no regular expression at all
        return text
    return _USERINFO.sub(_hide, text)


def without_userinfo(url: str) -> str:
    """``url`` without its user-info, for a client that sends the credentials otherwise (a header): HTTP
    clients log and quote the URLs they request."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
