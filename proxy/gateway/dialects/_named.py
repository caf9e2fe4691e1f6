"""Every dialect by its name: what ``calls.endpoint`` records and what ``Forwarder.handle`` is told."""

from __future__ import annotations

from typing import Literal

from proxy.gateway.dialects._dialect import Dialect
from proxy.gateway.dialects.chat import CHAT, COMPLETIONS
from proxy.gateway.dialects.messages import MESSAGES
from proxy.gateway.dialects.responses import RESPONSES

DialectName = Literal["chat.completions", "completions", "responses", "messages"]

DIALECTS: dict[str, Dialect] = {dialect.endpoint: dialect for dialect in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)}
