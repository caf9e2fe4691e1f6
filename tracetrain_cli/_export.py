"""Exporting captured trajectories as a dataset: one row per trajectory, JSONL or Parquet.

What the agent did and what it earned, in a file that ``datasets.load_dataset("json" |
"parquet", data_files=...)`` loads as is: for SFT (``tracetrain sft`` trains on it), for
analysis, or for another trainer. A row::

    id, group_id, policy, reward, reward_source, reward_note, demonstration, metrics, created_at, rewarded_at, n_calls,
    messages   the last answered chat call's request messages + its response message (failed calls left out)
    tools      that call's ``tools`` as JSON text (TRL's SFTTrainer reads it so), or null
    calls      every call in order: id, endpoint, version, served_model, status_code,
               messages (chat request) | prompt (completions request, as text), tools,
               response (the first choice as an assistant message), prompt_token_ids,
               completion_token_ids, logprobs, finish_reason, started_at

Token ids and logprobs are the store's, exactly as vLLM sampled them. Every object in a
row has the same keys in every row, because a dataset needs one schema, and because
``datasets`` re-encodes a JSON Lines file through pandas' ujson, which keeps 10 digits of
a float, as soon as one object's keys differ from another's (logprobs would no longer
round-trip). So messages have one shape (``role, content, name, tool_calls,
tool_call_id``; absent fields null): content given as parts is joined into its text, and
fields outside that shape (images, audio, refusals) are not exported
(``GET /v1/trajectories/{id}`` has the raw request). ``metrics`` holds every metric name
any exported trajectory has (null where a trajectory lacks one), found by a first pass
over the selected trajectories; it is null when none has metrics.

Trajectories are read in pages (keyset on the primary key, up to the newest one when the
export started) and written as each page arrives, so memory stays flat however large the
store is. The file appears under its name only once complete (written beside it, renamed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import orjson

from store import ExportFilter, Store
from tracetrain_core import call_messages, call_reply, call_tools, first_choice

ExportFormat = Literal["jsonl", "parquet"]
FORMATS: tuple[ExportFormat, ...] = ("jsonl", "parquet")
PAGE_SIZE = 256  # trajectories per read; their calls come in one query


# -- shaping ----------------------------------------------------------------------------------


def trajectory_row(
    trajectory: Mapping[str, Any], calls: Sequence[Mapping[str, Any]], metric_names: Sequence[str]
) -> dict[str, Any]:
    """One export row from a trajectories row, its calls rows (in order) and the export's metric names."""
    shaped = [call_row(call) for call in calls]
    metrics = trajectory["metrics"] or {}
    # A failed call is no answer, though a broken stream's record keeps what came before the failure.
    answered = (c for c in reversed(shaped) if c["status_code"] == 200 and c["messages"] is not None)
    last = next((c for c in answered if c["response"] is not None), None)
    return {
        "id": trajectory["id"],
        "group_id": trajectory["group_id"],
        "policy": trajectory["policy"],
        "reward": trajectory["reward"],
        "reward_source": trajectory["reward_source"],  # "service", "judge" or "human" (a person's score)
        "reward_note": trajectory["reward_note"],  # the person's note, or the judge's explanation
        "demonstration": trajectory.get("demonstration"),  # the answer a person wanted, with their score
        "metrics": {name: _number(metrics.get(name)) for name in metric_names} if metric_names else None,
        "created_at": trajectory["created_at"],
        "rewarded_at": trajectory["rewarded_at"],
        "n_calls": len(shaped),
        "messages": [*last["messages"], last["response"]] if last else None,
        "tools": last["tools"] if last else None,
        "calls": shaped,
    }


def call_row(call: Mapping[str, Any]) -> dict[str, Any]:
    request = call["request"] or {}
    sent = call_messages(call["endpoint"], request)  # chat, Responses and Messages calls alike; None: a text prompt
    chat = sent is not None
    tools = call_tools(call["endpoint"], request)
    return {
        "id": call["id"],
        "endpoint": call["endpoint"],
        "version": call["version"],
        "served_model": call["served_model"],
        "status_code": call["status_code"],
        "messages": [message(m) for m in sent] if sent is not None else None,
        "prompt": None if chat else _prompt_text(request.get("prompt")),
        "tools": orjson.dumps(tools).decode() if tools else None,
        "response": _response_message(call["endpoint"], call["response"], chat),
        "prompt_token_ids": list(call["prompt_token_ids"] or ()),
        "completion_token_ids": list(call["completion_token_ids"] or ()),
        "logprobs": list(call["logprobs"] or ()),
        "finish_reason": call["finish_reason"],
        "started_at": call["started_at"],
    }


def message(raw: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message in the export's one shape (see the module docstring)."""
    name, tool_call_id = raw.get("name"), raw.get("tool_call_id")
    return {
        "role": str(raw.get("role") or ""),
        "content": _text(raw.get("content")),
        "name": name if isinstance(name, str) else None,
        "tool_calls": _tool_calls(raw.get("tool_calls")),
        "tool_call_id": tool_call_id if isinstance(tool_call_id, str) else None,
    }


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, as the proxy's threading reads them
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return orjson.dumps(content).decode()


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    shaped = []
    for call in calls or ():
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
        arguments = function.get("arguments")
        shaped.append(
            {
                "id": call.get("id"),
                "type": call.get("type") or "function",
                "function": {
                    "name": function.get("name"),
                    # OpenAI sends arguments as JSON text; a client that sent an object gets it as text too.
                    "arguments": arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode(),
                },
            }
        )
    return shaped or None  # vLLM answers "tool_calls": [] for none: one spelling, null


def _prompt_text(prompt: Any) -> str | None:
    if prompt is None or isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return orjson.dumps(prompt).decode()  # token ids or several prompts: kept, as JSON text


def _response_message(endpoint: str, response: Mapping[str, Any] | None, chat: bool) -> dict[str, Any] | None:
    if chat:
        reply = call_reply(endpoint, response)
        return message(reply) if reply is not None else None
    first = first_choice(response)
    return message({"role": "assistant", "content": first.get("text")}) if first is not None else None


# -- writing ------------------------------------------------------------------------------------


class _Writer(Protocol):
    def write(self, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class _JsonlWriter:
    def __init__(self, path: Path) -> None:
        self._file = path.open("wb")

    def write(self, rows: list[dict[str, Any]]) -> None:
        self._file.write(b"".join(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE) for row in rows))

    def close(self) -> None:
        self._file.close()


def arrow_schema(metric_names: Sequence[str]) -> Any:
    """The Parquet file's schema: fixed, so every page (row group) has the same one."""
    import pyarrow as pa  # type: ignore[import-untyped]  # no stubs

    tool_call = pa.struct(
        [
            ("id", pa.string()),
            ("type", pa.string()),
            ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
        ]
    )
    message_type = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("name", pa.string()),
            ("tool_calls", pa.list_(tool_call)),
            ("tool_call_id", pa.string()),
        ]
    )
    call = pa.struct(
        [
            ("id", pa.string()),
            ("endpoint", pa.string()),
            ("version", pa.int64()),
            ("served_model", pa.string()),
            ("status_code", pa.int64()),
            ("messages", pa.list_(message_type)),
            ("prompt", pa.string()),
            ("tools", pa.string()),
            ("response", message_type),
            ("prompt_token_ids", pa.list_(pa.int64())),
            ("completion_token_ids", pa.list_(pa.int64())),
            ("logprobs", pa.list_(pa.float64())),
            ("finish_reason", pa.string()),
            ("started_at", pa.float64()),
        ]
    )
    return pa.schema(
        [
            ("id", pa.string()),
            ("group_id", pa.string()),
            ("policy", pa.string()),
            ("reward", pa.float64()),
            ("reward_source", pa.string()),
            ("reward_note", pa.string()),
            ("demonstration", pa.string()),
            # Parquet has no empty struct: with no metric names, the column is all null.
            ("metrics", pa.struct([(name, pa.float64()) for name in metric_names]) if metric_names else pa.null()),
            ("created_at", pa.float64()),
            ("rewarded_at", pa.float64()),
            ("n_calls", pa.int64()),
            ("messages", pa.list_(message_type)),
            ("tools", pa.string()),
            ("calls", pa.list_(call)),
        ]
    )


class _ParquetWriter:
    def __init__(self, path: Path, metric_names: Sequence[str]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq  # type: ignore[import-untyped]  # no stubs

        self._pa = pa
        self._schema = arrow_schema(metric_names)
        self._writer = pq.ParquetWriter(path, self._schema)

    def write(self, rows: list[dict[str, Any]]) -> None:
        self._writer.write_table(self._pa.Table.from_pylist(rows, schema=self._schema))

    def close(self) -> None:
        self._writer.close()


def parquet_problem() -> str | None:
    """Why Parquet cannot be written here (pyarrow missing), or None."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return "writing Parquet needs pyarrow: pip install pyarrow (it comes with pip install 'tracetrain[train]')"
    return None


async def export_trajectories(
    url: str,
    out: Path,
    fmt: ExportFormat,
    where: ExportFilter,
    *,
    page_size: int = PAGE_SIZE,
    on_rows: Callable[[int], None] | None = None,
) -> int:
    """Write the trajectories ``where`` selects to ``out``; returns how many rows were written.

    ``on_rows`` is called with each page's row count (a progress bar). ``out`` is replaced
    only once the new file is complete.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    store = await Store.open(url, capture=False)
    written = 0
    try:
        newest = await store.export.newest_key()
        metrics = await store.export.metric_names(where, newest)
        writer: _Writer = _ParquetWriter(work, metrics) if fmt == "parquet" else _JsonlWriter(work)
        try:
            async for page in store.export.pages(where, newest, page_size):
                rows = [trajectory_row(t, page.calls[t["id"]], metrics) for t in page.trajectories]
                writer.write(rows)
                written += len(rows)
                if on_rows is not None:
                    on_rows(len(rows))
        finally:
            writer.close()
        work.replace(out)
    finally:
        work.unlink(missing_ok=True)
        await store.close()
    return written
