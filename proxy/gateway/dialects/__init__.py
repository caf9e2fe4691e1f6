"""The APIs the proxy speaks, each a dialect of chat completions (``Dialect``, ``_dialect``).

A dialect turns its API's request into the chat completion vLLM is sent, and vLLM's answer (whole,
or chunk by chunk) back into its API's response and events; the call's steps between are the
forwarder's, the same for every dialect. ``responses/``: OpenAI's Responses API; ``messages/``:
Anthropic's Messages API.
"""

from proxy.gateway.dialects._dialect import Dialect, StreamTranslator
from proxy.gateway.dialects.messages import MESSAGES, CountTokensRequest, MessagesRequest, count_tokens_chat
from proxy.gateway.dialects.responses import RESPONSES, ResponsesRequest

__all__ = [
    "MESSAGES",
    "RESPONSES",
    "CountTokensRequest",
    "Dialect",
    "MessagesRequest",
    "ResponsesRequest",
    "StreamTranslator",
    "count_tokens_chat",
]
