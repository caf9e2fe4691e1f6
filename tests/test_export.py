"""``tracetrain export``: captured trajectories as a JSONL or Parquet dataset that HF ``datasets`` loads.

The data is real capture: the proxy in front of the fake vLLM, rewards posted over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from conftest import RunningProxy
from datasets import load_dataset
from fake_vllm import FakeVLLM, Reply, ToolCall

from tracetrain_cli._export import ExportFilter, export_trajectories
from tracetrain_cli._main import main

SYSTEM = {"role": "system", "content": "You answer in one sentence."}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
# id -> (policy, reward, metrics); None: never rewarded
EXPECTED_REWARDS = {
    "good": ("agent", 1.0, {"correct": 1.0}),
    "mid": ("agent", 0.5, {}),
    "bad": ("agent", 0.0, {"len": 3.0}),
    "open": ("agent", None, {}),
    "text": ("agent", 0.9, {}),
    "other": ("other", 1.0, {}),
}


def reward(proxy: RunningProxy, trajectory_id: str, value: float, metrics: dict[str, float] | None = None) -> None:
    body = {"trajectory_id": trajectory_id, "reward": value, "metrics": metrics or {}}
    assert httpx.post(f"{proxy.v1}/rewards", json=body).status_code == 200


@pytest.fixture
def captured(start_proxy: Callable[..., RunningProxy], fake: FakeVLLM) -> RunningProxy:
    """Six trajectories of two policies: multi-call with a tool call, streamed, completions, unrewarded."""
    proxy = start_proxy()

    def chat(trajectory_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        client = proxy.client(default_headers={"X-Trajectory-Id": trajectory_id, "X-Group-Id": "g1"})
        return client.chat.completions.create(model="agent", messages=messages, **kwargs)

    fake.script(Reply(content="I will look it up."), Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]))
    first = [SYSTEM, {"role": "user", "content": "Weather in Paris?"}]
    answer = chat("good", first).choices[0].message.content
    chat("good", [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}],
         tools=[WEATHER_TOOL])  # fmt: skip
    fake.script(Reply(content="Sunny, I think."))
    for _ in chat("mid", [SYSTEM, {"role": "user", "content": "Weather in Rome?"}], stream=True):
        pass
    chat("bad", [{"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "now?"}]}])
    chat("open", [{"role": "user", "content": "Anything?"}])
    text_client = proxy.client(default_headers={"X-Trajectory-Id": "text"})
    text_client.completions.create(model="agent", prompt="The weather in Oslo is", max_tokens=8)
    for trajectory_id, (_, value, metrics) in EXPECTED_REWARDS.items():
        if value is not None and trajectory_id != "other":
            reward(proxy, trajectory_id, value, metrics)
    proxy.stop()

    other = start_proxy(policy="other")  # the same data directory, another policy
    other.client(default_headers={"X-Trajectory-Id": "other"}).chat.completions.create(
        model="other", messages=[{"role": "user", "content": "Weather in Bern?"}]
    )
    reward(other, "other", 1.0)
    other.stop()
    return proxy


def whole_prompts(calls: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Each stored call's whole prompt: a compact row's ids follow ``prefix_tokens`` of its reference's
    prompt + completion (store._compact), rebuilt here from the raw rows, in the order they were made."""
    whole: dict[str, list[int]] = {}
    for call in calls:
        own = json.loads(call["prompt_token_ids"])
        ref = call["prefix_of"]
        if ref is not None:
            earlier = next(c for c in calls if c["id"] == ref)
            own = (whole[ref] + json.loads(earlier["completion_token_ids"]))[: call["prefix_tokens"]] + own
        whole[call["id"]] = own
    return whole


def export(proxy: RunningProxy, out: Path, *flags: str) -> int:
    return main(["export", "--data-dir", str(proxy.settings.data_dir), "--output", str(out), *flags])


def load(path: Path, tmp_path: Path) -> Any:
    kind = "parquet" if path.suffix == ".parquet" else "json"
    return load_dataset(kind, data_files=str(path), split="train", cache_dir=str(tmp_path / "hf-cache"))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_export_loads_with_datasets_and_keeps_every_token_exact(
    captured: RunningProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    out = tmp_path / f"all{suffix}"
    assert export(captured, out) == 0
    said = capsys.readouterr().out
    assert f"wrote 6 trajectories ({suffix[1:]}) to {out.resolve()}" in said

    rows = {row["id"]: row for row in load(out, tmp_path)}
    stored = captured.rows("SELECT * FROM trajectories ORDER BY pk")
    assert list(rows) == [t["id"] for t in stored]  # oldest first
    for trajectory_id, (policy, value, metrics) in EXPECTED_REWARDS.items():
        row = rows[trajectory_id]
        assert (row["policy"], row["reward"], row["group_id"]) == (policy, value, stored_group(captured, trajectory_id))
        assert {k: v for k, v in (row["metrics"] or {}).items() if v is not None} == metrics
        assert row["reward_source"] == (None if value is None else "service")
        calls = captured.rows("SELECT * FROM calls WHERE trajectory_id = ? ORDER BY started_at, pk", trajectory_id)
        assert row["n_calls"] == len(row["calls"]) == len(calls) > 0
        prompts = whole_prompts(calls)
        for exported, call in zip(row["calls"], calls, strict=True):
            assert exported["id"] == call["id"] and exported["version"] == call["version"] == 0
            assert exported["prompt_token_ids"] == prompts[call["id"]]
            assert exported["completion_token_ids"] == json.loads(call["completion_token_ids"])
            assert exported["logprobs"] == json.loads(call["logprobs"])  # floats bit-exact
            assert exported["finish_reason"] == call["finish_reason"]
            assert len(exported["completion_token_ids"]) == len(exported["logprobs"]) > 0

    good = rows["good"]
    first, second = good["calls"]
    assert [m["content"] for m in first["messages"]] == ["You answer in one sentence.", "Weather in Paris?"]
    assert first["response"]["content"] == "I will look it up." and first["tools"] is None
    assert json.loads(second["tools"]) == [WEATHER_TOOL]
    (tool_call,) = second["response"]["tool_calls"]
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert second["finish_reason"] == "tool_calls"
    # The whole conversation: the last call's request messages, then its response.
    assert [m["role"] for m in good["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert good["messages"][2]["content"] == "I will look it up."
    assert good["messages"][-1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(good["tools"]) == [WEATHER_TOOL]

    assert rows["mid"]["messages"][-1]["content"] == "Sunny, I think."  # a stream, reassembled
    assert rows["bad"]["messages"][0]["content"] == "Weather now?"  # content parts, joined
    text = rows["text"]
    assert text["messages"] is None and text["calls"][0]["messages"] is None
    assert text["calls"][0]["prompt"] == "The weather in Oslo is"
    assert text["calls"][0]["response"]["content"]


def stored_group(proxy: RunningProxy, trajectory_id: str) -> str:
    return str(proxy.rows("SELECT group_id FROM trajectories WHERE id = ?", trajectory_id)[0]["group_id"])


def test_min_reward_and_policy_choose_the_rows(captured: RunningProxy, tmp_path: Path) -> None:
    chosen = {}
    for name, flags in {
        "best": ["--min-reward", "0.5"],
        "best-agent": ["--min-reward", "0.5", "--policy", "agent"],
        "other": ["--policy", "other"],
        "zero": ["--min-reward", "0"],
    }.items():
        out = tmp_path / f"{name}.jsonl"
        assert export(captured, out, *flags) == 0
        chosen[name] = [row["id"] for row in load(out, tmp_path)]
    assert chosen["best"] == ["good", "mid", "text", "other"]
    assert chosen["best-agent"] == ["good", "mid", "text"]
    assert chosen["other"] == ["other"]
    assert chosen["zero"] == ["good", "mid", "bad", "text", "other"]  # an unrewarded trajectory never passes


def test_pages_stream_the_same_rows_as_one_read(captured: RunningProxy, tmp_path: Path) -> None:
    url = captured.settings.resolved_database_url
    pages: list[int] = []
    n = asyncio.run(export_trajectories(url, tmp_path / "paged.jsonl", "jsonl", ExportFilter(), page_size=2,
                                        on_rows=pages.append))  # fmt: skip
    asyncio.run(export_trajectories(url, tmp_path / "whole.jsonl", "jsonl", ExportFilter(), page_size=1000))
    assert n == 6 and pages == [2, 2, 2]
    assert (tmp_path / "paged.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_nothing_matching_exits_2_says_why_and_writes_nothing(
    captured: RunningProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "none.jsonl"
    assert export(captured, out, "--min-reward", "5") == 2
    err = capsys.readouterr().err
    assert "no trajectory matches (reward >= 5)" in err
    assert "6 trajectories, 5 rewarded, the best reward 1" in err and "Nothing written" in err
    assert not out.exists()


def test_format_follows_the_output_suffix_unless_given(captured: RunningProxy, tmp_path: Path) -> None:
    assert export(captured, tmp_path / "a.parquet") == 0
    assert (tmp_path / "a.parquet").read_bytes()[:4] == b"PAR1"
    assert export(captured, tmp_path / "b.data", "--format", "parquet") == 0
    assert (tmp_path / "b.data").read_bytes()[:4] == b"PAR1"
    assert export(captured, tmp_path / "c.data") == 0
    assert json.loads((tmp_path / "c.data").read_text().splitlines()[0])["id"] == "good"


def test_the_default_output_goes_to_the_data_directory(captured: RunningProxy) -> None:
    assert main(["export", "--data-dir", str(captured.settings.data_dir), "--policy", "other"]) == 0
    (written,) = (captured.settings.data_dir / "exports").glob("trajectories-*.jsonl")
    assert json.loads(written.read_text())["id"] == "other"


def test_a_missing_store_names_the_flags_to_use(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["export", "--data-dir", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x.jsonl")])
    assert "no store at" in str(exc.value.code) and "--data-dir" in str(exc.value.code)
    assert not (tmp_path / "nowhere").exists()  # reading never creates a store


def test_parquet_without_pyarrow_names_what_to_install(
    captured: RunningProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now fails, as when it is not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(SystemExit) as exc:
        export(captured, tmp_path / "x.parquet")
    message = str(exc.value.code)
    assert "pip install pyarrow" in message and "tracetrain[train]" in message and "--format jsonl" in message
    assert not (tmp_path / "x.parquet").exists()


def test_an_export_reads_a_postgres_store(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, tmp_path: Path
) -> None:
    url = os.environ.get("TRACETRAIN_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("set TRACETRAIN_TEST_POSTGRES_URL to run the store on PostgreSQL (.ci/postgres.sh starts one)")

    async def reset() -> None:  # the database named there may be wiped
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public;")
        await conn.close()

    asyncio.run(reset())
    proxy = start_proxy(database_url=url)
    for k in range(3):
        client = proxy.client(default_headers={"X-Trajectory-Id": f"pg{k}"})
        client.chat.completions.create(model="agent", messages=[{"role": "user", "content": f"Question {k}?"}])
        reward(proxy, f"pg{k}", float(k), {"k": float(k)} if k else {})
    out = tmp_path / "pg.parquet"
    assert main(["export", "--database-url", url, "--min-reward", "1", "--output", str(out)]) == 0
    rows = list(load(out, tmp_path))
    assert [(r["id"], r["reward"], r["metrics"]) for r in rows] == [("pg1", 1.0, {"k": 1.0}), ("pg2", 2.0, {"k": 2.0})]
    assert all(r["calls"][0]["completion_token_ids"] and r["messages"][-1]["role"] == "assistant" for r in rows)
