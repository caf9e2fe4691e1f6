"""The APIs the proxy speaks, each a dialect on the one call path (``Dialect``, ``_dialect``).

A dialect turns its API's request into the body vLLM is sent, and vLLM's answer (whole, or chunk by
chunk) back into its API's response and events; the call's steps between are the forwarder's, the
same for every dialect. ``chat/``: chat completions and text completions, which vLLM speaks itself
(the identity); ``responses/``: OpenAI's Responses API; ``messages/``: Anthropic's Messages API, both
translated to chat completions.
"""

from proxy.gateway.dialects._dialect import ChatTranslation, Dialect, StreamTranslator, json_object
from proxy.gateway.dialects._named import DIALECTS, DialectName
from proxy.gateway.dialects.chat import (
    CHAT,
    COMPLETIONS,
    PASSTHROUGH_EVENTS,
    ChatCompletionRequest,
    CompletionRequest,
)
from proxy.gateway.dialects.messages import MESSAGES, CountTokensRequest, MessagesRequest, count_tokens_chat
from proxy.gateway.dialects.responses import RESPONSES, ResponsesRequest

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "DIALECTS",
    "MESSAGES",
    "PASSTHROUGH_EVENTS",
    "RESPONSES",
    "ChatCompletionRequest",
    "ChatTranslation",
    "CompletionRequest",
    "CountTokensRequest",
    "Dialect",
    "DialectName",
    "MessagesRequest",
    "ResponsesRequest",
    "StreamTranslator",
    "count_tokens_chat",
    "json_object",
]
