"""The SSE decoder against the WHATWG HTML standard's own examples, and its line-end and chunking rules.

The examples are quoted from https://html.spec.whatwg.org/multipage/server-sent-events.html
(section 9.2.5, "Parsing an event stream" and 9.2.6 "Interpreting an event stream").
"""

from __future__ import annotations

import pytest

from proxy.gateway.upstream._sse import ServerSentEvent, SSEDecoder


def decode(stream: bytes, chunk_size: int | None = None) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    size = chunk_size or max(1, len(stream))
    return [event for i in range(0, len(stream), size) for event in decoder.feed(stream[i : i + size])]


def every_split(stream: bytes) -> list[list[ServerSentEvent]]:
    """The events for the stream whole, byte by byte, and cut in two at every position."""
    results = [decode(stream), decode(stream, 1)]
    for cut in range(1, len(stream)):
        decoder = SSEDecoder()
        results.append(decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]))
    return results


def test_spec_stock_example_joins_data_lines_with_lf() -> None:
    stream = b"data: YHOO\ndata: +2\ndata: 10\n\n"
    for events in every_split(stream):
        assert events == [ServerSentEvent(b"YHOO\n+2\n10")]


def test_spec_example_comment_ids_and_one_space_removed() -> None:
    stream = b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\ndata:  third event\n"
    for events in every_split(stream):
        # The comment block fires nothing; "id" alone resets the last event id; the last block
        # has no blank line after it, so it is dropped.
        assert events == [ServerSentEvent(b"first event", id="1"), ServerSentEvent(b"second event", id="")]
    assert decode(stream + b"\n")[-1] == ServerSentEvent(b" third event", id="")


def test_spec_example_empty_data_and_a_single_newline() -> None:
    stream = b"data\n\ndata\ndata\n\ndata:"
    for events in every_split(stream):
        assert events == [ServerSentEvent(b""), ServerSentEvent(b"\n")]


def test_spec_example_with_and_without_the_space_are_identical() -> None:
    stream = b"data:test\n\ndata: test\n\n"
    for events in every_split(stream):
        assert events == [ServerSentEvent(b"test"), ServerSentEvent(b"test")]


def test_spec_example_event_types() -> None:
    stream = b"event: add\ndata: 73857293\n\nevent: remove\ndata: 2153\n\nevent: add\ndata: 113411\n\n"
    for events in every_split(stream):
        assert [(e.event, e.data) for e in events] == [("add", b"73857293"), ("remove", b"2153"), ("add", b"113411")]


@pytest.mark.parametrize("end", [b"\r\n", b"\r", b"\n"], ids=["crlf", "cr", "lf"])
def test_every_line_end_the_spec_allows(end: bytes) -> None:
    stream = end.join([b"data: a", b"data: b", b"", b": comment", b"id: 7", b"data: c", b"", b""])
    for events in every_split(stream):
        assert events == [ServerSentEvent(b"a\nb"), ServerSentEvent(b"c", id="7")]


def test_mixed_line_ends_and_a_crlf_split_between_chunks() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []
    assert decoder.feed(b"\n") == []  # the LF of a CRLF: not a second (blank) line
    assert decoder.feed(b"\r") == [ServerSentEvent(b"x")]
    assert decoder.feed(b"\ndata: y\n\r\n") == [ServerSentEvent(b"y")]


def test_a_leading_byte_order_mark_is_ignored_once() -> None:
    stream = b"\xef\xbb\xbfdata: a\n\n\xef\xbb\xbfdata: b\n\n"
    for events in every_split(stream):
        # The second BOM is part of a field name that is not "data": that line is ignored.
        assert events == [ServerSentEvent(b"a")]


def test_event_type_resets_after_each_dispatch_and_without_data() -> None:
    stream = b"event: lonely\n\ndata: a\n\nevent: named\ndata: b\n\ndata: c\n\n"
    assert [(e.event, e.data) for e in decode(stream)] == [("message", b"a"), ("named", b"b"), ("message", b"c")]


def test_id_with_nul_is_ignored_and_retry_needs_digits() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"id: 5\nretry: 3000\n\nid: x\x00y\nretry: 1s\n\n")
    assert (decoder.last_event_id, decoder.retry_ms) == ("5", 3000)


def test_unknown_fields_and_field_without_colon_are_ignored() -> None:
    stream = b"foo: bar\nbaz\ndata: kept\n\n"
    assert decode(stream) == [ServerSentEvent(b"kept")]


def test_vllm_stream_yields_each_json_payload() -> None:
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    for events in every_split(stream):
        assert [e.data for e in events] == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
