"""The shape of a captured conversation (``tracetrain_core``), on hand-made messages and responses."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.gateway._keying import Conversation
from tracetrain_core import canonical_message, common_prefix, first_choice, reply_message, same_message

TOOL_CALL = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"b": 1, "a": 2}'}}
# A reply as vLLM stores it: a tool call and the null fields it adds.
VLLM_REPLY = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL], "reasoning_content": None,
              "refusal": None}  # fmt: skip


def test_the_canonical_form_is_the_one_the_stored_tail_hashes_were_made_of() -> None:
    # Tail hashes in the store are digests of these bytes (values from before the move to the store):
    # any change stops stored trajectories from threading after an upgrade.
    assert canonical_message(VLLM_REPLY) == b'["assistant","",null,[["get_weather","{\\"a\\":2,\\"b\\":1}"]]]'
    parts = {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
    assert canonical_message(parts) == b'["user","Hi there",null,[]]'
    image = {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]}
    assert canonical_message(image) == b'["user",[{"type":"text","text":"Hi"},{"type":"image_url"}],null,[]]'
    tool = {"role": "tool", "tool_call_id": "call-1", "name": "get_weather", "content": "18 C"}
    assert canonical_message(tool) == b'["tool","18 C","get_weather",[]]'
    conversation = Conversation("agent", [{"role": "system", "content": "Be brief."}, parts])
    assert conversation.task_key == "7a2dc3aabf75ca9541fe02788d0e5876"
    assert conversation.tail_after(VLLM_REPLY) == "d064e5d4d26f625cb52170effe3443c6"


def test_a_message_sent_back_reserialized_is_the_same_message() -> None:
    echoed = {
        "role": "assistant",
        "tool_calls": [{"id": "other-id", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"a": 2, "b": 1}'}}],
    }  # fmt: skip
    assert same_message(echoed, VLLM_REPLY)
    parts = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    assert same_message(parts, {"role": "user", "content": "Hi"})
    assert not same_message({"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi!"})
    assert not same_message({"role": "user", "content": "Hi"}, {"role": "system", "content": "Hi"})
    assert not same_message("Hi", {"role": "user", "content": "Hi"})


def test_the_reply_is_the_first_choice_as_an_assistant_message() -> None:
    response: dict[str, Any] = {"choices": [{"index": 0, "message": VLLM_REPLY}, {"index": 1, "message": {}}]}
    reply = reply_message(response)
    assert reply == VLLM_REPLY and reply is not VLLM_REPLY  # a copy: callers may change it
    assert reply_message({"choices": [{"message": {"content": "Hi"}}]}) == {"role": "assistant", "content": "Hi"}
    completion = {"choices": [{"index": 0, "text": "Paris"}]}
    assert first_choice(completion) == {"index": 0, "text": "Paris"} and reply_message(completion) is None
    for failed in (None, {}, {"choices": []}, {"choices": ["not a choice"]}):
        assert first_choice(failed) is None and reply_message(failed) is None


def test_common_prefix_counts_the_leading_items_all_sequences_share() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], [1, 2, 3]) == 3
    assert common_prefix([1, 2], [9]) == 0
    assert common_prefix([1, 2, 3]) == 3  # alone, a sequence shares all of itself
    assert common_prefix([], [1]) == 0
    sent = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, {"role": "user", "content": "?"}]
    assert common_prefix(sent, [{"role": "user", "content": "Hi"}], same=same_message) == 1
    with pytest.raises(ValueError):
        common_prefix()
