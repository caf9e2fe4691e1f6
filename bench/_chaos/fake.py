"""``python bench/_chaos/fake.py --port N``: the fake vLLM of ``tests/fake_vllm.py``, failing on request.

A call asks for a fault in its last user message, so the bench's calls pass any translation
(Responses, Messages) on their way here:

- ``chaos:engine-error``: an engine failure. Streamed, as vLLM 0.32 reports one (its chat
  server's ``GenerationError`` path): the role chunk and one token, then
  ``data: {"error": {"message": "Internal server error", "type": "InternalServerError",
  "param": null, "code": 500}}`` and ``data: [DONE]``; not streamed, that error as a 500.
- ``chaos:drop``: the connection dropped after the first token (``Reply.fail_mid_stream``).

Everything else is answered as the fake answers it (an echo of the last user message), each token
``--token-delay`` seconds apart, so that streams last long enough to be cut.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from fake_vllm import FakeVLLM, Reply

ENGINE_ERROR = "chaos:engine-error"
DROP = "chaos:drop"
_FAILING = "Engine trouble ahead"  # the reply whose stream fails: marks the job for _events
_ENGINE_FAILURE = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                             "code": 500}}  # fmt: skip


class ChaosVLLM(FakeVLLM):
    """The fake, with vLLM's in-stream engine failure for the replies that ask for it."""

    async def _events(
        self, job: Any, opening: Sequence[dict[str, Any]], choice: Callable[[int, int, bool], dict[str, Any] | None]
    ) -> AsyncGenerator[bytes, None]:
        events = super()._events(job, opening, choice)
        if not job.reply.content.startswith(_FAILING):
            async for event in events:
                yield event
            return
        sent = 0
        async for event in events:
            yield event
            sent += 1
            if sent > len(opening):  # the role chunk(s) and one token, then the engine fails
                break
        await events.aclose()
        yield b"data: " + json.dumps(_ENGINE_FAILURE).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


def _last_user_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return str(body.get("prompt") or "")
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
            return str(content or "")
    return ""


def reply_for(body: dict[str, Any]) -> Reply | None:
    """The fault a call asks for, as the reply it gets; None: the fake's own answer."""
    text = _last_user_text(body)
    if ENGINE_ERROR in text:
        if body.get("stream"):
            return Reply(content=f"{_FAILING}: this stream will not finish well at all.")
        return Reply(status=500, error_message="Internal server error")
    if DROP in text:
        return Reply(content="This answer is cut off after its first token by a dropped connection.",
                     fail_mid_stream=True)  # fmt: skip
    return None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay", type=float, default=0.002, help="seconds per generated token")
    args = parser.parse_args(argv)
    fake = ChaosVLLM(token_delay_s=args.token_delay, emit_eos=True)
    fake.reply_for = reply_for
    uvicorn.run(fake.app, host=args.host, port=args.port, loop="uvloop", http="httptools", ws="none",
                lifespan="off", access_log=False, log_level="warning")  # fmt: skip


if __name__ == "__main__":
    main()
