"""The fake vLLM's text side: a toy tokenizer, a ChatML-like template and a port of
vLLM's Hermes tool-call parser (see ``fake_vllm``'s docstring for what is faithful)."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

# ---------------------------------------------------------------- toy tokenizer

_SPECIAL_IDS = {
    "<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "<tool_call>": 4, "</tool_call>": 5,
    "<think>": 6, "</think>": 7,
}  # fmt: skip
THINK_START, THINK_END = "<think>", "</think>"
EOS_TOKEN_ID = _SPECIAL_IDS["<|im_end|>"]
_BYTE_BASE = 16  # ids 16..271 spell a piece byte by byte
_HASH_LOW, _HASH_HIGH = 1000, 50000
TOKEN_ID_LIMIT = _HASH_HIGH  # every id the toy tokenizer gives is below this
_PIECE_RE = re.compile("|".join(map(re.escape, _SPECIAL_IDS)) + r"|\w+|[^\S\n]+|\n|[^\w\s]")
# Runners-up offered as top_logprobs alternatives.
_ALT_PIECES = (
    "the",
    ",",
    "a",
    ".",
    "and",
    " ",
    "to",
    "of",
    "\n",
    "is",
    "in",
    "I",
    "it",
    "that",
    "you",
    "for",
    "on",
    "with",
    "as",
    "be",
    "at",
)


class _Vocab:
    """Piece <-> id table shared by every FakeVLLM in the process.

    An id is a hash of its piece, hence the same in every instance and process, except
    on a hash collision: the piece the process meets second is spelled in byte tokens
    (ids 16..271), so decoding stays exact.
    """

    def __init__(self) -> None:
        self._ids: dict[str, tuple[int, ...]] = {p: (i,) for p, i in _SPECIAL_IDS.items()}
        self._pieces: dict[int, str] = {i: p for p, i in _SPECIAL_IDS.items()}
        self.single: dict[str, int] = dict(_SPECIAL_IDS)  # the pieces with one id: tokenize's fast path
        self._lock = threading.Lock()  # the server thread and the test thread both add pieces

    def ids(self, piece: str) -> tuple[int, ...]:
        found = self._ids.get(piece)
        return found if found is not None else self._add(piece)

    def text(self, token_id: int) -> str:
        if _BYTE_BASE <= token_id < _BYTE_BASE + 256:
            return bytes([token_id - _BYTE_BASE]).decode(errors="replace")
        return self._pieces.get(token_id, "<unk>")

    def _add(self, piece: str) -> tuple[int, ...]:
        with self._lock:
            if piece in self._ids:
                return self._ids[piece]
            data = piece.encode()
            token_id = _HASH_LOW + zlib.crc32(data) % (_HASH_HIGH - _HASH_LOW)
            owner = self._pieces.setdefault(token_id, piece)
            ids = (token_id,) if owner == piece else tuple(_BYTE_BASE + b for b in data)
            self._ids[piece] = ids
            if len(ids) == 1:
                self.single[piece] = ids[0]
            return ids


_VOCAB = _Vocab()


def tokenize(text: str) -> list[int]:
    """Deterministic, reversible toy tokenization: ``detokenize(tokenize(s)) == s``."""
    return _encode(text)[0]


def detokenize(token_ids: Sequence[int]) -> str:
    """Inverse of ``tokenize``; special tokens decode to their text, unknown ids to ``<unk>``."""
    out: list[str] = []
    pending = bytearray()
    for token_id in token_ids:
        if _BYTE_BASE <= token_id < _BYTE_BASE + 256:
            pending.append(token_id - _BYTE_BASE)
            continue
        if pending:
            out.append(pending.decode(errors="replace"))
            pending.clear()
        out.append(_VOCAB.text(token_id))
    return "".join(out) + pending.decode(errors="replace")


def _encode(text: str) -> tuple[list[int], list[str]]:
    """Token ids of ``text`` and the text each one adds (a byte-spelled piece lands on its last byte)."""
    pieces = _PIECE_RE.findall(text)
    try:
        return [_VOCAB.single[piece] for piece in pieces], pieces
    except KeyError:  # a piece seen for the first time, or spelled in bytes
        ids: list[int] = []
        texts: list[str] = []
        for piece in pieces:
            piece_ids = _VOCAB.ids(piece)
            ids.extend(piece_ids)
            texts.extend([""] * (len(piece_ids) - 1) + [piece])
        return ids, texts


def sampled_logprob(token_id: int) -> float:
    """The logprob reported for sampling ``token_id``: deterministic, in [-0.85, -0.05]."""
    return -(0.05 + (token_id % 17) / 20)


# ---------------------------------------------------------------- chat template


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts: vLLM joins the text parts with newlines
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def _assistant_text(content: str, calls: Sequence[tuple[str, str]]) -> str:
    """What the model generates for a turn; rendering history uses the same text."""
    blocks = (
        f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'
        for name, args in calls
    )
    return content + "\n".join(blocks)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation ChatML-style: the prompt whose ``tokenize`` is ``prompt_token_ids``.

    ``[{"role": "user", "content": "hi"}]`` renders to
    ``"<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n"``. An assistant turn with
    ``tool_calls`` renders as the fake generates it, so a follow-up prompt begins with the
    previous prompt's and completion's ids.
    """
    parts: list[str] = []
    rest = list(messages)
    if tools:
        listing = "\n".join(orjson.dumps(t, option=orjson.OPT_SORT_KEYS).decode() for t in tools)
        system = f"# Tools\n<tools>\n{listing}\n</tools>"
        if rest and rest[0].get("role") == "system":
            system = f"{_text(rest.pop(0).get('content'))}\n\n{system}"
        parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for message in rest:
        body = _text(message.get("content"))
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = [
                (f["name"], f["arguments"] if isinstance(f["arguments"], str) else json.dumps(f["arguments"]))
                for f in (c["function"] for c in message["tool_calls"])
            ]
            body = _assistant_text(body, calls)
        parts.append(f"<|im_start|>{message.get('role')}\n{body}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


# ---------------------------------------------------------------- port of vLLM's Hermes2ProToolParser

_TC_OPEN, _TC_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS_RE = re.compile(r'"arguments"\s*:\s*')


def _parse_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """``extract_tool_calls``: (content before the calls, [(name, arguments)])."""
    if _TC_OPEN not in text:
        return text, []
    try:
        raw_calls = [json.loads(a or b) for a, b in _TOOL_CALL_RE.findall(text)]
        calls = [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in raw_calls]
    except (ValueError, KeyError, TypeError):
        return text, []  # vLLM gives up and returns the raw text as content
    return text[: text.find(_TC_OPEN)] or None, calls


def _tag_overlap(text: str, tag: str) -> int:
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _tool_call_bodies(text: str) -> list[tuple[str, bool]]:
    """The JSON inside each ``<tool_call>`` so far, and whether it is complete."""
    bodies: list[tuple[str, bool]] = []
    pos = 0
    while (start := text.find(_TC_OPEN, pos)) != -1:
        body_start = start + len(_TC_OPEN)
        end = text.find(_TC_CLOSE, body_start)
        if end != -1:
            bodies.append((text[body_start:end].strip(), True))
            pos = end + len(_TC_CLOSE)
            continue
        raw = text[body_start:]
        raw = raw[: len(raw) - _tag_overlap(raw, _TC_CLOSE)].strip()
        complete = False
        if raw:
            with contextlib.suppress(ValueError):
                json.loads(raw)
                complete = True
        bodies.append((raw, complete))
        break
    return bodies


def _tool_arguments(body: str, complete: bool) -> str | None:
    match = _ARGS_RE.search(body)
    if match is None:
        return None
    raw = body[match.end() :]
    if complete:  # drop the brace closing the outer {"name", "arguments"} object
        raw = raw.rstrip()
        raw = raw[:-1].rstrip() if raw.endswith("}") else raw
    return raw


def _hermes_deltas(texts: Sequence[str], call_id: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """``extract_tool_calls_streaming`` run token by token: one delta, or None, per token."""
    deltas: list[dict[str, Any] | None] = []
    text, sent = "", 0
    streamed: list[str | None] = []  # per call: arguments sent so far, None until the name is
    for piece in texts:
        text += piece
        start = text.find(_TC_OPEN)
        sendable = start if start != -1 else len(text) - _tag_overlap(text, _TC_OPEN)
        content = text[sent:sendable] if sendable > sent else None
        sent = max(sent, sendable)
        calls: list[dict[str, Any]] = []
        for i, (body, complete) in enumerate(_tool_call_bodies(text)):
            if i == len(streamed):
                streamed.append(None)
            if streamed[i] is None:
                if (name := _NAME_RE.search(body)) is None:
                    break
                streamed[i] = ""
                calls.append({"id": call_id(i), "type": "function", "index": i, "function": {"name": name[1]}})
            sent_args = streamed[i] or ""
            args = _tool_arguments(body, complete)
            if args is not None and len(args) > len(sent_args):
                calls.append({"index": i, "function": {"arguments": args[len(sent_args) :]}})
                streamed[i] = args
        delta = {"content": content, "tool_calls": calls} if calls else {"content": content} if content else None
        deltas.append(delta)
    if deltas and (last := deltas[-1]) and "tool_calls" in last:
        # On the finishing token vLLM appends the last call's unstreamed arguments: "{}" if none went out.
        function = last["tool_calls"][-1]["function"]
        function["arguments"] = function.get("arguments", "") + ("" if streamed[-1] else "{}")
    return deltas
