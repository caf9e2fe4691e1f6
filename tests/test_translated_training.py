"""Done means: a group whose trajectories came through /v1/responses and /v1/messages, rewarded, trains ``agent@1``.

The fake vLLM serves, the real trainer ``Worker`` (the tiny model, its embedding as wide as the fake's
token ids) trains the step from the captured ids, the publisher loads ``agent@1`` into the fake and
flips the alias: the next Responses and Messages calls are served by it. Each trajectory is two calls
whose second prompt extends the first prompt and completion, so each merges into one sample.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM
from fake_vllm_text import TOKEN_ID_LIMIT
from test_trainer_worker import run_worker

GROUP = "weather-task"
TASK = "What is the weather like in Paris today?"


@pytest.fixture
def wide_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama-wide", vocab_size=TOKEN_ID_LIMIT)


def two_responses_calls(proxy: RunningProxy, trajectory_id: str) -> str:
    client = proxy.client(default_headers={"X-Trajectory-Id": trajectory_id, "X-Group-Id": GROUP})
    first = client.responses.create(model="agent", instructions="Be brief.", input=TASK)
    items = [{"role": "user", "content": TASK}, *(i.model_dump(exclude_none=True) for i in first.output),
             {"role": "user", "content": "And tomorrow?"}]  # fmt: skip
    return client.responses.create(model="agent", instructions="Be brief.", input=items).model


def two_messages_calls(proxy: RunningProxy, trajectory_id: str) -> str:
    headers = {"X-Trajectory-Id": trajectory_id, "X-Group-Id": GROUP}
    with anthropic.Anthropic(base_url=proxy.url, api_key="unused", default_headers=headers, max_retries=0) as sdk:
        first = sdk.messages.create(model="agent", max_tokens=64, system="Be brief.",
                                    messages=[{"role": "user", "content": TASK}])  # fmt: skip
        turns = [{"role": "user", "content": TASK}, {"role": "assistant", "content": first.content},
                 {"role": "user", "content": "And tomorrow?"}]  # fmt: skip
        return sdk.messages.create(model="agent", max_tokens=64, system="Be brief.", messages=turns).model  # type: ignore[arg-type]


def test_a_group_of_responses_and_messages_trajectories_trains_agent_at_1(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, wide_tiny_model: Path
) -> None:
    from trainer import TrainConfig
    from trainer._worker import WorkerSettings

    proxy = start_proxy(min_group_size=4, batch_groups=1)
    for i, call in enumerate((two_responses_calls, two_messages_calls, two_responses_calls, two_messages_calls)):
        assert call(proxy, f"t{i}") == "agent@0"
    rewards = [{"trajectory_id": f"t{i}", "reward": float(i < 2)} for i in range(4)]
    httpx.post(f"{proxy.v1}/rewards", json={"rewards": rewards}).raise_for_status()
    [job] = httpx.get(f"{proxy.url}/admin/jobs").json()["data"]
    assert job["state"] == "queued" and job["group_ids"] == [GROUP]

    settings = WorkerSettings(
        database_url=proxy.settings.resolved_database_url, data_dir=proxy.settings.data_dir, policies=("agent",),
        base_model=wide_tiny_model, config=TrainConfig(lora_r=8, lora_alpha=16, dtype="float32"),
    )  # fmt: skip

    assert asyncio.run(run_worker(settings)) == 1
    [job] = httpx.get(f"{proxy.url}/admin/jobs").json()["data"]
    assert job["state"] == "succeeded", job["error"]
    metrics = job["metrics"]
    assert job["version"] == 1 and metrics["samples"] == 4 and metrics["loss_tokens"] > 0
    assert (metrics["samples_merged"], metrics["samples_mismatched"]) == (4, 0), "each trajectory is one sample"
    deadline = time.monotonic() + 30
    while httpx.get(f"{proxy.url}/admin/adapters").json()["active_version"] != 1:
        assert time.monotonic() < deadline, httpx.get(f"{proxy.url}/admin/adapters").json()
        time.sleep(0.2)
    assert "agent@1" in fake.loras
    assert two_responses_calls(proxy, "after-r") == "agent@1"
    assert two_messages_calls(proxy, "after-m") == "agent@1"
    assert {r["model"] for r in fake.requests[-4:]} == {"agent@1"}
