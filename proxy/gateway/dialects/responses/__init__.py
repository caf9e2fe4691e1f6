"""OpenAI's Responses API as a dialect of chat completions (``RESPONSES``).

``_dialect``: the request as chat (checked; stored state and hosted tools refused) and chat's answer as a
``response``; ``_shape``: the API's objects (a response, its items, its usage); ``_stream``: chat chunks as
the API's streamed events.
"""

from proxy.gateway.dialects.responses._dialect import RESPONSES, ResponsesRequest

__all__ = ["RESPONSES", "ResponsesRequest"]
