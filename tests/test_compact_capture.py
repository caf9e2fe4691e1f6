"""Compact capture (store._compact): a call that continues its trajectory stores only what is new,
and every reader still sees the whole prompt ids and messages."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

from store import ExportFilter, RewardIn, Store
from store._compact import Chains, expand

SYSTEM = {"role": "system", "content": "You answer briefly. " * 20}


def converse(proxy: RunningProxy, trajectory_id: str, turns: int) -> list[list[dict[str, Any]]]:
    """A multi-turn conversation keyed by header; returns the messages each call sent."""
    client = proxy.client(default_headers={"X-Trajectory-Id": trajectory_id})
    messages: list[dict[str, Any]] = [SYSTEM]
    sent = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question number {turn}: what comes next?"})
        sent.append(list(messages))
        reply = client.chat.completions.create(model="agent", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return sent


def test_a_multi_turn_trajectory_stores_each_prompt_once_and_reads_back_whole(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    fake.script(*(Reply(content=f"Answer {i} is here.") for i in range(6)))
    sent = converse(proxy, "multi", 6)

    stored = proxy.rows("SELECT * FROM calls WHERE trajectory_id = 'multi' ORDER BY pk")
    got = httpx.get(f"{proxy.v1}/trajectories/multi").json()["calls"]
    for i, (call, messages, row) in enumerate(zip(got, sent, stored, strict=True)):
        assert call["prompt_token_ids"] == fake.tokenize(fake.render_chat(messages, None))
        assert call["request"]["messages"] == messages
        assert not {"prefix_of", "prefix_tokens", "prefix_messages"} & call.keys()
        if i == 0:
            assert row["prefix_of"] is None
            continue
        # The row holds only the ids after the previous call's prompt + completion, and the new messages.
        previous = got[i - 1]
        whole = previous["prompt_token_ids"] + previous["completion_token_ids"]
        assert row["prefix_of"] == previous["id"] and row["prefix_tokens"] == len(whole)
        assert json.loads(row["prompt_token_ids"]) == call["prompt_token_ids"][len(whole) :]
        assert row["prefix_messages"] == len(sent[i - 1])
        assert json.loads(row["request"])["messages"] == messages[len(sent[i - 1]) :]
    stored_ids = sum(len(json.loads(row["prompt_token_ids"])) for row in stored)
    whole_ids = sum(len(call["prompt_token_ids"]) for call in got)
    assert stored_ids * 3 < whole_ids


def test_an_edited_history_is_stored_against_the_prefix_it_still_shares(proxy: RunningProxy, fake: FakeVLLM) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": "edited"})
    first = [SYSTEM, {"role": "user", "content": "Tell me a story about a cat."}]
    client.chat.completions.create(model="agent", messages=first)
    # The agent drops its last turn and asks something else: only the system message is shared.
    second = [SYSTEM, {"role": "user", "content": "Rather a story about a dog."}]
    client.chat.completions.create(model="agent", messages=second)

    row = proxy.rows("SELECT * FROM calls WHERE trajectory_id = 'edited' ORDER BY pk")[1]
    whole = fake.tokenize(fake.render_chat(second, None))
    assert row["prefix_messages"] == 1 and 0 < row["prefix_tokens"] < len(whole)
    got = httpx.get(f"{proxy.v1}/trajectories/edited").json()["calls"][1]
    assert got["prompt_token_ids"] == whole and got["request"]["messages"] == second


def test_a_failed_call_is_never_a_reference(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="One."), Reply(status=500, error_message="engine died"), Reply(content="Three."))
    client = proxy.client(default_headers={"X-Trajectory-Id": "failing"})
    messages = [SYSTEM, {"role": "user", "content": "Count with me."}]
    client.chat.completions.create(model="agent", messages=messages)
    messages += [{"role": "assistant", "content": "One."}, {"role": "user", "content": "Go on."}]
    with contextlib.suppress(openai.APIStatusError):  # the upstream's 500 reaches the client as an error
        client.chat.completions.create(model="agent", messages=messages)
    client.chat.completions.create(model="agent", messages=messages)

    first, failed, third = proxy.rows("SELECT id, prefix_of, status_code FROM calls ORDER BY pk")
    assert failed["status_code"] != 200 and third["prefix_of"] == first["id"]
    calls = httpx.get(f"{proxy.v1}/trajectories/failing").json()["calls"]
    assert calls[2]["prompt_token_ids"] == fake.tokenize(fake.render_chat(messages, None))


def test_the_trainer_and_export_read_the_whole_prompts(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM
) -> None:
    proxy = start_proxy()
    sent = converse(proxy, "for-training", 4)
    proxy.stop()

    async def read() -> tuple[list[Any], list[Any]]:
        store = await Store.open(f"sqlite+aiosqlite:///{proxy.db_path}", capture=False)
        try:
            (group,) = {row["group_id"] for row in proxy.rows("SELECT group_id FROM calls")}
            await store.add_rewards([RewardIn("for-training", 1.0)])
            (trajectory,) = await store.jobs.rewarded_trajectories([group], policy="agent")
            exported = [page async for page in store.export.pages(ExportFilter(), 10**9, 10)]
            return trajectory.calls, exported[0].calls["for-training"]
        finally:
            await store.close()

    trained, exported = asyncio.run(read())
    expected = [fake.tokenize(fake.render_chat(messages, None)) for messages in sent]
    assert [c.prompt_token_ids for c in trained] == expected
    assert [c["prompt_token_ids"] for c in exported] == expected
    assert [c["request"]["messages"] for c in exported] == sent


def test_metrics_show_what_compact_capture_holds_in_memory(proxy: RunningProxy, fake: FakeVLLM) -> None:
    """Each trajectory's last call is held (bounded): /metrics shows how many, and how many token ids."""
    fake.script(*(Reply(content=f"Answer {i} is here.") for i in range(4)))
    converse(proxy, "held-a", 3)
    converse(proxy, "held-b", 1)

    calls = [httpx.get(f"{proxy.v1}/trajectories/{tid}").json()["calls"][-1] for tid in ("held-a", "held-b")]
    held_ids = sum(len(c["prompt_token_ids"]) + len(c["completion_token_ids"]) for c in calls)
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'tracetrain_compact_capture_held{what="trajectories"} 2.0' in metrics
    assert f'tracetrain_compact_capture_held{{what="token_ids"}} {float(held_ids)}' in metrics


def test_chains_forget_the_least_recently_used_trajectory_past_their_budget() -> None:
    chains = Chains(max_bytes=1_100, max_trajectories=100)  # two calls of 5 ids (and 512 bytes of objects each)
    call = {"id": "c-a", "status_code": 200, "prompt_token_ids": [1, 2, 3, 4], "completion_token_ids": [5],
            "request": {"messages": []}}  # fmt: skip
    chains.remember("a", call)
    chains.remember("b", call | {"id": "c-b"})
    chains.remember("c", call | {"id": "c-c"})  # a third: "a" goes
    assert len(chains) == 2
    assert chains.stored_row("a", call)["prefix_of"] is None
    assert chains.stored_row("c", call | {"prompt_token_ids": [1, 2, 3, 4, 5, 6]})["prefix_tokens"] == 5


def test_compact_captures_memory_is_bounded_in_bytes_not_ids() -> None:
    """40 calls carrying a 2 MB field vLLM never renders (few token ids) held 90 MB, for good: bytes are the bound."""
    chains = Chains(max_bytes=20_000_000)
    for i in range(40):
        big = {"role": "user", "content": "Hi", "attachment": "x" * 2_000_000}
        call = {"id": f"c-{i}", "status_code": 200, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4],
                "request": {"messages": [big]}}  # fmt: skip
        chains.remember(f"t-{i}", call)
        assert chains.held_bytes <= 20_000_000
    assert 8 <= len(chains) <= 10 and chains.held_bytes > 16_000_000  # the newest ones, as many as fit
    assert chains.stored_row("t-39", {"prompt_token_ids": [1, 2, 3, 4, 5], "request": {"messages": [big]}}) == {
        "prompt_token_ids": [5], "request": {"messages": []}, "prefix_of": "c-39", "prefix_tokens": 4,
        "prefix_messages": 1,
    }  # fmt: skip


def test_one_trajectory_too_large_to_hold_keeps_its_ids_only() -> None:
    chains = Chains(max_bytes=8_000_000)
    huge = {"role": "user", "content": "y" * 1_500_000}  # more than an eighth of the bound
    chains.remember("t", {"id": "c-1", "status_code": 200, "prompt_token_ids": [1, 2], "completion_token_ids": [3],
                          "request": {"messages": [huge]}})  # fmt: skip
    assert chains.held_bytes < 1_000  # its ids and its entry
    row = chains.stored_row("t", {"prompt_token_ids": [1, 2, 3, 9], "request": {"messages": [huge]}})
    assert row["prefix_tokens"] == 3 and row["prefix_messages"] == 0 and row["request"]["messages"] == [huge]


def test_the_bytes_held_follow_each_call_and_show_on_metrics(proxy: RunningProxy) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": "bytes"})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi", "notes": "n" * 100_000}]
    for turn in range(3):
        reply = client.chat.completions.create(model="agent", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And {turn}?"}]  # fmt: skip
    held = json.dumps(messages[:-1], separators=(",", ":"))
    metrics = httpx.get(f"{proxy.url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith('tracetrain_compact_capture_held{what="bytes"}'))
    assert len(held) < float(line.split()[-1]) < len(held) + 3_000  # the messages as JSON, the ids, the objects


def test_expand_rebuilds_a_chain_read_in_any_order() -> None:
    rows = [
        {"id": "c3", "prefix_of": "c2", "prefix_tokens": 4, "prefix_messages": 0, "prompt_token_ids": [9],
         "completion_token_ids": []},
        {"id": "c1", "prefix_of": None, "prefix_tokens": 0, "prefix_messages": 0, "prompt_token_ids": [1, 2],
         "completion_token_ids": [3]},
        {"id": "c2", "prefix_of": "c1", "prefix_tokens": 2, "prefix_messages": 0, "prompt_token_ids": [7],
         "completion_token_ids": [8]},
    ]  # fmt: skip
    expand(rows)
    assert [row["prompt_token_ids"] for row in rows] == [[1, 2, 7, 8, 9], [1, 2], [1, 2, 7]]
    assert all("prefix_of" not in row for row in rows)
