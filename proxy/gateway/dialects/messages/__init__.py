"""Anthropic's Messages API as a dialect of chat completions (``MESSAGES``), and its token count.

``_dialect``: the request as chat, count_tokens' chat body; ``_wire``: its request models; ``_shape``: chat's
answer in Messages' shape (ids, stop reasons, content blocks, errors); ``_stream``: chat chunks as Messages
events.
"""

from proxy.gateway.dialects.messages._dialect import MESSAGES, count_tokens_chat
from proxy.gateway.dialects.messages._wire import CountTokensRequest, MessagesRequest

__all__ = ["MESSAGES", "CountTokensRequest", "MessagesRequest", "count_tokens_chat"]
