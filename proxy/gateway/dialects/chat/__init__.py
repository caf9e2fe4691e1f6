"""Chat completions and (legacy) text completions: the APIs vLLM speaks itself, relayed as they are.

``_dialect``: ``CHAT`` and ``COMPLETIONS`` (validated, sent as written, answered less what the client did
not ask for) and a stream's own events; ``_wire``: their request models.
"""

from proxy.gateway.dialects.chat._dialect import CHAT, COMPLETIONS, PASSTHROUGH_EVENTS
from proxy.gateway.dialects.chat._wire import ChatCompletionRequest, CompletionRequest

__all__ = ["CHAT", "COMPLETIONS", "PASSTHROUGH_EVENTS", "ChatCompletionRequest", "CompletionRequest"]
