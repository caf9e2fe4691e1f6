"""Compact capture: a call that continues an earlier call of its trajectory stores only what is new.

Call k of a multi-turn trajectory repeats call k-1: its prompt is that call's prompt, its
completion and the next message; its request carries every earlier message again. Stored
whole, a trajectory's rows grow as the square of its length (a 40-turn trajectory whose
prompt reaches 8k tokens stored ~160k ids where ~8k are new). So a call's row keeps only the
prompt ids after the prefix it shares with an earlier call's prompt + completion, and only the
request's messages after those it shares with that call's request; three columns say how to
rebuild the rest (``calls.prefix_of``, ``prefix_tokens``, ``prefix_messages``).

Writing: ``Chains`` holds, in the process's memory, the last recorded call of each trajectory
(its id, its ids as 4-byte integers, its messages), bounded in bytes (the ids', the messages' as
JSON, a client may send megabytes in a message field that vLLM never renders, and the objects'
overhead, measured) and in trajectories, least recently used first out, none older than an hour; a trajectory whose
messages alone would take an eighth of the bound keeps its ids only. Nothing is read from the
store for it, so the request path gains no query. A call whose trajectory it does not hold
(recorded by another replica, before a restart, or evicted) is stored whole, as before. Only a
committed call becomes a reference, so a row never names one that was not written; calls are
deleted with their whole trajectory only, and never a trajectory touched within two hours
(``store._retention``), so a reference never dangles.

Reading: ``expand`` rebuilds every compact row of a read from the rows it refers to, which the
read holds because every read of calls takes whole trajectories. Readers (the data API, the
dashboard, export, the trainer, the judge) see the ids and messages they saw before; the three
columns are dropped from what they get.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from store._errors import StoreError
from store._redact import redact

COMPACT_COLUMNS = ("prefix_of", "prefix_tokens", "prefix_messages")
_WHOLE = {"prefix_of": None, "prefix_tokens": 0, "prefix_messages": 0}
_ITEM = 4  # bytes per id in a sequence held in memory
# What a held trajectory and each of its held messages take beyond their ids and JSON, as CPython 3.11 lays them
# out (the entry, its key and id, the sequence and size arrays; a message's dict and its small strings):
# measured with tracemalloc, 1,030 bytes for a one-message trajectory of 42 ids whose message is 81 bytes of JSON.
_PER_TRAJECTORY = 512
_PER_MESSAGE = 256
# What the writer's memory of recent calls may hold: bytes of ids and messages of all trajectories together,
# and trajectories.
MAX_BYTES = 64_000_000
MAX_TRAJECTORIES = 20_000
# A call older than this is no reference: retention never deletes a trajectory touched more recently than
# twice this (store._retention.MIN_AGE_S), so a reference always names a row that is still there.
MAX_REFERENCE_AGE_S = 3600.0


@dataclass(slots=True)
class _Last:
    """The last committed call of a trajectory."""

    call_id: str
    sequence: bytes  # its prompt + completion ids, 4-byte integers
    messages: list[Any] | None  # its request's messages as the client sent them (None: too large to hold)
    sizes: array[int]  # bytes of messages[: i + 1] as JSON, for each i
    at: float  # when it was recorded (time.monotonic())

    @property
    def held_bytes(self) -> int:
        """What it takes in memory, about: its ids, its messages as JSON, and its objects' overhead."""
        held = len(self.sequence) + _PER_TRAJECTORY
        if self.messages is not None and self.sizes:
            held += self.sizes[-1] + _PER_MESSAGE * len(self.sizes)
        return held


class Chains:
    """The last recorded call of each recent trajectory: what a new call of it is stored against."""

    def __init__(self, *, max_bytes: int = MAX_BYTES, max_trajectories: int = MAX_TRAJECTORIES) -> None:
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self._max_bytes = max_bytes
        self._max_trajectories = max_trajectories
        self._bytes = 0
        self._ids = 0

    def __len__(self) -> int:
        return len(self._last)

    @property
    def token_ids(self) -> int:
        """The prompt and completion ids held in memory, over every trajectory."""
        return self._ids

    @property
    def held_bytes(self) -> int:
        """The bytes held, over every trajectory (about: ids 4 each, messages as JSON, the objects' overhead);
        at most ``max_bytes``."""
        return self._bytes

    def stored_row(self, trajectory_id: str, call: dict[str, Any]) -> dict[str, Any]:
        """The row to store for ``call``: compact when it continues its trajectory's last call, else whole.

        ``call`` itself is left as it is (the metrics and exporters read it after the record).
        """
        last = self._last.get(trajectory_id)
        if last is None or time.monotonic() - last.at > MAX_REFERENCE_AGE_S:
            return call | _WHOLE
        prompt = call.get("prompt_token_ids") or []
        tokens = _shared_prefix(_pack(prompt), last.sequence) if prompt else 0
        request = call.get("request")
        messages: Any = request.get("messages") if isinstance(request, dict) else None
        n_messages = _shared_messages(messages, last.messages)
        if tokens == 0 and n_messages == 0:
            return call | _WHOLE
        row = call | {"prefix_of": last.call_id, "prefix_tokens": tokens, "prefix_messages": n_messages}
        row["prompt_token_ids"] = prompt[tokens:]
        if n_messages:
            assert isinstance(request, dict)  # the messages were its
            row["request"] = {**request, "messages": messages[n_messages:]}
        return row

    def remember(self, trajectory_id: str, call: dict[str, Any], shared_messages: int = 0) -> None:
        """``call`` (whole, as built) committed: the next call of its trajectory is stored against it.

        ``shared_messages``: how many of its messages its stored row shared with the call before
        (``stored_row``'s ``prefix_messages``): their sizes are known already.
        """
        prompt = call.get("prompt_token_ids")
        if call.get("status_code") != 200 or not prompt:
            return  # a failed call is no prefix of the next
        request = call.get("request")
        messages = request.get("messages") if isinstance(request, dict) else None
        sequence = _pack(prompt) + _pack(call.get("completion_token_ids") or [])
        previous = self._last.pop(trajectory_id, None)
        if previous is not None:
            self._drop(previous)
        kept, sizes = self._sizes(messages, previous, shared_messages)
        last = _Last(call["id"], sequence, kept, sizes, time.monotonic())
        self._last[trajectory_id] = last
        self._bytes += last.held_bytes
        self._ids += len(sequence) // _ITEM
        while self._last and (self._bytes > self._max_bytes or len(self._last) > self._max_trajectories):
            _, evicted = self._last.popitem(last=False)
            self._drop(evicted)

    def forget(self, trajectory_ids: Iterable[str]) -> None:
        """Trajectories deleted (retention): a new call of the same id starts whole."""
        for trajectory_id in trajectory_ids:
            gone = self._last.pop(trajectory_id, None)
            if gone is not None:
                self._drop(gone)

    def _drop(self, last: _Last) -> None:
        self._bytes -= last.held_bytes
        self._ids -= len(last.sequence) // _ITEM

    def _sizes(self, messages: Any, previous: _Last | None, shared: int) -> tuple[list[Any] | None, array[int]]:
        """The messages to hold (None: none, or too large) and their running sizes as JSON.

        Only the messages after ``shared`` are measured: the ones before are the previous call's.
        """
        if not isinstance(messages, list):
            return None, array("q")
        known = previous.sizes if previous is not None and previous.messages is not None else array("q")
        shared = min(shared, len(known), len(messages))
        sizes = known[:shared]
        total = sizes[-1] if shared else 0
        try:
            for message in messages[shared:]:
                total += len(orjson.dumps(message))
                sizes.append(total)
        except orjson.JSONEncodeError:
            return None, array("q")
        if total > self._max_bytes // 8:  # one trajectory may not push every other one out: its ids only
            return None, array("q")
        return messages, sizes


def _pack(ids: list[int]) -> bytes:
    return array("i", ids).tobytes()


def _shared_prefix(prompt: bytes, sequence: bytes) -> int:
    """How many leading ids ``prompt`` shares with ``sequence`` (compared as bytes, in C)."""
    if prompt.startswith(sequence):  # the usual turn: the whole previous prompt and completion, then more
        return len(sequence) // _ITEM
    n = min(len(prompt), len(sequence)) // _ITEM
    lo, hi = 0, n + 1  # prompt[:lo] matches, prompt[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prompt[lo * _ITEM : mid * _ITEM] == sequence[lo * _ITEM : mid * _ITEM]:
            lo = mid
        else:
            hi = mid
    return lo


def _shared_messages(messages: Any, previous: list[Any] | None) -> int:
    if not isinstance(messages, list) or not previous:
        return 0
    n = min(len(messages), len(previous))
    if messages[:n] == previous[:n]:
        return n
    shared = 0
    while shared < n and messages[shared] == previous[shared]:
        shared += 1
    return shared


def expand(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rebuild, in place, the prompt ids and messages of ``rows``' compact calls; drop the columns that say how;
    redact the errors (``store._redact``).

    ``rows`` must hold every call a compact row refers to (a read of whole trajectories
    does); the keys a read did not select (``prompt_token_ids``, ``request``) are left out of
    the rebuild. Returns ``rows``.
    """
    by_id = {row["id"]: row for row in rows if "id" in row}
    for row in rows:
        _whole(row, by_id)
    for row in rows:
        for name in COMPACT_COLUMNS:
            row.pop(name, None)
        if row.get("error"):  # stored before errors were redacted on the way in (store._record_check)
            row["error"] = redact(str(row["error"]))
    return rows


def _whole(row: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> None:
    chain = []
    while row.get("prefix_of") is not None:
        chain.append(row)
        ref = by_id.get(row["prefix_of"])
        if ref is None:
            raise StoreError(f"call {row.get('id')} continues call {row['prefix_of']}, which this read does not hold")
        row = ref
    for compact in reversed(chain):  # the oldest first: each rebuilds from a whole one
        ref = by_id[compact["prefix_of"]]
        if "prompt_token_ids" in compact:
            sequence = ref["prompt_token_ids"] + ref["completion_token_ids"]
            compact["prompt_token_ids"] = sequence[: compact["prefix_tokens"]] + compact["prompt_token_ids"]
        n_messages = compact.get("prefix_messages") or 0
        if n_messages and "request" in compact:
            earlier = ref["request"]["messages"][:n_messages]
            compact["request"] = compact["request"] | {"messages": earlier + compact["request"]["messages"]}
        compact["prefix_of"] = None
