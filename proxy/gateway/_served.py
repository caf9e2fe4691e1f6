"""What the served model and its vLLM take beyond text chat (``Served``), and the proxy's seal on what it hands out.

Built once per app (``proxy._services``) and given to every dialect with each call, so a translation
knows, without asking vLLM on the call's path:

- ``reasoning``: vLLM runs a ``--reasoning-parser`` (``Settings.reasoning_parser``; ``serve
  --reasoning-parser`` sets it): a thinking budget can be passed (vLLM refuses ``thinking_token_budget``
  without one);
- ``images``: the model reads images (``Settings.reads_images``; ``serve`` reads it in the model's
  ``config.json``): image parts go to it; otherwise each becomes a text placeholder the model reads;
- ``signer``: the HMAC that signs what a client must send back unchanged (an Anthropic ``thinking``
  block's ``signature``) and checks it when it comes back.

The signer's key is derived from the admin token when there is one (every replica has the same, as
for admin sessions), otherwise kept in ``DATA_DIR/signing-key`` (32 random bytes, mode 0600, made on
the first start): signatures outlive restarts. A new admin token (or a lost key file) makes the
thinking blocks clients hold unverifiable: their next call is refused, as Anthropic refuses a block
that another key signed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

_KEY_FILE = "signing-key"
_CONTEXT = b"tracetrain signing v1"


class Signer:
    """HMAC-SHA256 signatures over ``(kind, text)``: ``sign``, and ``verify`` when the text comes back."""

    def __init__(self, key: bytes) -> None:
        self._key = hmac.new(key, _CONTEXT, hashlib.sha256).digest()

    @classmethod
    def ephemeral(cls) -> Signer:
        """A key that lives as long as the process (tests, embedding without a data directory)."""
        return cls(secrets.token_bytes(32))

    @classmethod
    def for_server(cls, data_dir: Path, admin_token: str | None) -> Signer:
        """The server's signer: from the admin token, else from ``data_dir``'s key file (made if missing)."""
        if admin_token:
            return cls(admin_token.encode())
        path = data_dir / _KEY_FILE
        try:
            return cls(path.read_bytes())
        except FileNotFoundError:
            pass
        data_dir.mkdir(parents=True, exist_ok=True)
        key = secrets.token_bytes(32)
        spare = data_dir / f".{_KEY_FILE}.{os.getpid()}"
        fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key)
        try:
            os.link(spare, path)  # whole or not at all: another process starting meanwhile reads one key
        except FileExistsError:
            key = path.read_bytes()
        finally:
            spare.unlink()
        return cls(key)

    def sign(self, kind: str, text: str) -> str:
        digest = hmac.new(self._key, kind.encode() + b"\0" + text.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def verify(self, kind: str, text: str, signature: object) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self.sign(kind, text), signature)


@dataclass(frozen=True, slots=True)
class Served:
    """What the served model and its vLLM take (see the module docstring); one per app."""

    reasoning: bool = False
    images: bool = False
    signer: Signer = field(default_factory=Signer.ephemeral)
